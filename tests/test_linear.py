"""The engine's linear layers (minivllm.worker.linear): oneDNN and (W @ x.T).T against stock
nn.Linear, and linear_backend="auto", which measures them and keeps the fastest per row
count, for the decoder's layers and for the vocabulary projection."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_greedy, random_workload, run_engine
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.worker import linear as linear_mod
from minivllm.worker.linear import PLAN_FILE, choose_linear_plan, plan_cache_key
from minivllm.worker.linear_autotune import (
    BUCKET_ROWS,
    HEAD_ROWS,
    choose_backends,
    measure_linear_backends,
    noisy,
    prefer_one_library,
)
from minivllm.worker.linear_plan import (
    FORWARD,
    LinearChoice,
    LinearPlan,
    onednn_available,
    onednn_rows,
    plain_linears,
    planned_linear,
    resolve_linear_backend,
)
from minivllm.worker.model_loader import make_tiny_model

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")
CPU = torch.device("cpu")
VOCAB = 512
# Decoder layers: torch for 1-8 rows (decodes of a few requests), oneDNN above; the
# vocabulary projection: (W @ x.T).T for 1-2 sampling rows, torch above.
MIXED = LinearPlan(LinearChoice(BUCKET_ROWS, ("torch", "torch", "onednn", "onednn", "onednn", "onednn")),
                   LinearChoice(HEAD_ROWS, ("transposed", "torch", "torch")))


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, int, int]]:
    """Every linear product computed from now on, as (library, rows, output features):
    the three implementations in minivllm.worker.linear_plan.FORWARD, and F.linear itself for the
    layers left as plain nn.Linear."""
    seen: list[tuple[str, int, int]] = []

    def spy(name, fn):
        def forward(x, weight, bias=None):
            seen.append((name, x.numel() // x.shape[-1], weight.shape[0]))
            return fn(x, weight, bias)
        return forward

    for name, fn in list(FORWARD.items()):
        monkeypatch.setitem(FORWARD, name, spy(name, fn))
    monkeypatch.setattr(F, "linear", spy("torch", F.linear))
    return seen


@pytest.mark.parametrize("backend", ["onednn", "transposed"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (1, 5, 64), (512, 64), (33, 64), (3, 11, 64)])
def test_each_library_matches_nn_linear(shape, bias, backend):
    """(33 rows, and 3 x 11, reach oneDNN padded to 36 rows: the padding never shows.)"""
    if backend == "onednn" and not onednn_available():
        pytest.skip("this PyTorch build has no oneDNN")
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(64, 96, bias=bias)
    x = torch.randn(*shape, generator=g)
    expected = F.linear(x, layer.weight, layer.bias)
    with torch.inference_mode(), planned_linear(LinearPlan.single(backend).assign(layer)):
        out = layer(x)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_onednn_sees_a_few_row_counts_each_padded_by_at_most_an_eighth():
    """oneDNN keeps a primitive (and its memory) per distinct shape: rows 1 to 2,048 reach
    it as 72 sizes, none more than 1/8 larger than asked, in the same order."""
    padded = [onednn_rows(r) for r in range(1, 2049)]
    assert all(r <= p <= r * 9 / 8 for r, p in enumerate(padded, start=1))
    assert padded == sorted(padded) and padded[:15] == list(range(1, 16))
    assert len(set(padded)) == 72


@needs_onednn
@pytest.mark.parametrize("plan", [LinearPlan.single("onednn"), MIXED], ids=["onednn", "mixed"])
def test_layers_are_plain_again_after_the_block_even_on_error(plan):
    model = make_tiny_model("llama")
    linears = plain_linears(model)
    assert len(linears) == 7 * model.config.num_hidden_layers + 1  # q k v o gate up down, lm_head
    with pytest.raises(RuntimeError, match="boom"), planned_linear(plan.assign(model)):
        assert all(type(m) is not nn.Linear for m in linears)
        raise RuntimeError("boom")
    assert all(type(m) is nn.Linear and "linear_choice" not in vars(m) for m in linears)
    with planned_linear(LinearPlan.single("onednn").assign(model)):  # every layer through oneDNN
        assert all(type(m) is not nn.Linear for m in linears)
    assert all(type(m) is nn.Linear for m in linears)


@needs_onednn
def test_a_mixed_plan_picks_the_library_by_rows_and_layer(calls):
    model = make_tiny_model("llama", vocab_size=VOCAB)
    head = model.get_output_embeddings()
    gate = model.model.layers[0].mlp.gate_proj
    with torch.inference_mode(), planned_linear(MIXED.assign(model)):
        for layer, rows in [(gate, 8), (gate, 9), (head, 2), (head, 3)]:
            layer(torch.randn(1, rows, layer.in_features))  # rows count, not the batch dimension
    assert calls == [("torch", 8, gate.out_features), ("onednn", 9, gate.out_features),
                     ("transposed", 2, VOCAB), ("torch", 3, VOCAB)]


def test_choice_buckets_by_nearest_measured_rows():
    c = LinearChoice((1, 4, 16, 64, 256, 512), ("torch", "onednn", "onednn", "torch", "onednn", "onednn"))
    by_rows = {r: c.backend_for(r) for r in (1, 2, 3, 8, 9, 32, 33, 128, 129, 362, 363, 512, 4096)}
    assert by_rows == {1: "torch", 2: "torch", 3: "onednn", 8: "onednn", 9: "onednn", 32: "onednn",
                       33: "torch", 128: "torch", 129: "onednn", 362: "onednn", 363: "onednn",
                       512: "onednn", 4096: "onednn"}
    assert c.name == "torch 1-2 rows, onednn 3-32 rows, torch 33-128 rows, onednn 129+ rows"
    assert LinearChoice((1, 64), ("onednn", "onednn")).name == "onednn"
    assert LinearPlan.single("transposed").name == "transposed"
    assert LinearPlan(c, LinearChoice((1,), ("onednn",))).name == f"layers: {c.name}; vocabulary projection: onednn"
    with pytest.raises(ValueError, match="ascending"):
        LinearChoice((4, 1), ("torch", "torch"))
    with pytest.raises(ValueError, match="unknown linear backends"):
        LinearChoice((1,), ("mkl",))


def test_choice_keeps_the_fastest_per_row_count():
    # Fake FLOP/s, three rounds each: a CPU where oneDNN loses at few rows and wins at many.
    rates = {
        1: {"torch": [10, 11, 9], "onednn": [5, 4, 9], "transposed": [12, 13, 12]},
        16: {"torch": [40, 41, 39], "onednn": [40.5, 41.6, 40.4], "transposed": [30, 30, 30]},  # within 2%: stock
        64: {"torch": [80, 81, 79], "onednn": [20, 91, 89], "transposed": [70, 70, 70]},  # 20: slowed by another program
        512: {"torch": [100, 100, 100], "onednn": [160, 150, 155], "transposed": [99, 99, 99]},
    }
    assert choose_backends(rates) == LinearChoice((1, 16, 64, 512), ("transposed", "torch", "onednn", "onednn"))
    assert choose_backends(rates, margin=0.0).backends == ("transposed", "onednn", "onednn", "onednn")
    flipped = {n: {"torch": r["onednn"], "onednn": r["torch"]} for n, r in rates.items()}
    assert choose_backends(flipped).backends == ("onednn", "torch", "torch", "torch")
    assert choose_backends({}) == LinearChoice((1,), ("torch",))  # nothing measured: the stock path


def test_one_library_nearly_as_fast_everywhere_is_preferred_to_a_patchwork():
    # Each row count's winner by a few percent, as one noisy second of measuring gives.
    close = {1: {"torch": [10, 10, 10], "onednn": [10.4, 10.4, 10.4], "transposed": [10.3, 10.3, 10.3]},
             16: {"torch": [40, 40, 40], "onednn": [40, 40, 40], "transposed": [41.9, 41.9, 41.9]},
             512: {"torch": [100, 100, 100], "onednn": [103, 103, 103], "transposed": [90, 90, 90]}}
    mixed = choose_backends(close)
    assert mixed.backends == ("onednn", "transposed", "onednn")
    one, why = prefer_one_library(close, mixed)
    # oneDNN is at worst 5% slower (16 rows) and fastest on average: it serves every row count.
    assert one == LinearChoice((1, 16, 512), ("onednn",) * 3)
    assert why.startswith("onednn alone, within 5%") and "at 16 rows" in why
    # A library that wins by a clear margin somewhere keeps the mix, and says which came closest.
    far = {**close, 16: {"torch": [40] * 3, "onednn": [40] * 3, "transposed": [60] * 3},
           512: {"torch": [100] * 3, "onednn": [150] * 3, "transposed": [90] * 3}}
    kept, why = prefer_one_library(far, choose_backends(far))
    assert kept == choose_backends(far) and why.startswith("mixed, because every single library loses more than 5%")
    # One library already: nothing to decide.
    assert prefer_one_library({1: {"torch": [1], "onednn": [2]}}, LinearChoice((1,), ("onednn",)))[0].backends == ("onednn",)


def test_choice_compares_backends_within_a_round():
    # The machine slowed down after torch's first sample: its best sample is the fastest
    # of all, yet in every round after it oneDNN ran 10% faster than torch.
    drift = {512: {"torch": [100.0, 60.0, 60.0], "onednn": [70.0, 66.0, 66.0]}}
    assert choose_backends(drift).backends == ("onednn",)


def test_a_disturbed_measurement_is_recognised():
    quiet = {"layers": {1: {"torch": [10.0, 9.8, 9.9], "onednn": [12.0, 11.5, 11.9]}}}
    assert noisy(quiet) == []
    busy = {"layers": {1: {"torch": [10.0, 4.0, 3.0], "onednn": [12.0, 11.5, 11.9]}}}
    assert noisy(busy) == ["layers torch at 1 rows"]


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
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    assert plan_cache_key(model, torch.float32) != key
    monkeypatch.undo()
    assert plan_cache_key(model, torch.float32) == key


def test_measurement_times_every_backend_at_every_row_count():
    model = make_tiny_model("qwen2", vocab_size=VOCAB)  # qwen2: biases on q, k, v
    backends = ("torch", "onednn", "transposed") if onednn_available() else ("torch", "transposed")
    rates = measure_linear_backends(model, backends, budget_s=0.05, rounds=3)
    assert set(rates["layers"]) == set(BUCKET_ROWS) and set(rates["head"]) == set(HEAD_ROWS)
    for by_rows in rates.values():
        for by_backend in by_rows.values():
            assert set(by_backend) == set(backends)
            assert all(len(v) == 3 and all(x > 0 for x in v) for v in by_backend.values())


def fake_rates(winner_below_16: str, winner_above: str) -> dict:
    """Measured rates (faked): ``winner_below_16`` fastest under 16 rows, ``winner_above`` from there."""
    def group(rows):
        return {n: {b: [3.0e9 if b == (winner_below_16 if n < 16 else winner_above) else 2.0e9] * 3
                    for b in ("torch", "onednn", "transposed")} for n in rows}
    return {"layers": group(BUCKET_ROWS), "head": group(HEAD_ROWS)}


def test_auto_measures_once_then_reads_the_cache(tmp_path, monkeypatch, caplog):
    model = make_tiny_model("llama")
    measured = []
    monkeypatch.setattr(linear_mod, "measure_linear_backends",
                        lambda m, backends, **kw: measured.append(backends) or fake_rates("transposed", "onednn"))
    with caplog.at_level(logging.INFO, logger="minivllm"):
        plan = choose_linear_plan("auto", model, tmp_path)
    assert plan.layers.backends == ("transposed", "transposed", "onednn", "onednn", "onednn", "onednn")
    assert plan.head.backends == ("transposed", "transposed", "onednn") and len(measured) == 1
    assert "measured in" in caplog.text and "layers at 512 rows torch 2.0 onednn 3.0 transposed 2.0" in caplog.text
    assert f"Chose: {plan.name}" in caplog.text
    (entry,) = json.loads((tmp_path / PLAN_FILE).read_text()).values()
    assert entry["key"] == plan_cache_key(model, torch.float32) and entry["layers"]["backends"] == list(plan.layers.backends)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="minivllm"):
        assert choose_linear_plan("auto", model, tmp_path) == plan
    assert len(measured) == 1 and "cached in" in caplog.text
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # another torch build: measured again
    choose_linear_plan("auto", model, tmp_path)
    assert len(measured) == 2 and len(json.loads((tmp_path / PLAN_FILE).read_text())) == 2


def test_a_disturbed_measurement_is_taken_again_and_not_cached(tmp_path, monkeypatch, caplog):
    model = make_tiny_model("llama")
    draws = []

    def disturbed(m, backends, **kw):
        rates = fake_rates("transposed", "onednn")
        rates["layers"][512]["torch"] = [2.0e9, 0.5e9, 0.5e9]  # another program ran
        draws.append(1)
        return rates

    monkeypatch.setattr(linear_mod, "measure_linear_backends", disturbed)
    with caplog.at_level(logging.INFO, logger="minivllm"):
        plan = choose_linear_plan("auto", model, tmp_path)
    assert len(draws) == 2 and plan.layers.backends[-1] == "onednn"  # measured twice, a plan still used
    assert "disturbed" in caplog.text and not (tmp_path / PLAN_FILE).exists()
    monkeypatch.setattr(linear_mod, "measure_linear_backends",
                        lambda m, b, **kw: draws.append(1) or fake_rates("transposed", "onednn"))
    choose_linear_plan("auto", model, tmp_path)  # a quiet measurement is cached
    assert len(draws) == 3 and (tmp_path / PLAN_FILE).exists()


def test_resolve_linear_backend():
    assert resolve_linear_backend("torch", CPU, torch.float32) == "torch"
    assert resolve_linear_backend("auto", CPU, torch.float16) == "auto"
    assert resolve_linear_backend("auto", torch.device("cuda"), torch.float32) == "torch"
    assert resolve_linear_backend("transposed", torch.device("cuda"), torch.float16) == "transposed"
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        resolve_linear_backend("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        resolve_linear_backend("onednn", CPU, torch.float16)


@needs_onednn
@pytest.mark.parametrize("backend", ["torch", "onednn", "transposed"])
def test_a_forced_backend_is_honoured_without_measuring(backend, monkeypatch, calls):
    def refuse(*args, **kwargs):
        raise AssertionError("a forced linear_backend must not be measured")

    monkeypatch.setattr(linear_mod, "measure_linear_backends", refuse)
    model = make_tiny_model("qwen2", vocab_size=VOCAB)
    prompt = list(range(3, 40))
    ref = hf_greedy(model, prompt, 12)
    llm = LLM(model, linear_backend=backend, log_stats_interval=None)
    assert llm.llm_engine.linear_backend == backend
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls.clear()
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert {name for name, _, _ in calls} == {backend} and len(calls) == 12 * len(plain_linears(model))
    assert out[0].outputs[0].token_ids == ref
    assert all(type(m) is nn.Linear for m in plain_linears(model)) and plain_linears(model)
    assert hf_greedy(model, prompt, 12) == ref  # the model is the user's stock model again


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_auto_switching_library_by_rows_keeps_tokens_identical(arch, tmp_path, monkeypatch, calls):
    """A measured plan that runs each product through one of three libraries by its rows
    and layer: the engine's steps (prefill chunks of up to 32 tokens, decodes of 1-16
    requests, the vocabulary projection on the sampling rows) go through all three as
    the plan says, and every greedy token equals stock generate()'s."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(linear_mod, "measure_linear_backends", lambda m, b, **kw: fake_rates("transposed", "onednn"))
    model = make_tiny_model(arch, vocab_size=VOCAB)
    prompts, lengths = random_workload(16, VOCAB, seed=3, max_len=60, max_out=20)
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    llm = LLM(model, max_num_batched_tokens=32, log_stats_interval=None)
    plan = llm.llm_engine.linear_plan
    assert plan.layers.backends == ("transposed", "transposed", "onednn", "onednn", "onednn", "onednn")
    calls.clear()
    assert run_engine(llm, prompts, lengths) == refs
    for name, rows, out_features in calls:
        assert name == (plan.head if out_features == VOCAB else plan.layers).backend_for(rows)
    assert {name for name, _, _ in calls} == {"transposed", "onednn"}
    rows = [r for _, r, _ in calls]
    assert min(rows) <= 8 < max(rows)  # both sides of the switch were stepped through


def test_a_backend_that_cannot_run_here_is_not_a_candidate(monkeypatch):
    model = make_tiny_model("llama")

    def refuses(x, weight, bias):
        raise RuntimeError("could not create a primitive descriptor")

    monkeypatch.setitem(FORWARD, "onednn", refuses)
    rates = measure_linear_backends(model, ("torch", "onednn", "transposed"), budget_s=0.05, rounds=2)
    for by_rows in rates.values():
        for by_backend in by_rows.values():
            assert set(by_backend) == {"torch", "transposed"}
    assert "onednn" not in choose_backends(rates["layers"]).backends
