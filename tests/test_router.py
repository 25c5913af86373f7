"""The router in front of real replicas, over loopback HTTP (notebook 14).

The replicas are real ``minivllm serve`` processes (started by
:class:`~minivllm.entrypoints.data_parallel.LocalReplicas`, what ``serve --data-parallel-size`` uses) over a
tiny random Llama saved with SmolLM2's tokenizer and chat template: real templating,
real prefix caches, millisecond steps. Where a request goes is read from the replicas'
own ``/metrics`` (their HTTP and prefix-cache counters), not from the router; the
reference answer is the replica's own, asked directly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tiny_chat import deadline, save_tiny_chat  # noqa: E402

from minivllm.entrypoints.data_parallel import LocalReplicas, free_port  # noqa: E402
from minivllm.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402
from minivllm.entrypoints.router_app import build_router_app  # noqa: E402
from minivllm.worker.model_loader import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.multiprocess

TIMEOUT = 30.0
SERVE_ARGS = ["--no-engine-process", "--log-stats-interval", "0", "--max-model-len", "512"]
LONG = dict(max_tokens=450, temperature=0, extra_body={"ignore_eos": True})
"""A request that keeps a replica busy for a second or more."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny Llama over SmolLM2's vocabulary, saved with SmolLM2's tokenizer."""
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def replicas(tiny_dir):
    with LocalReplicas(2, ["--model", tiny_dir, *SERVE_ARGS], startup_timeout=120) as local:
        yield local


def router(urls, policy, tiny_dir, **kwargs) -> ServerThread:
    tokenizer = load_tokenizer(tiny_dir) if policy == "prefix_aware" else None
    return ServerThread(build_router_app(urls, policy, tokenizer=tokenizer, **kwargs)).start()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def served(url: str, handler: str = "/v1/chat/completions") -> float:
    """Requests the replica answered (200) on ``handler``, by its own count."""
    return scrape(url).get(("minivllm:http_requests_total", (("handler", handler), ("status", "200"))), 0.0)


def hits(url: str) -> float:
    return scrape(url)[("minivllm:prefix_cache_hits_total", ())]


def chat(base_url: str, messages, **kwargs):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=kwargs.pop("api_key", "none"), timeout=TIMEOUT,
                           max_retries=0)
    model = kwargs.pop("model", None) or client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=messages, **kwargs)


def document(i: int) -> str:
    """A few hundred tokens of text, different for every i (several full KV blocks)."""
    return " ".join(f"Paragraph {i}.{j}: the {i}-th report says item {j * 7 + i} costs {j + 3 * i} coins."
                    for j in range(12))


def ask(doc: int, q: int) -> list[dict]:
    return [{"role": "user", "content": f"{document(doc)}\n\nQuestion {q}: what does item {q} cost?"}]


def short(i: int) -> list[dict]:
    """A prompt short enough to leave room for a LONG answer."""
    return [{"role": "user", "content": f"Tell me story number {i}."}]


def which(replicas: LocalReplicas, send) -> int:
    """Send one request through the router and say which replica answered it."""
    before = [served(u) for u in replicas.urls]
    send()
    after = [served(u) for u in replicas.urls]
    [i] = [i for i in range(len(before)) if after[i] == before[i] + 1]
    return i


# -- the policies ----------------------------------------------------------------------------
def test_round_robin_alternates(replicas, tiny_dir):
    with deadline(60):
        rt = router(replicas.urls, "round_robin", tiny_dir)
        try:
            order = [which(replicas, lambda q=q: chat(rt.url, ask(100, q), max_tokens=2))
                     for q in range(4)]
        finally:
            rt.stop()
    assert order in ([0, 1, 0, 1], [1, 0, 1, 0])


def test_prefix_aware_keeps_a_documents_questions_on_one_replica(replicas, tiny_dir):
    """Interleaved questions over two documents: every follow-up lands where its document
    went first and reuses its blocks; round robin on the same shape scatters them and
    reuses less."""
    def run(policy: str, docs: tuple[int, ...]) -> tuple[list[tuple[int, int]], float]:
        rt = router(replicas.urls, policy, tiny_dir)
        before = sum(hits(u) for u in replicas.urls)
        try:
            placed = [(d, which(replicas, lambda d=d, q=q: chat(rt.url, ask(d, q), max_tokens=2)))
                      for q in range(2) for d in docs]
        finally:
            rt.stop()
        return placed, sum(hits(u) for u in replicas.urls) - before

    with deadline(90):
        aware, aware_hits = run("prefix_aware", (200, 201, 202))
        blind, blind_hits = run("round_robin", (300, 301, 302))
    for d in (200, 201, 202):
        assert len({i for doc, i in aware if doc == d}) == 1, aware
    for d in (300, 301, 302):  # three documents over two replicas in turn: each one split
        assert len({i for doc, i in blind if doc == d}) == 2, blind
    assert aware_hits > blind_hits
    doc_blocks = len(load_tokenizer(tiny_dir).encode(document(200))) // 16
    assert aware_hits >= 3 * (doc_blocks - 1) * 16, "each follow-up should reuse its document's blocks"


def test_least_outstanding_avoids_the_busy_replica(replicas, tiny_dir):
    with deadline(60):
        rt = router(replicas.urls, "least_outstanding", tiny_dir)
        try:
            stream = chat(rt.url, short(400), stream=True, **LONG)
            next(iter(stream))  # it is running on one replica now
            busy = [i for i, u in enumerate(replicas.urls)
                    if scrape(u)[("minivllm:num_requests_running", ())] == 1]
            assert len(busy) == 1
            quick = [which(replicas, lambda q=q: chat(rt.url, ask(401, q), max_tokens=2)) for q in range(2)]
            stream.close()
        finally:
            rt.stop()
    assert quick == [1 - busy[0]] * 2


# -- the same answers ------------------------------------------------------------------------
def test_answers_through_the_router_equal_the_replicas_own(replicas, tiny_dir):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    direct = chat(replicas.urls[0], messages, max_tokens=16, temperature=0)
    with deadline(60):
        rt = router(replicas.urls, "round_robin", tiny_dir)
        try:
            for _ in range(2):  # once on each replica
                routed = chat(rt.url, messages, max_tokens=16, temperature=0)
                assert routed.choices[0].message.content == direct.choices[0].message.content
                assert routed.usage == direct.usage
                pieces = [c.choices[0].delta.content or "" for c in
                          chat(rt.url, messages, max_tokens=16, temperature=0, stream=True)]
                assert len(pieces) > 2 and "".join(pieces) == direct.choices[0].message.content
            client = openai.OpenAI(base_url=rt.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
            ref = openai.OpenAI(base_url=replicas.urls[1] + "/v1", api_key="none", timeout=TIMEOUT)
            model = client.models.list().data[0].id
            want = ref.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                          temperature=0).choices[0].text
            got = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                            temperature=0).choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model=model, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True))
            assert got == want == streamed
            # A replica's refusal comes back as it is (and is not a replica failure).
            with pytest.raises(openai.BadRequestError, match="temperature"):
                client.completions.create(model=model, prompt="x", temperature=-1)
            assert all(r.healthy for r in rt.app.state.router.replicas)
        finally:
            rt.stop()


def test_metrics_aggregate_both_replicas(replicas, tiny_dir):
    with deadline(60):
        rt = router(replicas.urls, "round_robin", tiny_dir)
        try:
            for q in range(2):
                chat(rt.url, ask(500, q), max_tokens=2)
            merged = scrape(rt.url)
            own = [scrape(u) for u in replicas.urls]
        finally:
            rt.stop()
    for url, m in zip(replicas.urls, own):
        for name in ("minivllm:prefix_cache_queries_total", "minivllm:prefix_cache_hits_total"):
            assert merged[(name, (("replica", url),))] == m[(name, ())]
        assert merged[("minivllm:router_requests_total", (("replica", url),))] == 1
        assert merged[("minivllm:router_replica_healthy", (("replica", url),))] == 1
    assert merged[("minivllm:router_retries_total", ())] == 0


# -- failures --------------------------------------------------------------------------------
def test_a_dead_replica_is_skipped_retried_and_probed_back(replicas, tiny_dir):
    """A replica that is not there: the request that finds out is retried on the other
    (streaming too), the dead one leaves rotation, and comes back once /health answers."""
    port = free_port()
    dead = f"http://127.0.0.1:{port}"
    messages = [{"role": "user", "content": "Hello!"}]
    with deadline(90):
        want = chat(replicas.urls[0], messages, max_tokens=8, temperature=0).choices[0].message.content
        rt = router([dead, replicas.urls[0]], "round_robin", tiny_dir, health_interval=0.2)
        try:
            pieces = [c.choices[0].delta.content or "" for c in  # the model named: no /v1/models first
                      chat(rt.url, messages, model=tiny_dir, max_tokens=8, temperature=0, stream=True)]
            assert "".join(pieces) == want
            state = rt.app.state.router
            assert state.stats.retries == 1 and not state.replicas[0].healthy
            assert chat(rt.url, messages, max_tokens=8, temperature=0).choices[0].message.content == want
            assert state.stats.retries == 1, "a replica out of rotation is not tried again"
            from tiny_chat import tiny_chat_llm

            with ServerThread(build_app(tiny_chat_llm(), max_waiting=8), port=port):
                t = time.monotonic()
                while not state.replicas[0].healthy:
                    assert time.monotonic() - t < 60, "the replica was never probed back"
                    time.sleep(0.05)
        finally:
            rt.stop()


def test_a_replica_killed_mid_run(tiny_dir):
    """Kill a replica while it holds a plain request and a stream: the plain one is retried
    on the other replica and succeeds; the stream, already begun, ends with a clear error.
    Kill the other: a clear 503, at once."""
    with LocalReplicas(2, ["--model", tiny_dir, *SERVE_ARGS], startup_timeout=120) as local, deadline(90):
        rt = router(local.urls, "round_robin", tiny_dir, health_interval=60)
        state = rt.app.state.router
        try:
            client = openai.OpenAI(base_url=rt.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
            model = client.models.list().data[0].id
            result: dict = {}

            def plain() -> None:
                try:
                    result["answer"] = client.chat.completions.create(model=model, messages=short(600), **LONG)
                except Exception as e:  # noqa: BLE001 - the assertion below reports it
                    result["error"] = e

            worker = threading.Thread(target=plain)
            worker.start()  # round robin: replica 0
            while scrape(local.urls[0])[("minivllm:num_requests_running", ())] < 1:
                time.sleep(0.01)
            client.chat.completions.create(model=model, messages=ask(601, 0), max_tokens=2)  # replica 1
            stream = client.chat.completions.create(model=model, messages=short(602), stream=True, **LONG)
            chunks = iter(stream)
            next(chunks)  # replica 0 has begun streaming
            assert scrape(local.urls[0])[("minivllm:num_requests_running", ())] == 2, "both still running"
            local.procs[0].kill()
            local.procs[0].wait()
            with pytest.raises(openai.APIError, match="mid-stream"):
                for _ in chunks:
                    pass
            worker.join(TIMEOUT)
            assert "answer" in result, result.get("error")
            direct = openai.OpenAI(base_url=local.urls[1] + "/v1", api_key="none", timeout=TIMEOUT)
            want = direct.chat.completions.create(model=model, messages=short(600), **LONG)
            assert result["answer"].choices[0].message.content == want.choices[0].message.content
            assert state.stats.retries == 1
            assert not state.replicas[0].healthy and state.replicas[1].healthy
            health = httpx.get(rt.url + "/health").json()
            assert [r["healthy"] for r in health["replicas"]] == [False, True]
            assert all(r.outstanding == 0 for r in state.replicas), "every request was accounted for"

            local.procs[1].kill()
            local.procs[1].wait()
            for _ in range(2):  # the first finds out, the second knows
                r = httpx.post(rt.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT)
                assert r.status_code == 503
                assert r.json()["error"]["code"] == "no_healthy_replica"
            assert httpx.get(rt.url + "/health").status_code == 503
        finally:
            rt.stop()


# -- serve --data-parallel-size ----------------------------------------------------------------
def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1] in ("Z", "X") for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return True


@pytest.mark.parametrize(("stop", "log_level"), [(signal.SIGINT, "warning"), (signal.SIGKILL, "info")],
                         ids=["ctrl-c", "killed"])
def test_serve_data_parallel_starts_answers_and_leaves_no_children(tiny_dir, tmp_path, stop, log_level):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", "import sys; from minivllm.entrypoints.cli import main; sys.exit(main())", "serve",
           "--data-parallel-size", "2", "--routing-policy", "prefix_aware", "--model", tiny_dir,
           "--port", str(port), "--uvicorn-log-level", log_level, *SERVE_ARGS]
    # Tenants: the router holds the limits, the replicas get the keys (their own file).
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"name": "t", "api_key": "sk-t", "max_tokens_per_minute": 1000}]}))
    cmd += ["--tenants", str(tenants)]
    log = tmp_path / "serve.log"
    parent = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})  # SIGKILL loses no line
    try:
        with deadline(120):
            while True:
                assert parent.poll() is None, "serve --data-parallel-size exited"
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            health = httpx.get(url + "/health").json()
            assert len(health["replicas"]) == 2 and health["routing_policy"] == "prefix_aware"
            with pytest.raises(openai.AuthenticationError):
                chat(url, [{"role": "user", "content": "Hi"}], max_tokens=4)
            answer = chat(url, [{"role": "user", "content": "Hi"}], max_tokens=4, api_key="sk-t")
            assert answer.usage.completion_tokens == 4
            used = scrape(url)[("minivllm:router_tenant_generation_tokens_total", (("tenant", "t"),))]
            assert used == 4
            children = _children(parent.pid)
            assert len(children) == 2
            parent.send_signal(stop)
            parent.wait(30)
            t = time.monotonic()
            while not all(_gone(c) for c in children):
                assert time.monotonic() - t < 60, "a replica outlived serve --data-parallel-size"
                time.sleep(0.1)
        # uvicorn's access lines, one from the router and one from the replica that answered,
        # only at "info": --uvicorn-log-level reaches the router and every replica.
        access = log.read_text(errors="replace").count('"POST /v1/chat/completions HTTP/1.1" 200')
        assert access == (2 if log_level == "info" else 0), log.read_text(errors="replace")[-2000:]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


# -- the benchmark ---------------------------------------------------------------------------
def test_bench_router_prefix_aware_hits_more_with_the_same_outputs(tiny_dir):
    from minivllm.bench.router import format_router_table, router_benchmark
    from minivllm.sim.workload import document_workload

    workload = document_workload(None, num_documents=2, questions_per_document=3, document_len=96,
                                 output_len=4, vocab_size=1000)
    with deadline(120):
        rows = router_benchmark(workload, tiny_dir, policies=("round_robin", "prefix_aware"),
                                concurrency=2, serve_argv=["--max-model-len", "512"])
    blind, aware = rows
    assert aware["hit rate"] > blind["hit rate"]
    assert all(r["same outputs"] for r in rows)
    assert blind["per replica"] == "3/3"
    assert "prefix_aware" in format_router_table(rows)


# -- options ---------------------------------------------------------------------------------
def test_router_options_are_checked_and_urls_normalised():
    from minivllm.entrypoints.data_parallel import engine_argv
    from minivllm.entrypoints.routing import normalize_url
    from minivllm.exceptions import ValidationError

    assert normalize_url("10.0.0.2:8000/v1/") == "http://10.0.0.2:8000"
    assert normalize_url("https://host/") == "https://host"
    with pytest.raises(ValidationError, match="at least one"):
        build_router_app([], "round_robin")
    with pytest.raises(ValidationError, match="at least one"):  # prefill servers alone
        build_router_app([], "round_robin", prefill=["http://p:1"])
    with pytest.raises(ValidationError, match="twice"):
        build_router_app(["http://a:1", "a:1/v1"], "round_robin")
    with pytest.raises(ValidationError, match="twice"):  # one server cannot do both
        build_router_app(["http://a:1"], "round_robin", prefill=["a:1"])
    with pytest.raises(ValidationError, match="unknown routing policy"):
        build_router_app(["http://a:1"], "random")
    with pytest.raises(ValidationError, match="tokenizer"):
        build_router_app(["http://a:1"], "prefix_aware")
    with pytest.raises(ValidationError, match="data_parallel_size"):
        LocalReplicas(0, [])
    assert engine_argv({"block_size": 16, "enable_prefix_caching": False, "kv_cache_memory": None,
                        "speculative_config": {"method": "ngram"}}) == [
        "--block-size", "16", "--no-enable-prefix-caching", "--speculative-config", '{"method": "ngram"}']


def test_router_api_key(replicas, tiny_dir):
    with deadline(30):
        rt = router(replicas.urls, "round_robin", tiny_dir, api_key="router-key")
        try:
            body = {"prompt": "hi", "max_tokens": 2}
            r = httpx.post(rt.url + "/v1/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.post(rt.url + "/v1/completions", json=body, timeout=TIMEOUT,
                           headers={"Authorization": "Bearer router-key"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        finally:
            rt.stop()


# -- disaggregated prefill -------------------------------------------------------------------
def test_disaggregated_prefill_behind_the_router(tiny_dir, tmp_path):
    """A prefill instance (kv_producer) computes each prompt as one token; the decode
    instance (kv_consumer) loads its full blocks from the shared folder and answers, as one
    engine alone answers. A prefill instance that is gone costs time, not the answer."""
    from minivllm import LLM

    def server(role: str | None = None) -> ServerThread:
        config = None if role is None else {"kv_connector": "SharedStorageConnector", "kv_role": role,
                                            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
        return ServerThread(build_app(LLM(tiny_dir, max_model_len=512, log_stats_interval=None,
                                          kv_transfer_config=config)))

    with server() as single, server("kv_producer") as prefill, server("kv_consumer") as decode, \
            ServerThread(build_router_app([decode.url], "round_robin", prefill=[prefill.url])) as rt:
        health = httpx.get(rt.url + "/health").json()
        assert [r["role"] for r in health["replicas"]] == ["decode", "prefill"]
        questions, lengths = [ask(doc, doc + 1) for doc in range(3)], []
        for i, messages in enumerate(questions):
            alone = chat(single.url, messages, max_tokens=12, temperature=0)
            lengths.append(alone.usage.prompt_tokens)
            split = chat(rt.url, messages, max_tokens=12, temperature=0, stream=i == 1)
            text = ("".join(c.choices[0].delta.content or "" for c in split) if i == 1
                    else split.choices[0].message.content)
            assert text == alone.choices[0].message.content
        m_decode, m_prefill = scrape(decode.url), scrape(prefill.url)
        loaded = m_decode[("minivllm:external_prefix_cache_hits_total", ())]
        local = m_decode[("minivllm:prefix_cache_hits_total", ())]  # the chat template's shared start
        assert loaded > local and loaded + local == sum((n - 1) // 16 * 16 for n in lengths)  # all but the last block
        assert m_prefill[("minivllm:generation_tokens_total", ())] == 3  # one token per request
        assert m_prefill[("minivllm:external_prefix_cache_hits_total", ())] == 0  # a producer never loads

        prefill.stop()  # gone: the decode instance computes the prompt itself
        messages = ask(7, 1)
        split = chat(rt.url, messages, max_tokens=12, temperature=0)
        assert split.choices[0].message.content == chat(single.url, messages, max_tokens=12,
                                                        temperature=0).choices[0].message.content
        m = scrape(rt.url)
        assert m[("minivllm:router_prefill_failures_total", ())] == 1
        assert scrape(decode.url)[("minivllm:external_prefix_cache_hits_total", ())] == loaded
