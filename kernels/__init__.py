"""Paged attention kernels, installed as ``minivllm.kernels``.

``reference.py`` is plain PyTorch (and the engine's CPU attention path); the Triton
kernels beside it are checked against it, in the order a reader meets them:
``triton_reshape_and_cache.py`` (KV store), ``paged_attention_v1.py`` (decode, one
program per query head), ``paged_attention_v2.py`` (unified, GQA-aware; the engine's
``attention_backend="triton"``), ``bench_paged_attention.py``. Those import triton, so
nothing here imports them: ``import minivllm.kernels`` works where triton is not
installed (``triton_utils.triton_available()`` tells). On a CPU, set
``TRITON_INTERPRET=1`` before triton is first imported (see ``triton_utils``).

The folder is not a top-level ``kernels`` package on purpose: Hugging Face publishes one
of that name, which transformers (from 5.25) depends on and imports. Python still finds
this folder as ``kernels`` when the repository root is on ``sys.path``, which it is for
any ``python -m ...`` or ``python -c ...`` started there; the lines below then step aside.
"""

import sys


def _step_aside() -> None:
    """Imported as top-level ``kernels`` (the repository root is on ``sys.path``), load the
    ``kernels`` package found on the rest of ``sys.path`` and put it in our place in
    ``sys.modules``: the import statement that got here returns that module, so
    ``from kernels import CUDAProperties`` in transformers gets Hugging Face's. Where no
    other ``kernels`` exists, stay a module without a ``__version__``, which transformers
    reads as "kernels not installed"."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != root]
    spec = PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _step_aside()
