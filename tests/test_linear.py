"""The engine's linear layers (minivllm.linear): oneDNN against stock nn.Linear, and
linear_backend="auto", which measures both and keeps the faster per row count."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_greedy, random_workload, run_engine
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm import linear as linear_mod
from minivllm.linear import (
    BUCKET_ROWS,
    PLAN_FILE,
    LinearPlan,
    choose_backends,
    choose_linear_plan,
    measure_linear_backends,
    onednn_available,
    onednn_linear,
    plain_linears,
    plan_cache_key,
    planned_linear,
    resolve_linear_backend,
)
from minivllm.model_loader import make_tiny_model

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")
CPU = torch.device("cpu")
ONEDNN_OP, TORCH_OP = "mkldnn::_linear_pointwise", "aten::linear"
# torch for 1-8 rows (decodes of a few requests, the vocabulary projection), oneDNN above.
MIXED = LinearPlan(BUCKET_ROWS, ("torch", "torch", "onednn", "onednn", "onednn", "onednn"))


def ops_run(fn) -> set[str]:
    """Names of the linear ops ``fn`` ran (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()} & {ONEDNN_OP, TORCH_OP}


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (1, 5, 64), (512, 64)])
def test_onednn_linear_matches_nn_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(64, 96, bias=bias)
    x = torch.randn(*shape, generator=g)
    expected = F.linear(x, layer.weight, layer.bias)
    with torch.inference_mode(), onednn_linear([layer]):
        out = layer(x)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("plan", [LinearPlan.single("onednn"), MIXED], ids=["onednn", "mixed"])
def test_layers_are_plain_again_after_the_block_even_on_error(plan):
    model = make_tiny_model("llama")
    linears = plain_linears(model)
    assert len(linears) == 7 * model.config.num_hidden_layers + 1  # q k v o gate up down, lm_head
    with pytest.raises(RuntimeError, match="boom"), planned_linear(linears, plan):
        assert all(type(m) is not nn.Linear for m in linears)
        raise RuntimeError("boom")
    assert all(type(m) is nn.Linear and "linear_plan" not in vars(m) for m in linears)


@needs_onednn
def test_a_mixed_plan_picks_the_library_by_rows():
    layer = nn.Linear(64, 96)
    with torch.inference_mode(), planned_linear([layer], MIXED):
        assert ops_run(lambda: layer(torch.randn(8, 64))) == {TORCH_OP}
        assert ops_run(lambda: layer(torch.randn(1, 9, 64))) == {ONEDNN_OP}  # rows, not the batch dim
        big = torch.randn(512, 64)
        torch.testing.assert_close(layer(big), F.linear(big, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_plan_buckets_by_nearest_measured_rows():
    plan = LinearPlan((1, 4, 16, 64, 256, 512), ("torch", "onednn", "onednn", "torch", "onednn", "onednn"))
    by_rows = {r: plan.backend_for(r) for r in (1, 2, 3, 8, 9, 32, 33, 128, 129, 362, 363, 512, 4096)}
    assert by_rows == {1: "torch", 2: "torch", 3: "onednn", 8: "onednn", 9: "onednn", 32: "onednn",
                       33: "torch", 128: "torch", 129: "onednn", 362: "onednn", 363: "onednn",
                       512: "onednn", 4096: "onednn"}
    assert plan.name == "torch 1-2 rows, onednn 3-32 rows, torch 33-128 rows, onednn 129+ rows"
    assert LinearPlan((1, 64), ("onednn", "onednn")).name == "onednn"
    assert LinearPlan.single("torch").backend_for(10**6) == "torch"
    with pytest.raises(ValueError, match="ascending"):
        LinearPlan((4, 1), ("torch", "torch"))
    with pytest.raises(ValueError, match="unknown linear backends"):
        LinearPlan((1,), ("mkl",))


def test_choice_keeps_the_faster_per_row_count():
    # Fake FLOP/s, three samples each: a CPU where oneDNN loses at few rows and wins at many.
    rates = {
        1: {"torch": [10, 11, 9], "onednn": [5, 4, 50]},  # one lucky oneDNN sample: the median decides
        16: {"torch": [40, 41, 39], "onednn": [40.5, 40.6, 40.4]},  # within 2%: keep the stock path
        64: {"torch": [80, 81, 79], "onednn": [90, 91, 89]},
        512: {"torch": [100, 100, 100], "onednn": [160, 150, 155]},
    }
    plan = choose_backends(rates)
    assert plan == LinearPlan((1, 16, 64, 512), ("torch", "torch", "onednn", "onednn"))
    assert choose_backends(rates, margin=0.0).backends == ("torch", "onednn", "onednn", "onednn")
    flipped = {n: {"torch": r["onednn"], "onednn": r["torch"]} for n, r in rates.items()}
    assert choose_backends(flipped).backends == ("onednn", "torch", "torch", "torch")


def test_cache_key_names_what_the_answer_depends_on(monkeypatch):
    model = make_tiny_model("llama")
    key = plan_cache_key(model, torch.float32)
    assert key["torch"] == torch.__version__ and key["dtype"] == "float32"
    assert key["linear_shapes"] == {"64x128": 4, "64x32": 4, "64x512": 1, "64x64": 4, "128x64": 2}
    assert plan_cache_key(model, torch.bfloat16) != key
    assert plan_cache_key(make_tiny_model("llama", hidden_size=96), torch.float32) != key
    named = make_tiny_model("llama")
    named.config.name_or_path = "someone/another-model"
    assert plan_cache_key(named, torch.float32) != key
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert plan_cache_key(model, torch.float32) != key
    monkeypatch.undo()
    monkeypatch.setattr(linear_mod, "cpu_description", lambda: {"cpu": "Some Other CPU", "cpu_flags": "x"})
    assert plan_cache_key(model, torch.float32) != key
    monkeypatch.undo()
    assert plan_cache_key(model, torch.float32) == key


def test_measurement_times_every_backend_at_every_row_count():
    model = make_tiny_model("qwen2", vocab_size=512)
    rates = measure_linear_backends(model, rows=(1, 32), budget_s=0.05, rounds=3)
    assert set(rates) == {1, 32}
    for by_backend in rates.values():
        assert set(by_backend) == {"torch", "onednn"}
        assert all(len(v) == 3 and all(x > 0 for x in v) for v in by_backend.values())


@needs_onednn
def test_auto_measures_once_then_reads_the_cache(tmp_path, monkeypatch, caplog):
    model = make_tiny_model("llama")
    fake = {n: {"torch": [2.0e9] * 3, "onednn": [1.0e9 if n < 64 else 3.0e9] * 3} for n in BUCKET_ROWS}
    calls = []
    monkeypatch.setattr(linear_mod, "measure_linear_backends", lambda m, **kw: calls.append(m) or fake)
    with caplog.at_level(logging.INFO, logger="minivllm"):
        plan = choose_linear_plan("auto", model, tmp_path)
    assert plan.backends == ("torch", "torch", "torch", "onednn", "onednn", "onednn") and len(calls) == 1
    assert "measured in" in caplog.text and "512 rows torch 2.0 onednn 3.0" in caplog.text
    assert f"Chose: {plan.name}" in caplog.text
    stored = json.loads((tmp_path / PLAN_FILE).read_text())
    (entry,) = stored.values()
    assert entry["key"] == plan_cache_key(model, torch.float32) and entry["backends"] == list(plan.backends)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="minivllm"):
        assert choose_linear_plan("auto", model, tmp_path) == plan
    assert len(calls) == 1 and "cached in" in caplog.text
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # another torch build: measured again
    choose_linear_plan("auto", model, tmp_path)
    assert len(calls) == 2 and len(json.loads((tmp_path / PLAN_FILE).read_text())) == 2


def test_resolve_linear_backend():
    assert resolve_linear_backend("torch", CPU, torch.float32) == "torch"
    assert resolve_linear_backend("auto", CPU, torch.float16) == "torch"
    assert resolve_linear_backend("auto", torch.device("cuda"), torch.float32) == "torch"
    assert resolve_linear_backend("auto", CPU, torch.float32) == ("auto" if onednn_available() else "torch")
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        resolve_linear_backend("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        resolve_linear_backend("onednn", CPU, torch.float16)


@needs_onednn
@pytest.mark.parametrize("backend, op", [("torch", TORCH_OP), ("onednn", ONEDNN_OP)])
def test_a_forced_backend_is_honoured_without_measuring(backend, op, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a forced linear_backend must not be measured")

    monkeypatch.setattr(linear_mod, "measure_linear_backends", refuse)
    model = make_tiny_model("qwen2", vocab_size=512)
    prompt = list(range(3, 40))
    ref = hf_greedy(model, prompt, 12)
    llm = LLM(model, linear_backend=backend, log_stats_interval=None)
    assert llm.llm_engine.linear_backend == backend
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = []
    assert ops_run(lambda: out.extend(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False))) == {op}
    assert out[0].outputs[0].token_ids == ref
    assert all(type(m) is nn.Linear for m in plain_linears(model)) and plain_linears(model)
    assert hf_greedy(model, prompt, 12) == ref  # the model is the user's stock model again


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_auto_switching_library_by_rows_keeps_tokens_identical(arch, tmp_path, monkeypatch):
    """A measured plan that uses nn.Linear for small products and oneDNN for large ones: the
    engine's steps run through both (prefill chunks of up to 32 tokens, decodes of 1-16
    requests, the vocabulary projection on the sampling rows), and every greedy token
    equals stock generate()'s."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    # Measured rates (faked) of a CPU where nn.Linear wins below 16 rows and oneDNN above.
    fake = {n: {"torch": [2.0e9] * 3, "onednn": [1.0e9 if n < 16 else 3.0e9] * 3} for n in BUCKET_ROWS}
    monkeypatch.setattr(linear_mod, "measure_linear_backends", lambda m, **kw: fake)
    model = make_tiny_model(arch, vocab_size=512)
    prompts, lengths = random_workload(16, 512, seed=3, max_len=60, max_out=20)
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    llm = LLM(model, max_num_batched_tokens=32, log_stats_interval=None)
    assert llm.llm_engine.linear_plan == MIXED
    out = []
    assert ops_run(lambda: out.extend(run_engine(llm, prompts, lengths))) == {TORCH_OP, ONEDNN_OP}
    assert out == refs
    sizes = {s.num_tokens for s in llm.trace.steps}
    assert min(sizes) <= 8 < max(sizes)  # both buckets were stepped through
