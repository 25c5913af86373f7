"""Parallel sampling (``SamplingParams.n > 1``, issue 20): one prompt, n completions.

The parent request is fanned out into n child requests (``minivllm.engine.parallel_sampling``);
child ``i`` samples with ``seed + i`` when the parent has a seed (vLLM's rule), so it must
give exactly what a request of its own with that seed gives; greedy children must all
give transformers' greedy continuation. The children share the prompt's full KV blocks
(prefix caching): the first computes them, the others hit them in the same step.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import all_blocks_free, hf_greedy

from minivllm import LLM, SamplingParams
from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.exceptions import ValidationError
from minivllm.worker.model_loader import make_tiny_model

VOCAB = 512
BLOCK = 4
PROMPT = {"prompt_token_ids": list(range(3, 21))}  # 18 tokens: 4 full blocks and 2 tokens
FULL = 16  # tokens in the prompt's full blocks


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", vocab_size=VOCAB)


@pytest.fixture()
def llm(model) -> LLM:
    return LLM(model, block_size=BLOCK, log_stats_interval=None)


def sampled(n: int, seed: int | None = 7, max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                          **kw)


def metric(llm: LLM, name: str) -> int:
    return next(m.value for m in llm.get_metrics() if m.name == f"minivllm:{name}")


def test_seeded_children_equal_separate_requests_with_seed_plus_index(llm):
    [out] = llm.generate(PROMPT, sampled(4, seed=11), use_tqdm=False)
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
    alone = llm.generate([PROMPT] * 4, [sampled(1, seed=11 + i) for i in range(4)], use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in alone]
    assert [c.text for c in out.outputs] == [o.outputs[0].text for o in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4, "the children should differ"
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in out.outputs)
    assert all_blocks_free(llm)


def test_greedy_children_all_give_transformers_greedy_continuation(llm, model):
    params = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([PROMPT, {"prompt_token_ids": [5, 9, 2]}], params, use_tqdm=False)
    for out, prompt in zip(outs, ([*range(3, 21)], [5, 9, 2])):
        want = hf_greedy(model, prompt, 6)
        assert [c.token_ids for c in out.outputs] == [want] * 3
    assert all_blocks_free(llm)


def test_prompt_full_blocks_are_computed_once_and_shared(llm):
    [out] = llm.generate(PROMPT, sampled(3), use_tqdm=False)
    # Public counters: the two later children found the 4 full prompt blocks cached.
    assert metric(llm, "prefix_cache_hits") == 2 * FULL
    assert metric(llm, "prefix_cache_queries") == 3 * 18
    assert out.num_cached_tokens == FULL
    # The trace: all three children admitted in the first step, the first computing the
    # whole prompt, the others only the 2 tokens of their own partial last block.
    first = llm.trace.steps[0]
    computed = {s.request_id: (s.num_computed_tokens, s.num_new_tokens) for s in first.scheduled}
    assert computed == {"0_0": (0, 18), "1_0": (FULL, 2), "2_0": (FULL, 2)}
    tables = first.block_tables
    shared = tables["0_0"][:4]
    assert tables["1_0"][:4] == tables["2_0"][:4] == shared
    assert all(first.block_ref_counts[b] == 3 for b in shared)
    lasts = {tables[c][4] for c in ("0_0", "1_0", "2_0")}
    assert len(lasts) == 3 and all(first.block_ref_counts[b] == 1 for b in lasts)
    assert all_blocks_free(llm)


def test_chunked_prefill_shares_what_the_first_child_has_scheduled(model):
    """A budget too small for the whole prompt: the children come in behind the first
    child's chunks and hit every full block it has scheduled by then."""
    llm = LLM(model, block_size=BLOCK, max_num_batched_tokens=12, log_stats_interval=None)
    llm.generate(PROMPT, sampled(3), use_tqdm=False)
    prefill = {}
    for record in llm.trace.steps:
        for s in record.scheduled:
            if s.is_prefill:
                prefill[s.request_id] = prefill.get(s.request_id, 0) + s.num_new_tokens
    assert prefill["0_0"] == 18
    # Each later child computes at most its partial block plus what it was admitted
    # ahead of; together far less than the 2 * 18 tokens of no sharing.
    assert prefill["1_0"] + prefill["2_0"] == 2 * 18 - metric(llm, "prefix_cache_hits")
    assert metric(llm, "prefix_cache_hits") >= FULL
    assert all_blocks_free(llm)


def test_unseeded_children_differ_and_all_blocks_are_freed(llm):
    [out] = llm.generate(PROMPT, sampled(5, seed=None), use_tqdm=False)
    assert len(out.outputs) == 5 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all_blocks_free(llm)


def test_abort_of_the_parent_aborts_every_child_and_frees_everything(llm):
    engine = llm.llm_engine
    children = engine.add_request("p", PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True,
                                                              seed=1))
    assert [r.request_id for r in children] == ["0_p", "1_p", "2_p"]
    for _ in range(2):
        [out] = engine.step()
        assert out.request_id == "p" and not out.finished and len(out.outputs) == 3
    assert engine.has_request("p")
    with pytest.raises(ValidationError, match="already in use"):
        engine.add_request("p", PROMPT)
    engine.abort_request("p")
    [out] = engine.step()
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not engine.has_request("p") and not engine.has_unfinished_requests()
    assert all_blocks_free(llm)
    with pytest.raises(KeyError):
        engine.abort_request("p")


def test_children_finishing_at_different_times(llm):
    """The parent is finished only when its last child is; the children that finished
    earlier keep their own reason, and the streamed outputs keep all n completions."""
    engine = llm.llm_engine
    alone = [o.outputs[0].token_ids for o in llm.generate(
        [PROMPT] * 2, [sampled(1, seed=3 + i, max_tokens=6) for i in range(2)], use_tqdm=False)]
    stop = next(t for t in alone[1][1:5] if t not in alone[0])  # ends child 1 early only
    engine.add_request("s", PROMPT, sampled(2, seed=3, max_tokens=6, stop_token_ids=[stop]))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert all(o.request_id == "s" and len(o.outputs) == 2 for o in outs)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    first, second = outs[-1].outputs
    assert (first.finish_reason, first.token_ids) == ("length", alone[0])
    cut = alone[1].index(stop) + 1
    assert (second.finish_reason, second.stop_reason, second.token_ids) == ("stop", stop, alone[1][:cut])
    # Child 1 finished steps before the parent did, and stayed finished in every output.
    done_at = next(i for i, o in enumerate(outs) if o.outputs[1].finished())
    assert done_at < len(outs) - 1 and all(o.outputs[1].finished() for o in outs[done_at:])
    assert all_blocks_free(llm)


@pytest.mark.parametrize("n", [0, 17, -1, 1.5, True, "2"])
def test_bad_n_is_refused(n):
    with pytest.raises(ValidationError) as e:
        SamplingParams(n=n)
    assert e.value.param == "n"


def test_seed_plus_index_must_stay_a_seed():
    with pytest.raises(ValidationError) as e:
        SamplingParams(n=2, seed=2**63 - 1)
    assert e.value.param == "seed"


def test_stream_refuses_n_above_one(llm):
    with pytest.raises(ValidationError) as e:
        next(llm.stream(PROMPT, sampled(2)))
    assert e.value.param == "n"


def test_async_engine_streams_all_children_and_abort_frees_them(llm):
    async def run():
        engine = AsyncLLMEngine(llm.llm_engine)
        try:
            outs = [o async for o in engine.generate("a", PROMPT, sampled(3, seed=21))]
            stream = await engine.add_request("b", PROMPT, SamplingParams(n=2, max_tokens=200,
                                                                          ignore_eos=True))
            await stream.__anext__()
            stream.close()  # the client went away: every child is aborted
            deadline = time.monotonic() + 10
            while llm.llm_engine.has_unfinished_requests() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            await engine.shutdown()
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    alone = llm.generate([PROMPT] * 3, [sampled(1, seed=21 + i) for i in range(3)], use_tqdm=False)
    assert [c.token_ids for c in outs[-1].outputs] == [o.outputs[0].token_ids for o in alone]
    assert all_blocks_free(llm)


# -- the server, in its default mode (engine core in its own process), official client -------
@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from minivllm.entrypoints.openai.api_server import ServerThread, build_app

    with ServerThread(build_app(api_key="k", log_stats_interval=None)) as s:
        deadline = time.monotonic() + 120
        while httpx.get(s.url + "/health").status_code != 200:  # the core is loading
            assert time.monotonic() < deadline, "the engine never became ready"
            time.sleep(0.1)
        yield s


@pytest.mark.real_model
@pytest.mark.multiprocess
def test_server_n_choices_through_the_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", timeout=60, max_retries=0)
    kw = dict(model=None, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=5,
              extra_body={"return_token_ids": True})

    r = client.completions.create(n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    ids = [c.token_ids for c in r.choices]
    assert ids[0] != ids[1], "seeds 5 and 6 should sample differently"
    assert r.usage.completion_tokens == sum(map(len, ids))  # every choice's tokens count
    # Child i is the request with seed 5 + i.
    for i in range(2):
        alone = client.completions.create(n=1, **{**kw, "seed": 5 + i})
        assert alone.choices[0].token_ids == ids[i] and alone.choices[0].text == r.choices[i].text
        assert alone.usage.prompt_tokens == r.usage.prompt_tokens  # the prompt counts once

    texts, reasons = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.completions.create(n=2, stream=True, **kw):
        [c] = chunk.choices
        texts[c.index] += c.text
        reasons[c.index].append(c.finish_reason)
    assert [texts[0], texts[1]] == [c.text for c in r.choices]
    for i in range(2):
        assert reasons[i][-1] == r.choices[i].finish_reason and not any(reasons[i][:-1])

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=None, messages=messages, n=2, max_tokens=8,
                                          temperature=1.0, seed=9)
    assert [c.index for c in chat.choices] == [0, 1]
    content, roles = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.chat.completions.create(model=None, messages=messages, n=2, max_tokens=8,
                                                temperature=1.0, seed=9, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        [c] = chunk.choices
        content[c.index] += c.delta.content or ""
        roles[c.index].append(c.delta.role)
    assert [content[0], content[1]] == [c.message.content for c in chat.choices]
    assert all(roles[i][0] == "assistant" for i in range(2))
    assert usage.completion_tokens == chat.usage.completion_tokens

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(n=17, **kw)
    assert e.value.body["param"] == "n"
