"""quantization="int8" (minivllm.worker.quantization) and ``minivllm bench quantization``:
the weights a quarter of the bytes, the answers close to float32's, the caller's model
untouched, bad settings refused by name, and perplexity through the engine equal to
transformers' own loss."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import all_blocks_free, hf_greedy, random_workload
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.bench.quantization import agreement, perplexity
from minivllm.exceptions import ValidationError
from minivllm.worker.model_loader import make_tiny_model
from minivllm.worker.quantization import Int8Linear, quantize_model, smoothing_factors

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", seed=3, vocab_size=VOCAB)


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt token's log-probability (after the first) as the engine computes it."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [[e[t].logprob for t, e in zip(p[1:], o.prompt_logprobs[1:], strict=True)]
            for p, o in zip(prompts, outs, strict=True)]


def test_int8_weights_take_a_quarter_of_the_bytes_and_stay_close_to_float32(model):
    prompts = random_workload(6, VOCAB, seed=1, min_len=8, max_len=40)[0]
    fp32 = LLM(model, tokenizer=None, log_stats_interval=None)
    int8 = LLM(model, tokenizer=None, quantization="int8", log_stats_interval=None)
    report = int8.llm_engine.quantization
    assert fp32.llm_engine.quantization is None
    assert report.method == "int8" and report.layers == 2 * 7 + 1  # 2 layers of 7, and the head
    # 1 byte a weight instead of 4, and a 4-byte scale per row (64 to 512 rows of 64 to 128 here)
    assert report.bytes_before / 4 < report.bytes_after < report.bytes_before / 3.5
    a, b = prompt_logprobs(fp32, prompts), prompt_logprobs(int8, prompts)
    diffs = [abs(x - y) for pa, pb in zip(a, b) for x, y in zip(pa, pb)]
    # Rounding to 8 bits moves the log-probabilities, a little: not zero, not large.
    assert 0 < max(diffs) < 0.1
    out = int8.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)
    assert all_blocks_free(int8)


def test_the_callers_model_is_not_quantized_and_float32_stays_token_identical(model):
    LLM(model, tokenizer=None, quantization="int8", log_stats_interval=None)
    assert any(type(m) is nn.Linear for m in model.modules())
    assert not [m for m in model.modules() if type(m).__name__ == "Int8Linear"]
    prompt = random_workload(1, VOCAB, seed=2, min_len=12, max_len=12)[0][0]
    llm = LLM(model, tokenizer=None, log_stats_interval=None)
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == hf_greedy(model, prompt, 16)


def test_int8_rows_do_not_depend_on_the_rest_of_the_batch(model):
    """Each token's activations get their own scale and the integer sums are exact, so a
    row's result is the same alone or among others (a scale shared by the whole batch
    would let one request's outlier coarsen every other request's rounding)."""
    layer = make_tiny_model("llama", seed=5, vocab_size=VOCAB).model.layers[0].mlp.down_proj
    q = nn.Sequential(layer)
    assert quantize_model(q, "int8").layers == 1 and type(q[0]) is not nn.Linear
    x = torch.randn(5, layer.in_features)
    x[3] *= 100  # one outlier row
    together = q(x)
    alone = torch.cat([q(x[i:i + 1]) for i in range(5)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("kwargs, says", [
    (dict(quantization="int3"), "quantization must be one of"),
    (dict(quantization="int8", dtype="bfloat16"), "float32"),
    (dict(quantization="int8", tensor_parallel_size=2), "tensor parallelism"),
])
def test_bad_quantization_settings_are_refused_by_name(model, kwargs, says):
    with pytest.raises(ValidationError, match=says) as e:
        LLM(model, tokenizer=None, log_stats_interval=None, **kwargs)
    assert e.value.param == "quantization"


def test_the_command_line_takes_quantization():
    from minivllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--quantization", "int8"])
    assert args.quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--quantization", "int4"])


def test_perplexity_through_the_engine_is_transformers_loss():
    """The benchmark's perplexity, from the engine's prompt log-probabilities, against
    exp(loss) of the same model in transformers (a reference nobody here wrote)."""
    model = make_tiny_model("qwen2", seed=4, vocab_size=VOCAB)
    chunks = random_workload(3, VOCAB, seed=4, min_len=32, max_len=32)[0]
    ids = torch.tensor(chunks)
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    llm = LLM(model, tokenizer=None, log_stats_interval=None)
    assert perplexity(llm, chunks) == pytest.approx(math.exp(loss), rel=1e-4)


def test_agreement_counts_identical_requests_and_the_common_prefix():
    base = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert agreement(base, base) == (1.0, 3.0)
    same, prefix = agreement(base, [[1, 2, 3], [4, 0, 6], [0, 8, 9]])
    assert same == pytest.approx(1 / 3) and prefix == pytest.approx((3 + 1 + 0) / 3)


def test_smoothing_tames_an_outlier_channel():
    """One input channel a hundred times the others (as in the MLP's down_proj of real
    models): smoothing moves its range into the weight, and the 8-bit product comes
    closer to the float one; the factors cancel, so without rounding nothing changes."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 32, bias=False)
    x = torch.randn(40, 64)
    x[:, 5] *= 100
    exact = layer(x).detach()
    s = smoothing_factors(x.abs().amax(dim=0), layer.weight)
    assert torch.allclose((x / s) @ (layer.weight.detach() * s).T, exact, rtol=1e-4, atol=1e-4)

    def error(q: Int8Linear) -> float:
        return ((q(x) - exact).norm() / exact.norm()).item()

    plain, smoothed = Int8Linear.from_linear(layer), Int8Linear.from_linear(layer, s)
    assert error(smoothed) < error(plain) / 2
    assert smoothed.weight_bytes() == plain.weight_bytes() + 4 * 64  # a factor per input channel


def test_bench_quantization_reports_every_setting_against_float32():
    """The benchmark end to end on a tiny model with SmolLM2's tokenizer: one row per
    setting, float32 first and agreeing with itself, int8 at about a quarter of the weight
    bytes (smoothed on the calibration text), an fp8 cache at four times the tokens per GiB,
    every number a number."""
    from tiny_chat import tiny_chat_llm

    from minivllm.bench.quantization import SETTINGS, TASKS, quantization_benchmark

    base = tiny_chat_llm()
    model, tokenizer = base.llm_engine.model, base.get_tokenizer()
    rows = quantization_benchmark(model, tokenizer, rounds=1, num_requests=4, chunks=2, output_len=(4, 16))
    assert [(r["quantization"], r["kv_cache_dtype"]) for r in rows] == [(q or "none", kv) for q, kv in SETTINGS]
    assert [r["setting"] for r in rows] == ["none (float32)", "int8 weights", "fp8 KV cache",
                                            "int8 weights + fp8 KV cache"]
    fp32, int8, fp8_kv, both = rows
    # the ratios are against the float32 row of the same run
    for row in (int8, fp8_kv, both):
        assert row["batch-1 speedup"] == pytest.approx(row["batch-1 decode tok/s"] / fp32["batch-1 decode tok/s"])
        assert 0 <= row["greedy identical"] <= 1 and 0 <= row["tokens before first difference"] <= 48
    assert fp32["greedy identical"] == 1
    assert fp32["linear weights MB"] / 4 < int8["linear weights MB"] < fp32["linear weights MB"] / 3.5
    assert fp8_kv["linear weights MB"] == fp32["linear weights MB"]
    # the cache's bytes per token, not the weights, decide the tokens per GiB
    assert int8["KV tokens per GiB"] == fp32["KV tokens per GiB"]
    assert fp8_kv["KV tokens per GiB"] == both["KV tokens per GiB"]
    assert fp8_kv["KV tokens per GiB"] // 4 == fp32["KV tokens per GiB"]
    for row in rows:
        assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1
        assert row["batch-1 decode tok/s"] > 0 and row["4 requests out tok/s"] > 0
        assert 0 <= int(row["answers right"].split("/")[0]) <= len(TASKS)


@pytest.mark.parametrize("flag", ["--rounds", "--num-requests"])
def test_bench_quantization_refuses_a_count_below_one(flag, capsys):
    from minivllm.bench.cli import main

    with pytest.raises(SystemExit, match=f"{flag} must be at least 1"):
        main(["quantization", flag, "0"])
