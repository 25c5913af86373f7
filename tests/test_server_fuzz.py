"""No request can hurt another, over HTTP (issue 16): a bad-input matrix and a fuzzer.

A server (a tiny random model behind SmolLM2's tokenizer and chat template) takes a
matrix of hostile requests, each of which must get a 4xx naming the field, and then
schemathesis (https://schemathesis.readthedocs.io), which generates requests from the
server's own OpenAPI schema, valid and invalid, bounded and derandomized, with the checks
"no 5xx" and "the response matches the schema". After each, a greedy canary must still
return the text it returned before, and ``/health`` must say the engine is fine.

Every test runs against three designs (issue 35: what users run is what must be proven):
the engine on a thread of the server, the engine core in its own process (what
``minivllm serve`` runs), and the router in front of two ``minivllm serve`` replicas, fuzzed
with a replica's schema (the router forwards the requests unchanged).
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_chat import CANARY_PARAMS, CANARY_PROMPT, canary, save_tiny_chat, tiny_chat_llm

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    response_schema_conformance,
    status_code_conformance,
)

from minivllm.entrypoints.data_parallel import LocalReplicas  # noqa: E402
from minivllm.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402
from minivllm.entrypoints.router_app import build_router_app  # noqa: E402

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BYTES = 64 * 1024
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "What is the capital of France?"}]
NAN_BODY = b'{"prompt": "hi", "temperature": NaN}'


class Target:
    """A server under test: its ``url``, where its schema is, and what is fine inside it."""

    def __init__(self, url: str, schema_url: str, replica_urls: list[str], expected: str,
                 paths: str = ".*") -> None:
        self.url, self.schema_url, self.replica_urls, self.expected = url, schema_url, replica_urls, expected
        self.paths = paths
        """The schema's paths this target answers as documented (the router answers /health
        and /metrics for the fleet, in shapes of its own)."""

    def schema(self):
        return schemathesis.openapi.from_url(self.schema_url).include(path_regex=self.paths)

    def engines_are_fine(self) -> None:
        """Every engine behind it alive and, once idle, holding no KV block."""
        for url in self.replica_urls:
            health = httpx.get(url + "/health", timeout=60)
            assert health.status_code == 200 and health.json()["status"] == "ok", health.text
            deadline = time.monotonic() + 60
            while (usage := _gauge(url, "minivllm:kv_cache_usage_perc")) != 0:
                assert time.monotonic() < deadline, f"KV blocks still in use at {url}: {usage}"
                time.sleep(0.05)


def _gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in {url}/metrics")


SERVER = dict(max_model_len=64, max_num_seqs=16)


@pytest.fixture(scope="module", params=["thread", pytest.param("process", marks=pytest.mark.multiprocess),
                                        pytest.param("router", marks=pytest.mark.multiprocess)])
def served(request, tmp_path_factory):
    """The :class:`Target` of one design, with the canary's text from before any abuse."""
    llm = tiny_chat_llm(**SERVER)
    expected = canary(llm)
    if request.param == "thread":
        with ServerThread(build_app(llm, api_key=KEY, max_waiting=64, max_request_bytes=MAX_BYTES)) as server:
            yield Target(server.url, server.url + "/openapi.json", [server.url], expected)
        return
    model_dir = save_tiny_chat(tmp_path_factory.mktemp("fuzz-model"))  # the same seeded weights
    if request.param == "process":
        app = build_app(model=model_dir, api_key=KEY, max_waiting=64, max_request_bytes=MAX_BYTES,
                        log_stats_interval=None, **SERVER)
        with ServerThread(app) as server:
            while httpx.get(server.url + "/health").status_code == 503:  # the core loads
                time.sleep(0.1)
            yield Target(server.url, server.url + "/openapi.json", [server.url], expected)
        return
    argv = ["--model", model_dir, "--api-key", KEY, "--max-waiting", "64", "--max-request-bytes",
            str(MAX_BYTES), "--max-model-len", "64", "--max-num-seqs", "16", "--log-stats-interval", "0",
            "--uvicorn-log-level", "warning"]
    with LocalReplicas(2, argv, startup_timeout=120) as local:
        app = build_router_app(local.urls, "round_robin", api_key=KEY, max_request_bytes=MAX_BYTES)
        with ServerThread(app) as router:
            yield Target(router.url, local.urls[0] + "/openapi.json", local.urls, expected, paths="^/v1/")


@pytest.fixture()
def client(served):
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as c:
        yield c


def http_canary(client) -> str:
    body = {"prompt": CANARY_PROMPT, **CANARY_PARAMS}
    r = client.post(C, json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def engine_is_fine(client, served: Target) -> None:
    """The engines are alive, hold no blocks once idle, and answer exactly as before."""
    served.engines_are_fine()
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    for _ in served.replica_urls:  # through the router: round robin asks each replica
        assert http_canary(client) == served.expected


# -- the matrix ------------------------------------------------------------------------------
def cases() -> list[tuple[str, dict | bytes, int, str | None]]:
    """(path, body, status, param) for each hostile request."""
    out = []

    def bad(path, body, param, status=400):
        out.append((path, body, status, param))

    for path in (C, CHAT):
        base = {"prompt": "hi"} if path == C else {"messages": MSG}
        field_values = {
            "temperature": ["NaN", "1e-40", "Infinity", -1, -1e-30, True, "hot", [1]],
            "top_p": [0, 0.0, -0.5, 1.5, "1e-50", "0.5", True],
            "top_k": [1.5, True, -2, "5"],
            "max_tokens": [0, -5, 1.5, "16", True, 10**6],
            "min_tokens": [-1, 1.5, "2"],
            "seed": [2**64, -(2**63) - 1, 1.5, "1", True],
            "stop": [[1], 1, [""], "", ["a"] * 17, {"x": 1}],
            "stop_token_ids": [[-1], [1.5], "x", [10**9], [True]],
            "ignore_eos": [1, "true"],
            "n": [17, 0, "1", 1.5, True],
            "stream": ["yes", 1],
            "return_token_ids": [1],
            "user": [5],
            "presence_penalty": [2.5, -3, "1", True], "frequency_penalty": [-2.5, "0"],
            "repetition_penalty": [0, -1, "1.2"], "min_p": [-0.1, 1.5, "0.1"],
            "logit_bias": [{"1": 101}, {"1": -100.5}, {"x": 5}, {"-1": 5}, {"1": "5"}, [1], {"99999": 1}],
            "response_format": [{"type": "xml"}, {"type": "json_schema"}, "json",
                                {"type": "text", "json_schema": {"name": "x"}},
                                {"type": "json_schema", "json_schema": {"schema": {}}},
                                {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "objectx"}}}],
            "structured_outputs": [{"json": [1]}, {"json": 5}, {"json": "{not json"},
                                   {"json": {"type": "integer", "minimum": 2, "maximum": 1}},
                                   {"regex": "(ab"}, {"regex": 5}, {"choice": []}, {"choice": "a"},
                                   {"choice": [1]}, {"grammar": "root ::= "}, {"grammar": ["x"]}, {},
                                   {"json": {}, "regex": "a"}, {"regex": "a", "disable_any_whitespace": True},
                                   {"json_object": 1}, {"jsn": {}}, "json", [1]],
            # vLLM's structured-output fields before v0.12: refused, naming what to send instead
            "guided_json": [{"type": "object"}], "guided_regex": ["a+"], "guided_choice": [["a"]],
            "guided_grammar": ["root ::= \"a\""],
            "disable_any_whitespace": [True, 1],  # belongs inside structured_outputs
        }
        for field, values in field_values.items():
            for v in values:
                bad(path, {**base, field: v}, field)
        bad(path, {**base, "min_tokens": 10, "max_tokens": 2}, "min_tokens")
        bad(path, {**base, "stream_options": {"include_usage": True}}, "stream_options")
        bad(path, {**base, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options")
        bad(path, {**base, "model": "gpt-4"}, "model", 404)
        bad(path, [base], None)
        bad(path, "hi", None)
        bad(path, b'{"prompt": ', None)
        bad(path, b"\xff\xfe\x00", None)
        bad(path, NAN_BODY.replace(b'"prompt": "hi"', json.dumps(base)[1:-1].encode()), "temperature")
        bad(path, json.dumps(base).encode()[:-1] + b', "presence_penalty": NaN}', "presence_penalty")
    for prompt in (None, 5, [], "", [1.5], [-1], [10**9], ["a", "b"], [[1], [2]], [1] * 100, [True]):
        bad(C, {"prompt": prompt, "max_tokens": 4} if prompt is not None else {"max_tokens": 4}, "prompt")
    for field, value in (("echo", True), ("logprobs", 21), ("logprobs", True), ("logprobs", -1),
                         ("best_of", 2), ("suffix", "x")):
        bad(C, {"prompt": "hi", field: value}, field)
    for messages in ([], "hello", [{"role": "user"}], [{"content": "x"}],
                     [{"role": "robot", "content": "x"}], [{"role": "user", "content": 5}],
                     [{"role": "user", "content": None}],
                     [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                     [{"role": "user", "content": [{"type": "text", "text": None}]}],
                     [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "user", "content": [{"type": "text"}]}],
                     [{"role": "user", "content": "hi", "name": "bob"}],
                     [{"role": "user", "content": "x" * 600}]):
        bad(CHAT, {"messages": messages}, "messages")
    for field, value in (("logprobs", 1), ("top_logprobs", 2), ("top_logprobs", 21),
                         ("tools", [{"type": "function"}]),
                         ("tool_choice", "auto"), ("functions", [{"name": "f"}]),
                         ("parallel_tool_calls", True), ("max_completion_tokens", 0)):
        bad(CHAT, {"messages": MSG, field: value}, field)
    return out


CASES = cases()
NOT_AUTHORIZED = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                  {"Authorization": "Basic Zm9vOmJhcg=="}, {"Authorization": "Bearer kä".encode()},
                  {"Authorization": b"Bearer \xff\xfe"}, {"Authorization": "bearer"}]


def test_bad_input_matrix_over_http(served, client):
    """Every case is refused with its status, ``param`` naming the field, and OpenAI's
    error shape; the engine never notices."""
    server = served
    engine_is_fine(client, served)
    statuses: dict[int, int] = {}
    for path, body, status, param in CASES:
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = client.post(path, json=body)
        assert r.status_code == status, (path, body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param, (body, error)
        if param is not None:
            assert param in error["message"], (body, error)
        statuses[status] = statuses.get(status, 0) + 1
    for headers in NOT_AUTHORIZED:
        r = httpx.post(server.url + C, json={"prompt": "hi"}, headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    # The key is checked before the body is read: a huge body without one is a 401.
    r = httpx.post(server.url + C, content=b"x" * (8 * MAX_BYTES), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 401
    # Bodies over the limit: 413, whether or not they say their length up front.
    big = json.dumps({"prompt": "y" * MAX_BYTES}).encode()
    r = client.post(C, content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = client.post(C, content=iter([big[:1000], big[1000:]]), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    # A body just under the limit, sent in chunks, is read whole and served.
    r = client.post(C, content=iter([b'{"prompt": "hi", ', b'"max_tokens": 2}']),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    # An unknown field (a typo here) is served as vLLM serves it, and named in a header.
    r = client.post(C, json={"prompt": "hi", "max_tokens": 2, "temprature": 0.5})
    assert r.status_code == 200 and r.headers["x-minivllm-ignored-fields"] == "temprature", r.text
    # stream_options with a stream is honoured (the usage chunk comes before [DONE]).
    body = {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", C, json=body) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["usage"]["completion_tokens"] == 2
    tried = len(CASES) + len(NOT_AUTHORIZED) + 4
    engine_is_fine(client, served)
    print(f"\nHTTP bad inputs tried: {tried}, clean 4xx rejections: {tried - 1} "
          f"(+1 chunked body served), by status {statuses}, engine deaths: 0")


@pytest.mark.parametrize("extra", [dict(temperature=1e-40), dict(temperature=5e-324),
                                   dict(temperature=1e-37), dict(temperature=1.0, top_p=1e-46),
                                   dict(temperature=0.9, top_p=1e-50)])
def test_former_engine_killers_are_served_greedy(served, client, extra):
    """These once made the step raise and killed the server; now they are greedy."""
    body = {"prompt": CANARY_PROMPT, **CANARY_PARAMS, **extra}
    r = client.post(C, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == served.expected
    engine_is_fine(client, served)


def test_seed_out_of_range_names_seed_in_chat(client):
    r = client.post(CHAT, json={"messages": MSG, "seed": 2**64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_stop_string_on_the_last_allowed_token(served, client):
    r = client.post(C, json={"prompt": CANARY_PROMPT, "max_tokens": 1, "temperature": 0})
    text = r.json()["choices"][0]["text"]
    stop = text.strip()
    assert stop
    r = client.post(C, json={"prompt": CANARY_PROMPT, "max_tokens": 1, "temperature": 0, "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == text[: text.index(stop)]


# -- schemathesis --------------------------------------------------------------------------------
# Driven through its Python API (a strategy of cases for every operation, valid and
# invalid) rather than its pytest plugin, whose fixture-based loading does not work
# with pytest 9.
FUZZ_EXAMPLES = 300


def test_fuzzed_requests_never_get_a_5xx_and_match_the_schema(served, client):
    schema = served.schema()
    strategy = st.one_of(schema.as_strategy(GenerationMode.POSITIVE),
                         schema.as_strategy(GenerationMode.NEGATIVE))
    by_status: dict[int, int] = {}
    by_operation: dict[str, int] = {}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case):
        response = case.call_and_validate(
            base_url=served.url, headers=AUTH, timeout=60,
            checks=[not_a_server_error, response_schema_conformance, status_code_conformance])
        by_status[response.status_code] = by_status.get(response.status_code, 0) + 1
        label = f"{case.method} {case.path}"
        by_operation[label] = by_operation.get(label, 0) + 1

    fuzz()
    examples = sum(by_status.values())
    assert examples >= FUZZ_EXAMPLES // 2, by_status  # hypothesis may stop early on its own
    assert by_status.get(200, 0) >= 20 and by_status.get(400, 0) >= 20, by_status
    assert len(by_operation) == (5 if served.paths == ".*" else 3), by_operation
    engine_is_fine(client, served)
    print(f"\nschemathesis examples run: {examples}, by status {by_status}, by operation {by_operation}")


@pytest.mark.parametrize("path, body", [(C, {"prompt": "hi", "max_tokens": 3, "stream": True}),
                                        (CHAT, {"messages": MSG, "max_tokens": 3, "stream": True})])
def test_a_stream_matches_the_schema_it_documents(served, path, body):
    """A streamed 200 checked on purpose, not left to the fuzzer's draw: schemathesis reads
    each server-sent event against the schema the server documents for text/event-stream."""
    schema = served.schema()
    case = schema[path]["POST"].Case(body=body, media_type="application/json")
    response = case.call_and_validate(base_url=served.url, headers=AUTH, timeout=60,
                                      checks=[not_a_server_error, response_schema_conformance])
    assert response.status_code == 200
    assert response.headers["content-type"][0].startswith("text/event-stream")
    assert response.text.rstrip().endswith("data: [DONE]")
