"""The model's linear layers on a CPU: two libraries, chosen by measuring (notebook 01).

On a CPU almost every millisecond of a step is a matrix product with one of the model's
weight matrices: 7 per layer plus the vocabulary projection. ``nn.Linear`` sends them to
MKL's ``sgemm``. PyTorch also ships oneDNN (``torch.ops.mkldnn._linear_pointwise``, the op
``torch.compile`` uses on a CPU, and vLLM's CPU backend's choice). Which one is faster
depends on the CPU and on how many rows the product has: on one AMD EPYC oneDNN was up to
twice as fast at every row count; on an Intel Xeon it was 0.4x at 1 and 32 rows and 1.6x
at 512. No fixed rule is right everywhere, so ``linear_backend="auto"`` measures, as
``torch.backends.cudnn.benchmark`` and Triton's autotuner do:

1. for a few row counts a step can have (:data:`BUCKET_ROWS`: one decode up to a full
   512-token prefill), run the model's own linear layers, in model order so that weights
   come from memory as in a real step, through each library for a short slice of time,
   a few times over, alternating which goes first;
2. per row count, keep the faster (:func:`choose_backends`); the result is a
   :class:`LinearPlan`, and during a step every layer looks at the rows it was given and
   runs through the library that won nearest that row count;
3. store the plan on disk (``$MINIVLLM_CACHE/linear_plans.json``), keyed by what the
   answer depends on (:func:`plan_cache_key`: CPU, torch version, threads, model shapes,
   dtype), so later starts pay nothing. Delete the file to measure again.

``minivllm bench linear`` shows the two libraries on your CPU; ``minivllm bench
roofline`` how close the engine gets to the machine's own limit.

Only the engine's forward pass uses the plan: :func:`planned_linear` swaps the class of
every ``nn.Linear`` for the duration of a ``with`` block and back afterwards, so weights
stay where they are (no copy) and a plain ``model.generate()`` outside the engine still
runs stock PyTorch: the reference minivllm's greedy tokens are checked against. The two
libraries add up the same products in a different order, so logits differ in the last
bits (a few parts in a million in float32), the same kind of difference batching itself
makes; greedy tokens stay identical to ``generate()`` in the tests, with either library
and with a plan that switches between them by row count.

oneDNN compiles a kernel the first time it sees a shape (about 0.5 ms per weight shape
and row count, then cached; the cache holds 1,024 by default), so a step with a
never-seen token count pays a few milliseconds once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("minivllm")

LINEAR_BACKENDS = ("auto", "onednn", "torch")
BUCKET_ROWS = (1, 4, 16, 64, 256, 512)
"""Row counts "auto" measures: decode steps of 1 to a few dozen requests, mixed steps,
and a full 512-token prefill. A product of ``r`` rows uses the choice made at the
nearest of these on a log scale (so 3-8 rows use 4's, and anything above 362 uses 512's)."""
PLAN_FILE = "linear_plans.json"


def onednn_available() -> bool:
    """True where this PyTorch build has oneDNN and its linear op."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise  # noqa: B018 (looked up, not called)
    except (AttributeError, RuntimeError):
        return False
    return True


def onednn_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through oneDNN, with the dense weight as it is (no packing, no copy)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


FORWARD: dict[str, Callable] = {"torch": F.linear, "onednn": onednn_forward}


@dataclass(frozen=True)
class LinearPlan:
    """Which library computes a product, by its number of rows: the one chosen at the
    nearest (on a log scale) of ``rows``."""

    rows: tuple[int, ...]
    backends: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.backends) or not self.rows or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"a LinearPlan needs ascending distinct rows, one backend each: {self}")
        if unknown := set(self.backends) - set(FORWARD):
            raise ValueError(f"unknown linear backends {sorted(unknown)}; choose from {sorted(FORWARD)}")

    @classmethod
    def single(cls, backend: str) -> LinearPlan:
        return cls((1,), (backend,))

    def backend_for(self, rows: int) -> str:
        for i in range(len(self.rows) - 1):
            if rows * rows <= self.rows[i] * self.rows[i + 1]:  # rows <= the geometric midpoint
                return self.backends[i]
        return self.backends[-1]

    @property
    def name(self) -> str:
        """"onednn" or "torch" when one library serves every row count, else which serves which."""
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


STOCK_PLAN = LinearPlan.single("torch")
"""Every product through ``nn.Linear`` as it is (``linear_backend="torch"``)."""


class PlannedLinear(nn.Linear):
    """``nn.Linear`` that runs each call through the library its :class:`LinearPlan`
    chose for that many rows (the plan rides on the layer while it is swapped in)."""

    linear_plan: LinearPlan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return FORWARD[self.linear_plan.backend_for(rows)](x, self.weight, self.bias)


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` whose product always runs in oneDNN (a plan with one choice)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_forward(x, self.weight, self.bias)


def plain_linears(model: nn.Module) -> list[nn.Linear]:
    """Every layer of ``model`` that is exactly ``nn.Linear`` (not a subclass with its own
    forward, such as a quantized layer)."""
    return [m for m in model.modules() if type(m) is nn.Linear]


@contextmanager
def planned_linear(linears: list[nn.Linear], plan: LinearPlan) -> Iterator[None]:
    """Within the block, ``linears`` compute as ``plan`` says; afterwards they are plain
    ``nn.Linear`` again (also when the block raises). A plan with one library swaps in a
    class that skips the per-call lookup; an all-"torch" plan changes nothing."""
    kinds = set(plan.backends)
    if kinds == {"torch"}:
        yield
        return
    cls = OneDNNLinear if kinds == {"onednn"} else PlannedLinear
    for m in linears:
        m.__class__ = cls
        if cls is PlannedLinear:
            m.linear_plan = plan
    try:
        yield
    finally:
        for m in linears:
            m.__class__ = nn.Linear
            m.__dict__.pop("linear_plan", None)


def onednn_linear(linears: list[nn.Linear]):
    """Within the block, ``linears`` compute through oneDNN (``planned_linear`` with one choice)."""
    return planned_linear(linears, LinearPlan.single("onednn"))


def resolve_linear_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Check the setting before anything is loaded. "auto" stays "auto" (measured once the
    model is loaded, :func:`choose_linear_plan`) where oneDNN can run, else it is "torch"."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    usable = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and onednn_available()
    if backend == "auto":
        return "auto" if usable else "torch"
    if backend == "onednn" and not usable:
        raise ValueError(
            'linear_backend="onednn" needs a CPU device, a float32 or bfloat16 model and a '
            f"PyTorch build with oneDNN (device {device}, dtype {dtype}, oneDNN available: "
            f'{onednn_available()}); use linear_backend="torch"'
        )
    return backend


# -- measuring ----------------------------------------------------------------------------

def cpu_description() -> dict[str, str]:
    """The CPU as the OS names it, and a digest of its instruction-set flags (two CPUs
    sold under one name, e.g. "AMD EPYC" in a virtual machine, can differ in AVX-512)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "flags") and key not in info:
                    info[key] = value.strip()
    except OSError:
        pass
    flags = info.pop("flags", "")
    name = info.pop("model name", "") or platform.processor() or platform.machine()
    detail = " ".join(f"{k} {v}" for k, v in sorted(info.items()))
    return {"cpu": f"{name} ({detail})" if detail else name,
            "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:12]}


def plan_cache_key(model: nn.Module, dtype: torch.dtype) -> dict:
    """Everything the measured answer depends on: the CPU, the torch build (its MKL and
    oneDNN), the threads it may use, the model (its name and the shapes of its linear
    layers) and the dtype."""
    shapes: dict[str, int] = {}
    for m in plain_linears(model):
        key = f"{m.in_features}x{m.out_features}"
        shapes[key] = shapes.get(key, 0) + 1
    config = getattr(model, "config", None)
    return {
        **cpu_description(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": getattr(config, "name_or_path", "") or type(model).__name__,
        "linear_shapes": dict(sorted(shapes.items())),
        "dtype": str(dtype).removeprefix("torch."),
        "rows": list(BUCKET_ROWS),
    }


@torch.inference_mode()
def measure_linear_backends(
    model: nn.Module,
    rows: Sequence[int] = BUCKET_ROWS,
    budget_s: float = 1.2,
    rounds: int = 3,
    backends: Sequence[str] = ("torch", "onednn"),
    max_head_rows: int = 64,
) -> dict[int, dict[str, list[float]]]:
    """FLOP/s of each backend at each row count, ``rounds`` samples each, in about
    ``budget_s`` seconds (plus a warm-up call per weight shape, which compiles oneDNN's
    kernels outside the timings).

    Each sample walks the model's linear layers in model order, continuing where the
    previous sample stopped, for ``budget_s / (len(rows) * len(backends) * rounds)``
    seconds or one pass over the model, whichever is shorter: the weights come from
    memory, as in a real step (the whole model is far larger than the CPU's caches), and
    the two backends read the same kind of weights. The vocabulary projection is walked
    only for up to ``max_head_rows`` rows (it only ever sees the sampling rows)."""
    linears = plain_linears(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    dtype = next(model.parameters()).dtype
    slice_s = budget_s / (len(rows) * len(backends) * rounds)
    rates: dict[int, dict[str, list[float]]] = {}
    cursor = 0
    for n in rows:
        walk = [m for m in linears if n <= max_head_rows or m is not head]
        inputs = {f: torch.randn(n, f, dtype=dtype) for f in {m.in_features for m in walk}}
        first = {(m.in_features, m.out_features): m for m in walk}
        for b in backends:  # warm-up: oneDNN builds a kernel per (shape, rows)
            for m in first.values():
                FORWARD[b](inputs[m.in_features], m.weight, m.bias)
        rates[n] = {b: [] for b in backends}
        for r in range(rounds):
            for b in backends[::-1] if r % 2 else backends:  # alternate who goes first
                fn, flops, t0 = FORWARD[b], 0, time.perf_counter()
                for i in range(len(walk)):
                    m = walk[(cursor + i) % len(walk)]
                    fn(inputs[m.in_features], m.weight, m.bias)
                    flops += 2 * n * m.in_features * m.out_features
                    if time.perf_counter() - t0 >= slice_s:
                        break
                cursor += i + 1
                rates[n][b].append(flops / (time.perf_counter() - t0))
    return rates


def choose_backends(rates: dict[int, dict[str, list[float]]], margin: float = 0.02,
                    default: str = "torch") -> LinearPlan:
    """Per row count, the backend with the highest median rate; the ``default`` (the
    stock path) keeps a row count unless another beats it by more than ``margin``, the
    size of a difference a short measurement cannot tell from noise."""
    rows = sorted(rates)
    chosen = []
    for n in rows:
        med = {b: statistics.median(v) for b, v in rates[n].items()}
        best = max(med, key=med.get)
        keep = default in med and med[best] <= med[default] * (1 + margin)
        chosen.append(default if keep else best)
    return LinearPlan(tuple(rows), tuple(chosen))


def _load_plans(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def choose_linear_plan(backend: str, model: nn.Module, cache_dir: Path | None = None,
                       budget_s: float = 1.2) -> LinearPlan:
    """The plan for a resolved ``linear_backend`` (:func:`resolve_linear_backend`):
    "torch" and "onednn" are taken as given; "auto" is looked up in the cache under
    ``cache_dir`` (default ``$MINIVLLM_CACHE``) or measured and stored there."""
    if backend != "auto":
        return LinearPlan.single(backend)
    from minivllm.model_loader import cache_root

    dtype = next(model.parameters()).dtype
    key = plan_cache_key(model, dtype)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = (cache_dir or cache_root()) / PLAN_FILE
    entry = _load_plans(path).get(digest)
    if entry is not None:
        plan = LinearPlan(tuple(entry["rows"]), tuple(entry["backends"]))
        logger.info("linear_backend auto: %s (measured %s, cached in %s)", plan.name, entry["measured"], path)
        return plan
    t0 = time.perf_counter()
    rates = measure_linear_backends(model, budget_s=budget_s)
    seconds = time.perf_counter() - t0
    plan = choose_backends(rates)
    table = "; ".join(f"{n} rows " + " ".join(f"{b} {statistics.median(v) / 1e9:.1f}" for b, v in r.items())
                      for n, r in rates.items())
    logger.info("linear_backend auto: measured in %.2f s, GFLOP/s (median of %d): %s. Chose: %s. Cached in %s",
                seconds, len(next(iter(rates[BUCKET_ROWS[0]].values()))), table, plan.name, path)
    entry = {"key": key, "rows": list(plan.rows), "backends": list(plan.backends), "seconds": round(seconds, 3),
             "gflops": {n: {b: [round(x / 1e9, 2) for x in v] for b, v in r.items()} for n, r in rates.items()},
             "measured": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:  # write a whole new file, then rename: a reader never sees half of one
        path.parent.mkdir(parents=True, exist_ok=True)
        plans = {**_load_plans(path), digest: entry}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(plans, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("linear_backend auto: could not cache the plan in %s (%s); it is measured again next start",
                       path, e)
    return plan
