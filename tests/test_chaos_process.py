"""Chaos on what ships (issue 35): ``minivllm serve`` with its engine core in a process of
its own, and the router in front of two such servers.

Each test ends the way an operator needs it to end. No request hangs past a bound, and
every request ends with a clear status: done, refused (503 naming ``max_waiting``), or an
error event that says what happened. After a fault the server either recovers, with every
KV block free again and ``/health`` 200, or exits with status 1 and a log line saying why
(vLLM's rule for a dead engine). The faults:

* clients that hang up at random points, one that reads a byte a second, and a burst
  over ``--max-waiting``, all at once;
* the engine core killed (SIGKILL) mid-stream;
* the engine core stopped (SIGSTOP) mid-stream, which only a silence bound can tell from
  a slow step (``VLLM_ENGINE_ITERATION_TIMEOUT_S``);
* a replica behind the router stopped, and a replica's core killed.

The model is the tiny random one with SmolLM2's tokenizer: steps take milliseconds, so
each test takes seconds; every bound below is a liveness bound that only a hang reaches.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from tiny_chat import save_tiny_chat  # noqa: E402

from minivllm.bench.soak import core_pid  # noqa: E402
from minivllm.entrypoints.data_parallel import free_port  # noqa: E402

pytestmark = pytest.mark.multiprocess

BOUND_S = 60.0
"""No request may take longer than this to end, however it ends."""
SERVE = ["--max-num-seqs", "4", "--max-model-len", "512", "--log-stats-interval", "0",
         "--uvicorn-log-level", "warning"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-chaos"))


class Served:
    """``minivllm serve`` in a process of its own, its log in a file."""

    def __init__(self, tiny_dir: str, log: Path, *args: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--model", tiny_dir,
               "--port", str(self.port), *SERVE, *args]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"serve exited while starting:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "serve did not become ready"
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    @property
    def core_pid(self) -> int:
        """The engine core under the server (found as ``minivllm bench soak`` finds it)."""
        pid = core_pid(self.proc.pid)
        assert pid is not None, "no engine core process under the server"
        return pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(url: str) -> dict[str, float]:
    """Nothing running or waiting and no KV block in use, as the core last reported."""
    deadline = time.monotonic() + BOUND_S
    while True:
        m = metrics(url)
        if (m["minivllm:num_requests_running"] == m["minivllm:num_requests_waiting"] == 0
                and m["minivllm:kv_cache_usage_perc"] == 0):
            return m
        assert time.monotonic() < deadline, f"never idle: {m}"
        time.sleep(0.1)


async def stream(http, body: dict, hang_up_after: int | None = None) -> dict:
    """One streamed completion: its text, whether it saw [DONE], any error event."""
    text, events, error, done = "", 0, None, False
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": json.loads(await r.aread())}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            data = json.loads(line[6:])
            if "error" in data:
                error = data["error"]
                continue
            events += 1
            text += data["choices"][0]["text"] if data["choices"] else ""
            if hang_up_after is not None and events >= hang_up_after:
                break  # leaving the block drops the connection mid-stream
    return {"status": 200, "text": text, "done": done, "error": error}


def slow_reader(url: str, max_tokens: int) -> socket.socket:
    """A client that sends a streaming request, then reads nothing (until closed)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_hang_ups_a_slow_reader_and_a_burst_on_the_engine_process(tiny_dir, tmp_path):
    server = Served(tiny_dir, tmp_path / "serve.log", "--max-waiting", "4")
    try:
        slow = slow_reader(server.url, 300)
        rng = random.Random(35)
        streams = [({"prompt": f"Story {i}:", "max_tokens": rng.randint(8, 40), "ignore_eos": True,
                     "temperature": 0}, rng.randint(1, 5) if i % 3 == 0 else None) for i in range(16)]

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=BOUND_S,
                                         limits=httpx.Limits(max_connections=64)) as http:
                burst = [http.post("/v1/completions", json={"prompt": f"Burst {i}", "max_tokens": 16,
                                                            "ignore_eos": True}) for i in range(24)]
                return await asyncio.gather(*(stream(http, b, h) for b, h in streams), *burst)

        start = time.monotonic()
        results = asyncio.run(asyncio.wait_for(run(), BOUND_S))
        elapsed = time.monotonic() - start
        got, burst = results[:len(streams)], results[len(streams):]
        for (_body, hang_up), r in zip(streams, got):
            if r["status"] == 503:  # the streams take part in the burst too
                assert "max_waiting" in r["body"]["error"]["message"]
            elif hang_up is None:
                assert r["done"] and r["error"] is None, r
        codes = [r.status_code for r in burst]
        assert set(codes) <= {200, 503}, codes
        statuses = [r["status"] for r in got] + codes
        # 40 requests at once on 4 seats (the slow reader holds one) and 4 places to wait:
        # some are refused, and at least the 3 + 4 the server has room for are served.
        assert statuses.count(503) >= 1 and statuses.count(200) >= 3 + 4, statuses
        for r in burst:
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "queue_full"
                assert "max_waiting=4" in r.json()["error"]["message"]
            else:
                assert r.json()["choices"][0]["finish_reason"] == "length"
        # The slow reader has read nothing, yet its request finished in the engine and gave
        # back its blocks: a client's pace holds memory for its text, never KV blocks.
        m = wait_idle(server.url)
        assert m['minivllm:request_success_total{finished_reason="length"}'] >= 1
        assert httpx.get(server.url + "/health").status_code == 200
        slow.close()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=BOUND_S)
        assert r.status_code == 200  # still serving
        print(f"\n16 streams (6 to hang up) and 24 plain requests at once, a slow reader: "
              f"{statuses.count(200)} served, {statuses.count(503)} refused 503, {elapsed:.1f} s")
    finally:
        server.stop()
    assert server.proc.returncode in (0, -signal.SIGTERM)


class OpenStream:
    """A long streamed completion, begun (its first event read) and kept open."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=BOUND_S)
        self.context = self.client.stream("POST", "/v1/completions", json={
            "prompt": "Hello", "max_tokens": 450, "ignore_eos": True, "stream": True})
        self.lines = self.context.__enter__().iter_lines()
        assert next(self.lines).startswith("data: {")

    def close(self) -> None:
        self.context.__exit__(None, None, None)
        self.client.close()


def last_event(lines) -> dict:
    events = [line for line in lines if line.startswith("data: ")]
    return json.loads(events[-1][6:])


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_stopped_core_ends_streams_and_the_server_exits_1(tiny_dir, tmp_path, fault):
    server = Served(tiny_dir, tmp_path / "serve.log", env={"VLLM_ENGINE_ITERATION_TIMEOUT_S": "3"})
    try:
        held = OpenStream(server.url)
        core = server.core_pid
        start = time.monotonic()
        os.kill(core, getattr(signal, fault))
        error = last_event(held.lines)["error"]  # the stream ends: no hang
        ended = time.monotonic() - start
        held.close()
        code = server.proc.wait(BOUND_S)
        log = server.log.read_text()
    finally:
        server.stop()
    why = ("was killed by SIGKILL" if fault == "SIGKILL"
           else "sent nothing for 3 s with 1 request(s) or call(s) in flight")
    assert why in error["message"], error
    assert code == 1, log[-3000:]
    assert "the engine died" in log and why in log and "exits with status 1" in log, log[-3000:]
    assert not Path(f"/proc/{core}").exists() or "Z" in Path(f"/proc/{core}/stat").read_text().split()[2]
    print(f"\n{fault}: the stream ended {ended:.1f} s later with: {error['message'][:120]}")


def test_a_stopped_replica_and_a_dead_replica_core_behind_the_router(tiny_dir, tmp_path):
    """The router's fleet recovers: a replica that stops answering leaves the rotation
    when its health probe fails twice, and its stream in flight ends then with an error
    event (the read timeout, 600 s, is far past the test's 60 s bound); it comes back
    when it is resumed; a replica whose core is killed exits 1 and stays out; the other
    serves."""
    from minivllm.entrypoints.openai.api_server import ServerThread
    from minivllm.entrypoints.router_app import build_router_app

    replicas = [Served(tiny_dir, tmp_path / f"replica{i}.log", env={"VLLM_ENGINE_ITERATION_TIMEOUT_S": "3"})
                for i in range(2)]
    app = build_router_app([r.url for r in replicas], "round_robin", health_interval=0.5, read_timeout=600)
    state = app.state.router
    try:
        with ServerThread(app) as router:
            ask = {"prompt": "Hi", "max_tokens": 4}
            assert httpx.post(router.url + "/v1/completions", json=ask, timeout=BOUND_S).status_code == 200
            # round robin: the next request goes to replica 1; stop that whole server mid-stream
            held = OpenStream(router.url)
            os.kill(replicas[1].proc.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                error = last_event(held.lines)["error"]
                held.close()
                assert "out of rotation" in error["message"], error
                print(f"\nthe stopped replica's stream ended {time.monotonic() - stopped:.1f} s after SIGSTOP")
                assert not state.replicas[1].healthy
                for _ in range(4):  # all served by replica 0 meanwhile
                    assert httpx.post(router.url + "/v1/completions", json=ask, timeout=BOUND_S).status_code == 200
            finally:
                os.kill(replicas[1].proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + BOUND_S
            while not state.replicas[1].healthy:  # the probe brings it back
                assert time.monotonic() < deadline, "the resumed replica never came back"
                time.sleep(0.1)
            wait_idle(replicas[1].url)  # its aborted stream gave its blocks back

            # Kill replica 0's engine core: replica 0 exits 1, replica 1 serves every request.
            os.kill(replicas[0].core_pid, signal.SIGKILL)
            assert replicas[0].proc.wait(BOUND_S) == 1
            statuses = [httpx.post(router.url + "/v1/completions", json=ask, timeout=BOUND_S).status_code
                        for _ in range(4)]
            assert statuses == [200] * 4, statuses
            assert not state.replicas[0].healthy and state.replicas[1].healthy
            assert "the engine died" in replicas[0].log.read_text()
            assert all(r.outstanding == 0 for r in state.replicas)

            # Stop the idle replica 1: the probe takes it out with no request sent to it, so
            # the next request is a 503 at once, not a wait for the read timeout.
            os.kill(replicas[1].proc.pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + BOUND_S
                while state.replicas[1].healthy:
                    assert time.monotonic() < deadline, "the probe never took the stopped replica out"
                    time.sleep(0.1)
                r = httpx.post(router.url + "/v1/completions", json=ask, timeout=BOUND_S)
                assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
            finally:
                os.kill(replicas[1].proc.pid, signal.SIGCONT)
    finally:
        for r in replicas:
            r.stop()
