"""Warm-up: do the slow first-time work before a session starts, and say how long it took.

The first use of the embedded model dequantizes its GGUF file to float32 and caches it
(model_loader.py): about 15 s on a laptop CPU, which thirty laptops doing it at once in
the first notebook turn into a silent, puzzling minute. ``minivllm warmup`` (``make
warmup``) does that conversion ahead of time, loads the engine from the cache, runs one
short generation, and prints what this laptop has: the Python and torch build, whether
Triton is there, and where the cache lives. A facilitator can ask the room to run it
and read one line per laptop.
"""

from __future__ import annotations

import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from minivllm.kernels.triton_utils import interpreting, triton_available
from minivllm.worker.model_loader import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    cache_root,
    resolve_model_dir,
)


@dataclass
class WarmupReport:
    model_dir: Path
    converted: bool
    """True when this run converted the model; False when it was already cached."""
    convert_s: float
    load_s: float
    generate_s: float
    num_tokens: int
    text: str
    total_s: float


def folder_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def describe_platform() -> list[str]:
    """What matters about this laptop for the course, one fact a line."""
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    lines = [f"Python {platform.python_version()} on {sys.platform} ({platform.machine()}), "
             f"torch {torch.__version__} ({build})"]
    if torch.version.cuda and not torch.cuda.is_available():
        lines.append("warning: this torch is the CUDA build but there is no GPU: several GB for "
                     "nothing. Reinstall the CPU build (README, Platform notes).")
    if not triton_available():
        lines.append("Triton: not installed (it has Linux wheels only); the engine and notebook "
                     "05 use the PyTorch reference attention")
    elif torch.cuda.is_available():
        lines.append("Triton: installed; kernels run on the GPU")
    else:
        now = " (on now)" if interpreting() else ""
        lines.append("Triton: installed; kernels run on this CPU in its interpreter, "
                     f"TRITON_INTERPRET=1{now}, which notebook 05 sets in its first cell")
    return lines


def warmup(
    model: str = DEFAULT_MODEL,
    *,
    reconvert: bool = False,
    max_tokens: int = 16,
    prompt: str = "What is the capital of France?",
    log: Callable[[str], None] = print,
) -> WarmupReport:
    """Convert (if needed), load and run ``model`` once; log each step's time."""
    from minivllm import LLM, SamplingParams

    start = time.perf_counter()
    for line in describe_platform():
        log(line)

    converted = False
    if model in EMBEDDED_MODELS:
        target = cache_root() / model
        if reconvert and target.exists():
            shutil.rmtree(target)
        converted = not (target / "model.safetensors").exists()
        if converted:
            log(f"Converting {model} (GGUF -> float32 safetensors), once per laptop ...")
    t = time.perf_counter()
    model_dir = resolve_model_dir(model)
    convert_s = time.perf_counter() - t
    if converted:
        log(f"converted in {convert_s:.1f} s")
    else:
        log(f"model already converted ({convert_s:.2f} s to find it)")
    log(f"cache: {model_dir} ({folder_mib(model_dir):.0f} MiB)")

    t = time.perf_counter()
    llm = LLM(model, log_stats_interval=None)
    load_s = time.perf_counter() - t
    log(f"engine loaded in {load_s:.1f} s")

    t = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0].outputs[0]
    generate_s = time.perf_counter() - t
    log(f"generated {len(out.token_ids)} tokens in {generate_s:.1f} s: {out.text!r}")

    total_s = time.perf_counter() - start
    log(f"Ready: warm-up took {total_s:.1f} s.")
    return WarmupReport(model_dir, converted, convert_s, load_s, generate_s, len(out.token_ids),
                        out.text, total_s)
