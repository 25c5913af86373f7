"""Chaos (issue 16): many streaming clients, some hanging up, some hostile, one huge.

64 concurrent streaming clients; a third of them hang up at random points; four carry a
request that fails inside the engine (injected at the sampler); invalid requests, a
4 MB body and a 900 KB prompt arrive while they stream. Every healthy stream must end
with exactly its expected text, none may stall longer than ``STALL_BOUND_S``, the
failing ones must get an error event, and afterwards the KV cache is empty, the engine
alive, and a canary unchanged. The tiny random model keeps it to seconds.

That streams keep flowing while a huge prompt arrives is checked by its cause, not by a
clock: the huge prompt is tokenized on the tokenizer thread, never on the stepping
thread (before issue 16 it was, and every stream paused 4-6 s). The longest gap is
printed; ``STALL_BOUND_S`` is a liveness bound that only a hang reaches.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest
from helpers import greedy
from tiny_chat import canary, tiny_chat_llm

from minivllm import LLM, SamplingParams
from minivllm.engine.async_llm import AsyncLLMEngine, EngineOverloadedError
from minivllm.sample.sampler import SamplingError
from minivllm.worker.model_loader import make_tiny_model

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from minivllm.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402

N_CLIENTS = 64
POISON_SEED = 4242
STALL_BOUND_S = 60.0
"""No stream may wait longer than this between two events, nor for its first one: a
liveness bound (a step of the tiny model takes milliseconds, even on a loaded laptop),
not a speed claim."""
QUESTIONS = ["What is the capital of France?", "Name a colour.", "Say hello.", "Count to three.",
             "Why is the sky blue?", "Write a haiku.", "What is 2 + 2?", "Name a planet."]


class PoisonedSampler:
    """The real sampler, except that requests seeded with POISON_SEED fail, as a request
    whose sampling breaks would."""

    def __init__(self, real) -> None:
        self.real = real

    def __call__(self, logits, params, generators):
        tokens = self.real(logits, params, generators)
        return [SamplingError("injected failure") if p.seed == POISON_SEED else t
                for p, t in zip(params, tokens)]


def client_specs(rng: random.Random) -> list[dict]:
    """What each of the 64 streaming clients sends, and whether it hangs up."""
    specs = []
    hang_ups = set(rng.sample(range(N_CLIENTS), N_CLIENTS // 3))
    poisoned = set(rng.sample(sorted(set(range(N_CLIENTS)) - hang_ups), 4))
    for i in range(N_CLIENTS):
        params = dict(max_tokens=rng.randint(8, 24), ignore_eos=True)
        kind = i % 4
        if kind == 0:
            params["temperature"] = 0.0
        elif kind == 1:
            params.update(temperature=0.8, top_p=0.9, seed=1000 + i)
        elif kind == 2:  # values that used to kill the engine: greedy now
            params.update(rng.choice([dict(temperature=1e-40), dict(temperature=0.7, top_p=1e-46)]))
        else:
            params.update(temperature=1.0, top_k=20, seed=2000 + i)
        if i in poisoned:
            params.update(temperature=0.8, seed=POISON_SEED)
        chat = i % 2 == 0
        question = QUESTIONS[i % len(QUESTIONS)]
        specs.append(dict(index=i, chat=chat, question=question, params=params,
                          hang_up_after=rng.randint(1, 6) if i in hang_ups else None,
                          poisoned=i in poisoned))
    return specs


def body_of(spec: dict) -> tuple[str, dict]:
    if spec["chat"]:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": spec["question"]}],
                                        "stream": True, **spec["params"]}
    return "/v1/completions", {"prompt": spec["question"], "stream": True, **spec["params"]}


def expected_texts(llm: LLM, specs: list[dict]) -> dict[int, str]:
    """Each healthy client's text, computed offline on the same engine first."""
    out = {}
    for spec in specs:
        if spec["poisoned"]:
            continue
        params = SamplingParams(**spec["params"])
        if spec["chat"]:
            o = llm.chat([{"role": "user", "content": spec["question"]}], params, use_tqdm=False)[0]
        else:
            o = llm.generate(spec["question"], params, use_tqdm=False)[0]
        out[spec["index"]] = o.outputs[0].text
    return out


async def stream_one(http, spec: dict) -> dict:
    path, body = body_of(spec)
    start = time.perf_counter()
    times, text, events, error, done = [], "", 0, None, False
    async with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            times.append(time.perf_counter())
            if line == "data: [DONE]":
                done = True
                break
            data = json.loads(line[6:])
            if "error" in data:
                error = data["error"]
                continue
            events += 1
            if data["choices"]:
                c = data["choices"][0]
                text += (c["delta"].get("content") or "") if "delta" in c else c["text"]
            if spec["hang_up_after"] is not None and events >= spec["hang_up_after"]:
                break  # leaving the block closes the connection mid-stream
    gaps = [b - a for a, b in zip([start, *times], times)]
    return dict(text=text, error=error, done=done, max_gap=max(gaps, default=0.0),
                first=times[0] - start if times else None)


async def hostile(http) -> dict[str, int]:
    """Requests that must be refused while the streams run."""
    await asyncio.sleep(0.2)
    statuses = {}
    bodies = [
        ("nan string", {"prompt": "hi", "temperature": "NaN"}),
        ("top_p 0", {"prompt": "hi", "top_p": 0}),
        ("seed 2^64", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}),
        ("penalty", {"prompt": "hi", "presence_penalty": 2.5}),
        ("image", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
        ("text part 5", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
        ("900 KB prompt", {"prompt": "word " * 180_000, "max_tokens": 4}),
    ]
    for name, body in bodies:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = await http.post(path, json=body)
        statuses[name] = r.status_code
    raw = b'{"prompt": "' + b"a" * (4 << 20) + b'"}'
    r = await http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    statuses["4 MB body"] = r.status_code
    r = await http.post("/v1/completions", content=b'{"prompt": "hi", "temperature": NaN}',
                        headers={"Content-Type": "application/json"})
    statuses["NaN literal"] = r.status_code
    return statuses


def scrape_aborts(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith('minivllm:request_success_total{finished_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_chaos_64_streams_hang_ups_poison_and_a_huge_body():
    llm = tiny_chat_llm(max_model_len=256, max_num_seqs=64)
    specs = client_specs(random.Random(16))
    want = expected_texts(llm, specs)
    before = canary(llm)
    engine = llm.llm_engine
    engine.model_runner.sampler = PoisonedSampler(engine.model_runner.sampler)
    tokenizer, encode = engine.processor.tokenizer, engine.processor.tokenizer.encode
    huge_on = []  # the threads that tokenized a huge prompt

    def recording_encode(text, *args, **kwargs):
        if len(text) > 100_000:
            huge_on.append(threading.current_thread().name)
        return encode(text, *args, **kwargs)
    tokenizer.encode = recording_encode  # this instance only, undone below
    with ServerThread(build_app(llm, max_waiting=None)) as server:
        aborts_before = scrape_aborts(server.url)

        async def run():
            limits = httpx.Limits(max_connections=N_CLIENTS + 8)
            async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
                return await asyncio.gather(hostile(http), *(stream_one(http, s) for s in specs))

        t0 = time.perf_counter()
        statuses, *results = asyncio.run(asyncio.wait_for(run(), 120))
        elapsed = time.perf_counter() - t0
        async_engine = server.app.state.engine
        deadline = time.monotonic() + 30
        while (async_engine.kv_cache_usage > 0 or async_engine.num_running) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert async_engine.kv_cache_usage == 0 and async_engine.num_running == 0
        assert async_engine.error is None
        assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"
        aborted = scrape_aborts(server.url) - aborts_before
    engine.model_runner.sampler = engine.model_runner.sampler.real
    del tokenizer.encode

    assert statuses == {"nan string": 400, "top_p 0": 400, "seed 2^64": 400, "penalty": 400,
                        "image": 400, "text part 5": 400, "900 KB prompt": 400,
                        "4 MB body": 413, "NaN literal": 400}, statuses
    healthy = [s for s in specs if not s["poisoned"] and s["hang_up_after"] is None]
    for spec in healthy:
        got = results[spec["index"]]
        assert got["done"] and got["error"] is None, (spec, got)
        assert got["text"] == want[spec["index"]], spec
    for spec in specs:
        if spec["poisoned"]:
            got = results[spec["index"]]
            assert got["error"] is not None and "injected" in got["error"]["message"], got
            assert got["error"]["code"] == "request_failed" and got["done"]
    hung_up = [s for s in specs if s["hang_up_after"] is not None]
    for spec in hung_up:  # what arrived before hanging up is a prefix of the expected text
        assert want[spec["index"]].startswith(results[spec["index"]]["text"]), spec
    assert 1 <= aborted <= len(hung_up)
    # the 900 KB prompt was tokenized, off the thread that steps the engine
    assert huge_on and not any(name.startswith("minivllm-engine") for name in huge_on), huge_on
    max_gap = max(r["max_gap"] for r in results)
    assert max_gap < STALL_BOUND_S, f"a stream stalled for {max_gap:.2f} s: a hang?"
    assert canary(llm) == before
    assert llm.llm_engine.kv_cache_manager.usage == 0
    print(f"\nchaos: {N_CLIENTS} streams ({len(healthy)} healthy, {len(hung_up)} hung up, "
          f"{sum(s['poisoned'] for s in specs)} failing in the engine), {len(statuses)} hostile "
          f"requests {statuses}; {aborted:.0f} aborts; longest wait for an event {max_gap:.3f} s "
          f"(bound {STALL_BOUND_S} s); all done in {elapsed:.1f} s; KV usage after: 0")


# -- admission under max_waiting -------------------------------------------------------------------
def test_a_burst_that_fits_the_free_seats_all_gets_in():
    """Requests still being added used to count as waiting, so with 8 free seats and
    max_waiting=2 only 2 of a burst got in. Now 8 take the seats, 2 wait, 2 are refused."""
    llm = LLM(make_tiny_model("llama"), max_num_seqs=8, log_stats_interval=None)

    async def burst():
        engine = AsyncLLMEngine(llm.llm_engine, max_waiting=2)
        engine.start()
        results = await asyncio.gather(
            *(engine.add_request(f"r{i}", {"prompt_token_ids": [1, 2, 3, i]}, greedy(500))
              for i in range(12)), return_exceptions=True)
        await engine.shutdown()
        return results

    results = asyncio.run(asyncio.wait_for(burst(), 60))
    refused = [r for r in results if isinstance(r, EngineOverloadedError)]
    assert len(refused) == 2 and len(results) - len(refused) == 10, results
    assert llm.llm_engine.kv_cache_manager.usage == 0



def test_a_request_just_added_is_counted_once(monkeypatch):
    """The stepping thread moves a request from "on its way" to the scheduler's waiting
    count. If a newcomer's admission check ran between the two updates it saw the request
    twice and got a spurious 503 (notebook 10's exercise 2 failed so on a busy CPU). Here
    the stepping thread is held inside that moment on purpose: one seat, held by r0; r1
    waits; r2 arrives while r1 is being counted, and must wait too (max_waiting=2)."""
    llm = LLM(make_tiny_model("llama"), max_num_seqs=1, log_stats_interval=None)
    kv = llm.llm_engine.kv_cache_manager
    in_window, real_usage = threading.Event(), type(kv).usage

    def slow_usage(self):
        if not in_window.is_set() and any(r.request_id == "r1" for r in llm.llm_engine.scheduler.waiting):
            in_window.set()  # r1 was just added: hold the stepping thread here a moment
            time.sleep(0.3)
        return real_usage.fget(self)

    monkeypatch.setattr(type(kv), "usage", property(slow_usage))

    async def arrivals():
        engine = AsyncLLMEngine(llm.llm_engine, max_waiting=2)
        engine.start()
        r0 = await engine.add_request("r0", {"prompt_token_ids": [1, 2, 3]}, greedy(500))
        while engine.num_running < 1:
            await asyncio.sleep(0.01)
        r1 = asyncio.ensure_future(engine.add_request("r1", {"prompt_token_ids": [4, 5, 6]}, greedy(4)))
        await asyncio.to_thread(in_window.wait, 10)
        try:
            await engine.add_request("r2", {"prompt_token_ids": [7, 8, 9]}, greedy(4))
            outcome = "admitted"
        except EngineOverloadedError as e:
            outcome = f"refused: {e}"
        await r1
        r0.close()
        await engine.shutdown()
        return outcome

    assert asyncio.run(asyncio.wait_for(arrivals(), 60)) == "admitted"


def test_an_engine_built_by_the_client_is_built_and_stepped_on_one_thread():
    """The thread server's engine: built on the thread that steps it, so that one thread
    runs the model (two would keep two OpenMP teams on the same cores)."""
    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return LLM(make_tiny_model("llama"), log_stats_interval=None).llm_engine

    async def run():
        engine = AsyncLLMEngine(build)
        engine.start()
        stepped_on = await engine.call(threading.current_thread)
        outputs = [o async for o in engine.generate("a", {"prompt_token_ids": [1, 2, 3]}, greedy(4))]
        await engine.shutdown()
        return stepped_on, outputs[-1]

    stepped_on, final = asyncio.run(asyncio.wait_for(run(), 60))
    assert built_on == [stepped_on] and stepped_on is not threading.main_thread()
    assert final.finished and len(final.outputs[0].token_ids) == 4
