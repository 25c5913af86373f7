"""The OpenAI-compatible server, end to end over loopback HTTP (notebook 10).

One real SmolLM2 engine serves every test. Its offline greedy outputs are computed
first, with ``LLM.generate``; then the same engine goes behind the server, and every
answer that comes back over HTTP must equal the offline one token for token.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from minivllm import LLM, SamplingParams

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minivllm.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402

pytestmark = pytest.mark.real_model

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = 60.0
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_PARAMS = SamplingParams(temperature=0.0, max_tokens=24)
PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(64)]
MANY_PARAMS = SamplingParams(temperature=0.0, max_tokens=8)
# A long-running request kept in flight while bad requests arrive.
INFLIGHT_PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(log_stats_interval=None)


@pytest.fixture(scope="module")
def offline(llm: LLM) -> dict:
    """Offline greedy references, computed before the server owns the engine."""
    chat_prompt = {"prompt_token_ids": llm._chat_ids(CHAT)}
    outs = llm.generate([chat_prompt, PROMPTS[0], *PROMPTS],
                        [CHAT_PARAMS, INFLIGHT_PARAMS] + [MANY_PARAMS] * len(PROMPTS), use_tqdm=False)
    return {"chat": outs[0].outputs[0], "inflight": outs[1].outputs[0],
            "many": [o.outputs[0] for o in outs[2:]]}


@pytest.fixture(scope="module")
def server(llm: LLM, offline: dict, pytestconfig: pytest.Config):
    if pytestconfig.getoption("engine_process"):  # the same engine settings, in its own process
        app = build_app(api_key=KEY, max_waiting=100, log_stats_interval=None)
    else:
        app = build_app(llm, api_key=KEY, max_waiting=100)
    with ServerThread(app) as s:
        deadline = time.monotonic() + 120
        while httpx.get(s.url + "/health").status_code != 200:  # the core is loading
            assert time.monotonic() < deadline, "the engine never became ready"
            time.sleep(0.1)
        yield s
    assert not s.thread.is_alive(), "the server thread did not stop"


@pytest.fixture()
def client(server: ServerThread):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT) as c:
        yield c


def scrape(client) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def successes(metrics: dict, reason: str) -> float:
    return metrics[("minivllm:request_success_total", (("finished_reason", reason),))]


def wait_until_idle(client, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(client)
        idle = (m[("minivllm:num_requests_running", ())] == 0
                and m[("minivllm:num_requests_waiting", ())] == 0
                and m[("minivllm:kv_cache_usage_perc", ())] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# -- the official client ---------------------------------------------------------------------
def test_openai_client_chat_and_stream_match_offline(server, offline):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
    [model] = client.models.list().data
    want = offline["chat"]

    resp = client.chat.completions.create(model=model.id, messages=CHAT, max_tokens=24, temperature=0)
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].finish_reason == want.finish_reason
    assert resp.usage.completion_tokens == len(want.token_ids)

    pieces, reasons = [], []
    for chunk in client.chat.completions.create(model=model.id, messages=CHAT, max_tokens=24,
                                                temperature=0, stream=True):
        pieces.append(chunk.choices[0].delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
    assert len(pieces) > 2, "the answer should arrive in several chunks"
    assert "".join(pieces) == want.text
    assert reasons[-1] == want.finish_reason and not any(reasons[:-1])


def test_openai_client_penalties_break_smollm2s_loop(server):
    """SmolLM2 greedy loops on this prompt ("I'm a big apple." again and again); the
    penalties a user reaches for break the loop (issue 20)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)

    def distinct(**kw) -> tuple[int, int]:
        r = client.completions.create(model=None, prompt="I like apples. I like apples. I like",
                                      max_tokens=48, temperature=0,
                                      extra_body={"return_token_ids": True, **kw.pop("extra_body", {})},
                                      **kw)
        ids = r.choices[0].token_ids
        return len(set(ids)), len(ids)

    looping, n = distinct()
    assert n == 48 and looping < 12, (looping, n)
    assert distinct(presence_penalty=1.0)[0] > 2 * looping
    assert distinct(extra_body={"repetition_penalty": 1.3})[0] > 2 * looping


def test_streamed_completion_is_sse_ending_with_done(client, offline):
    body = {"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == offline["many"][3].text


# -- many at once ---------------------------------------------------------------------------
def test_64_concurrent_requests_match_offline(client, server, offline):
    before = scrape(client)

    async def one(http, prompt: str) -> dict:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    async def all_of_them() -> list[dict]:
        limits = httpx.Limits(max_connections=len(PROMPTS))
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=TIMEOUT,
                                     limits=limits) as http:
            return await asyncio.gather(*(one(http, p) for p in PROMPTS))

    choices = asyncio.run(asyncio.wait_for(all_of_them(), TIMEOUT))
    for got, want in zip(choices, offline["many"]):
        assert got["token_ids"] == want.token_ids
        assert got["text"] == want.text

    after = wait_until_idle(client)
    done = sum(successes(after, r) - successes(before, r) for r in ("stop", "length"))
    assert done == 64
    assert successes(after, "abort") == successes(before, "abort")
    assert after[("minivllm:num_requests_running", ())] == 0
    ok = ("minivllm:http_requests_total", (("handler", "/v1/completions"), ("status", "200")))
    assert after[ok] - before.get(ok, 0) == 64


# -- cancellation ---------------------------------------------------------------------------
def test_disconnect_mid_stream_aborts_and_frees_blocks(server, client, offline):
    before = scrape(client)
    body = {"prompt": PROMPTS[1], "max_tokens": 2000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT) as other:
        with other.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [line for line in (next(lines) for _ in range(6)) if line]
            assert len(got) >= 2
            during = scrape(client)
            assert during[("minivllm:num_requests_running", ())] == 1
            assert during[("minivllm:kv_cache_usage_perc", ())] > 0
    # The connection is closed: the server notices, aborts, and frees the blocks.
    after = wait_until_idle(client)
    assert after[("minivllm:kv_cache_usage_perc", ())] == 0
    assert after[("minivllm:num_requests_running", ())] == 0
    assert successes(after, "abort") == successes(before, "abort") + 1
    generated = (after[("minivllm:generation_tokens_total", ())]
                 - before[("minivllm:generation_tokens_total", ())])
    assert generated < 200, "the aborted request kept running"
    # ... and keeps serving.
    r = client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline["many"][2].text


def test_disconnect_before_a_plain_response_aborts_too(server, client):
    before = scrape(client)
    body = json.dumps({"prompt": PROMPTS[4], "max_tokens": 2000, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((server.host, server.port), timeout=TIMEOUT) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + TIMEOUT
        while scrape(client)[("minivllm:num_requests_running", ())] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    after = wait_until_idle(client)
    assert after[("minivllm:kv_cache_usage_perc", ())] == 0
    assert successes(after, "abort") == successes(before, "abort") + 1


# -- limits and errors ----------------------------------------------------------------------
BAD_REQUESTS = [
    # (path, body (dict or raw bytes), status, param, words the message must contain)
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400, None, "not valid JSON"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens", "maximum length"),
    ("/v1/completions", {"prompt": [1] * 8192}, 400, "prompt", "max_model_len"),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n", "n must be"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**6}, 400, "max_tokens", "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4"}, 404, "model", "does not exist"),
]


def check_error(r, status: int, param: str | None, words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error
    assert error["param"] == param, error


def test_bad_inputs_get_clear_errors_and_do_not_disturb_requests_in_flight(server, client, offline):
    app_engine = server.app.state.engine
    result: dict = {}

    def in_flight() -> None:
        body = {"prompt": PROMPTS[0], "max_tokens": 32, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                result["events"] = [line for line in r.iter_lines() if line]

    thread = threading.Thread(target=in_flight)
    thread.start()
    try:
        for path, body, status, param, words in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = client.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = client.post(path, json=body)
            check_error(r, status, param, words)

        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers=headers,
                           timeout=TIMEOUT)
            check_error(r, 401, None, "API key")
        assert httpx.get(server.url + "/v1/models", timeout=TIMEOUT).status_code == 401
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200  # no key needed

        # Capacity: with the queue bound at 0, any new request is one too many.
        app_engine.max_waiting = 0
        try:
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            check_error(r, 503, None, "capacity")
            assert r.json()["error"]["code"] == "queue_full"
        finally:
            app_engine.max_waiting = 100
    finally:
        thread.join(TIMEOUT)
    assert not thread.is_alive()

    events = result["events"]
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == offline["inflight"].text
    assert wait_until_idle(client)[("minivllm:kv_cache_usage_perc", ())] == 0
