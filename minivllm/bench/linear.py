"""Linear mode: the model's matrix products through ``nn.Linear`` and through oneDNN.

``minivllm bench linear`` (notebook 01). Whether ``linear_backend="auto"`` (oneDNN on a
CPU, :mod:`minivllm.linear`) pays off depends on the CPU's matmul library; this measures
it on the machine in use.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch


@torch.inference_mode()
def linear_benchmark(model, rows: Sequence[int] = (1, 32, 512), repeats: int = 3) -> list[dict]:
    """Seconds for every decoder linear layer of ``model`` (not the vocabulary projection)
    to multiply ``n`` rows, once through ``nn.Linear`` as it is and once through oneDNN
    (``minivllm.linear``), best of ``repeats``. The layers run one after another as in a
    forward pass, so each weight comes from memory rather than cache, as in a real step."""
    from minivllm.linear import onednn_linear, plain_linears

    output = model.get_output_embeddings()
    linears = [m for m in plain_linears(model) if m is not output]
    dtype = next(model.parameters()).dtype
    results = []

    def best(inputs: dict[int, torch.Tensor], swapped: list) -> float:
        times = []
        for _ in range(repeats):
            with onednn_linear(swapped):
                t = time.perf_counter()
                for m in linears:
                    m(inputs[m.in_features])
                times.append(time.perf_counter() - t)
        return min(times)

    for n in rows:
        inputs = {m.in_features: torch.randn(n, m.in_features, dtype=dtype) for m in linears}
        torch_s, onednn_s = best(inputs, []), best(inputs, linears)
        results.append({"rows": n, "layers": len(linears), "torch s": torch_s, "onednn s": onednn_s,
                        "speed-up": torch_s / onednn_s})
    return results


def main(args: argparse.Namespace) -> int:
    """``minivllm bench linear``: every decoder linear layer of the model, both ways."""
    from minivllm.linear import onednn_available
    from minivllm.model_loader import load_model

    if not onednn_available():
        print("this PyTorch build has no oneDNN: linear_backend='auto' keeps nn.Linear")
        return 1
    model, _ = load_model(args.model)
    print("every decoder linear layer once, weights from memory (best of 3):")
    for r in linear_benchmark(model):
        print(f"{r['rows']:>4} rows x {r['layers']} layers: nn.Linear {r['torch s'] * 1e3:7.1f} ms, "
              f"oneDNN {r['onednn s'] * 1e3:7.1f} ms, {r['speed-up']:.2f}x")
    return 0
