"""Clients built for vLLM work unchanged (issue 35): guidellm's and ``vllm bench serve``'s
request bodies, vLLM's extension fields, and ``continuous_usage_stats``.

guidellm itself (a dev extra) runs a short benchmark against the server as it ships;
its request bodies are also reproduced exactly from its source
(``guidellm/backends/openai/request_handlers.py``), so that each field's handling is
checked where a failure can say which, as are those of vLLM's
``vllm/benchmarks/lib/endpoint_request_func.py``. Both server designs are served: the
default (the engine core in a process of its own) and the engine on a thread.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_chat import save_tiny_chat

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from minivllm import LLM  # noqa: E402
from minivllm.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402
from minivllm.entrypoints.openai.base_protocol import IGNORED_FIELDS_HEADER  # noqa: E402

C, CHAT = "/v1/completions", "/v1/chat/completions"
TIMEOUT = 60.0
PROMPT = "The capital of France is"
N = 6  # output tokens asked for (ignore_eos: exactly this many)


def guidellm_body(path: str, stream: bool) -> dict:
    """What guidellm 0.8.1 sends for a synthetic-data request with a fixed output length."""
    body: dict = {"model": "tiny"}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if path == C:
        return {**body, "max_tokens": N, "stop": None, "ignore_eos": True, "prompt": PROMPT}
    return {**body, "max_completion_tokens": N, "stop": None, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}


def vllm_bench_body(path: str) -> dict:
    """What ``vllm bench serve`` sends (backends openai-completions and openai-chat,
    with ``--ignore-eos``)."""
    if path == C:
        return {"model": "tiny", "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": N,
                "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True}
    return {"model": "tiny", "max_completion_tokens": N, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny Llama over SmolLM2's vocabulary, saved with SmolLM2's tokenizer."""
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module", params=[pytest.param("process", marks=pytest.mark.multiprocess),
                                        "thread"])
def client(request, tiny_dir):
    engine = dict(max_model_len=256, log_stats_interval=None)
    if request.param == "process":  # what `minivllm serve` runs
        app = build_app(model=tiny_dir, served_model_name="tiny", **engine)
    else:
        app = build_app(LLM(tiny_dir, **engine), served_model_name="tiny")
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        deadline = time.monotonic() + 120
        while c.get("/health").status_code != 200:  # the engine core loads while this says 503
            assert time.monotonic() < deadline, "the engine never became ready"
            time.sleep(0.1)
        yield c


def stream_chunks(client, path: str, body: dict) -> tuple[httpx.Headers, list[dict]]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        headers = r.headers
    assert lines[-1] == "data: [DONE]"
    return headers, [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.parametrize("path", [C, CHAT])
def test_guidellm_bodies_get_usage_in_every_chunk_adding_up(client, path):
    plain = client.post(path, json=guidellm_body(path, stream=False))
    assert plain.status_code == 200, plain.text
    assert IGNORED_FIELDS_HEADER not in plain.headers  # every field guidellm sends is acted on
    expected = plain.json()["usage"]
    assert expected["completion_tokens"] == N

    headers, chunks = stream_chunks(client, path, guidellm_body(path, stream=True))
    assert IGNORED_FIELDS_HEADER not in headers
    *token_chunks, last = chunks
    assert last["choices"] == [] and last["usage"] == expected
    counts = []
    for chunk in token_chunks:
        usage = chunk["usage"]  # vLLM's continuous_usage_stats: in every chunk
        assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        assert usage["prompt_tokens"] == expected["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        counts.append(usage["completion_tokens"])
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == N, counts


@pytest.mark.parametrize("path", [C, CHAT])
def test_vllm_bench_serve_bodies_succeed(client, path):
    """Parsed as ``vllm bench serve`` parses them: text in chunks with choices, the
    output length from the last chunk's usage; no usage before it (none asked for)."""
    _, chunks = stream_chunks(client, path, vllm_bench_body(path))
    with_choices = [c for c in chunks if c.get("choices")]
    assert with_choices and all("usage" not in c for c in with_choices)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == N


def test_continuous_usage_counts_each_choice_and_needs_include_usage(client):
    body = {"prompt": PROMPT, "max_tokens": N, "ignore_eos": True, "n": 2, "seed": 1,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    _, chunks = stream_chunks(client, C, body)
    per_choice: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        per_choice.setdefault(chunk["choices"][0]["index"], []).append(chunk["usage"]["completion_tokens"])
    assert sorted(per_choice) == [0, 1]
    assert all(c == sorted(c) and c[-1] == N for c in per_choice.values()), per_choice
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * N  # the request's, over both choices
    # vLLM's rule: continuous_usage_stats only with include_usage.
    body["stream_options"] = {"continuous_usage_stats": True}
    _, chunks = stream_chunks(client, C, body)
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("path", [C, CHAT])
def test_ignored_and_unknown_fields_are_served_and_named(client, path, caplog):
    body = {**guidellm_body(path, stream=False), "use_beam_search": True, "skip_special_tokens": True,
            "kv_transfer_params": {"do_remote_decode": True}, "temprature": 0.5}
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        headers, _ = stream_chunks(client, path, {**body, **guidellm_body(path, stream=True),
                                                  "stream_options": {"include_usage": True, "x": 1}})
    # skip_special_tokens: true is what this server does anyway, so it is not reported.
    assert r.headers[IGNORED_FIELDS_HEADER] == "use_beam_search,kv_transfer_params,temprature"
    assert headers[IGNORED_FIELDS_HEADER] == \
        "use_beam_search,kv_transfer_params,temprature,stream_options.x"
    lines = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(lines) == 2, lines  # one line per request
    assert "use_beam_search, kv_transfer_params, temprature" in lines[0]


@pytest.mark.parametrize("path", [C, CHAT])
@pytest.mark.parametrize("field, value", [
    ("use_beam_search", "yes"), ("length_penalty", "1"), ("truncate_prompt_tokens", 1.5),
    ("allowed_token_ids", ["a"]), ("cache_salt", 5), ("cache_salt", ""), ("stream_options", {"continuous_usage_stats": 1}),
    ("temperature", -1), ("guided_json", {"type": "object"}),
])
def test_bad_values_of_accepted_fields_are_400_naming_the_field(client, path, field, value):
    body = {**guidellm_body(path, stream=True), field: value}
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], error


def test_a_hostile_field_name_cannot_forge_a_header(client):
    """An unknown field's name is any JSON string; it reaches the header escaped."""
    body = {**guidellm_body(C, stream=False), "a\r\nx-forged: 1": 1, "\U0001f600é\x11": 2}
    r = client.post(C, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert "x-forged" not in r.headers
    assert r.headers[IGNORED_FIELDS_HEADER] == "a\\r\\nx-forged: 1,\\U0001f600\\xe9\\x11"


def test_guidellm_benchmarks_the_server_with_every_request_successful(client, tiny_dir, tmp_path):
    """guidellm 0.8.1 as a user runs it (its chat endpoint, streaming, synthetic prompts
    of 64 tokens and 16 output tokens, 4 at a time): every request succeeds, and each
    gets the 16 tokens it asked for."""
    pytest.importorskip("guidellm")
    guidellm = shutil.which("guidellm", path=str(Path(sys.executable).parent)) or "guidellm"
    report = tmp_path / "guidellm.json"
    cmd = [guidellm, "run", "--backend", f"kind=openai_http,target={client.base_url}",
           "--profile", "kind=concurrent,streams=4",
           "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
           "--constraint", "kind=max_requests,count=8",
           "--tokenizer", f"kind=huggingface_auto,model={tiny_dir}",
           "--output", f"kind=json,path={report}", "--disable-progress"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    state, requests = benchmark["scheduler_state"], benchmark["requests"]
    assert state["successful_requests"] == 8, state
    assert state["errored_requests"] == 0 and state["cancelled_requests"] == 0, requests["errored"][:1]
    assert [r["output_tokens"] for r in requests["successful"]] == [16] * 8
