"""No request can hurt another, offline (issue 16).

Bad input is refused at the point of entry with a ValueError/TypeError whose ``param``
names the field; values that used to kill a step now sample; a failure that belongs to
one request finishes that request alone; a failed step is rolled back so the engine
carries on token-identical to transformers; streams, generate() and aborts do not
disturb each other. Tiny random models throughout (transformers' generate() is the
reference), with SmolLM2's tokenizer where text matters.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import all_blocks_free, greedy, hf_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_chat import CANARY_PROMPT, canary, deadline, tiny_chat_llm

from minivllm import LLM, SamplingParams
from minivllm.sample.sampler import Sampler
from minivllm.worker.model_loader import make_tiny_model

VOCAB = 512
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def chat_llm():
    return tiny_chat_llm(max_model_len=256)


def rejected(param: str, fn, *args, **kwargs) -> Exception:
    """``fn(*args, **kwargs)`` must raise ValueError/TypeError naming ``param``."""
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    e = info.value
    assert getattr(e, "param", None) == param, f"param {getattr(e, 'param', None)!r}: {e}"
    assert param in str(e), f"the message does not name {param!r}: {e}"
    return e


# -- the bad-input matrix, offline ----------------------------------------------------------
SAMPLING_CASES = [
    *[("temperature", v) for v in (NAN, INF, -INF, -1, -1e-9, "0.5", "NaN", "1e-40", True, None, [1])],
    *[("top_p", v) for v in (0, 0.0, -0.1, 1.5, NAN, INF, "1e-50", True, None)],
    *[("top_k", v) for v in (1.5, True, -2, "5", None, NAN)],
    *[("max_tokens", v) for v in (0, -1, NAN, INF, 1.0, 16.0, True, "16")],
    *[("min_tokens", v) for v in (-1, 1.5, True, None, NAN)],
    *[("stop", v) for v in ([1], 1, [""], "", [None], ["a"] * 17, {"a"}, [b"x"])],
    *[("stop_token_ids", v) for v in ([-1], [1.5], [True], "1", 5, [None])],
    *[("ignore_eos", v) for v in (1, 0, "true", None)],
    *[("seed", v) for v in (1.0, "1", True, 2**64, 2**63, -(2**63) - 1, NAN)],
    *[("presence_penalty", v) for v in (2.5, -2.5, NAN, "1", None)],
    *[("frequency_penalty", v) for v in (INF, 3, True)],
    *[("repetition_penalty", v) for v in (0, -1, NAN, "1.2")],
    *[("min_p", v) for v in (-0.1, 1.01, NAN)],
    *[("logit_bias", v) for v in ({1: 101}, {1: NAN}, {"x": 1}, {-1: 1}, [1], {1: None})],
]
EXTRA_SAMPLING_CASES = [  # (kwargs, param): combinations
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
]

CONFIG_CASES = [
    *[("block_size", v) for v in (0, -1, 1.5, True, "16")],
    *[("num_kv_blocks", v) for v in (0, -4, 2.0, True)],
    *[("kv_cache_memory", v) for v in (0, -1, 1.5)],
    *[("max_num_seqs", v) for v in (0, -1, 1.5, None)],
    *[("max_num_batched_tokens", v) for v in (0, -8, 8.0)],
    *[("max_model_len", v) for v in (0, 1, -5, 1.5, 100_000)],
    *[("max_trace_steps", v) for v in (0, -1, 2.5)],
    *[("enable_chunked_prefill", v) for v in ("yes", 1, None)],
    *[("enable_prefix_caching", v) for v in (0, "no")],
    ("attention_backend", "flash"), ("linear_backend", "mkl"), ("dtype", "float64"),
    ("device", "not-a-device"), ("device", 0),
    *[("seed", v) for v in (1.5, "0", None, 2**64)],
    *[("log_stats_interval", v) for v in (-1, NAN, "5")],
]
EXTRA_CONFIG_CASES = [
    # The cache holds 4 x 16 = 64 tokens: a max_model_len of 512 could never run.
    (dict(num_kv_blocks=4, max_model_len=512), "max_model_len"),
    # A byte budget too small for a single block.
    (dict(kv_cache_memory=100), "kv_cache_memory"),
]
if not torch.cuda.is_available():
    EXTRA_CONFIG_CASES.append((dict(device="cuda"), "device"))

GOOD = {"prompt_token_ids": [1, 2, 3]}
PROMPT_CASES = [  # (prompt, param) through LLM.generate
    (123, "prompt"), (None, "prompt"), ({"prompt_token_ids": [1.5]}, "prompt"),
    ({"prompt_token_ids": [True]}, "prompt"), ({"prompt_token_ids": "abc"}, "prompt"),
    ({"prompt_token_ids": [-1]}, "prompt"), ({"prompt_token_ids": [10**9]}, "prompt"),
    ({"prompt_token_ids": []}, "prompt"), ({"ids": [1]}, "prompt"),
    ({"prompt_token_ids": [1], "prompt": 5}, "prompt"), ({"prompt_token_ids": [1] * 600}, "prompt"),
    ({"prompt_token_ids": torch.tensor([1, 2])}, "prompt"),
]

CHAT_CASES = [  # messages -> always param "messages"
    [], "hello", [{"role": "user"}], [{"content": "hi"}], [{"role": "robot", "content": "x"}],
    [{"role": "user", "content": 5}], [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "text", "text": None}]}],
    [{"role": "user", "content": [{"type": "text", "text": 7}]}],
    [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"text": "no type"}]}],
    [{"role": "user", "content": ["just a string"]}],
    [{"role": "user", "content": "hi", "name": "bob"}],
    [["not a message"]],
]


def test_bad_input_matrix_offline_every_case_is_refused_naming_its_field(chat_llm):
    llm = chat_llm
    before = canary(llm)
    tried = 0
    for param, value in SAMPLING_CASES:
        rejected(param, SamplingParams, **{param: value})
        tried += 1
    for kwargs, param in EXTRA_SAMPLING_CASES:
        rejected(param, SamplingParams, **kwargs)
        tried += 1
    model = llm.llm_engine.model
    for param, value in CONFIG_CASES:
        rejected(param, LLM, model, **{"log_stats_interval": None, param: value})
        tried += 1
    for kwargs, param in EXTRA_CONFIG_CASES:
        rejected(param, LLM, model, log_stats_interval=None, **kwargs)
        tried += 1
    rejected("model", LLM, 123)
    tried += 1
    for prompt, param in PROMPT_CASES:
        rejected(param, llm.generate, prompt, greedy(4), use_tqdm=False)
        tried += 1
    for messages in CHAT_CASES:
        rejected("messages", llm.chat, messages, greedy(4), use_tqdm=False)
        tried += 1
    engine = llm.llm_engine
    rejected("sampling_params", llm.generate, GOOD, "greedy", use_tqdm=False)
    rejected("sampling_params", llm.generate, [GOOD, GOOD], [greedy(2)], use_tqdm=False)
    rejected("use_tqdm", llm.generate, GOOD, greedy(2), use_tqdm="no")
    rejected("request_id", engine.add_request, 5, GOOD, greedy(2))
    rejected("stop_token_ids", engine.add_request, "s", GOOD, SamplingParams(stop_token_ids=[10**6]))
    rejected("arrival_time", engine.add_request, "t", GOOD, greedy(2), arrival_time=NAN)
    params = greedy(2)
    params.temperature = NAN  # changed after construction: add_request checks again
    rejected("temperature", engine.add_request, "u", GOOD, params)
    engine.add_request("dup", GOOD, greedy(2))
    rejected("request_id", engine.add_request, "dup", GOOD, greedy(2))
    engine.abort_request("dup")
    tried += 8
    # Nothing was left queued, no block is held, and the engine answers as before.
    assert canary(llm) == before
    assert not engine.has_unfinished_requests()
    assert all_blocks_free(llm)
    print(f"\noffline bad inputs tried: {tried}, clean rejections: {tried}, engine deaths: 0")


# -- values that used to kill the step now sample ------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(temperature=1e-40), dict(temperature=5e-324), dict(temperature=1e-37),
    dict(temperature=1e-6), dict(temperature=1.0, top_p=1e-46), dict(temperature=0.7, top_p=1e-50),
    dict(temperature=2.0, top_k=1),
])
def test_former_engine_killers_act_as_greedy(tiny, kwargs):
    """Temperature below 1e-5 is greedy (vLLM's _SAMPLING_EPS); top-p and top-k always
    keep the most likely token. Each gives transformers' greedy tokens."""
    prompt = [5, 6, 7, 8, 9]
    llm = LLM(tiny, log_stats_interval=None)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=10, ignore_eos=True,
                                                                    **kwargs), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == hf_greedy(tiny, prompt, 10)


def test_a_huge_temperature_samples_without_nan(tiny):
    llm = LLM(tiny, log_stats_interval=None)
    params = SamplingParams(temperature=1e300, max_tokens=10, ignore_eos=True, seed=3)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


# -- isolation: one request's failure is its own ----------------------------------------------------
def test_the_sampler_isolates_a_row_with_nan_logits():
    logits = torch.randn(3, 50)
    logits[1, 7] = NAN
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0.8, seed=2)]
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    tokens = Sampler()(logits, params, gens)
    assert tokens[0] == int(logits[0].argmax())
    assert isinstance(tokens[1], Exception) and "NaN" in str(tokens[1])
    assert isinstance(tokens[2], int)


def test_a_request_whose_sampling_fails_finishes_alone_with_an_error(tiny):
    llm = LLM(tiny, log_stats_interval=None)
    engine = llm.llm_engine
    prompts = {"a": [1, 2, 3, 4], "poison": [9, 8, 7], "b": [20, 21, 22, 23, 24], "poison0": [5, 5]}
    for rid, p in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": p}, greedy(12))
    # Break requests' sampling after they passed validation (a NaN temperature makes the
    # distribution NaN): one before its first token, one after; each must fail on its own.
    engine.scheduler.requests["poison0"].sampling_params.temperature = NAN
    final = {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
    engine.scheduler.requests["poison"].sampling_params.temperature = NAN
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0]
    for rid in ("poison", "poison0"):
        assert final[rid].finish_reason == "error" and "distribution" in final[rid].error
    assert final["poison0"].token_ids == [] and len(final["poison"].token_ids) == 1
    for rid in ("a", "b"):
        assert final[rid].finish_reason == "length"
        assert final[rid].token_ids == hf_greedy(tiny, prompts[rid], 12)
    assert all_blocks_free(llm)
    assert llm.get_metrics()  # the engine still answers


def test_a_request_whose_detokenization_fails_finishes_alone(chat_llm):
    llm = chat_llm
    expected = llm.generate(["Hello", "World"], greedy(6), use_tqdm=False)
    bad_token = expected[1].outputs[0].token_ids[2]
    tokenizer = llm.llm_engine.tokenizer
    real_decode = tokenizer.decode

    def decode(ids, **kw):  # a tokenizer that cannot decode one token
        if bad_token in list(ids) and bad_token not in expected[0].outputs[0].token_ids:
            raise RuntimeError("cannot decode")
        return real_decode(ids, **kw)

    if bad_token in expected[0].outputs[0].token_ids:
        pytest.skip("the two requests share the token chosen to fail")
    tokenizer.decode = decode
    try:
        outs = llm.generate(["Hello", "World"], greedy(6), use_tqdm=False)
    finally:
        del tokenizer.decode
    assert outs[0].outputs[0].text == expected[0].outputs[0].text
    assert outs[1].outputs[0].finish_reason == "error"
    assert "cannot decode" in outs[1].outputs[0].error
    assert all_blocks_free(llm)


# -- a failed step is rolled back --------------------------------------------------------------------
def failing_on(engine, calls: set[int], after_forward: bool):
    """Make ``execute_model`` raise on the given call numbers, before or after the forward
    pass (after it, the K/V of the step has been written and the sampler has run)."""
    real = engine.model_runner.execute_model
    count = {"n": 0}

    def execute_model(sched):
        count["n"] += 1
        if count["n"] in calls and not after_forward:
            raise RuntimeError("injected failure before the forward pass")
        result = real(sched)
        if count["n"] in calls:
            raise RuntimeError("injected failure after the forward pass")
        return result

    engine.model_runner.execute_model = execute_model


@pytest.mark.parametrize("after_forward", [False, True])
def test_a_failed_step_is_rolled_back_and_the_engine_carries_on_exactly(tiny, after_forward):
    """Once a sampler error left the others' tokens counted as computed without a new
    token, and the next steps raised or sampled from a neighbour's logits."""
    llm = LLM(tiny, block_size=4, max_num_batched_tokens=24, log_stats_interval=None)
    engine = llm.llm_engine
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], list(range(30, 60)), [11, 12, 13, 14, 15, 16]]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, greedy(10))
    failing_on(engine, {1, 3, 6, 7}, after_forward)
    final, failures = {}, 0
    while engine.has_unfinished_requests():
        before = {rid: (r.num_computed_tokens, r.status) for rid, r in engine.scheduler.requests.items()}
        try:
            outs = engine.step()
        except RuntimeError as e:
            assert "injected" in str(e)
            failures += 1
            after = {rid: (r.num_computed_tokens, r.status) for rid, r in engine.scheduler.requests.items()}
            assert after == before, "the failed step left state behind"
            engine.kv_cache_manager.check_invariants()
            continue
        for out in outs:
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert failures == 4
    assert [final[str(i)] for i in range(len(prompts))] == [hf_greedy(tiny, p, 10) for p in prompts]
    assert all_blocks_free(llm)


def test_a_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(tiny):
    """The step that fills a block registers its hash before the forward pass writes it.
    If that pass fails, nobody may hit the block: here B, with the same prompt, would
    read K/V that was never written."""
    llm = LLM(tiny, block_size=16, log_stats_interval=None)
    engine = llm.llm_engine
    prompt = list(range(100, 140))  # two full blocks and a bit
    engine.add_request("a", {"prompt_token_ids": prompt}, greedy(5))
    failing_on(engine, {1}, after_forward=False)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.abort_request("a")
    engine.add_request("b", {"prompt_token_ids": prompt}, greedy(5))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["a"].outputs[0].finish_reason == "abort"
    assert final["b"].outputs[0].token_ids == hf_greedy(tiny, prompt, 5)
    assert all_blocks_free(llm)


def test_requests_admitted_in_a_failed_step_that_share_a_prefix_recover(tiny):
    llm = LLM(tiny, block_size=4, log_stats_interval=None)
    engine = llm.llm_engine
    prompt = list(range(200, 226))
    engine.add_request("a", {"prompt_token_ids": prompt}, greedy(6))
    engine.add_request("b", {"prompt_token_ids": prompt + [7]}, greedy(6))  # hits a's blocks
    failing_on(engine, {1}, after_forward=False)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert {r.status.value for r in engine.scheduler.requests.values()} == {"waiting"}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert final == {"a": hf_greedy(tiny, prompt, 6), "b": hf_greedy(tiny, prompt + [7], 6)}
    assert all_blocks_free(llm)


# -- streams, generate and aborts side by side -----------------------------------------------------
def test_two_interleaved_streams_both_complete(chat_llm):
    llm = chat_llm
    prompts = ["Once upon a time", "The capital of France is"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    streams = [llm.stream(p, params) for p in prompts]
    got = ["", ""]
    live = {0, 1}
    with deadline(60):
        while live:
            for i in sorted(live):
                try:
                    got[i] += next(streams[i])
                except StopIteration:
                    live.discard(i)
    assert got == want
    assert all_blocks_free(llm)


def test_generate_while_a_stream_is_open(chat_llm):
    llm = chat_llm
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want_stream = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].text
    want_batch = [o.outputs[0].text for o in llm.generate(["Hello", "Goodbye"], params, use_tqdm=False)]
    with deadline(60):
        stream = llm.stream("Once upon a time", params)
        first = next(stream)
        batch = [o.outputs[0].text for o in llm.generate(["Hello", "Goodbye"], params, use_tqdm=False)]
        rest = "".join(stream)
    assert batch == want_batch
    assert first + rest == want_stream
    assert all_blocks_free(llm)


def test_a_stream_closed_early_is_aborted(chat_llm):
    llm = chat_llm
    stream = llm.stream("Once upon a time", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert canary(llm)  # the next call hands out the abort and runs normally
    assert all_blocks_free(llm)


def test_abort_then_re_add_the_same_id(tiny):
    """Re-adding an aborted id used to make every later step() raise KeyError."""
    llm = LLM(tiny, log_stats_interval=None)
    engine = llm.llm_engine
    engine.add_request("x", {"prompt_token_ids": [1, 2, 3]}, greedy(20))
    engine.step()
    engine.abort_request("x")
    engine.add_request("x", {"prompt_token_ids": [4, 5, 6]}, greedy(5))
    seen = []
    with deadline(60):
        while engine.has_unfinished_requests():
            seen += [(o.request_id, o.outputs[0].finish_reason) for o in engine.step() if o.finished]
    assert seen == [("x", "abort"), ("x", "length")]
    assert all_blocks_free(llm)


def test_a_preempted_request_longer_than_the_budget_runs_again_without_chunked_prefill(tiny):
    """Without chunked prefill a prompt must fit one step; a preempted request that grew
    past the budget used to wait forever ("scheduler made no progress"). It is now
    recomputed in chunks."""
    budget = 32
    llm = LLM(tiny, enable_chunked_prefill=False, enable_prefix_caching=False, block_size=4,
              num_kv_blocks=30, max_model_len=120, max_num_batched_tokens=budget,
              log_stats_interval=None)
    prompts = [list(range(10 + i, 38 + i)) for i in range(3)]  # 28 tokens each, within the budget
    with deadline(120):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(50), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tiny, p, 50) for p in prompts]
    steps = list(llm.trace.steps)
    assert sum(len(s.preempted) for s in steps) > 0
    assert any(c.is_prefill and c.num_computed_tokens > 0 for s in steps for c in s.scheduled), \
        "expected a preempted request recomputed in chunks"
    assert max(s.num_tokens for s in steps) <= budget
    assert all_blocks_free(llm)


# -- stop strings on the last allowed token ----------------------------------------------------------
def test_a_stop_string_completed_by_the_last_token_wins_over_length(chat_llm):
    llm = chat_llm
    one = llm.generate(CANARY_PROMPT, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    text = one[0].outputs[0].text
    stop = text.strip()
    assert stop, f"the first token decodes to {text!r}; pick another prompt"
    params = SamplingParams(temperature=0, max_tokens=1, stop=[stop])
    out = llm.generate(CANARY_PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert "".join(llm.stream(CANARY_PROMPT, params)) == out.text


# -- chat ------------------------------------------------------------------------------------------
def test_chat_takes_text_content_parts(chat_llm):
    llm = chat_llm
    plain = llm.chat([{"role": "user", "content": "Hello\nthere"}], greedy(6), use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                    {"type": "text", "text": "there"}]}],
                     greedy(6), use_tqdm=False)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids
    assert parts.outputs[0].token_ids == plain.outputs[0].token_ids


# -- hypothesis over SamplingParams -----------------------------------------------------------------
JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.lists(st.integers(), max_size=2))
FIELDS = {
    "temperature": st.one_of(st.floats(0, 4), st.sampled_from([1e-40, 5e-324, 1e-5, 1e300]),
                             st.floats(), st.integers(-2, 3), JUNK),
    "top_p": st.one_of(st.floats(0, 1), st.sampled_from([1e-46, 1e-50]), st.floats(), JUNK),
    "top_k": st.one_of(st.integers(-3, 60000), st.floats(), JUNK),
    "max_tokens": st.one_of(st.integers(-1, 12), st.none(), st.floats(), JUNK),
    "min_tokens": st.one_of(st.integers(-1, 6), st.floats(), JUNK),
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3),
                      st.lists(st.integers(), max_size=2), JUNK),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(-2, 49151), max_size=3), JUNK),
    "ignore_eos": st.one_of(st.booleans(), JUNK),
    "seed": st.one_of(st.none(), st.integers(-(2**64), 2**64), st.floats(), JUNK),
}
HYPOTHESIS_COUNTS = {"accepted": 0, "rejected": 0}


@pytest.fixture(scope="module")
def short_llm():
    return tiny_chat_llm(max_model_len=40)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kwargs=st.fixed_dictionaries({}, optional=FIELDS))
def test_any_sampling_params_either_refused_at_construction_or_served(short_llm, kwargs):
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        HYPOTHESIS_COUNTS["rejected"] += 1
        assert getattr(e, "param", None) in kwargs, f"{e!r} names no field of {kwargs}"
        return
    HYPOTHESIS_COUNTS["accepted"] += 1
    for value in (params.temperature, params.top_p):
        assert math.isfinite(value)
    out = short_llm.generate("Tell me a story", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason in ("stop", "length"), out
    if params.max_tokens is not None:
        assert len(out.token_ids) <= params.max_tokens
    assert all_blocks_free(short_llm)


def test_hypothesis_saw_both_kinds():
    """The strategy above must exercise both paths (it runs just before this test)."""
    if not any(HYPOTHESIS_COUNTS.values()):
        pytest.skip("counts come from the hypothesis test, which did not run")
    assert HYPOTHESIS_COUNTS["accepted"] >= 10 and HYPOTHESIS_COUNTS["rejected"] >= 10, HYPOTHESIS_COUNTS
    print(f"\nhypothesis SamplingParams examples: {HYPOTHESIS_COUNTS}")
