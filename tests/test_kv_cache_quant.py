"""kv_cache_dtype="fp8" (minivllm.worker.kv_cache_quant): a cache of one byte per value
holds four times the float32 tokens in the same memory; both attention backends over it
compute attention over the rounded keys and values (the scales folded in, as
AttentionBackend.forward says); the engine's answers stay close to float32's and do not
depend on batching, preemption or the prefix cache; bad settings are refused by name."""

from __future__ import annotations

import pytest
import torch
from helpers import all_blocks_free, random_workload
from paged_batches import DEVICE, TOL, make_batch, mixed, sdpa_expected

from minivllm import LLM, SamplingParams
from minivllm.exceptions import ValidationError
from minivllm.worker.attention import AttentionMetadata, get_attn_backend
from minivllm.worker.kv_cache_quant import (
    FP8_DTYPES,
    KV_SCALE_HEADROOM,
    calibrate_kv_scales,
    quantize_kv,
)
from minivllm.worker.model_loader import make_tiny_model

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", seed=3, vocab_size=VOCAB)


def test_quantize_kv_rounds_within_the_format_and_clamps_instead_of_overflowing():
    x = torch.tensor([0.0, 1.0, -3.3, 1e3, -1e6])
    for name, mantissa_bits in (("fp8_e4m3", 3), ("fp8_e5m2", 2)):
        dtype = FP8_DTYPES[name]
        q = quantize_kv(x, 0.5, dtype).float() * 0.5
        half_step = 2.0 ** -(mantissa_bits + 1)  # the largest relative rounding error
        top = torch.finfo(dtype).max * 0.5
        assert q[0] == 0 and q[1] == 1.0 and abs(q[2] + 3.3) <= 3.3 * half_step
        assert q[4] == -top  # clamped to the range, not -inf
        assert q[3] == top if 1e3 > top else abs(q[3] - 1e3) <= 1e3 * half_step


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_backends_over_an_8_bit_cache_attend_over_the_rounded_values(backend, kv_cache_dtype):
    """A mixed batch (prefills, a chunk, decodes) whose context is in an fp8 cache and
    whose new keys and values go in through ``forward``: the output is float32 SDPA over
    the values the cache holds (rounded, times their scales), and near SDPA over the
    unrounded ones."""
    if backend == "triton":
        pytest.importorskip("triton")
    dtype = FP8_DTYPES[kv_cache_dtype]
    bs = 8
    q_lens, seq_lens = mixed(bs)
    b = make_batch(q_lens, seq_lens, 6, 2, 16, bs)
    k_scale, v_scale = 0.02, 0.01
    exact = sdpa_expected(b)
    b.keys = [quantize_kv(k, k_scale, dtype).float() * k_scale for k in b.keys]
    b.values = [quantize_kv(v, v_scale, dtype).float() * v_scale for v in b.values]
    key_cache, value_cache = quantize_kv(b.key_cache, k_scale, dtype), quantize_kv(b.value_cache, v_scale, dtype)
    slots, new_keys, new_values = [], [], []
    for s, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        pos = torch.arange(seq_len - q_len, seq_len, device=DEVICE)
        slots.append(b.block_tables[s, pos // bs].long() * bs + pos % bs)
        new_keys.append(b.keys[s][seq_len - q_len:])
        new_values.append(b.values[s][seq_len - q_len:])
    slot_mapping = torch.cat(slots)
    for cache in (key_cache, value_cache):  # the new tokens' slots hold NaN until written
        cache.view(torch.uint8).view(-1, *cache.shape[2:])[slot_mapping] = 0x7F  # NaN in both formats

    attn = get_attn_backend(backend, [(key_cache, value_cache)], torch.device(DEVICE),
                            kv_scales=[(k_scale, v_scale)])
    common = AttentionMetadata(slot_mapping, b.block_tables, b.query_start_loc, b.seq_lens)
    out = attn.forward(0, b.query, torch.cat(new_keys), torch.cat(new_values), attn.build_metadata(common), b.scale)
    stored = key_cache.view(-1, *key_cache.shape[2:])[slot_mapping].float() * k_scale
    assert torch.equal(stored, torch.cat(new_keys)), "the new keys are stored as they round"
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out, sdpa_expected(b), **TOL[torch.float32])
    # Against the unrounded values: off by about the format's step (values are N(0, 1)).
    err = (out - exact).abs().max().item()
    assert 0 < err < 4 * 2.0 ** -(3 if kv_cache_dtype == "fp8" else 2)


def test_an_fp8_cache_holds_four_times_the_float32_tokens(model):
    memory = 3 << 20
    fp32 = LLM(model, tokenizer=None, kv_cache_memory=memory, log_stats_interval=None)
    fp8 = LLM(model, tokenizer=None, kv_cache_memory=memory, kv_cache_dtype="fp8", log_stats_interval=None)
    assert fp32.llm_engine.kv_cache_dtype == torch.float32
    assert fp8.llm_engine.kv_cache_dtype == torch.float8_e4m3fn
    a, b = fp32.llm_engine.kv_cache_manager.num_blocks, fp8.llm_engine.kv_cache_manager.num_blocks
    assert b in (4 * a, 4 * a + 1, 4 * a + 2, 4 * a + 3)  # floor(4m / x) against 4 floor(m / x)
    cache = fp8.llm_engine.model_runner.kv_caches[0][0]
    assert cache.dtype == torch.float8_e4m3fn and cache.shape[0] == b


def test_calibrated_scales_put_the_largest_value_at_half_the_range(model):
    prompts = random_workload(3, VOCAB, seed=5, min_len=16, max_len=16)[0]
    quant = calibrate_kv_scales(model, "fp8", prompts)
    assert len(quant.scales) == model.config.num_hidden_layers and quant.calibration_tokens == 48
    seen = {}

    def record(module, args, kwargs, output):  # keys are rotated after k_proj, so check the
        seen[module] = max(seen.get(module, 0.0), output.abs().amax().item())  # values
    hooks = [layer.self_attn.v_proj.register_forward_hook(record, with_kwargs=True)
             for layer in model.model.layers]
    model.set_attn_implementation("sdpa")  # an earlier test's engine set its own
    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([p]))
    for h in hooks:
        h.remove()
    for (_, v_scale), layer in zip(quant.scales, model.model.layers):
        top = seen[layer.self_attn.v_proj] / v_scale
        assert top == pytest.approx(torch.finfo(torch.float8_e4m3fn).max / KV_SCALE_HEADROOM, rel=1e-5)


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[float]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [e[t].logprob for p, o in zip(prompts, outs) for t, e in zip(p[1:], o.prompt_logprobs[1:])]


def test_fp8_kv_cache_answers_stay_close_to_float32_and_every_block_comes_back(model):
    prompts = random_workload(6, VOCAB, seed=1, min_len=8, max_len=40)[0]
    fp32 = LLM(model, tokenizer=None, log_stats_interval=None)
    fp8 = LLM(model, tokenizer=None, kv_cache_dtype="fp8", log_stats_interval=None)
    diffs = [abs(x - y) for x, y in zip(prompt_logprobs(fp32, prompts), prompt_logprobs(fp8, prompts))]
    assert 0 < max(diffs) < 0.1  # rounding moves them a little: not zero, not large
    out = fp8.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)
    assert all_blocks_free(fp8)


def test_fp8_greedy_tokens_do_not_depend_on_batching_preemption_or_the_prefix_cache(model):
    """The scales are fixed at load and every token is rounded the same way wherever it
    is computed, so an 8-bit engine keeps the engine's invariants: a request alone, in a
    batch, recomputed after preemption, or reading a cached prefix gives the same tokens."""
    prompts, _ = random_workload(8, VOCAB, seed=4, min_len=20, max_len=60)
    shared = prompts[0][:32]
    prompts = [shared + p for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(batch=True, **kw):
        llm = LLM(model, tokenizer=None, kv_cache_dtype="fp8", log_stats_interval=None, **kw)
        if batch:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        else:
            outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        assert all_blocks_free(llm)
        return [o.outputs[0].token_ids for o in outs], llm

    alone, _ = run(batch=False, enable_prefix_caching=False)
    batched, _ = run(max_num_batched_tokens=48)
    tight, llm = run(num_kv_blocks=14, block_size=8)
    assert sum(len(s.preempted) for s in llm.trace.steps) > 0
    assert batched == alone and tight == alone


def test_bad_kv_cache_dtypes_are_refused_by_name(model):
    for bad in ("int4", "fp16", None, 8):
        with pytest.raises(ValidationError, match="kv_cache_dtype"):
            LLM(model, tokenizer=None, kv_cache_dtype=bad, log_stats_interval=None)
    with pytest.raises(ValidationError, match="kv_cache_dtype.*tensor parallel"):
        LLM(model, tokenizer=None, kv_cache_dtype="fp8", tensor_parallel_size=2, log_stats_interval=None)


def test_the_command_line_takes_kv_cache_dtype():
    from minivllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "fp8_e5m2"])
    assert args.kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "int4"])
