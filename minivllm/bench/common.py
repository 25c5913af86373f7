"""What the benchmark modes share: the tokenizer alone, saving a figure, engine flags.
(Percentiles are :func:`minivllm.metrics.percentile`, the one definition minivllm uses.)"""

from __future__ import annotations

import argparse
from pathlib import Path

from minivllm.worker.model_loader import load_tokenizer  # noqa: F401  (the modes import it from here)

ENGINE_SETTINGS = ("block_size", "max_num_batched_tokens", "max_num_seqs", "compilation_config")
"""The EngineConfig fields that are ``minivllm bench`` flags (with ``model``): each mode names
those it takes (``minivllm.bench.cli.MODES``; ``compilation_config`` only where every engine
the mode builds can run compiled)."""

FIGURES = Path("figures")


def save_figure(fig, folder: str | Path, name: str) -> None:
    """Write ``fig`` to ``folder/name`` and say where; an empty ``folder`` saves nothing."""
    if folder:
        path = Path(folder) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        print(f"figure: {path}")


def engine_settings(args: argparse.Namespace) -> dict:
    """The engine settings a mode takes from the command line (those of
    :data:`ENGINE_SETTINGS` its subcommand has), except the model, which each mode loads
    its own way."""
    return {name: getattr(args, name) for name in ENGINE_SETTINGS if hasattr(args, name)}
