"""Which library computes each of the model's linear products, and how the engine swaps it in.

On a CPU almost every millisecond of a step is a product ``x @ W.T`` with one of the
model's weight matrices, and PyTorch ships more than one way to compute it
(:data:`FORWARD`):

- ``"torch"``: ``nn.Linear`` as it is (``F.linear``, MKL's ``sgemm`` on x86);
- ``"onednn"``: oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the op
  ``torch.compile`` uses on a CPU, and vLLM's CPU backend's choice);
- ``"transposed"``: ``(W @ x.T).T``, the same dot products with the weight as the left
  operand, which sends MKL down another kernel.

A :class:`LinearPlan` says which of them runs a product, by its number of rows (a
:class:`LinearChoice` for the decoder's layers, one for the vocabulary projection); how a
plan is chosen by measuring is :mod:`minivllm.worker.linear` and :mod:`minivllm.worker.linear_autotune`.

Why the plan is applied by swapping the layers' class (:func:`planned_linear`) and not by
replacing the layers: the weights stay where they are (no copy), and outside the
engine's ``with`` block the model is stock PyTorch again, so a plain
``model.generate()`` (the reference minivllm's greedy tokens are checked against) never
runs through a plan.

In vLLM: ``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.config import LINEAR_BACKENDS


def onednn_available() -> bool:
    """True where this PyTorch build has oneDNN and its linear op."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise  # noqa: B018 (looked up, not called)
    except (AttributeError, RuntimeError):
        return False
    return True


def onednn_rows(rows: int) -> int:
    """The row count oneDNN is called with for ``rows``: up to 15 as they are, above that
    rounded up to one of eight sizes per doubling (16, 18, ..., 30, 32, 36, ..., 60, 64,
    72, ...), so at most 1/8 of the rows are padding."""
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step


def onednn_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through oneDNN, with the dense weight as it is (no packing, no copy).

    oneDNN builds a "primitive" for each shape it is called with and caches it (up to
    1,024, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), and each one keeps a buffer about the
    size of its output: a server that saw every row count from 1 to 512 would hold
    gigabytes of them. So the rows are padded with zeros to :func:`onednn_rows`: a few
    dozen shapes per weight, memory that stops growing once they are all built, and fewer
    builds (about 0.5 ms each). vLLM pads a step's batch to a few sizes for the same
    reason: a CUDA graph is captured for each size it can replay."""
    rows = x.numel() // x.shape[-1]
    padded = onednn_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    x2 = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], weight.shape[0])


def transposed_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` computed as ``(W @ x.T).T``: the same dot products with the weight as
    the left operand, which sends MKL down another kernel; with few rows it streams the
    weight better on some CPUs. The result is made contiguous, as ``nn.Linear``'s is."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.mm(weight, x2.t()) if bias is None else torch.addmm(bias[:, None], weight, x2.t())
    return out.t().contiguous().view(*x.shape[:-1], weight.shape[0])


FORWARD: dict[str, Callable] = {"torch": F.linear, "onednn": onednn_forward, "transposed": transposed_forward}


@dataclass(frozen=True)
class LinearChoice:
    """Which library computes a product, by its number of rows: the one chosen at the
    nearest (on a log scale) of ``rows``."""

    rows: tuple[int, ...]
    backends: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.backends) or not self.rows or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"a LinearChoice needs ascending distinct rows, one backend each: {self}")
        if unknown := set(self.backends) - set(FORWARD):
            raise ValueError(f"unknown linear backends {sorted(unknown)}; choose from {sorted(FORWARD)}")

    def backend_for(self, rows: int) -> str:
        for i in range(len(self.rows) - 1):
            if rows * rows <= self.rows[i] * self.rows[i + 1]:  # rows <= the geometric midpoint
                return self.backends[i]
        return self.backends[-1]

    @property
    def name(self) -> str:
        """The library when one serves every row count, else which serves which rows."""
        if len(set(self.backends)) == 1:
            return self.backends[0]
        parts, start = [], 1
        for i, b in enumerate(self.backends):
            end = math.isqrt(self.rows[i] * self.rows[i + 1]) if i + 1 < len(self.rows) else None
            if parts and parts[-1][0] == b:
                parts[-1][2] = end
            else:
                parts.append([b, start, end])
            start = (end or 0) + 1
        return ", ".join(f"{b} {lo}-{hi} rows" if hi else f"{b} {lo}+ rows" for b, lo, hi in parts)


@dataclass(frozen=True)
class LinearPlan:
    """The choice for the decoder's linear layers and the one for the vocabulary
    projection (``head``): one huge matrix that only sees the sampling rows, and whose
    best library can differ (on one AMD EPYC oneDNN ran it 2x faster at 32 rows while the
    decoder's layers were a tie)."""

    layers: LinearChoice
    head: LinearChoice

    @classmethod
    def single(cls, backend: str) -> LinearPlan:
        one = LinearChoice((1,), (backend,))
        return cls(one, one)

    @property
    def name(self) -> str:
        """"onednn", "torch" or "transposed" when one library serves every product, else
        which serves which."""
        if self.layers.name == self.head.name:
            return self.layers.name
        return f"layers: {self.layers.name}; vocabulary projection: {self.head.name}"

    def assign(self, model: nn.Module) -> list[tuple[nn.Linear, LinearChoice]]:
        """Every plain linear layer of ``model`` with the choice it runs by."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return [(m, self.head if m is head else self.layers) for m in plain_linears(model)]


STOCK_PLAN = LinearPlan.single("torch")
"""Every product through ``nn.Linear`` as it is (``linear_backend="torch"``)."""


class PlannedLinear(nn.Linear):
    """``nn.Linear`` that runs each call through the library its :class:`LinearChoice`
    names for that many rows (the choice rides on the layer while it is swapped in)."""

    linear_choice: LinearChoice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return FORWARD[self.linear_choice.backend_for(rows)](x, self.weight, self.bias)


def plain_linears(model: nn.Module) -> list[nn.Linear]:
    """Every layer of ``model`` that is exactly ``nn.Linear`` (not a subclass with its own
    forward, such as a quantized layer)."""
    return [m for m in model.modules() if type(m) is nn.Linear]


@contextmanager
def planned_linear(assigned: list[tuple[nn.Linear, LinearChoice]]) -> Iterator[None]:
    """Within the block, each layer computes as its choice says (:meth:`LinearPlan.assign`);
    afterwards they are plain ``nn.Linear`` again (also when the block raises). Layers
    whose choice is "torch" throughout are left alone."""
    swapped = [(m, c) for m, c in assigned if set(c.backends) != {"torch"}]
    for m, c in swapped:
        m.__class__ = PlannedLinear
        m.linear_choice = c
    try:
        yield
    finally:
        for m, _ in swapped:
            m.__class__ = nn.Linear
            del m.linear_choice


def resolve_linear_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Check the setting before anything is loaded. "auto" stays "auto" on a CPU (measured
    once the model is loaded, :func:`choose_linear_plan`); elsewhere it is "torch"."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "auto" if device.type == "cpu" else "torch"
    if backend == "onednn" and not onednn_usable(device, dtype):
        raise ValueError(
            'linear_backend="onednn" needs a CPU device, a float32 or bfloat16 model and a '
            f"PyTorch build with oneDNN (device {device}, dtype {dtype}, oneDNN available: "
            f'{onednn_available()}); use linear_backend="torch"'
        )
    return backend


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and onednn_available()


def candidate_backends(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """What "auto" measures: the stock path first (it wins ties), then the others that run here."""
    return ("torch", "onednn", "transposed") if onednn_usable(device, dtype) else ("torch", "transposed")
