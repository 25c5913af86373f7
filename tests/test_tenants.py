"""Tenants (issue 35): several API keys, per-key concurrency and token-rate limits
answered with 429 and Retry-After, per-key usage in /metrics, and a prefix cache that one
tenant's prompts cannot hit for another's once it is salted per key.

The limits' arithmetic is checked on a clock the test moves; the server is checked as
``minivllm serve`` runs it (the engine core in its own process) and with the engine on a
thread.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
from tiny_chat import save_tiny_chat

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minivllm import LLM  # noqa: E402
from minivllm.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402
from minivllm.entrypoints.openai.tenants import RateLimited, Tenant, Tenants  # noqa: E402
from minivllm.exceptions import ValidationError  # noqa: E402

C = "/v1/completions"
TIMEOUT = 60.0
# About 100 tokens: six full blocks of 16, so a repeat of it can hit five.
LONG = " ".join(f"Paragraph {i} says that the cache is shared by every user of the server."
                for i in range(7))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeStream:
    """What a Lease reads from the request's stream: its last output's usage."""

    def __init__(self, prompt: int, generated: int) -> None:
        completion = type("C", (), {"token_ids": [0] * generated})()
        self.last = type("Out", (), {"prompt_token_ids": [0] * prompt, "outputs": [completion]})()


# -- the rules, on a clock the test moves ------------------------------------------------------
def test_concurrency_limit_counts_seats_and_frees_them_on_release():
    alice = Tenant("alice", "ka", max_concurrent_requests=2)
    tenants = Tenants([alice, Tenant("bob", "kb")], clock=Clock())
    a, b = tenants.admit(alice), tenants.admit(alice)
    with pytest.raises(RateLimited) as e:
        tenants.admit(alice)
    assert e.value.reason == "concurrency" and e.value.retry_after == 1
    assert "max_concurrent_requests=2" in str(e.value)
    for _ in range(5):  # bob has no limit, and alice's seats are hers alone
        tenants.admit(tenants.tenants[1])
    a.release()
    a.release()  # a second release gives back nothing
    assert alice.running == 1
    tenants.admit(alice)
    b.release()
    assert alice.requests == 3 and alice.rejected == {"concurrency": 1}


def test_token_bucket_charges_usage_and_says_when_to_retry():
    clock = Clock()
    bob = Tenant("bob", "kb", max_tokens_per_minute=600)  # 10 tokens a second
    tenants = Tenants([bob], clock=clock)
    lease = tenants.admit(bob)
    lease.stream = FakeStream(prompt=500, generated=300)  # 800 used: the bucket is at -200
    lease.release()
    assert (bob.prompt_tokens, bob.generation_tokens) == (500, 300)
    with pytest.raises(RateLimited) as e:
        tenants.admit(bob)
    assert e.value.reason == "token_rate"
    assert e.value.retry_after == math.ceil((1 + 200) / 10) == 21
    clock.now += 20  # refilled to 0: still under one token
    with pytest.raises(RateLimited):
        tenants.admit(bob)
    clock.now += 0.2  # 2 tokens
    tenants.admit(bob).release()  # no stream (refused before it was queued): charged nothing
    clock.now += 3600  # refilled at most to its size
    tenants.refill(bob)
    assert bob.bucket == 600
    assert bob.rejected == {"token_rate": 2}


def test_cache_salt_per_key_keeps_every_tenant_apart():
    tenants = Tenants([Tenant("a", "ka"), Tenant("b", "kb")], cache_salt_per_key=True)
    la, lb = tenants.admit(tenants.tenants[0]), tenants.admit(tenants.tenants[1])
    assert la.cache_salt(None) != lb.cache_salt(None)
    assert la.cache_salt("x") != lb.cache_salt("x") and la.cache_salt("x") != la.cache_salt(None)
    unsalted = Tenants([Tenant("a", "ka")])
    assert unsalted.admit(unsalted.tenants[0]).cache_salt("x") == "x"


def test_keys_and_files_are_checked(tmp_path):
    t = Tenants.from_options(["k1", "k2"])
    assert [x.name for x in t.tenants] == ["key0", "key1"]
    assert t.authenticate(b"k2").name == "key1" and t.authenticate(b"k3") is None
    assert Tenants.from_options(None) is None
    with pytest.raises(ValidationError, match="no key to salt by"):
        Tenants.from_options(None, cache_salt_per_key=True)
    bad = [
        ({"tenants": [{"name": "a b", "api_key": "k"}]}, "tenant name"),
        ({"tenants": [{"name": "a", "api_key": "k"}, {"name": "b", "api_key": "k"}]}, "no other tenant"),
        ({"tenants": [{"name": "a", "api_key": "k", "max_concurrent_requests": 0}]}, "positive"),
        ({"tenants": [{"name": "a", "api_key": "k", "max_tokens_per_minute": True}]}, "positive"),
        ({"tenants": [{"name": "a", "api_key": "k", "rpm": 3}]}, "optionally"),
        ({"tenants": [{"name": "a"}]}, "'api_key'"),
        ({"keys": []}, "must hold"),
    ]
    for data, message in bad:
        path = tmp_path / "t.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValidationError, match=message):
            Tenants.from_options(tenants_file=str(path))
    with pytest.raises(ValidationError, match="cannot read"):
        Tenants.from_options(tenants_file=str(tmp_path / "missing.json"))
    with pytest.raises(ValidationError, match="no other tenant"):
        Tenants.from_options(["k", "k"])


# -- the server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny Llama over SmolLM2's vocabulary, saved with SmolLM2's tokenizer."""
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-tenants"))


def serve(tiny_dir: str, design: str, **options):
    engine = dict(max_model_len=512, log_stats_interval=None)
    if design == "process":  # what `minivllm serve` runs
        return build_app(model=tiny_dir, **engine, **options)
    return build_app(LLM(tiny_dir, **engine), **options)


def ready(server: ServerThread) -> None:
    deadline = time.monotonic() + 120
    while httpx.get(server.url + "/health").status_code != 200:  # the core loads meanwhile
        assert time.monotonic() < deadline, "the engine never became ready"
        time.sleep(0.1)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def idle_metrics(url: str, timeout: float = 20.0) -> dict:
    """/metrics once nothing runs or waits (the core's counts arrive with its next step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if (m[("minivllm:num_requests_running", ())] == 0 and m[("minivllm:num_requests_waiting", ())] == 0
                and m[("minivllm:kv_cache_usage_perc", ())] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def once_the_seat_is_back(url: str, key: str) -> httpx.Response:
    """A request of a tenant whose one seat a closed stream held: refused (429) until the
    server has noticed the close, then answered."""
    deadline = time.monotonic() + 20
    while (r := complete(url, key)).status_code == 429:
        assert time.monotonic() < deadline, "the tenant's seat never came back"
        time.sleep(0.05)
    return r


def complete(url: str, key: str, prompt: str = "The capital of France is", **body) -> httpx.Response:
    return httpx.post(url + C, json={"prompt": prompt, "max_tokens": 4, "temperature": 0, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT)


HELD = 480  # output tokens of the stream that holds alice's seat
DESIGNS = [pytest.param("process", marks=pytest.mark.multiprocess), "thread"]


@pytest.mark.parametrize("design", DESIGNS)
def test_limits_429_with_retry_after_and_usage_per_tenant(tiny_dir, tmp_path, design):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "alice", "api_key": "sk-alice", "max_concurrent_requests": 1},
        {"name": "bob", "api_key": "sk-bob", "max_tokens_per_minute": 6},
    ]}))
    with ServerThread(serve(tiny_dir, design, tenants_file=str(path), api_key="sk-open")) as server:
        ready(server)
        url = server.url
        assert complete(url, "sk-nobody").status_code == 401
        assert complete(url, "sk-open").status_code == 200  # --api-key's key: a tenant without limits

        # alice holds her one seat with a long stream (hundreds of steps); her next request
        # is refused at once: 429.
        headers = {"Authorization": "Bearer sk-alice"}
        with httpx.stream("POST", url + C, headers=headers, timeout=TIMEOUT, json={
                "prompt": "Hello", "max_tokens": HELD, "ignore_eos": True, "stream": True}) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # the request is running
            refused = complete(url, "sk-alice")
            assert refused.status_code == 429, refused.text
            assert refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == "concurrency_limit"
            assert complete(url, "sk-bob").status_code == 200  # bob's seats are his own
        # The stream closed early: its seat comes back (and the request is aborted).
        r = once_the_seat_is_back(url, "sk-alice")
        assert r.status_code == 200, r.text

        # bob's first request used more than his 6 tokens a minute: he waits it off.
        refused = complete(url, "sk-bob")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "token_rate_limit"
        assert 1 <= int(refused.headers["Retry-After"]) <= 60

        m = idle_metrics(url)
        bob = {"tenant": "bob"}
        assert m[("minivllm:tenant_requests_total", (("tenant", "bob"),))] == 1
        assert m[("minivllm:tenant_rate_limited_requests_total",
                  (("reason", "token_rate"), ("tenant", "bob")))] == 1
        assert m[("minivllm:tenant_rate_limited_requests_total",
                  (("reason", "concurrency"), ("tenant", "alice")))] == 1
        short = r.json()["usage"]  # alice's last request: the same prompt as bob's
        assert m[("minivllm:tenant_prompt_tokens_total", tuple(bob.items()))] == short["prompt_tokens"]
        assert m[("minivllm:tenant_generation_tokens_total", tuple(bob.items()))] == 4
        # alice: the held stream was charged what it had generated when it was closed.
        alice_generated = m[("minivllm:tenant_generation_tokens_total", (("tenant", "alice"),))]
        assert 4 < alice_generated <= 4 + HELD
        assert m[("minivllm:tenant_requests_running", (("tenant", "alice"),))] == 0
        assert "sk-" not in httpx.get(url + "/metrics").text  # labelled by name, never by key


def prefix_hits(url: str, key: str, **body) -> float:
    """Prefix-cache hits (tokens) the server counted for one request of LONG."""
    before = idle_metrics(url)[("minivllm:prefix_cache_hits_total", ())]
    r = complete(url, key, LONG, max_tokens=2, **body)
    assert r.status_code == 200, r.text
    return idle_metrics(url)[("minivllm:prefix_cache_hits_total", ())] - before


@pytest.mark.parametrize("design", DESIGNS)
def test_cache_salt_per_key_gives_no_cross_tenant_hits(tiny_dir, design):
    """What a tenant could time: without salting, bob's request hits the blocks alice's
    prompt cached; with it, never, while each tenant still hits its own."""
    keys = ["sk-alice", "sk-bob"]
    with ServerThread(serve(tiny_dir, design, api_key=keys)) as shared:
        ready(shared)
        assert prefix_hits(shared.url, "sk-alice") == 0
        assert prefix_hits(shared.url, "sk-bob") >= 5 * 16  # alice's prompt, seen by bob
        # A request's own cache_salt (vLLM's field) keeps it apart even here.
        assert prefix_hits(shared.url, "sk-bob", cache_salt="mine") == 0
        assert prefix_hits(shared.url, "sk-bob", cache_salt="mine") >= 5 * 16
    with ServerThread(serve(tiny_dir, design, api_key=keys, cache_salt_per_key=True)) as salted:
        ready(salted)
        assert prefix_hits(salted.url, "sk-alice") == 0
        assert prefix_hits(salted.url, "sk-bob") == 0  # the cross-tenant hit is gone
        assert prefix_hits(salted.url, "sk-bob", cache_salt="x") == 0
        empty = complete(salted.url, "sk-bob", cache_salt="")  # refused, salted by key or not
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"
        assert prefix_hits(salted.url, "sk-alice") >= 5 * 16  # a tenant's own repeat still hits
        assert prefix_hits(salted.url, "sk-bob") >= 5 * 16


# -- behind the router ---------------------------------------------------------------------
def stream_chunks(url: str, key: str, **body) -> list[dict]:
    """A streamed completion's chunks, as the client receives them."""
    chunks = []
    with httpx.stream("POST", url + C, headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT,
                      json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True, "stream": True,
                            **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_the_router_holds_each_tenants_limits_for_all_its_replicas(tiny_dir, tmp_path):
    """Behind a round-robin router, a tenant's second request goes to the other replica,
    which alone would admit it: the router holds the one seat count and the one bucket,
    charged with the usage it reads off each answer, streamed or not."""
    from minivllm.entrypoints.data_parallel import replica_tenants
    from minivllm.entrypoints.router_app import build_router_app

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "alice", "api_key": "sk-alice", "max_concurrent_requests": 1},
        {"name": "bob", "api_key": "sk-bob", "max_tokens_per_minute": 6},
        {"name": "carol", "api_key": "sk-carol"},
    ]}))
    keys = replica_tenants(str(path), str(tmp_path))  # what `serve --data-parallel-size` starts replicas with
    assert json.loads(open(keys).read()) == {"tenants": [  # names and keys, no limits
        {"name": n, "api_key": f"sk-{n}"} for n in ("alice", "bob", "carol")]}
    assert os.stat(keys).st_mode & 0o777 == 0o600
    with ServerThread(serve(tiny_dir, "thread", tenants_file=keys)) as r0, \
            ServerThread(serve(tiny_dir, "thread", tenants_file=keys)) as r1, \
            ServerThread(build_router_app([r0.url, r1.url], "round_robin", tenants_file=str(path))) as rt:
        url = rt.url
        assert complete(url, "sk-nobody").status_code == 401

        # The router asks the replica for usage in every chunk; the client sees what it asked for.
        plain = stream_chunks(url, "sk-carol")
        assert plain and not any("usage" in c for c in plain)
        asked = stream_chunks(url, "sk-carol", stream_options={"include_usage": True})
        assert [c["usage"]["completion_tokens"] for c in asked if "usage" in c] == [5]
        assert asked[-1]["choices"] == [] and "usage" not in asked[0]
        every = stream_chunks(url, "sk-carol", stream_options={"include_usage": True,
                                                               "continuous_usage_stats": True})
        assert all("usage" in c for c in every)
        assert [c["text"] for c in plain[0]["choices"]] == [c["text"] for c in asked[0]["choices"]]

        # alice's one seat, held by a stream on one replica, is refused on the other.
        headers = {"Authorization": "Bearer sk-alice"}
        with httpx.stream("POST", url + C, headers=headers, timeout=TIMEOUT, json={
                "prompt": "Hello", "max_tokens": HELD, "ignore_eos": True, "stream": True}) as held:
            assert held.status_code == 200
            lines = held.iter_lines()
            next(lines)
            refused = complete(url, "sk-alice")
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "concurrency_limit"
            assert refused.headers["Retry-After"] == "1"
        r = once_the_seat_is_back(url, "sk-alice")
        assert r.status_code == 200, r.text

        # bob's first request (unstreamed) used more than his 6 tokens a minute.
        first = complete(url, "sk-bob")
        assert first.status_code == 200
        refused = complete(url, "sk-bob")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "token_rate_limit"

        for replica in (r0, r1):
            idle_metrics(replica.url)
        m = scrape(url)
        mine = {t: {k: m[(f"minivllm:router_tenant_{k}", (("tenant", t),))]
                    for k in ("requests_total", "prompt_tokens_total", "generation_tokens_total")}
                for t in ("alice", "bob", "carol")}
        assert mine["carol"]["generation_tokens_total"] == 3 * 5
        assert mine["carol"]["prompt_tokens_total"] == 3 * asked[-1]["usage"]["prompt_tokens"]
        assert mine["bob"] == {"requests_total": 1, "prompt_tokens_total": first.json()["usage"]["prompt_tokens"],
                               "generation_tokens_total": 4}
        # alice's held stream was charged what it had relayed when she closed it.
        assert 4 < mine["alice"]["generation_tokens_total"] <= 4 + HELD
        assert m[("minivllm:router_tenant_rate_limited_requests_total",
                  (("reason", "concurrency"), ("tenant", "alice")))] == 1
        assert m[("minivllm:router_tenant_rate_limited_requests_total",
                  (("reason", "token_rate"), ("tenant", "bob")))] == 1
        # The replicas count by name too (re-exported with their replica label); both served.
        per_replica = {labels: v for (name, labels), v in m.items()
                       if name == "minivllm:tenant_generation_tokens_total" and ("tenant", "carol") in labels}
        assert len(per_replica) == 2 and sum(per_replica.values()) == 3 * 5
        assert "sk-" not in httpx.get(url + "/metrics").text
