"""What the benchmark modes share: percentiles, the tokenizer alone, saving a figure."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from minivllm.model_loader import DEFAULT_MODEL

ENGINE_SETTINGS = ("block_size", "max_num_batched_tokens", "max_num_seqs")
"""The EngineConfig fields that are ``minivllm bench`` flags (with ``model``)."""

FIGURES = Path("figures")


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, NaN for no samples (a table cell, not an error)."""
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def load_tokenizer(model: str = DEFAULT_MODEL):
    """The tokenizer alone (no weights loaded), for building workloads."""
    from transformers import AutoTokenizer

    from minivllm.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model))


def save_figure(fig, folder: str | Path, name: str) -> None:
    """Write ``fig`` to ``folder/name`` and say where; an empty ``folder`` saves nothing."""
    if folder:
        path = Path(folder) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        print(f"figure: {path}")


def engine_settings(args: argparse.Namespace) -> dict:
    """The engine settings every mode takes from the command line, except the model,
    which each mode loads its own way."""
    return {name: getattr(args, name) for name in ENGINE_SETTINGS}
