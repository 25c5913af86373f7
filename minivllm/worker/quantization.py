"""Quantization: the linear layers' weights in 8 bits instead of 32 (notebook 15).

Why it pays: at batch 1 a decode step multiplies one row of activations by every weight
matrix of the model, so the step reads every weight once from memory and does two
floating-point operations per weight it reads. The CPU can compute far faster than its
memory can deliver float32 weights, so the step's time is roughly the weights' bytes
divided by the memory bandwidth. Store each weight in one byte instead of four and the
step reads a quarter of the bytes.

Why it is not free: a byte holds 256 values, so each number is rounded to the nearest of
255 evenly spaced levels. ``quantization="int8"`` here:

0. **smoothing, once, at load time** (SmoothQuant): the float model reads a little text
   (:func:`calibration_prompts`) while each linear layer's largest input per channel is
   recorded; each input channel j gets a factor ``s_j`` (:func:`smoothing_factors`), the
   weight's column j is multiplied by it and the activations' channel j will be divided
   by it, which leaves every product as it was but tames the few huge activation
   channels;
1. **weights, once, at load time**: each output row of a weight matrix gets its own
   scale, ``max |w| / 127`` over the row ("per channel", symmetric: zero stays exactly
   zero), and every weight of the row is stored as ``round(w / scale)``, an int8;
2. **activations, at every call** ("dynamic"): each token's row of activations gets its
   own scale the same way ("per token") and is rounded to int8 too;
3. the product runs in integers, int8 times int8 summed exactly in int32
   (``torch._int_mm``, PyTorch's integer matrix product), and each
   sum is multiplied back by its token's and its row's scale.

Every linear layer is converted, the vocabulary projection included (at batch 1 it is a
fifth of the model's weights); the embedding table stays float32, since a lookup reads
only the rows of the tokens it is given. The rounding moves the logits a little, so
greedy tokens can part from the float32 model's after a while:
``minivllm bench quantization`` measures by how much (perplexity, agreement, answers).

Why a scale per token and not one per call (what PyTorch's older dynamic quantization,
fbgemm's ``quantized.linear_dynamic``, does): measured once on SmolLM2-135M (a one-off
script; notebook 15 recomputes the per-layer error), one scale for all
the activations of a call raised the perplexity of standard-library docstrings from 18.0
to 31.0 (to 68.7 with the 7-bit activations fbgemm uses on CPUs without VNNI): in the
input of the MLP's last projection (``down_proj``) a few channels of a text's first token
run a thousand times larger than anything else (in one layer 3,389 times the typical
channel's largest value; notebook 15 draws it), so one scale for everything rounds every
other value to a handful of levels;
keeping ``down_proj`` in float32 alone brought it back to 23.7. A scale per token gave
18.7 (+4%), smoothing with it 18.3 (+2%), and the weights' rounding alone (float32
arithmetic on rounded weights) 18.0. A scale per token has a second
merit: a token's result does not depend on the other tokens in the batch (the integer
sums are exact), so a request's answer does not change with who else is being served.

Why 8-bit activations at all, not weight-only int8 (the weights in 8 bits, the arithmetic
in float32): PyTorch's weight-only CPU kernels (``torch._weight_int8pack_mm``,
``torch._weight_int4pack_mm_for_cpu``) measured slower than float32 on the machines here,
so they would save memory but cost speed (``minivllm bench quantization`` and the
quantization issue's closing note have the figures).

In vLLM: ``--quantization`` names a method (``fp8``, ``awq``, ``gptq``,
``compressed-tensors``, ``bitsandbytes``, ...); ``vllm/model_executor/layers/quantization/``
holds one module per method, each giving the linear layers a ``QuantizeMethodBase`` that
creates the weights and runs ``apply``. This one is what vLLM calls W8A8 int8 with
per-channel weight scales and dynamic per-token activation scales (compressed-tensors'
``W8A8`` scheme), which vLLM's CPU backend also runs on oneDNN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minivllm.config import QUANTIZATION_METHODS


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8 with one scale per output row, multiplied by
    activations quantized to int8 with one scale per token, at each call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 smoothing: torch.Tensor | None = None) -> None:
        """``smoothing``: one factor per input channel, multiplied into the weight's
        columns and divided out of the activations at each call (:func:`smoothing_factors`)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        if smoothing is not None:
            w = w * smoothing  # (x / s) @ (W * s).T is x @ W.T
        self.register_buffer("input_scale", None if smoothing is None else 1 / smoothing)
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # one per output row
        self.register_buffer("weight_scale", scale)
        # Stored [in, out] as _int_mm takes it (a transposed view of the row-major int8 matrix).
        self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8).t())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def from_linear(cls, linear: nn.Linear, smoothing: torch.Tensor | None = None) -> Int8Linear:
        return cls(linear.weight, linear.bias, smoothing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.input_scale is not None:
            rows = rows * self.input_scale
        # Each token its own scale: one token's outlier cannot coarsen another's rounding,
        # and a row's result does not depend on what else is in the batch.
        x_scale = (rows.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        xq = torch.round(rows / x_scale).to(torch.int8)
        acc = torch._int_mm(xq, self.qweight)  # int8 x int8, summed exactly in int32
        out = acc.float() * x_scale * self.weight_scale
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes the layer's weight occupies: one per weight, a float32 scale per row and,
        when smoothed, a float32 factor per input channel."""
        smoothed = 0 if self.input_scale is None else 4 * self.in_features
        return self.out_features * self.in_features + 4 * self.out_features + smoothed

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


@dataclass(frozen=True)
class QuantizationReport:
    """What :func:`quantize_model` converted, and the weight bytes before and after."""

    method: str
    layers: int
    bytes_before: int
    bytes_after: int
    calibration_tokens: int = 0
    """Tokens run through the float model to measure the activations (0: not smoothed)."""

    def describe(self) -> str:
        """One line for the engine's start-up log."""
        return (f"Quantization {self.method}: {self.layers} linear layers, "
                f"{self.bytes_before / 2**20:.0f} -> {self.bytes_after / 2**20:.0f} MiB, smoothed by "
                f"activations of {self.calibration_tokens} calibration tokens.")


def check_quantization(method: str | None, device: torch.device, dtype: torch.dtype,
                       tensor_parallel_size: int = 1) -> None:
    """Refuse, with the reason, a setting this build cannot run (raises ``ValueError``)."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {method!r}")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"quantization={method!r} is written and measured for the CPU: it needs "
            f"device 'cpu' and dtype 'float32' (got device {device}, dtype {dtype}); on a GPU, "
            f"use bfloat16 or float16 weights instead")
    if tensor_parallel_size != 1:
        raise ValueError(f"quantization={method!r} is not combined with tensor parallelism here "
                         f"(tensor_parallel_size={tensor_parallel_size}): the sharding slices float "
                         f"weights; use one or the other")
    try:  # the integer product this build has on this CPU, tried once on a tiny example
        torch._int_mm(torch.ones(1, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8))
    except (RuntimeError, NotImplementedError) as e:
        raise ValueError(f"quantization={method!r} needs torch._int_mm (int8 x int8 -> int32) on "
                         f"the CPU, which this PyTorch build lacks: {e}") from None


SMOOTHING_ALPHA = 0.5
"""How much of the activations' range moves into the weights (SmoothQuant's alpha: 0 none, 1 all)."""


def calibration_prompts(tokenizer, vocab_size: int, n: int = 8, length: int = 128) -> list[list[int]]:
    """What the activations are measured on: ``n`` pieces of ``length`` tokens of Python's
    own help topics (``pydoc_data``; not the standard-library docstrings that ``bench
    quantization`` scores perplexity on), or seeded random tokens for a model without a
    tokenizer."""
    if tokenizer is None:
        rng = torch.Generator().manual_seed(0)
        return torch.randint(vocab_size, (n, length), generator=rng).tolist()
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)
    step = max(length, len(ids) // n)
    return [ids[i * step:i * step + length] for i in range(n) if len(ids) >= i * step + length]


def activation_maxima(model: nn.Module, prompts: list[list[int]]) -> dict[nn.Linear, torch.Tensor]:
    """Each linear layer's largest ``|x|`` per input channel over the prompts (the float
    model run as it is, one prompt at a time)."""
    maxima: dict[nn.Linear, torch.Tensor] = {}

    def record(layer: nn.Linear, args: tuple, _output: torch.Tensor) -> None:
        seen = args[0].detach().reshape(-1, layer.in_features).abs().amax(dim=0).float()
        maxima[layer] = seen if layer not in maxima else torch.maximum(maxima[layer], seen)

    hooks = [m.register_forward_hook(record) for m in model.modules() if type(m) is nn.Linear]
    try:
        run_prompts(model, prompts)
    finally:
        for h in hooks:
            h.remove()
    return maxima


def run_prompts(model: nn.Module, prompts: list[list[int]]) -> None:
    """Run each prompt through the model as it is, one at a time, for what the caller's
    hooks record (the int8 smoothing here, the KV cache's scales in kv_cache_quant)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids], device=device))


def smoothing_factors(x_max: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel factor ``s = max|x|^alpha / max|w|^(1 - alpha)``.

    Dividing channel j of the activations by s_j and multiplying column j of the weight
    by it leaves the product unchanged, but moves range from the activations, where a few
    channels are huge, into the weight, where every channel is alike: after it, both are
    rounded to 8 bits with less error (Xiao et al., 2023)."""
    w_max = weight.detach().abs().amax(dim=0).float().clamp(min=1e-5)
    return (x_max.clamp(min=1e-5) ** alpha / w_max ** (1 - alpha)).clamp(min=1e-5)


def quantize_model(model: nn.Module, method: str, calibration: list[list[int]] | None = None) -> QuantizationReport:
    """Replace every ``nn.Linear`` of ``model`` in place with its quantized form, smoothed
    by activations measured on ``calibration`` (token id lists) when given.

    The float32 weights of the replaced layers are dropped (a tied vocabulary projection's
    weight lives on in the embedding table, which stays float32)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}")
    maxima = activation_maxima(model, calibration) if calibration else {}
    before = after = layers = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            smoothing = smoothing_factors(maxima[child], child.weight) if child in maxima else None
            quantized = Int8Linear.from_linear(child, smoothing)
            before += child.weight.numel() * child.weight.element_size()
            after += quantized.weight_bytes()
            layers += 1
            setattr(parent, name, quantized)
    tokens = sum(map(len, calibration)) if calibration else 0
    return QuantizationReport(method, layers, before, after, tokens)
