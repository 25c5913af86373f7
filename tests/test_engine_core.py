"""The engine core in its own process (``minivllm.engine.core``, ``minivllm.engine.core_client``).

The server in front of a split engine must answer exactly as the offline engine does,
free a disconnected request's blocks, refuse bad input without the core, say 503 until
the core is ready, turn a dead core into clear errors, and leave no process behind,
however it ends (shutdown, SIGTERM, SIGKILL).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
httpx = pytest.importorskip("httpx")
from test_server import scrape, successes, wait_until_idle  # noqa: E402

from minivllm.engine.async_llm import AsyncMPEngine  # noqa: E402
from minivllm.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from minivllm.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.multiprocess]

TIMEOUT = 60.0
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(16)]
ENGINE = {"max_num_seqs": 8, "log_stats_interval": None}
COPY = ("Repeat this list exactly: red, green, blue, red, green, blue, red, green, blue, "
        "red, green, blue, red, green,")
"""A prompt whose greedy continuation copies from itself: n-gram drafts get accepted."""
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
        "adaptive": False}


def wait_healthy(client: httpx.Client, timeout: float = 120.0) -> list[int]:
    """Poll /health until 200; return every status seen."""
    seen, deadline = [], time.monotonic() + timeout
    while not seen or seen[-1] != 200:
        assert time.monotonic() < deadline, f"never ready: {seen[-5:]}"
        seen.append(client.get("/health").status_code)
        time.sleep(0.05)
    return seen


def is_gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for its parent's wait()."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not is_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return is_gone(pid)


@pytest.fixture(scope="module")
def offline() -> dict:
    llm = LLM(**ENGINE)
    chat = llm.generate({"prompt_token_ids": llm._chat_ids(CHAT)},
                        SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    stop = SamplingParams(temperature=0.0, max_tokens=24, stop=[" is"])
    many = llm.generate(PROMPTS, [stop if i % 2 else SamplingParams(temperature=0.0, max_tokens=12)
                                  for i in range(len(PROMPTS))], use_tqdm=False)
    copy = llm.generate(COPY, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    return {"chat": chat.outputs[0], "many": [o.outputs[0] for o in many], "copy": copy.outputs[0]}


@pytest.fixture(scope="module")
def split(offline):
    with pytest.MonkeyPatch.context() as mp:  # the development endpoints too (reset_prefix_cache)
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")
        app = build_app(**ENGINE)
    assert isinstance(app.state.engine, AsyncMPEngine)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        seen = wait_healthy(client)
        assert seen[0] == 503 and seen[-1] == 200, "health was not 503 while the core loaded"
        yield server, client
    pid = app.state.engine.pid
    assert wait_gone(pid), "the engine core outlived the server"


def test_the_model_list_asked_while_the_core_loads_waits_for_it():
    """Clients ask for /v1/models first (guidellm does, to pick the model): asked while
    the engine process still loads, it answers once the model is there, with its
    maximum length, not a 500 over a null."""
    app = build_app(**ENGINE)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        assert client.get("/health").status_code == 503, "the core had loaded before the test asked"
        models = client.get("/v1/models")
        assert models.status_code == 200, models.text
        assert models.json()["data"][0]["max_model_len"] == app.state.engine.max_model_len > 0


def test_outputs_match_offline_token_for_token(split, offline):
    server, client = split
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 24, "temperature": 0,
                                                  "return_token_ids": True})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == offline["chat"].text
    assert choice["token_ids"] == offline["chat"].token_ids

    async def one(http: httpx.AsyncClient, i: int) -> tuple[str, str | None]:
        body = {"prompt": PROMPTS[i], "max_tokens": 24 if i % 2 else 12, "temperature": 0,
                "stream": True, **({"stop": [" is"]} if i % 2 else {})}
        text, reason = "", None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    c = json.loads(line[6:])["choices"][0]
                    text, reason = text + c["text"], c["finish_reason"] or reason
        return text, reason

    async def all_of_them() -> list[tuple[str, str | None]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
            return await asyncio.gather(*(one(http, i) for i in range(len(PROMPTS))))

    streamed = asyncio.run(all_of_them())
    assert streamed == [(o.text, o.finish_reason) for o in offline["many"]]
    assert wait_until_idle(client)[("minivllm:kv_cache_usage_perc", ())] == 0


def test_each_token_is_detokenized_once_by_the_server(split, offline, monkeypatch):
    """The core sends token ids; the server's output processor turns each into text once
    (the core makes none: tests/test_output_processor.py), stop strings included."""
    server, client = split
    seen: list[int] = []
    real = IncrementalDetokenizer.add_token

    def add_token(self, token_id: int) -> str:
        seen.append(token_id)
        return real(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", add_token)
    want = offline["many"][5]  # greedy, it stops at " is" after 8 tokens
    assert want.stop_reason == " is"
    body = {"prompt": PROMPTS[5], "max_tokens": 24, "temperature": 0, "stop": [" is"], "return_token_ids": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (want.text, "stop", " is")
    assert seen == choice["token_ids"] == want.token_ids


def test_disconnect_aborts_in_the_core_and_frees_blocks(split, offline):
    server, client = split
    before = scrape(client)
    body = {"prompt": PROMPTS[1], "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as other:
        with other.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert len([line for line in (next(lines) for _ in range(6)) if line]) >= 2
            assert scrape(client)[("minivllm:kv_cache_usage_perc", ())] > 0
    after = wait_until_idle(client)
    assert after[("minivllm:kv_cache_usage_perc", ())] == 0
    assert after[("minivllm:num_requests_running", ())] == 0
    assert successes(after, "abort") == successes(before, "abort") + 1
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
    assert r.json()["choices"][0]["text"] == offline["many"][0].text


def test_reset_prefix_cache_reaches_the_core(split):
    """POST /reset_prefix_cache empties the core's cache: the same prompt found its blocks
    before, finds none after; refused (409) while a request holds blocks."""
    _, client = split
    body = {"prompt": COPY, "max_tokens": 2, "temperature": 0}

    def hits_of_one_request() -> float:
        before = scrape(client)[("minivllm:prefix_cache_hits_total", ())]
        assert client.post("/v1/completions", json=body).status_code == 200
        return wait_until_idle(client)[("minivllm:prefix_cache_hits_total", ())] - before

    hits_of_one_request()
    assert hits_of_one_request() > 0, "a repeated prompt found nothing cached"
    assert client.post("/reset_prefix_cache").status_code == 200
    assert hits_of_one_request() == 0, "the cache was not emptied"
    long = {"prompt": PROMPTS[2], "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=long) as r:
        lines = r.iter_lines()
        assert len([line for line in (next(lines) for _ in range(4)) if line]) >= 2  # decoding
        busy = client.post("/reset_prefix_cache")
    assert busy.status_code == 409 and "not reset" in busy.json()["error"]["message"], busy.text


def test_bad_input_is_refused_before_the_core(split):
    server, client = split
    # Idle first: a request of an earlier test on this shared server (an abort after a
    # disconnect) may still be ending, and would be counted between before and after.
    before = wait_until_idle(client)
    cases = [({"prompt": [10**9], "max_tokens": 4}, "prompt"),
             ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
             ({"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
             ({"prompt": [], "max_tokens": 4}, "prompt")]
    for body, param in cases:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    # Nothing reached the core: it finished no request, not even with an error.
    after = wait_until_idle(client)
    ended = [k for k in after if k[0] == "minivllm:request_success_total"]
    assert [after[k] for k in ended] == [before[k] for k in ended]


def test_speculative_config_crosses_into_the_core(offline):
    """The config is pickled into the spawned core: speculation runs there (its metrics
    exist and count accepted drafts), several tokens per step reach the server's
    detokenizer, and the greedy tokens are those of the offline engine without it."""
    app = build_app(**ENGINE, speculative_config=SPEC)
    assert app.state.engine.config.speculative_config == {**SPEC, "disable_by_batch_size": None}
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        wait_healthy(client)
        body = {"prompt": COPY, "max_tokens": 32, "temperature": 0}
        choice = client.post("/v1/completions", json={**body, "return_token_ids": True}).json()["choices"][0]
        assert choice["token_ids"] == offline["copy"].token_ids
        assert choice["text"] == offline["copy"].text
        text = ""
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == offline["copy"].text
        m = wait_until_idle(client)
    spec = {k[0].removeprefix("minivllm:spec_decode_").removesuffix("_total"): v
            for k, v in m.items() if k[0].startswith("minivllm:spec_decode_") and not k[1]}
    assert spec.keys() == {"num_drafts", "num_draft_tokens", "num_accepted_tokens"}, m.keys()
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    per_pos = [m[("minivllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
               for i in range(SPEC["num_speculative_tokens"])]
    assert sum(per_pos) == spec["num_accepted_tokens"]


def test_killed_core_gives_clear_errors_and_health_500(offline):
    app = build_app(**ENGINE)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        wait_healthy(client)
        body = {"prompt": PROMPTS[3], "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(app.state.engine.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        last = json.loads(rest[-1][6:])
        dead = "the engine core process was killed by SIGKILL"
        assert dead in last["error"]["message"], last
        health = client.get("/health")
        assert health.status_code == 500 and dead in health.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]


UNGUARDED_SERVER = """
import sys, time, httpx
from minivllm.entrypoints.openai.api_server import ServerThread, build_app

app = build_app(max_num_seqs=4, log_stats_interval=None)  # no __main__ guard
with ServerThread(app) as server:
    while (health := httpx.get(server.url + "/health")).status_code == 503:
        time.sleep(0.1)
    print(health.status_code, health.json()["error"]["message"], flush=True)
    stopping = time.monotonic()
print(f"stopped in {time.monotonic() - stopping:.1f} s", flush=True)
"""


def test_a_server_script_without_the_main_guard_is_told_so(tmp_path):
    """The engine core re-imports the script and would build a server of its own: it
    exits at once, /health says why (naming the guard), and the server still stops."""
    path = tmp_path / "serve_unguarded.py"
    path.write_text(UNGUARDED_SERVER)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    status, _, message = proc.stdout.partition(" ")
    assert proc.returncode == 0 and status == "500", proc.stdout + proc.stderr[-2000:]
    assert "engine core process exited while starting" in message and str(path) in message
    assert 'if __name__ == "__main__":' in message


def children_of(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def serve_in_a_process() -> tuple[subprocess.Popen, list[int], str]:
    """``minivllm serve`` as a user runs it; returns it, the processes under it (the engine
    core, multiprocessing's fork server whose child the core is, where there is one, and
    its resource tracker) and its url."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--port", str(port),
                             "--max-num-seqs", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        children, cores = [], []
        for c in children_of(proc.pid):
            cmdline = Path(f"/proc/{c}/cmdline").read_text()
            forked = children_of(c) if "forkserver" in cmdline else []
            cores += forked + ([c] if "spawn_main" in cmdline else [])
            children += [c, *forked]
        assert len(cores) == 1, "no engine core process"
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, children, url


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_minivllm_serve_leaves_no_orphan(how):
    proc, children, url = serve_in_a_process()
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=TIMEOUT)
        assert r.status_code == 200
        proc.send_signal(how)
        proc.wait(30)
        assert all(wait_gone(c) for c in children), f"a child outlived the server ({how.name})"
    finally:
        proc.kill()
        proc.wait()


def test_priority_crosses_into_the_core(offline):
    """``priority`` travels in AddRequest: with one seat in the core, two requests that
    wait behind a running one are served lower priority value first, though the less
    important one was sent first; the tokens are the offline engine's."""
    import concurrent.futures

    app = build_app(**{**ENGINE, "max_num_seqs": 1}, scheduling_policy="priority")
    assert app.state.engine.config.scheduling_policy == "priority"
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        wait_healthy(client)

        def complete(prompt: str, priority: int, max_tokens: int) -> tuple[float, dict]:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "priority": priority}
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
            return time.monotonic(), choice

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(complete, PROMPTS[0], 0, 48)  # holds the only seat
            while scrape(client)[("minivllm:num_requests_running", ())] < 1:
                time.sleep(0.02)
            batch = pool.submit(complete, PROMPTS[1], 5, 4)
            while scrape(client)[("minivllm:num_requests_waiting", ())] < 1:
                time.sleep(0.02)
            chat = pool.submit(complete, PROMPTS[2], -1, 4)
            while scrape(client)[("minivllm:num_requests_waiting", ())] < 2:
                assert not first.done(), "the first request finished before both others arrived"
                time.sleep(0.02)
            (_, a), (t_batch, b), (t_chat, c) = first.result(), batch.result(), chat.result()
        assert t_chat < t_batch
        assert a["finish_reason"] == b["finish_reason"] == c["finish_reason"] == "length"
        assert c["text"] == offline["many"][2].text[:len(c["text"])]
        refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "priority": 1.5})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
