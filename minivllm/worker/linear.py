"""The model's linear layers on a CPU: three ways to multiply, chosen by measuring (notebook 01).

On a CPU almost every millisecond of a step is a matrix product with one of the model's
weight matrices: 7 per layer plus the vocabulary projection. There is more than one way
to compute ``x @ W.T`` with what PyTorch ships (:data:`~minivllm.worker.linear_plan.FORWARD`):

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
   rounds (:func:`choose_backends`), unless one library is within 5% of that choice at
   every row count, which is then used for all (:func:`prefer_one_library`): a
   :class:`LinearPlan`.
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

Only the engine's forward pass uses the plan: :func:`~minivllm.worker.linear_plan.planned_linear` swaps the class of
the layers for the duration of a ``with`` block and back afterwards, so weights stay
where they are (no copy) and a plain ``model.generate()`` outside the engine still runs
stock PyTorch: the reference minivllm's greedy tokens are checked against. The libraries
add up the same products in a different order, so logits differ in the last bits (a few
parts in a million in float32), the same kind of difference batching itself makes;
greedy tokens stay identical to ``generate()`` in the tests, with each library and with
a plan that switches between them by row count.

oneDNN compiles a kernel the first time it sees a shape (about 0.5 ms per weight shape
and row count, then cached with a buffer the size of its output; the cache holds 1,024 by
default). So the rows reach it padded to a few sizes
(:func:`~minivllm.worker.linear_plan.onednn_rows`): a step with a never-seen size pays a
few milliseconds once, and the memory stops growing once every size has been seen.

The story in three modules: :mod:`minivllm.worker.linear_plan` the libraries and the plan a
layer runs by; :mod:`minivllm.worker.linear_autotune` the measuring; this module the "auto"
setting: the cache key, the cache, and the measured plan. Import each name from the
module that defines it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from minivllm.worker.linear_autotune import (
    BUCKET_ROWS,
    HEAD_ROWS,
    NOISE,
    Rates,
    choose_backends,
    cpu_description,
    measure_linear_backends,
    noisy,
    prefer_one_library,
)
from minivllm.worker.linear_plan import (
    STOCK_PLAN,
    LinearChoice,
    LinearPlan,
    candidate_backends,
    plain_linears,
)

logger = logging.getLogger("minivllm")

PLAN_FILE = "linear_plans.json"
MEASUREMENT_METHOD = 3
"""Part of the cache key: plans measured by an earlier way of measuring are not reused."""


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
    """The plan for a resolved ``linear_backend`` (:func:`~minivllm.worker.linear_plan.resolve_linear_backend`): a
    named library is taken as given; "auto" is looked up in the cache under ``cache_dir``
    (default ``$MINIVLLM_CACHE``), or measured and stored there."""
    if backend != "auto":
        return LinearPlan.single(backend)
    if not plain_linears(model):  # every layer quantized (minivllm.worker.quantization)
        return STOCK_PLAN
    from minivllm.worker.model_loader import cache_root

    param = next(model.parameters())
    key = plan_cache_key(model, param.dtype)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = (cache_dir or cache_root()) / PLAN_FILE
    entry = _load_plans(path).get(digest)
    if entry is not None:
        plan = LinearPlan(*(LinearChoice(tuple(entry[g]["rows"]), tuple(entry[g]["backends"]))
                            for g in ("layers", "head")))
        logger.info("linear_backend auto: %s (%s; measured %s, cached in %s)", plan.name, entry.get("why", ""),
                    entry["measured"], path)
        return plan
    t0 = time.perf_counter()
    backends = candidate_backends(param.device, param.dtype)
    rates = measure_linear_backends(model, backends, budget_s=budget_s)
    if disturbed := noisy(rates):  # another program ran: once more, and keep the quieter
        again = measure_linear_backends(model, backends, budget_s=budget_s)
        rates, disturbed = min((rates, disturbed), (again, noisy(again)), key=lambda rd: len(rd[1]))
    seconds = time.perf_counter() - t0
    layers, why_layers = prefer_one_library(rates["layers"], choose_backends(rates["layers"]))
    head, why_head = prefer_one_library(rates.get("head", {}), choose_backends(rates.get("head", {})))
    plan = LinearPlan(layers, head)
    why = f"layers: {why_layers}; vocabulary projection: {why_head}"
    logger.info("linear_backend auto: measured in %.2f s, GFLOP/s (best of each): %s. Chose: %s (%s).",
                seconds, _describe(rates), plan.name, why)
    if disturbed:
        # INFO, not a warning: the plan is still the fairest comparison this run could make
        # (paired rounds), and the next start measures again.
        logger.info("linear_backend auto: the measurement was disturbed (a sample %.1fx its median: "
                       "%s); using its plan for this run without caching it", 1 + NOISE,
                       ", ".join(disturbed[:4]) + (" ..." if len(disturbed) > 4 else ""))
        return plan
    entry = {"key": key, "seconds": round(seconds, 3), "why": why,
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
