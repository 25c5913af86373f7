"""Small helpers shared by the Triton kernels; importing this module never imports triton.

Running Triton on a CPU: set ``TRITON_INTERPRET=1`` in the environment *before triton is
first imported* in the process, not just before the kernel modules. ``@triton.jit`` reads
the variable when it decorates a function, and triton's own ``tl.zeros``, ``tl.sum``,
``tl.cdiv`` ... are ``@triton.jit`` functions decorated when ``triton.language`` is
imported. Set too late, calls fail with "0 active drivers" (nothing interpreted) or
"Cannot call @triton.jit'd outside of the scope of a kernel" (our kernels interpreted,
triton's helpers not). ``tests/conftest.py`` and the first cell of notebook 05 set it;
the kernel modules check this on import and explain the fix.

The interpreter runs one program instance after another through NumPy, a few ms per
(program instance x loop iteration): keep shapes tiny. It also mishandles bfloat16 in
``tl.dot`` (triton-lang/triton#11584); ``paged_attention_v2`` works around that.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    """True when triton is installed (Linux wheels only).

    It looks for the package without importing it, so it is safe to call before deciding
    whether to set ``TRITON_INTERPRET=1``.
    """
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_interpreter_mode() -> None:
    """Raise a clear error if triton was imported before ``TRITON_INTERPRET=1`` was set."""
    import triton.language as tl

    built_for_interpreter = "Interpreted" in type(tl.zeros).__name__
    if interpreting() and not built_for_interpreter:
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton was imported, so triton's own tl.* "
            "helpers were built for a GPU and the interpreted kernels cannot call them. "
            "Set it before the first `import triton` (and before calling anything that "
            "imports triton), e.g. in the first notebook cell or in a fresh process."
        )


def check_device(tensor: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; CPU tensors need the interpreter."""
    if tensor.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"Triton kernels got a {tensor.device.type} tensor but TRITON_INTERPRET is not "
            "set: compiled kernels run on CUDA only. To run them on a CPU (slowly), set "
            "TRITON_INTERPRET=1 before the first `import triton`, or use the PyTorch "
            "reference (minivllm.kernels.reference)."
        )


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (``tl.arange`` lengths must be powers of two)."""
    return 1 << max(0, (n - 1).bit_length())
