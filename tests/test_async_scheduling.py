"""Async scheduling (``async_scheduling=True``): step N+1 is scheduled while step N runs.

The reference is the same as everywhere: transformers' generate() for greedy tokens, and
the engine without async scheduling for what does not depend on the batch's timing
(seeded sampling, logprobs, stops). The overlap itself is checked by its order of
events, never by a clock.
"""

from __future__ import annotations

import threading

import pytest
from helpers import all_blocks_free, greedy, hf_greedy, random_workload, run_engine

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.core.async_scheduler import AsyncScheduler
from minivllm.core.scheduler import Scheduler
from minivllm.entrypoints.cli import build_parser
from minivllm.exceptions import ValidationError
from minivllm.worker.model_loader import make_tiny_model

VOCAB = 512


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_model("llama", vocab_size=VOCAB)
    prompts, lengths = random_workload(16, VOCAB, seed=1, max_len=100, max_out=40)
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    return model, prompts, lengths, refs


def make(model, **config) -> LLM:
    return LLM(model, async_scheduling=True, log_stats_interval=None, **config)


@pytest.mark.parametrize("config", [
    {}, {"num_kv_blocks": 24, "max_num_batched_tokens": 64}, {"max_num_batched_tokens": 16},
    {"block_size": 1, "max_num_batched_tokens": 64}, {"compilation_config": {"backend": "eager"}},
], ids=["ample", "preempting", "budget16", "block1", "compiled"])
def test_greedy_tokens_are_transformers_own(tiny, config):
    model, prompts, lengths, refs = tiny
    llm = make(model, **config)
    assert run_engine(llm, prompts, lengths) == refs
    steps = list(llm.trace.steps)
    if "num_kv_blocks" in config:
        assert sum(len(s.preempted) for s in steps) > 0, "the small cache should force preemption"
    requests = llm.llm_engine.scheduler.requests
    assert not requests and all_blocks_free(llm)


def test_the_next_step_is_scheduled_while_the_model_runs(tiny):
    """The forward pass of step k waits until the engine has called the scheduler for
    step k+1: only an engine that schedules while the model runs gets through (one that
    schedules after the forward pass would wait forever; here, 30 s and fail). Each
    step's record then starts before the one before it has been processed."""
    model, prompts, _, _ = tiny
    refs = [hf_greedy(model, p, 12) for p in prompts[:4]]
    llm = make(model)
    engine = llm.llm_engine
    calls = {"schedule": 0, "forward": 0}
    cond = threading.Condition()
    real_schedule = engine.scheduler.schedule

    def schedule():
        out = real_schedule()
        with cond:
            calls["schedule"] += 1
            cond.notify_all()
        return out

    def forward_pre_hook(module, args, kwargs):
        with cond:
            calls["forward"] += 1
            k = calls["forward"]
            waited = cond.wait_for(lambda: calls["schedule"] > k, timeout=30)
        assert waited, f"forward pass {k} ran alone: step {k + 1} was never scheduled meanwhile"

    engine.scheduler.schedule = schedule
    handle = model.register_forward_pre_hook(forward_pre_hook, with_kwargs=True)
    try:
        assert run_engine(llm, prompts[:4], [12] * 4) == refs
    finally:
        handle.remove()
    steps = list(llm.trace.steps)
    assert len(steps) >= 12
    for before, after in zip(steps, steps[1:]):
        assert after.start <= before.times.output_start <= before.end
        assert before.times.scheduled <= before.times.model_start
        assert after.times.model_start >= before.times.model_start + before.model_time


def test_a_request_that_stops_keeps_no_token_past_its_stop(tiny):
    """Its next step was scheduled before the stop was known: that token is computed and
    thrown away. Outputs, finish reasons and stop reasons are those of the engine
    without async scheduling; the blocks all come back."""
    model, prompts, _, _ = tiny
    # The tokens greedy decoding gives at positions 3 and 5 of two prompts become stops.
    stops = [hf_greedy(model, prompts[i], 8)[3 + 2 * i] for i in range(2)]
    params = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stops[0]]),
              SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stops[1]]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    inputs = [{"prompt_token_ids": p} for p in prompts[:3]]
    results = []
    for llm in (make(model), LLM(model, log_stats_interval=None)):
        outs = llm.generate(inputs, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                        for o in outs])
        assert all_blocks_free(llm)
    assert results[0] == results[1]
    assert [r[1] for r in results[0]] == ["stop", "stop", "length"]


def test_seeded_sampling_logprobs_and_penalties_are_unchanged(tiny):
    """A seeded request draws from its own generator, step after step, in the same order
    with or without async scheduling; logprobs come from the same logits. A request with
    penalties reads what it has generated, so it waits for its tokens (every other step):
    its tokens are the same too."""
    model, prompts, _, _ = tiny
    inputs = [{"prompt_token_ids": p} for p in prompts[:6]]
    params = [SamplingParams(temperature=0.9, top_k=40, max_tokens=16, seed=100 + i, ignore_eos=True,
                             logprobs=2 if i % 2 else None,
                             repetition_penalty=1.3 if i == 4 else 1.0) for i in range(6)]
    results = []
    for llm in (make(model), LLM(model, log_stats_interval=None)):
        outs = llm.generate(inputs, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids,
                         [{t: round(lp.logprob, 4) for t, lp in d.items()} for d in o.outputs[0].logprobs or []])
                        for o in outs])
    assert results[0] == results[1]


def test_a_request_with_penalties_is_scheduled_only_once_its_token_is_processed(tiny):
    """Alone in the engine, a plain request's next decode is scheduled before its last
    one is processed; one with penalties only after (its penalties read that token)."""
    model, prompts, _, _ = tiny
    for penalty, ahead in ((1.0, True), (1.2, False)):
        llm = make(model)
        llm.generate([{"prompt_token_ids": prompts[0]}],
                     SamplingParams(temperature=0, max_tokens=8, repetition_penalty=penalty, ignore_eos=True),
                     use_tqdm=False)
        steps = list(llm.trace.steps)
        assert len(steps) >= 8
        for before, after in zip(steps, steps[1:]):
            if ahead:
                assert after.start <= before.times.output_start
            else:
                assert after.start >= before.end


def test_abort_while_a_step_is_in_flight(tiny):
    model, prompts, _, _ = tiny
    llm = make(model)
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, greedy(30))
    finished = {}
    for _ in range(4):
        for out in engine.step():
            finished.setdefault(out.request_id, out) if out.finished else None
    engine.abort_request(["1"])
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["1"].outputs[0].finish_reason == "abort"
    assert finished["0"].outputs[0].token_ids == hf_greedy(model, prompts[0], 30)
    assert finished["2"].outputs[0].token_ids == hf_greedy(model, prompts[2], 30)
    assert all_blocks_free(llm) and engine.model_runner.generators == {}


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_step_fails_the_one_behind_it_and_both_are_rolled_back(tiny, error):
    """The step after a failed one was scheduled on placeholders that were never
    sampled: it does not run. Both are undone; stepping again carries on exactly. The
    same for Ctrl-C in a notebook."""
    model, prompts, _, _ = tiny
    llm = make(model, block_size=4, max_num_batched_tokens=24)
    engine = llm.llm_engine
    runner = engine.model_runner
    real = runner.execute_step
    calls = {"n": 0}

    def execute_step(step):
        calls["n"] += 1
        if calls["n"] in (2, 5, 6):
            raise error("injected failure")
        return real(step)

    runner.execute_step = execute_step
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), {"prompt_token_ids": p[:30]}, greedy(10))
    final, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except error as e:
            assert "injected failure" in str(e)
            failures += 1
            assert all(r.num_output_placeholders == 0 for r in engine.scheduler.requests.values())
            engine.kv_cache_manager.check_invariants()
            continue
        for out in outs:
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert failures >= 2
    assert [final[str(i)] for i in range(4)] == [hf_greedy(model, p[:30], 10) for p in prompts[:4]]
    assert all_blocks_free(llm)


@pytest.mark.parametrize("field, value", [
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
    ("tensor_parallel_size", 2),
    ("kv_transfer_config", {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}),
])
def test_what_it_does_not_run_with_is_refused_naming_the_field(field, value):
    with pytest.raises(ValidationError) as e:
        EngineConfig(async_scheduling=True, **{field: value})
    assert e.value.param == field and "async_scheduling" in str(e.value)


def test_a_scheduler_without_placeholders_is_refused(tiny):
    class MyScheduler(Scheduler):
        pass

    class MyAsyncScheduler(AsyncScheduler):
        pass

    with pytest.raises(ValidationError) as e:
        make(tiny[0], scheduler_cls=MyScheduler)
    assert e.value.param == "scheduler_cls"
    assert type(make(tiny[0], scheduler_cls=MyAsyncScheduler).llm_engine.scheduler) is MyAsyncScheduler
    assert type(make(tiny[0]).llm_engine.scheduler) is AsyncScheduler
    with pytest.raises(ValidationError) as e:
        EngineConfig(async_scheduling="yes")
    assert e.value.param == "async_scheduling"


def test_the_command_line_takes_the_flag():
    for command in (["generate", "hi", "--async-scheduling"], ["serve", "--async-scheduling"]):
        assert build_parser().parse_args(command).async_scheduling is True
    assert build_parser().parse_args(["serve"]).async_scheduling is False



def test_generate_returns_with_nothing_in_flight(tiny):
    """The step scheduled behind a stop is processed before generate() returns, so the
    next call's trace holds only its own steps."""
    model, prompts, _, _ = tiny
    llm = make(model)
    stop = hf_greedy(model, prompts[0], 8)[3]
    first = llm.generate([{"prompt_token_ids": prompts[0]}],
                         SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]), use_tqdm=False)
    assert first[0].outputs[0].finish_reason == "stop" and not llm.llm_engine.has_steps_in_flight()
    llm.trace.clear()
    second = llm.generate([{"prompt_token_ids": prompts[1]}], greedy(5), use_tqdm=False)
    assert {c.request_id for s in llm.trace.steps for c in s.scheduled} == {second[0].request_id}
    assert all_blocks_free(llm)


def test_a_step_that_fails_after_one_of_its_requests_was_aborted(tiny):
    """The step packed last time runs in the next call: a request in it can be aborted in
    between, and if that step then fails, the rollback leaves the finished request alone."""
    model, prompts, _, _ = tiny
    llm = make(model)
    engine = llm.llm_engine
    runner = engine.model_runner
    real, fail = runner.execute_step, {"now": False}

    def execute_step(step):
        if fail["now"]:
            fail["now"] = False
            raise RuntimeError("injected failure")
        return real(step)

    runner.execute_step = execute_step
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, greedy(8))
    engine.step()
    engine.add_request("b", {"prompt_token_ids": prompts[1]}, greedy(8))
    engine.step()  # b is admitted in the step packed now, to run in the next call
    engine.abort_request(["b"])
    fail["now"] = True
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0]
    assert final["b"].finish_reason == "abort"
    assert final["a"].token_ids == hf_greedy(model, prompts[0], 8)
    assert all_blocks_free(llm)
