"""``minivllm bench soak``: mixed traffic against ``minivllm serve`` for minutes or hours,
with faults injected on a schedule. It counts what an operator needs to trust a server.

A soak answers what a test of seconds cannot. Does a request ever go missing? Does a
fault leave KV blocks behind? Does memory creep up with every thousand requests? This
mode plays a supervisor (it starts ``minivllm serve`` and starts it again when it exits)
and a crowd of clients, whose prompts run from one short question to thirty of them.
Every ``--fault-interval`` seconds it injects the next fault of a fixed cycle:

* ``hang_up``: a client that leaves mid-stream;
* ``slow_reader``: a client that sends a streaming request, then reads nothing for 10 s
  (or ``--fault-interval``, if shorter);
* ``burst``: three times as many requests at once as the server has seats and waiting
  places (the extra ones are refused with 503);
* ``pause_core``: the engine core stopped (SIGSTOP) for 2 s, then resumed: a slow step,
  which the server must ride out;
* ``kill_core``: the engine core killed (SIGKILL). The server must end the open requests
  with an error event and exit with status 1; the supervisor restarts it.

Every request ends in one of three ways:

* **served**: a 200, with ``[DONE]`` for a stream;
* **failed, by cause**: refused with 503 (queue full), ended by the dead engine, or found
  no server while it restarted (connection refused);
* **lost**: no answer within the bound, or a stream that stopped with neither ``[DONE]``
  nor an error event. This must stay 0.

Before each fault, the traffic pauses until the server is idle. The soak then reads the
KV cache usage (anything above 0 is a leaked block, since nothing runs), and the
resident memory of the server and its core. Memory growth per 1,000 requests is the slope
of those samples within each server lifetime (the median over lifetimes), so the
restarts do not hide growth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from minivllm.entrypoints.data_parallel import free_port

logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request

FAULTS = ("hang_up", "slow_reader", "burst", "pause_core", "kill_core")
BOUND_S = 120.0
"""A request that has had no answer for this long counts as lost."""
PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
           "Explain what a KV cache is in one sentence.", "Count from one to ten."]


@dataclass
class SoakReport:
    minutes: float
    served: int = 0
    failed: Counter = field(default_factory=Counter)
    lost: int = 0
    lost_how: list[str] = field(default_factory=list)
    """When and how each lost request was lost, to find it in the server's log."""
    faults: Counter = field(default_factory=Counter)
    restarts: int = 0
    exit_codes: Counter = field(default_factory=Counter)
    idle_kv_usage: list[float] = field(default_factory=list)
    """The KV cache usage read at each idle checkpoint: 0 unless a block leaked."""
    memory: list[list[tuple[int, int]]] = field(default_factory=lambda: [[]])
    """Per server lifetime: (requests served so far, server + core RSS bytes) at each checkpoint."""

    def growth_per_1000(self) -> float | None:
        """MiB per 1,000 requests: the median over lifetimes of each lifetime's slope
        (least squares), leaving out each lifetime's first sample (start-up, warm-up)."""
        slopes = []
        for samples in self.memory:
            pts = samples[1:]
            if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                mx, my = statistics.fmean(xs), statistics.fmean(ys)
                var = sum((x - mx) ** 2 for x in xs)
                if var:
                    slopes.append(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var * 1000 / 2**20)
        return statistics.median(slopes) if slopes else None

    def table(self) -> str:
        growth = self.growth_per_1000()
        rows = [("minutes", f"{self.minutes:.1f}"), ("requests served", str(self.served)),
                *((f"failed: {cause}", str(n)) for cause, n in sorted(self.failed.items())),
                ("lost (must be 0)", str(self.lost)),
                ("faults injected", ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))),
                ("server restarts (exit codes)", f"{self.restarts} ({dict(self.exit_codes)})"),
                ("leaked KV blocks at idle checkpoints (must be 0)",
                 "0" if not any(self.idle_kv_usage) else f"usage {max(self.idle_kv_usage):.4f}"),
                ("idle checkpoints", str(len(self.idle_kv_usage))),
                ("memory growth per 1,000 requests (server + core RSS)",
                 "n/a (too few checkpoints)" if growth is None else f"{growth:+.1f} MiB")]
        width = max(len(k) for k, _ in rows)
        return "\n".join([f"{k:<{width}}  {v}" for k, v in rows] + [f"  lost: {x}" for x in self.lost_how])


def rss_bytes(pid: int) -> int:
    """A process's resident memory (Linux's /proc), 0 if it has gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (FileNotFoundError, ProcessLookupError):
        return 0


def core_pid(server_pid: int) -> int | None:
    """The engine core under ``minivllm serve``: the fork server's child, or a spawned child."""
    def children(pid: int) -> list[int]:
        try:
            return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except FileNotFoundError:
            return []
    for child in children(server_pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"forkserver" in cmdline and children(child):
            return children(child)[0]
        if b"spawn_main" in cmdline:
            return child
    return None


class Supervisor:
    """Starts ``minivllm serve`` and starts it again whenever it exits."""

    def __init__(self, serve_args: list[str], log: Path, report: SoakReport) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--port", str(self.port),
                    "--uvicorn-log-level", "warning", *serve_args]
        self.log, self.report, self.proc = log, report, None

    async def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        async with httpx.AsyncClient() as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"minivllm serve exited with {self.proc.returncode} while "
                                       f"starting; see {self.log}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"minivllm serve did not become ready in 300 s; see {self.log}")
                try:
                    if (await http.get(self.url + "/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.2)

    async def watch(self) -> None:
        """Restart the server whenever it exits (what systemd or Kubernetes would do)."""
        while True:
            await asyncio.sleep(0.2)
            if self.proc.poll() is not None:
                self.report.exit_codes[self.proc.returncode] += 1
                self.report.restarts += 1
                self.report.memory.append([])
                await self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Soak:
    def __init__(self, args: argparse.Namespace, sup: Supervisor, report: SoakReport) -> None:
        self.args, self.sup, self.report = args, sup, report
        self.rng = random.Random(args.seed)
        self.open = asyncio.Event()  # set: clients may send
        self.open.set()
        self.in_flight = 0

    def body(self, stream: bool, max_tokens: int | None = None) -> tuple[str, dict]:
        rng = self.rng
        params = {"max_tokens": max_tokens or rng.randint(8, 32), "stream": stream,
                  "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1000)}
        if rng.random() < 0.2:
            params["n"] = 2
        if rng.random() < 0.2:
            params["stop"] = ["."]
        # A quarter of the prompts are two to thirty questions in one, so the server sees
        # prompts of every length up to a few hundred tokens, as a real one does (each new
        # length is a new shape for the matrix products: memory that must stop growing).
        count = rng.randint(2, 30) if rng.random() < 0.25 else 1
        prompt = " ".join(rng.choice(PROMPTS) for _ in range(count))
        if rng.random() < 0.5:
            return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **params}
        return "/v1/completions", {"prompt": prompt, **params}

    async def request(self, http: httpx.AsyncClient, path: str, body: dict, hang_up_after: int = 0) -> str:
        """Send one request, count how it ended, and return that."""
        self.in_flight += 1
        try:
            outcome = await asyncio.wait_for(self._send(http, path, body, hang_up_after), BOUND_S)
        except asyncio.TimeoutError:
            outcome = f"lost: no answer in {BOUND_S:g} s"
        except httpx.ConnectError:
            outcome = "no server (restarting): connection refused"
        except httpx.TransportError as e:
            outcome = f"connection broken ({type(e).__name__})"
        finally:
            self.in_flight -= 1
        if outcome == "served":
            self.report.served += 1
        elif outcome.startswith("lost"):
            self.report.lost += 1
            self.report.lost_how.append(f"{time.strftime('%H:%M:%S')} {outcome}: {path} "
                                        f"stream={body['stream']} n={body.get('n', 1)}")
        else:
            self.report.failed[outcome] += 1
        return outcome

    async def _send(self, http: httpx.AsyncClient, path: str, body: dict, hang_up_after: int) -> str:
        async with http.stream("POST", self.sup.url + path, json=body) as r:
            if r.status_code != 200:
                error = json.loads(await r.aread()).get("error", {})
                return f"HTTP {r.status_code} {error.get('code') or error.get('type')}"
            if not body["stream"]:
                await r.aread()
                return "served"
            events = 0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "served"
                if line.startswith('data: {"error"'):
                    return "engine died mid-stream (error event)"
                events += line.startswith("data: ")
                if hang_up_after and events >= hang_up_after:
                    return "hung up by the client (fault)"
            return "lost: the stream ended with neither [DONE] nor an error event"

    async def client(self, http: httpx.AsyncClient) -> None:
        while True:
            await self.open.wait()
            path, body = self.body(stream=self.rng.random() < 0.6)
            if await self.request(http, path, body) != "served":
                await asyncio.sleep(0.5)  # refused, or no server: a real client backs off too

    async def checkpoint(self, http: httpx.AsyncClient) -> None:
        """Pause the traffic, wait for an idle server, read its KV usage and memory."""
        self.open.clear()
        try:
            deadline = time.monotonic() + BOUND_S
            while self.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            while time.monotonic() < deadline:
                m = await metrics(http, self.sup.url)
                if m.get("minivllm:num_requests_running") == 0 and m.get("minivllm:num_requests_waiting") == 0:
                    self.report.idle_kv_usage.append(m["minivllm:kv_cache_usage_perc"])
                    break
                await asyncio.sleep(0.2)
            core = core_pid(self.sup.proc.pid)
            rss = rss_bytes(self.sup.proc.pid) + (rss_bytes(core) if core else 0)
            self.report.memory[-1].append((self.report.served, rss))
        finally:
            self.open.set()

    async def fault(self, http: httpx.AsyncClient, name: str) -> None:
        self.report.faults[name] += 1
        core = core_pid(self.sup.proc.pid)
        if name == "hang_up":
            path, body = self.body(stream=True, max_tokens=64)
            await self.request(http, path, body, hang_up_after=2)
        elif name == "slow_reader":
            sock = socket.create_connection(("127.0.0.1", self.sup.port))
            raw = json.dumps({"prompt": PROMPTS[0], "max_tokens": 32, "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            await asyncio.sleep(min(10.0, self.args.fault_interval))
            sock.close()
        elif name == "burst":
            n = 3 * (self.args.seats + self.args.max_waiting)
            await asyncio.gather(*(self.request(http, *self.body(stream=False, max_tokens=8)) for _ in range(n)))
        elif name == "pause_core" and core:
            os.kill(core, signal.SIGSTOP)
            await asyncio.sleep(2)
            os.kill(core, signal.SIGCONT)
        elif name == "kill_core" and core:
            os.kill(core, signal.SIGKILL)


async def metrics(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    try:
        text = (await http.get(url + "/metrics", timeout=30)).text
    except httpx.TransportError:
        return {}
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


async def soak(args: argparse.Namespace, log: Path) -> SoakReport:
    report = SoakReport(args.minutes)
    serve_args = ["--model", args.model, "--max-num-seqs", str(args.seats),
                  "--max-waiting", str(args.max_waiting), "--log-stats-interval", "0"]
    sup = Supervisor(serve_args, log, report)
    start = time.monotonic()
    await sup.start()
    run = Soak(args, sup, report)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=BOUND_S, limits=limits) as http:
        tasks = [asyncio.ensure_future(sup.watch())]
        tasks += [asyncio.ensure_future(run.client(http)) for _ in range(args.concurrency)]
        try:
            end = start + args.minutes * 60
            i = 0
            # Every fault named fires at least once, however slow the machine: a soak that
            # ran out of minutes before its last fault would not have tested it.
            while time.monotonic() + args.fault_interval < end or i < len(faults):
                await asyncio.sleep(args.fault_interval)
                await run.checkpoint(http)  # before every fault: idle, no block held, memory
                await run.fault(http, faults[i % len(faults)])
                i += 1
                while sup.proc.poll() is not None or not await _healthy(http, sup.url):
                    await asyncio.sleep(0.2)  # restarting: the next fault waits for a server
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            await run.checkpoint(http)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            sup.stop()
    report.minutes = (time.monotonic() - start) / 60
    return report


async def _healthy(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(url + "/health", timeout=10)).status_code == 200
    except httpx.TransportError:
        return False


def main(args: argparse.Namespace) -> int:
    """minivllm bench soak: mixed traffic against minivllm serve with faults injected on a
    schedule; prints requests served, failed by cause, lost, leaked KV blocks and memory
    growth per 1,000 requests."""
    if not sys.platform.startswith("linux"):
        print("minivllm bench soak reads /proc and sends SIGSTOP and SIGKILL: it runs on Linux only")
        return 2
    unknown = sorted(set(f.strip() for f in args.faults.split(",") if f.strip()) - set(FAULTS))
    if unknown or not args.faults.strip():
        print(f"--faults takes a comma-separated subset of {','.join(FAULTS)}; got {args.faults!r}")
        return 2
    for name in ("minutes", "fault_interval", "concurrency", "seats", "max_waiting"):
        value = getattr(args, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            print(f"--{name.replace('_', '-')} must be a positive number, got {value!r}")
            return 2
    log = Path(args.log or f"soak-{int(time.time())}.log")
    print(f"soak: {args.minutes:g} min against minivllm serve --model {args.model}; faults every "
          f"{args.fault_interval:g} s ({args.faults}); the server's log: {log}", flush=True)
    report = asyncio.run(soak(args, log))
    print(report.table())
    leaked = any(report.idle_kv_usage)
    return 1 if report.lost or leaked else 0
