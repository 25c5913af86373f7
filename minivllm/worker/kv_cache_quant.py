"""An 8-bit KV cache: keys and values stored in one byte each (notebook 15).

Why: after the weights, the KV cache is what fills a serving engine's memory, and what
it holds decides how many requests run at once. In float32 a token of SmolLM2-135M
costs 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes = 46,080 bytes; in one byte
a quarter of that, so the same memory holds four times the tokens (twice, against a
16-bit cache: what vLLM's documentation promises).

How, with vLLM's names (``kv_cache_dtype="fp8"``, which is ``"fp8_e4m3"``, or
``"fp8_e5m2"``): an fp8 number keeps a sign, a few exponent bits and 3 (e4m3) or 2 (e5m2)
mantissa bits, so it rounds each value to about 6% (e4m3) of itself, whatever its size,
but only within a range (448 for e4m3). Each layer gets one scale for its keys and one
for its values (per tensor, as vLLM's ``k_scale`` / ``v_scale``): the cache stores
``k / k_scale``, and the scales are chosen so the largest key seen while reading a
little text at load (:func:`calibrate_kv_scales`) lands at half the range, leaving room
for larger ones; anything past the range is clamped to it, never turned into inf or NaN.

The scales never reach the kernels. Attention computes ``softmax(scale * q . k) v``; with
``k = k_scale * k8`` and ``v = v_scale * v8`` that is ``v_scale * softmax((scale *
k_scale) * q . k8) v8``: the key scale folds into the softmax scale and the value scale
multiplies the output, so every attention backend runs its usual code over the 8-bit
cache, converting each tile it loads to the query's dtype
(:meth:`minivllm.worker.attention.AttentionBackend.forward` does the folding, in one place).

Two things differ from vLLM's defaults: vLLM takes the scales from the checkpoint or
uses 1.0 unless ``calculate_kv_scales`` measures them on the first batch; here they are
always measured, at load, on fixed text, so a request's tokens never depend on which
request came first. And the rounding is done by PyTorch before the cache write, in the
Triton path too: Triton's interpreter rounds float-to-fp8 by truncating the mantissa
without carrying into the exponent (-1.87 became -1.0 in e5m2 in a test here), while
fp8-to-float, which the attention kernel does, is exact there.

In vLLM: ``--kv-cache-dtype`` (``vllm/config/cache.py``), the scales in
``vllm/model_executor/layers/quantization/kv_cache.py`` (``BaseKVCacheMethod``), and each
attention backend's cache write (``reshape_and_cache_flash`` with ``k_scale``, ``v_scale``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from minivllm.config import KV_CACHE_DTYPES
from minivllm.worker.quantization import run_prompts

FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""What each ``kv_cache_dtype`` other than "auto" stores (vLLM: "fp8" means e4m3)."""
KV_SCALE_HEADROOM = 2.0
"""The largest calibration value lands at the fp8 range divided by this."""
_CALIBRATION_ATTENTION = "minivllm_kv_calibration"


@dataclass(frozen=True)
class KVCacheQuantization:
    """An 8-bit cache's dtype and its per-layer scales (:func:`calibrate_kv_scales`)."""

    kv_cache_dtype: str
    """The setting as given ("fp8", "fp8_e4m3", "fp8_e5m2")."""
    dtype: torch.dtype
    scales: list[tuple[float, float]]
    """Per layer, (k_scale, v_scale): a cached value times its scale is the value."""
    calibration_tokens: int


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache is stored in: the model's for "auto"."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else FP8_DTYPES[kv_cache_dtype]


def check_kv_cache_dtype(kv_cache_dtype: str, tensor_parallel_size: int) -> None:
    """Refuse, with the reason, a combination this build cannot run (``ValueError``)."""
    if kv_cache_dtype != "auto" and tensor_parallel_size != 1:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not combined with tensor "
                         f"parallelism here (tensor_parallel_size={tensor_parallel_size}): the "
                         f"workers allocate their caches in the model's dtype; use one or the other")


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in ``dtype``, clamped to its range (e5m2 would give inf past it)."""
    limit = torch.finfo(dtype).max
    return (x / scale).clamp_(-limit, limit).to(dtype)


def calibrate_kv_scales(model: torch.nn.Module, kv_cache_dtype: str,
                        prompts: list[list[int]]) -> KVCacheQuantization:
    """Run ``prompts`` through the model as it is (stock SDPA attention, one prompt at a
    time), record each layer's largest ``|k|`` and ``|v|`` as attention receives them
    (keys after the rotary embedding: what the cache stores), and make the scales."""
    dtype = FP8_DTYPES[kv_cache_dtype]
    maxima: dict[int, list[float]] = {}

    def recording_attention(module, query, key, value, *args, **kwargs):
        seen = [float(key.detach().abs().amax()), float(value.detach().abs().amax())]
        old = maxima.get(module.layer_idx, [0.0, 0.0])
        maxima[module.layer_idx] = [max(a, b) for a, b in zip(old, seen)]
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(_CALIBRATION_ATTENTION, recording_attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(_CALIBRATION_ATTENTION)
    try:
        run_prompts(model, prompts)
    finally:
        model.set_attn_implementation(before)
    top = torch.finfo(dtype).max / KV_SCALE_HEADROOM
    scales = [tuple(max(m, 1e-6) / top for m in maxima[i]) for i in sorted(maxima)]
    return KVCacheQuantization(kv_cache_dtype, dtype, scales, sum(map(len, prompts)))
