"""Measuring the linear-layer libraries on this CPU, as an autotuner does (notebook 01).

Which library (:data:`~minivllm.worker.linear_plan.FORWARD`) is fastest depends on the CPU and
on how many rows the product has, and no fixed rule is right everywhere, so
``linear_backend="auto"`` measures, as ``torch.backends.cudnn.benchmark`` and Triton's
autotuner do. This module holds the measuring; :func:`minivllm.worker.linear.choose_linear_plan`
caches its answer.

- :func:`measure_linear_backends` runs the model's own decoder layers at a few row counts
  a step can have (:data:`BUCKET_ROWS`), in model order so that weights come from memory
  as in a real step, through each candidate for a short slice of time, a few rounds,
  each candidate going first in turn; the vocabulary projection, one huge matrix that
  only sees the sampling rows, is timed on its own (:data:`HEAD_ROWS`).
- :func:`choose_backends` keeps, per row count, the library that was fastest *against the
  others in the same rounds*: ratios within a round cancel whatever slowed the whole
  round down.
- :func:`prefer_one_library` keeps a single library instead when one is nearly as fast as
  the per-row-count choice at every row count: a patchwork chosen from small differences
  lost to the best single library end to end on one AMD EPYC (0.89x of oneDNN alone on
  32 requests), as noise in a one-second measurement picks a different winner per row.
- :func:`noisy` says when another program disturbed the measurement.
- :func:`cpu_description` names the CPU, for the cache key.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from minivllm.worker.linear_plan import FORWARD, LinearChoice, plain_linears

logger = logging.getLogger("minivllm")

BUCKET_ROWS = (1, 4, 16, 64, 256, 512)
"""Row counts "auto" measures the decoder's linear layers at: decode steps of 1 to a few
dozen requests, mixed steps, a full 512-token prefill. A product of ``r`` rows uses the
choice made at the nearest of these on a log scale (3-8 rows use 4's, above 362 512's)."""
HEAD_ROWS = (1, 8, 64)
"""Row counts the vocabulary projection is measured at: it only ever sees the rows that
sample, one per request in the step."""


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


def _ratios(rates: Rates, stock: str) -> dict[int, dict[str, float]]:
    """Per row count, each backend's speed relative to ``stock`` in the same rounds (median)."""
    out = {}
    for n, by_backend in rates.items():
        ref = by_backend.get(stock) or next(iter(by_backend.values()))
        out[n] = {b: statistics.median(x / r for x, r in zip(v, ref)) for b, v in by_backend.items()}
    return out


def choose_backends(rates: Rates, margin: float = 0.02, stock: str = "torch") -> LinearChoice:
    """Per row count, the backend that ran fastest *relative to the others in the same
    round*: each round times every backend back to back, so its ratios to the stock
    path cancel what slowed the whole round (another program, the CPU's clock), and the
    median over the rounds ignores a round that one backend lost to a disturbance. The
    stock path keeps a row count unless another beats it by more than ``margin``."""
    if not rates:
        return LinearChoice((1,), (stock,))
    rows = sorted(rates)
    ratios = _ratios(rates, stock)
    chosen = []
    for n in rows:
        ratio = ratios[n]
        best = max(ratio, key=ratio.get)
        keep = stock in ratio and ratio[best] <= ratio[stock] * (1 + margin)
        chosen.append(stock if keep else best)
    return LinearChoice(tuple(rows), tuple(chosen))


ONE_LIBRARY_TOLERANCE = 0.05
"""How much slower than the per-row-count choice a single library may be, at its worst row
count, and still be preferred (:func:`prefer_one_library`)."""


def prefer_one_library(rates: Rates, choice: LinearChoice, tolerance: float = ONE_LIBRARY_TOLERANCE,
                       stock: str = "torch") -> tuple[LinearChoice, str]:
    """``choice`` (from :func:`choose_backends`), or one library for every row count when
    one is at most ``tolerance`` slower than ``choice`` at each row count measured; with
    why, in words. Of several such libraries, the one fastest on average over the row
    counts (geometric mean; the stock path on a tie).

    Why: each row count's winner comes from a second of measurement on a machine that may
    be shared, and a difference of a few percent there is as likely noise as a real gap.
    One library end to end is what the fixed settings give, and a mix must beat it by a
    clear margin somewhere to be worth its switches."""
    if len(set(choice.backends)) == 1:
        return choice, f"{choice.backends[0]} was fastest at every row count measured"
    ratios = _ratios(rates, stock)
    chosen = dict(zip(choice.rows, choice.backends))
    worst = {}  # library -> (its largest loss against the choice, at which rows)
    for b in next(iter(ratios.values())):
        worst[b] = max((ratios[n][chosen[n]] / ratios[n][b] - 1, n) for n in choice.rows)
    near = [b for b in worst if worst[b][0] <= tolerance]
    if not near:
        b, (loss, n) = min(worst.items(), key=lambda kv: kv[1][0])
        return choice, (f"mixed, because every single library loses more than {tolerance:.0%} somewhere "
                        f"(the closest, {b}, {loss:.0%} at {n} rows)")

    def mean_speed(b: str) -> float:
        return statistics.geometric_mean(ratios[n][b] for n in choice.rows)

    best = max(near, key=lambda b: (mean_speed(b), b == stock))
    loss, n = worst[best]
    return (LinearChoice(choice.rows, (best,) * len(choice.rows)),
            f"{best} alone, within {tolerance:.0%} of the per-row-count choice ({choice.name}) at every row "
            f"count (at worst {loss:.1%} slower, at {n} rows)")
