"""The model's linear layers on a CPU, through oneDNN (README "Measured", notebook 01).

On a CPU almost every millisecond of a step is a matrix product with one of the model's
weight matrices: 7 per layer plus the vocabulary projection. ``nn.Linear`` sends them to
MKL's ``sgemm``. PyTorch also ships oneDNN, whose float32 products can be markedly
faster on a CPU: ``minivllm bench linear`` times all 210 decoder linear layers of SmolLM2
both ways, for 1, 32 and 512 rows, on your machine (the README's "Measured" section
shows what it found on the CPU this project is measured on). vLLM's CPU backend also
routes its linear layers through oneDNN.

Only the engine's forward pass uses it: :func:`onednn_linear` swaps the class of every
``nn.Linear`` to :class:`OneDNNLinear` for the duration of a ``with`` block and back
afterwards, so the weights stay where they are (no copy) and a plain ``model.generate()``
outside the engine still runs stock PyTorch. That matters: stock ``generate()`` is the
reference minivllm's greedy tokens are checked against.

oneDNN compiles a kernel the first time it sees a shape (about 0.5 ms per weight shape
and batch size, then cached; the cache holds 1,024 by default), so a step with a
never-seen token count pays a few milliseconds once.

The two libraries add up the same products in a different order, so logits differ in the
last bits (a few parts in a million in float32), the same kind of difference batching itself
makes; greedy tokens stay identical to ``generate()`` in the tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

LINEAR_BACKENDS = ("auto", "onednn", "torch")


def onednn_available() -> bool:
    """True where this PyTorch build has oneDNN and its linear op."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise  # noqa: B018 (looked up, not called)
    except (AttributeError, RuntimeError):
        return False
    return True


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` whose product runs in oneDNN (the op ``torch.compile`` uses on CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def resolve_linear_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto" picks oneDNN for float32/bfloat16 models on a CPU, stock PyTorch elsewhere."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    usable = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and onednn_available()
    if backend == "auto":
        return "onednn" if usable else "torch"
    if backend == "onednn" and not usable:
        raise ValueError(
            'linear_backend="onednn" needs a CPU device, a float32 or bfloat16 model and a '
            f"PyTorch build with oneDNN (device {device}, dtype {dtype}, oneDNN available: "
            f'{onednn_available()}); use linear_backend="torch"'
        )
    return backend


def plain_linears(model: nn.Module) -> list[nn.Linear]:
    """Every layer of ``model`` that is exactly ``nn.Linear`` (not a subclass with its own
    forward, such as a quantized layer)."""
    return [m for m in model.modules() if type(m) is nn.Linear]


@contextmanager
def onednn_linear(linears: list[nn.Linear]) -> Iterator[None]:
    """Within the block, ``linears`` compute through oneDNN; afterwards they are plain
    ``nn.Linear`` again (also when the block raises)."""
    for m in linears:
        m.__class__ = OneDNNLinear
    try:
        yield
    finally:
        for m in linears:
            m.__class__ = nn.Linear
