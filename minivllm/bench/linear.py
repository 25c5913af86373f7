"""Linear mode: the model's matrix products through each library ``minivllm.worker.linear`` knows.

``minivllm bench linear`` (notebook 11). Which library is fastest (``nn.Linear``, oneDNN,
or ``(W @ x.T).T``) depends on the CPU and on the rows; ``linear_backend="auto"``
measures it briefly when an engine starts, and this measures it at length on the machine
in use.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from minivllm.bench.timing import compare, measure


@torch.inference_mode()
def linear_benchmark(model, rows: Sequence[int] = (1, 4, 32, 512), repeats: int = 3,
                     backends: Sequence[str] | None = None, warmup: int = 1) -> list[dict]:
    """Seconds for every decoder linear layer of ``model`` (not the vocabulary projection)
    to multiply ``n`` rows, through each of ``backends`` (default: every one that runs
    here). The layers run one after another as in a forward pass, so each weight comes
    from memory rather than cache, as in a real step. The backends are timed in
    interleaved rounds (:func:`minivllm.bench.timing.measure`: ``warmup`` rounds dropped,
    then ``repeats`` rounds), so a slow moment of a shared machine slows them alike.

    Each row says ``"<backend> s"`` (the median of the rounds), ``"timings"`` (each
    backend's :class:`~minivllm.bench.timing.Timing`, every round), ``"fastest"`` (the
    lowest median), ``"speed-up"`` (``nn.Linear``'s median over the fastest's) and
    ``"verdict"``: whether the fastest is clearly faster than its runner-up on this
    machine, or their spreads overlap (:func:`minivllm.bench.timing.compare`)."""
    from minivllm.worker.linear_plan import (
        LinearPlan,
        candidate_backends,
        plain_linears,
        planned_linear,
    )

    output = model.get_output_embeddings()
    linears = [m for m in plain_linears(model) if m is not output]
    param = next(model.parameters())
    backends = backends or candidate_backends(param.device, param.dtype)
    results = []

    def run(inputs: dict[int, torch.Tensor], backend: str):
        def once() -> None:
            with planned_linear([(m, LinearPlan.single(backend).layers) for m in linears]):
                for m in linears:
                    m(inputs[m.in_features])
        return once

    for n in rows:
        inputs = {m.in_features: torch.randn(n, m.in_features, dtype=param.dtype) for m in linears}
        timings = measure({b: run(inputs, b) for b in backends}, rounds=repeats, warmup=warmup)
        row = {"rows": n, "layers": len(linears), **{f"{b} s": timings[b].median for b in backends}}
        ranked = sorted(backends, key=lambda b: timings[b].median)
        row["fastest"] = ranked[0]
        row["speed-up"] = row["torch s"] / row[f"{row['fastest']} s"]
        row["timings"] = timings
        row["verdict"] = (compare(timings[ranked[0]].scaled(1e3, "ms"), timings[ranked[1]].scaled(1e3, "ms")).verdict
                          if len(ranked) > 1
                          else f"only {ranked[0]} runs here")
        results.append(row)
    return results


def main(args: argparse.Namespace) -> int:
    """``minivllm bench linear``: every decoder linear layer of the model, each library."""
    from minivllm.bench.timing import table
    from minivllm.worker.model_loader import load_model

    model, _ = load_model(args.model)
    print(f"every decoder linear layer once, weights from memory ({args.rounds} interleaved rounds after a "
          "warm-up), ms:")
    for r in linear_benchmark(model, repeats=args.rounds):
        print(f"{r['rows']} rows x {r['layers']} layers:")
        print(table([t.scaled(1e3, "ms") for t in r["timings"].values()], baseline="torch"))
        print(f"fastest {r['fastest']}, {r['speed-up']:.2f}x nn.Linear; {r['verdict']}")
    return 0
