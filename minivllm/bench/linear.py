"""Linear mode: the model's matrix products through each library ``minivllm.linear`` knows.

``minivllm bench linear`` (notebook 01). Which library is fastest (``nn.Linear``, oneDNN,
or ``(W @ x.T).T``) depends on the CPU and on the rows; ``linear_backend="auto"``
measures it briefly when an engine starts, and this measures it at length on the machine
in use.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch


@torch.inference_mode()
def linear_benchmark(model, rows: Sequence[int] = (1, 4, 32, 512), repeats: int = 3,
                     backends: Sequence[str] | None = None) -> list[dict]:
    """Seconds for every decoder linear layer of ``model`` (not the vocabulary projection)
    to multiply ``n`` rows, through each of ``backends`` (default: every one that runs
    here), best of ``repeats``. The layers run one after another as in a forward pass,
    so each weight comes from memory rather than cache, as in a real step. Each row says
    ``"<backend> s"`` and ``"speed-up"``: ``nn.Linear``'s time over the fastest's."""
    from minivllm.linear import LinearPlan, candidate_backends, plain_linears, planned_linear

    output = model.get_output_embeddings()
    linears = [m for m in plain_linears(model) if m is not output]
    param = next(model.parameters())
    backends = backends or candidate_backends(param.device, param.dtype)
    results = []

    def best(inputs: dict[int, torch.Tensor], backend: str) -> float:
        times = []
        for _ in range(repeats):
            with planned_linear([(m, LinearPlan.single(backend).layers) for m in linears]):
                t = time.perf_counter()
                for m in linears:
                    m(inputs[m.in_features])
                times.append(time.perf_counter() - t)
        return min(times)

    for n in rows:
        inputs = {m.in_features: torch.randn(n, m.in_features, dtype=param.dtype) for m in linears}
        row = {"rows": n, "layers": len(linears), **{f"{b} s": best(inputs, b) for b in backends}}
        row["fastest"] = min(backends, key=lambda b: row[f"{b} s"])
        row["speed-up"] = row["torch s"] / row[f"{row['fastest']} s"]
        results.append(row)
    return results


def main(args: argparse.Namespace) -> int:
    """``minivllm bench linear``: every decoder linear layer of the model, each library."""
    from minivllm.model_loader import load_model

    model, _ = load_model(args.model)
    print("every decoder linear layer once, weights from memory (best of 3), ms:")
    for r in linear_benchmark(model):
        times = ", ".join(f"{k[:-2]} {v * 1e3:7.1f}" for k, v in r.items() if k.endswith(" s"))
        print(f"{r['rows']:>4} rows x {r['layers']} layers: {times}; fastest {r['fastest']}, "
              f"{r['speed-up']:.2f}x nn.Linear")
    return 0
