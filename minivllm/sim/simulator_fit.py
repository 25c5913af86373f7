"""Fitting the simulator's cost model to the real runner, and checking it.

:mod:`minivllm.sim.simulator` predicts each step's time with a :class:`CostModel`; this
module produces one: it serves chat workloads on the real engine, fits the model to
the measured steps (:func:`~minivllm.sim.cost_model.fit_cost_model`), and checks it on a
workload it never saw by replaying that workload on a simulated engine and comparing
the predicted span with the measured one. ``minivllm bench fit-simulator`` runs it and
saves the result as ``minivllm/data/cost_model_smollm2_cpu.json``; :func:`calibrate`
(``minivllm bench calibrate``) is the short version every machine runs for itself, cached
where :meth:`CostModel.for_this_machine` finds it. Notebook 09 calibrates in place.
"""

from __future__ import annotations

import copy
import logging
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from minivllm.engine.llm_engine import EngineConfig, LLMEngine
from minivllm.sim.cost_model import (
    CostModel,
    calibration_key,
    calibration_path,
    cpu_name,
    fit_cost_model,
    step_intervals,
)
from minivllm.sim.replay import replay_workload
from minivllm.sim.simulator import make_simulated_engine
from minivllm.sim.workload import WorkloadRequest, chat_workload
from minivllm.trace import Trace
from minivllm.worker.model_loader import DEFAULT_MODEL
from minivllm.worker.model_runner import kv_cache_bytes_per_token

logger = logging.getLogger("minivllm")


def _measure(engine: LLMEngine, workload: list[WorkloadRequest], tag: str) -> tuple[Trace, float]:
    """Serve ``workload`` from an empty trace and prefix cache; its trace and wall time."""
    for r in workload:
        r.request_id = f"{tag}-{r.request_id}"
    engine.trace.clear()
    engine.reset_prefix_cache()
    t = time.perf_counter()
    replay_workload(engine, workload)
    wall = time.perf_counter() - t
    trace = copy.copy(engine.trace)
    trace.steps = copy.copy(engine.trace.steps)
    return trace, wall


def _describe(engine: LLMEngine, model: str, fit_workloads: str, command: str) -> dict:
    """Where a cost model comes from: what a reader needs to judge if it fits their machine."""
    cfg = engine.config
    return {
        "model": model,
        "dtype": cfg.dtype,
        "device": str(engine.device),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "attention_backend": engine.attention_backend,
        "linear_backend": engine.linear_backend,
        "block_size": cfg.block_size,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "kv_bytes_per_token": kv_cache_bytes_per_token(engine.model, engine.model.dtype),
        "vocab_size": engine.model.config.vocab_size,
        "max_position_embeddings": engine.model.config.max_position_embeddings,
        "fit_workloads": fit_workloads,
        "command": command,
        "created": time.strftime("%Y-%m-%d"),
    }


def fit_simulator(
    model: str = DEFAULT_MODEL,
    fit_seeds: Sequence[int] = (1, 3),
    heldout_seed: int = 2,
    n: int = 32,
    fit_rate: float = 2.0,
    out_path: str | Path | None = None,
    command: str = "",
    fit_shape: dict | None = None,
    heldout_shape: dict | None = None,
    source: str = "fitted by minivllm bench fit-simulator",
    **settings,
) -> dict:
    """Measure the real engine, fit the cost model, check it on a held-out workload.

    Fit data: for each seed, ``n`` chat requests all at once and ``n`` more arriving at
    ``fit_rate`` req/s (so steps of every mix of prefill chunks and decodes are seen).
    Two seeds rather than one, because single steps jitter on a shared machine and one
    seed's held-out error moved with it (``minivllm bench fit-simulator`` prints the
    error; run it a few times to see the spread on yours).
    Held out: another ``n``-request workload all at once (or of ``heldout_shape``:
    ``chat_workload`` arguments); its measured wall time is compared with the simulator's
    prediction for the same workload. ``settings``: EngineConfig fields (backends, dtype).
    """
    engine = LLMEngine(EngineConfig(model=model, log_stats_interval=None, **settings))
    tok = engine.tokenizer
    replay_workload(engine, [WorkloadRequest("warmup", [1, 2, 3, 4], 4)])
    traces = []
    for seed in fit_seeds:
        for rate in (None, fit_rate):
            workload = chat_workload(tok, n, seed, rate=rate, **(fit_shape or {}))
            tr, wall = _measure(engine, workload, f"fit{seed}-{rate}")
            logger.info("fit run seed %d rate %s: %d steps, %.1f s", seed, rate, len(tr.steps), wall)
            traces.append(tr)
    shape = {"n": n, **(heldout_shape or {})}
    held_workload = chat_workload(tok, seed=heldout_seed, **shape)
    held_trace, held_wall = _measure(engine, chat_workload(tok, seed=heldout_seed, **shape), "heldout")
    fit_args = "".join(f", {k}={v}" for k, v in (fit_shape or {}).items())
    fit_workloads = (f"chat_workload(n={n}{fit_args}, seed in {list(fit_seeds)}), all at once and "
                     f"at {fit_rate} req/s")
    cm = fit_cost_model(traces, {**_describe(engine, model, fit_workloads, command), "source": source})
    cfg = engine.config
    sim = make_simulated_engine(cm, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                                max_num_batched_tokens=cfg.max_num_batched_tokens)
    sim_res = replay_workload(sim, held_workload)
    predicted = sim_res.end - sim_res.start
    described = ", ".join(f"{k}={v}" for k, v in shape.items())
    cm.meta["held_out"] = {
        "workload": f"chat_workload({described}, seed={heldout_seed})"
                    + ("" if "rate" in shape else ", all at once"),
        "measured_wall_s": held_wall,
        "predicted_s": predicted,
        "error": predicted / held_wall - 1,
        "measured_steps": len(held_trace.steps),
        "simulated_steps": sim_res.num_steps,
    }
    if out_path is not None:
        cm.save(out_path)
    return {"cost_model": cm, "traces": traces, "held_out_trace": held_trace}


CALIBRATION_FIT = {"output_len": (8, 64)}
"""The calibration's fit workloads: the chat workload's prompts (20-300 tokens), outputs
shorter than its 16-128, so that a calibration stays short where every step is slow."""
CALIBRATION_HELD_OUT = {"prompt_len": (100, 400), "output_len": (8, 48), "rate": 4.0}
"""The held-out check of a calibration: another seed, longer prompts, shorter outputs,
arriving at another rate."""


MAX_CALIBRATION_ERROR = 0.25
"""A calibration whose held-out error is larger is not saved: the machine was busy, or
the model does not fit it, and silent numbers from it would be worse than the warning."""


class CalibrationError(RuntimeError):
    """The calibration's own check failed; nothing was saved."""


def calibrate(model: str = DEFAULT_MODEL, n: int = 24, seed: int = 11, heldout_seed: int = 12,
              fit_rate: float = 2.0, max_error: float = MAX_CALIBRATION_ERROR, **settings) -> dict:
    """Fit this machine's cost model, check it on a held-out workload, and cache it
    where :meth:`~minivllm.sim.cost_model.CostModel.for_this_machine` (every simulated engine
    made without a cost model) will find it. It takes as long as the machine needs for
    about 300 steps of the real engine (87 s on a slow 2-core VM).

    The same measure-fit-check loop as :func:`fit_simulator`, shorter: one seed's
    ``n`` requests all at once (decode batches up to ``n``, full prefill budgets) and
    ``n`` arriving at ``fit_rate`` (every mix of chunks and decodes); held out, a workload of
    another seed and shape (:data:`CALIBRATION_HELD_OUT`). ``settings``: EngineConfig
    fields that change a step's cost (``dtype``, ``attention_backend``,
    ``linear_backend``), which are part of the cache key. A held-out error above
    ``max_error`` raises :class:`CalibrationError` and saves nothing.
    """
    t = time.perf_counter()
    res = fit_simulator(model, fit_seeds=(seed,), heldout_seed=heldout_seed, n=n, fit_rate=fit_rate,
                        fit_shape=CALIBRATION_FIT, heldout_shape={"n": n, **CALIBRATION_HELD_OUT}, source="calibrated on this machine",
                        command=f"minivllm.sim.simulator_fit.calibrate(n={n})", **settings)
    cm = res["cost_model"]
    cm.meta["calibration_seconds"] = time.perf_counter() - t
    held = cm.meta["held_out"]
    if not abs(held["error"]) <= max_error:  # also refuses a NaN error or bound
        raise CalibrationError(
            f"the calibrated model missed its held-out workload by {held['error']:+.0%} (measured "
            f"{held['measured_wall_s']:.1f} s, predicted {held['predicted_s']:.1f} s; fit R^2 "
            f"{cm.meta['fit']['r2']:.2f}), more than {max_error:.0%}: nothing was saved. Was the "
            f"machine busy? Run it again with nothing else running.")
    path = save_calibration(cm, model=model, **settings)
    logger.info("Calibrated the simulator in %.0f s: held-out %s measured %.2f s, predicted "
                "%.2f s (%+.1f%%); saved %s", cm.meta["calibration_seconds"], held["workload"],
                held["measured_wall_s"], held["predicted_s"], 100 * held["error"], path)
    return {**res, "path": path}


def save_calibration(cost_model: CostModel, source: str | None = None, **settings: str) -> Path:
    """Make ``cost_model`` this machine's calibration for these engine settings
    (:func:`~minivllm.sim.cost_model.calibration_key`: model, dtype, backends), where every
    simulated engine made without a cost model finds it; returns the file."""
    key = calibration_key(**settings)
    cost_model.meta.update(calibration_key=key, cpu=key["cpu"])
    if source is not None:
        cost_model.meta["source"] = source
    path = calibration_path(key)
    cost_model.save(path)
    return path


def plot_cost_model_fit(cost_model: CostModel, traces: Sequence[Trace], ax=None):
    """Predicted against measured time of every step the model was fitted on."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(4, 4))
    else:
        fig = ax.figure
    meas, pred = [], []
    for tr in traces:
        for step, seconds in step_intervals(tr):
            meas.append(seconds * 1e3)
            pred.append(cost_model.predict(step.scheduled) * 1e3)
    ax.scatter(meas, pred, s=6, alpha=0.5)
    hi = max(meas + pred)
    ax.plot([0, hi], [0, hi], "k--", lw=1)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted (ms)")
    ax.set_title("simulator cost model", fontsize=9)
    fig.tight_layout()
    return fig
