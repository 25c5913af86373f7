"""Compiling the model with torch.compile around one opaque attention op (notebook 11).

A step of the stock transformers model is a few hundred small PyTorch calls per layer
besides the matrix products: norms, rotary embeddings, reshapes, the activation, the
residual adds. Each costs the interpreter and a dispatch, a few microseconds, whatever
the batch. torch.compile (``compilation_config={"mode": 3}``) traces the model's forward
pass into a graph once, and inductor turns the graph into fused code: the elementwise
work of a layer becomes a few loops, the matrix products stay library calls.

What stops a plain ``torch.compile(model)`` is attention. The paged attention reads the
step's block tables and its :class:`~minivllm.kernels.reference.AttentionPlan`, Python
objects made anew each step; a graph can hold tensors and constants only, and a traced
function guards on the objects it is given, so every step would trace again. vLLM's
answer, followed here:

1. **One opaque op.** Attention is a custom operator, ``minivllm::unified_attention``
   (``torch.library.custom_op``): the tracer records it as a single node it does not look
   into, and the compiled code calls it as it is (vLLM: ``unified_attention`` in
   ``vllm/attention/layer.py``).
2. **A forward context.** The op finds the step's attention backend and metadata in a
   context the model runner sets around the call (:func:`forward_context`; vLLM:
   ``vllm/forward_context.py``). It is the one piece of state outside the arguments in
   minivllm, and exists only because a compiled graph cannot carry it; the eager path
   passes both as keyword arguments.
3. **Dynamic shapes, warmed up.** The number of tokens changes every step, so the model is
   compiled for a symbolic number of tokens, which torch.compile does for any size but
   0 and 1: exactly one token (a decode of one request) gets code of its own. The runner
   pads the logits rows it keeps to at least two, so that size never specialises, and
   :func:`warm_up` compiles both graphs when the engine starts (and logs how long), not
   in the first request's time. Inductor keeps what it built in its cache on disk
   (``TORCHINDUCTOR_CACHE_DIR``, by default under ``/tmp``), so a later start reuses it.

vLLM goes one step further on a GPU: it splits the graph at the attention ops
("piecewise") and captures the pieces between them as CUDA graphs for a list of batch
sizes (``cudagraph_capture_sizes``), padding each step to the next size, because there
the cost per kernel launch dominates small steps. A CPU has no graphs to capture; the
linear products stay the library calls inductor chooses (the measured ``linear_backend``
plan is an eager-mode tool, :mod:`minivllm.worker.linear`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from minivllm.config import CompilationConfig

if TYPE_CHECKING:
    from minivllm.worker.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger("minivllm")

_context = threading.local()


@contextmanager
def forward_context(backend: AttentionBackend, metadata: AttentionMetadata) -> Iterator[None]:
    """Within the block, :func:`unified_attention` attends with ``backend`` over this
    step's ``metadata``. Per thread: two engines stepping in two threads see their own."""
    _context.value = (backend, metadata)
    try:
        yield
    finally:
        _context.value = None


@torch.library.custom_op("minivllm::unified_attention", mutates_args=())
def unified_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                      scale: float) -> torch.Tensor:
    """One layer's paged attention, opaque to the compiler: writes the new keys and values
    into the cache and attends (:meth:`AttentionBackend.forward`). The cache it writes is
    not an argument, so the compiler never sees that write; the op's output, which the
    next layer reads, keeps the layers in order."""
    ctx = getattr(_context, "value", None)
    if ctx is None:
        raise RuntimeError("minivllm::unified_attention runs inside forward_context(backend, metadata): "
                           "call the compiled model through minivllm's ModelRunner")
    backend, metadata = ctx
    return backend.forward(layer_idx, query, key, value, metadata, scale)


@unified_attention.register_fake
def _(query, key, value, layer_idx, scale):
    """What the tracer needs to know: the output is shaped like the query."""
    return torch.empty_like(query)


GRAPHS_PER_PROCESS = 64
"""How many graphs of one model class's forward a process may hold (dynamo's
``recompile_limit``, 8 by default: every compiled engine adds two, so four engines of
different shapes in one program, a benchmark or a test session, would hit it)."""


def compile_model(model: torch.nn.Module, config: CompilationConfig):
    """The model's forward pass compiled for any number of tokens. ``fullgraph=True``:
    anything the tracer cannot put in the graph, or one graph too many, is an error at
    warm-up, not a silent fall back to eager code."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, GRAPHS_PER_PROCESS)
    return torch.compile(model, backend=config.backend, dynamic=True, fullgraph=True)


def warm_up(run, sizes: tuple[int, ...] = (1, 3)) -> float:
    """Compile before the first request: ``run(num_tokens)`` runs one forward pass of that
    many tokens (the runner's dummy step). One token and three cover the two graphs (three,
    not two: the runner keeps at least two logits rows, and equal sizes would be traced as
    one symbol). Returns the seconds it took."""
    t0 = time.perf_counter()
    for n in sizes:
        run(n)
    return time.perf_counter() - t0
