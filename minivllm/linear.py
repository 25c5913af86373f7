"""The model's linear layers on a CPU: three ways to multiply, chosen by measuring (notebook 01).

On a CPU almost every millisecond of a step is a matrix product with one of the model's
weight matrices: 7 per layer plus the vocabulary projection. There is more than one way
to compute ``x @ W.T`` with what PyTorch ships (:data:`FORWARD`):

- ``"torch"``: ``nn.Linear`` as it is (``F.linear``, MKL's ``sgemm`` on x86);
- ``"onednn"``: oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the op
  ``torch.compile`` uses on a CPU, and vLLM's CPU backend's choice);
- ``"transposed"``: ``(W @ x.T).T``, the same dot products with the weight as the left
  operand, which sends MKL down another kernel.

Which is fastest depends on the CPU and on how many rows the product has: on one AMD EPYC
oneDNN was up to twice as fast at every row count; on an Intel Xeon it was 0.4x at 1 and
32 rows and 1.6x at 512; on another AMD EPYC the transposed form was the fastest for a
few dozen rows. No fixed rule is right everywhere, so ``linear_backend="auto"`` measures,
as ``torch.backends.cudnn.benchmark`` and Triton's autotuner do
(:func:`measure_linear_backends`):

1. for a few row counts a step can have (:data:`BUCKET_ROWS`: one decode up to a full
   512-token prefill), run the model's own decoder layers, in model order so that
   weights come from memory as in a real step, through each candidate for a short slice
   of time, a few times over, each candidate going first in turn; the vocabulary
   projection, one huge matrix that only sees the sampling rows, is timed on its own;
2. per row count, keep the library that was fastest against the others in the same
   rounds (:func:`choose_backends`): a :class:`LinearPlan`.
   During a step every layer looks at the rows it was given and runs through the
   library chosen nearest that row count;
3. store the plan on disk (``$MINIVLLM_CACHE/linear_plans.json``), keyed by what the
   answer depends on (:func:`plan_cache_key`: CPU, torch version, threads, model shapes,
   dtype), so later starts pay nothing. The measurement takes a second or two, and what
   was measured and chosen goes to the ``minivllm`` logger. A measurement that another
   program disturbed (:func:`noisy`) is taken again, and used but not cached if it stays
   noisy. Delete the file to measure again.

``minivllm bench linear`` shows the libraries on your CPU; ``minivllm bench roofline``
how close the engine gets to the machine's own limit.

Only the engine's forward pass uses the plan: :func:`planned_linear` swaps the class of
the layers for the duration of a ``with`` block and back afterwards, so weights stay
where they are (no copy) and a plain ``model.generate()`` outside the engine still runs
stock PyTorch: the reference minivllm's greedy tokens are checked against. The libraries
add up the same products in a different order, so logits differ in the last bits (a few
parts in a million in float32), the same kind of difference batching itself makes;
greedy tokens stay identical to ``generate()`` in the tests, with each library and with
a plan that switches between them by row count.

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

from minivllm.config import LINEAR_BACKENDS

logger = logging.getLogger("minivllm")

BUCKET_ROWS = (1, 4, 16, 64, 256, 512)
"""Row counts "auto" measures the decoder's linear layers at: decode steps of 1 to a few
dozen requests, mixed steps, a full 512-token prefill. A product of ``r`` rows uses the
choice made at the nearest of these on a log scale (3-8 rows use 4's, above 362 512's)."""
HEAD_ROWS = (1, 8, 64)
"""Row counts the vocabulary projection is measured at: it only ever sees the rows that
sample, one per request in the step."""
PLAN_FILE = "linear_plans.json"
MEASUREMENT_METHOD = 2
"""Part of the cache key: plans measured by an earlier way of measuring are not reused."""


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
    layers), the dtype, and what is measured (row counts, candidates, the method)."""
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
        "rows": {"layers": list(BUCKET_ROWS), "head": list(HEAD_ROWS)},
        "candidates": list(candidate_backends(torch.device("cpu"), dtype)),
        "method": MEASUREMENT_METHOD,
    }


Rates = dict[int, dict[str, list[float]]]
"""Row count -> backend -> FLOP/s samples."""

NOISE = 1.0
"""A measurement in which one backend's fastest sample is more than twice its median was
disturbed by another program (a round-to-round spread of 10-50% is usual on a shared
virtual machine, and the paired comparison absorbs it): it is measured again, and not
cached if it stays that noisy."""


def _rates(weights: list[tuple[torch.Tensor, torch.Tensor | None]], rows: Sequence[int],
           backends: Sequence[str], rounds: int, slice_s: float, group: int = 1) -> Rates:
    """Each sample walks ``weights`` in order, continuing where the previous stopped
    (round and round for a small model), for at least ``slice_s`` seconds and a whole
    number of ``group``s (one decoder layer's products), so that every sample holds the
    layer's real mix of shapes and lasts long enough for the clock to time it well."""
    rates: Rates = {}
    cursor = 0
    for n in rows:
        inputs = {w.shape[1]: torch.randn(n, w.shape[1], dtype=w.dtype) for w, _ in weights}
        for name in backends:  # warm-up: oneDNN builds a kernel per (shape, rows)
            for w, b in {tuple(w.shape): (w, b) for w, b in weights}.values():
                FORWARD[name](inputs[w.shape[1]], w, b)
        rates[n] = {name: [] for name in backends}
        for r in range(rounds):
            k = r % len(backends)
            for name in backends[k:] + backends[:k]:  # each backend goes first in turn
                fn, flops, done, t0 = FORWARD[name], 0, 0, time.perf_counter()
                while True:
                    w, b = weights[(cursor + done) % len(weights)]
                    fn(inputs[w.shape[1]], w, b)
                    flops += 2 * n * w.numel()
                    done += 1
                    if done % group == 0 and time.perf_counter() - t0 >= slice_s:
                        break
                cursor += done
                rates[n][name].append(flops / (time.perf_counter() - t0))
    return rates


def _num_layers(model: nn.Module, num_linears: int) -> int:
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    return layers if layers and num_linears % layers == 0 else num_linears


def runnable_backends(weights: list[tuple[torch.Tensor, torch.Tensor | None]],
                      backends: Sequence[str]) -> list[str]:
    """The backends that can multiply every weight shape here, at the fewest and the most
    rows measured. A library can be present yet refuse a dtype on a given CPU (oneDNN's
    bfloat16 products need instructions some x86 CPUs lack): it is then not a candidate."""
    shapes = {tuple(w.shape): (w, b) for w, b in weights}.values()
    usable = []
    for name in backends:
        try:
            for w, b in shapes:
                for n in (min(BUCKET_ROWS), max(BUCKET_ROWS)):
                    FORWARD[name](torch.zeros(n, w.shape[1], dtype=w.dtype), w, b)
        except RuntimeError as e:
            logger.info("linear_backend auto: %s cannot run this model's products here (%s); not a candidate",
                        name, str(e).splitlines()[0][:120])
            continue
        usable.append(name)
    return usable


@torch.inference_mode()
def measure_linear_backends(model: nn.Module, backends: Sequence[str] = ("torch", "onednn", "transposed"),
                            budget_s: float = 0.6, rounds: int = 4, head_slice: int = 8192) -> dict[str, Rates]:
    """FLOP/s of each backend, ``rounds`` samples each: for the decoder's linear layers at
    :data:`BUCKET_ROWS` (about ``budget_s`` seconds in all; at least one whole decoder
    layer per sample, which at 512 rows takes longer) and for the vocabulary projection
    at :data:`HEAD_ROWS`, after a warm-up product per weight shape (oneDNN compiles its
    kernels then).

    A sample of the decoder's layers walks them in model order, continuing where the
    previous sample stopped: the weights come from memory, as in a real step (the model
    is far larger than the CPU's caches), and every backend reads the same kind of
    weights. The vocabulary projection is timed on its first ``head_slice`` rows, a
    matrix still larger than the caches of most CPUs, to keep the measurement short."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = [(m.weight, m.bias) for m in plain_linears(model) if m is not head]
    backends = runnable_backends([*layers, *([(head.weight, head.bias)] if type(head) is nn.Linear else [])],
                                 backends)
    slice_s = budget_s / (len(BUCKET_ROWS) * len(backends) * rounds)
    group = len(layers) // _num_layers(model, len(layers)) if layers else 1
    rates = {"layers": _rates(layers, BUCKET_ROWS, backends, rounds, slice_s, group) if layers else {}}
    if type(head) is nn.Linear:
        part = [(head.weight[:head_slice], None if head.bias is None else head.bias[:head_slice])]
        rates["head"] = _rates(part, HEAD_ROWS, backends, rounds, slice_s)
    return rates


def noisy(rates: dict[str, Rates], tolerance: float = NOISE) -> list[str]:
    """Where a backend's fastest sample beats its median by more than ``tolerance``:
    something else ran during the measurement (empty when it was quiet)."""
    return [f"{group} {b} at {n} rows" for group, by_rows in rates.items() for n, r in by_rows.items()
            for b, v in r.items() if max(v) > (1 + tolerance) * statistics.median(v)]


def choose_backends(rates: Rates, margin: float = 0.02, stock: str = "torch") -> LinearChoice:
    """Per row count, the backend that ran fastest *relative to the others in the same
    round*: each round times every backend back to back, so its ratios to the stock
    path cancel what slowed the whole round (another program, the CPU's clock), and the
    median over the rounds ignores a round that one backend lost to a disturbance. The
    stock path keeps a row count unless another beats it by more than ``margin``."""
    if not rates:
        return LinearChoice((1,), (stock,))
    rows = sorted(rates)
    chosen = []
    for n in rows:
        by_backend = rates[n]
        ref = by_backend.get(stock) or next(iter(by_backend.values()))
        ratio = {b: statistics.median(x / r for x, r in zip(v, ref)) for b, v in by_backend.items()}
        best = max(ratio, key=ratio.get)
        keep = stock in ratio and ratio[best] <= ratio[stock] * (1 + margin)
        chosen.append(stock if keep else best)
    return LinearChoice(tuple(rows), tuple(chosen))


def _load_plans(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _describe(rates: dict[str, Rates]) -> str:
    return "; ".join(f"{group} at {n} rows " + " ".join(f"{b} {max(v) / 1e9:.1f}" for b, v in r.items())
                     for group, by_rows in rates.items() for n, r in by_rows.items())


def choose_linear_plan(backend: str, model: nn.Module, cache_dir: Path | None = None,
                       budget_s: float = 0.6) -> LinearPlan:
    """The plan for a resolved ``linear_backend`` (:func:`resolve_linear_backend`): a
    named library is taken as given; "auto" is looked up in the cache under ``cache_dir``
    (default ``$MINIVLLM_CACHE``), or measured and stored there."""
    if backend != "auto":
        return LinearPlan.single(backend)
    from minivllm.model_loader import cache_root

    param = next(model.parameters())
    key = plan_cache_key(model, param.dtype)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = (cache_dir or cache_root()) / PLAN_FILE
    entry = _load_plans(path).get(digest)
    if entry is not None:
        plan = LinearPlan(*(LinearChoice(tuple(entry[g]["rows"]), tuple(entry[g]["backends"]))
                            for g in ("layers", "head")))
        logger.info("linear_backend auto: %s (measured %s, cached in %s)", plan.name, entry["measured"], path)
        return plan
    t0 = time.perf_counter()
    backends = candidate_backends(param.device, param.dtype)
    rates = measure_linear_backends(model, backends, budget_s=budget_s)
    if disturbed := noisy(rates):  # another program ran: once more, and keep the quieter
        again = measure_linear_backends(model, backends, budget_s=budget_s)
        rates, disturbed = min((rates, disturbed), (again, noisy(again)), key=lambda rd: len(rd[1]))
    seconds = time.perf_counter() - t0
    plan = LinearPlan(choose_backends(rates["layers"]), choose_backends(rates.get("head", {})))
    logger.info("linear_backend auto: measured in %.2f s, GFLOP/s (best of each): %s. Chose: %s.",
                seconds, _describe(rates), plan.name)
    if disturbed:
        # INFO, not a warning: the plan is still the fairest comparison this run could make
        # (paired rounds), and the next start measures again.
        logger.info("linear_backend auto: the measurement was disturbed (a sample %.1fx its median: "
                       "%s); using its plan for this run without caching it", 1 + NOISE,
                       ", ".join(disturbed[:4]) + (" ..." if len(disturbed) > 4 else ""))
        return plan
    entry = {"key": key, "seconds": round(seconds, 3),
             **{g: {"rows": list(c.rows), "backends": list(c.backends)} for g, c in (("layers", plan.layers),
                                                                                     ("head", plan.head))},
             "gflops": {g: {n: {b: [round(x / 1e9, 2) for x in v] for b, v in r.items()} for n, r in by_rows.items()}
                        for g, by_rows in rates.items()},
             "measured": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:  # write a whole new file, then rename: a reader never sees half of one
        path.parent.mkdir(parents=True, exist_ok=True)
        plans = {**_load_plans(path), digest: entry}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(plans, indent=1))
        os.replace(tmp, path)
        logger.info("linear_backend auto: plan cached in %s", path)
    except OSError as e:
        logger.warning("linear_backend auto: could not cache the plan in %s (%s); it is measured again next start",
                       path, e)
    return plan
