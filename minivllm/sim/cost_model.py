"""The simulator's cost model: how long one engine step takes, predicted from what it computes.

A simulated engine (:mod:`minivllm.sim.simulator`) needs one number per step: its duration.
The cost model is linear in what a step computes::

    step time = a + b * prefill_tokens + c * decode_requests
                  + d * decode_context + e * prefill_attention

(``decode_context``: sum of the context lengths the decodes attend over;
``prefill_attention``: query-key pairs of the prompt chunks, in thousands). It is fitted
by non-negative least squares to steps measured on the real runner (:func:`fit_cost_model`;
the whole measure-fit-check loop is :mod:`minivllm.sim.simulator_fit`) and shipped in
``minivllm/data/cost_model_smollm2_cpu.json`` together with the command that produced
it: ``minivllm bench fit-simulator``.

Step times are the machine's: a model fitted on one CPU predicts another's badly (a
2-core Xeon ran a workload in 23 s that the EPYC-fitted model predicted at 13 s). So a
machine calibrates its own (``minivllm bench calibrate``, :func:`minivllm.sim.simulator_fit.calibrate`,
under a minute) into the cache, keyed by what changes a step's cost
(:func:`calibration_key`); :meth:`CostModel.for_this_machine` uses it when it is there,
and otherwise falls back to the shipped model *saying so*. Every trace a simulated engine
writes names its cost model (``Trace.time_source``), and the figures drawn from it print
that name.

vLLM has no simulator; this module and :mod:`minivllm.sim.simulator` are minivllm's own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from minivllm.trace import StepRecord, Trace
from minivllm.worker.model_loader import DEFAULT_MODEL, cache_root

FEATURES = ("const", "prefill_tokens", "decode_requests", "decode_context", "prefill_attention")
DEFAULT_COST_MODEL = "cost_model_smollm2_cpu.json"
CALIBRATE_COMMAND = "minivllm bench calibrate"

logger = logging.getLogger("minivllm")
_warned: set[str] = set()
"""Calibration keys already warned about in this process (the warning is said once)."""


def step_features(chunks: Iterable) -> list[float]:
    """The cost model's inputs for one step. ``chunks`` are the scheduler's
    ``ScheduledRequest`` or the trace's ``ScheduledChunk``: both carry
    ``num_new_tokens``, ``num_computed_tokens`` and ``is_prefill``."""
    prefill = decodes = context = attention = 0.0
    for c in chunks:
        n = c.num_new_tokens
        if c.is_prefill:
            prefill += n
            # each new query attends to the cached tokens and to the new ones before it
            attention += n * (c.num_computed_tokens + (n + 1) / 2) / 1000
        else:
            decodes += 1
            context += c.num_computed_tokens + 1
    return [1.0, prefill, decodes, context, attention]


@dataclass
class CostModel:
    """Predicted seconds of one engine step, linear in :data:`FEATURES`."""

    coefficients: dict[str, float]
    meta: dict = field(default_factory=dict)
    """Where it came from: model, machine, engine settings, fit quality, command."""

    def predict_features(self, features: Sequence[float]) -> float:
        t = sum(self.coefficients[name] * x for name, x in zip(FEATURES, features))
        return max(t, 1e-6)  # a step never takes negative time, whatever the fit says

    def predict(self, chunks: Iterable) -> float:
        return self.predict_features(step_features(chunks))

    @property
    def label(self) -> str:
        """Which cost model this is, in a few words, for figures and logs."""
        source = self.meta.get("source", "given by hand")
        cpu = self.meta.get("cpu") or self.meta.get("processor")
        return f"cost model {source}" + (f", CPU {cpu}" if cpu else "")

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path | None = None) -> CostModel:
        """Load a fitted model; default: the one shipped with minivllm (fitted on another
        machine: :meth:`for_this_machine` prefers this machine's calibration)."""
        if path is None:
            text = resources.files("minivllm").joinpath("data", DEFAULT_COST_MODEL).read_text()
        else:
            text = Path(path).read_text()
        data = json.loads(text)
        cm = cls(coefficients=data["coefficients"], meta=data.get("meta", {}))
        if path is None:
            cm.meta["source"] = "shipped with minivllm"
        return cm

    @classmethod
    def for_this_machine(cls, **settings: str) -> CostModel:
        """This machine's calibrated model for these engine settings (see
        :func:`calibration_key`), or the shipped one with a warning, said once, of what
        that means: simulated seconds then belong to the machine it was fitted on."""
        key = calibration_key(**settings)
        path = calibration_path(key)
        if path.exists():
            return cls.load(path)
        shipped = cls.load()
        digest = path.stem
        if digest not in _warned:
            _warned.add(digest)
            held = shipped.meta.get("held_out", {}).get("error")
            logger.warning(
                "No simulator cost model is calibrated for this machine (%s; %s). Using the one "
                "shipped with minivllm, fitted on %s%s: simulated times are that machine's, not "
                "this one's. Run `%s` (under a minute) to calibrate this machine.",
                key["cpu"], ", ".join(f"{k} {v}" for k, v in key.items() if k != "cpu"),
                shipped.meta.get("cpu", "another machine"),
                f" (held-out error there {held:+.0%})" if held is not None else "",
                CALIBRATE_COMMAND)
        return shipped


# -- calibration: one cost model per machine and engine settings ---------------------------
def cpu_name() -> str:
    """The CPU's model name as the operating system reports it."""
    try:  # Linux; a virtual machine may say only "AMD EPYC": family and model tell more
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
        if "model name" in fields:
            ids = [f"{k} {fields[k]}" for k in ("cpu family", "model") if k in fields]
            return fields["model name"] + (f" ({', '.join(ids)})" if ids else "")
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                 capture_output=True, text=True, timeout=5).stdout.strip()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def calibration_key(model: str = DEFAULT_MODEL, dtype: str = "float32",
                    attention_backend: str = "auto", linear_backend: str = "auto") -> dict:
    """What a step's cost depends on besides the step itself: the CPU, torch's version
    and thread count, the model, its dtype and the attention and matmul backends (resolved:
    "auto" attention by what it chose here; "auto" linear layers stay "auto", a plan
    measured once per machine, minivllm.worker.linear). Two runs with equal keys may share a
    cost model; anything else must calibrate anew."""
    from minivllm.executor.abstract import DTYPES
    from minivllm.worker.attention import resolve_backend
    from minivllm.worker.linear_plan import resolve_linear_backend

    cpu = torch.device("cpu")
    return {
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": model,
        "dtype": dtype,
        "attention_backend": resolve_backend(attention_backend, cpu),
        "linear_backend": resolve_linear_backend(linear_backend, cpu, DTYPES[dtype]),
    }


def calibration_path(key: dict) -> Path:
    """Where this key's calibrated cost model is cached: ``$MINIVLLM_CACHE/cost_models/``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "cost_models" / f"{digest}.json"


def step_intervals(trace: Trace) -> list[tuple[StepRecord, float]]:
    """Each step with the wall time it really cost: from its start to the next step's
    start (so the engine's work between steps counts too), or to its own end when the
    engine went idle after it (the gap was waiting for arrivals, not work)."""
    steps = list(trace.steps)
    out = []
    for step, nxt in zip(steps, steps[1:] + [None]):
        busy = nxt is not None and (step.num_running or step.num_waiting)
        out.append((step, (nxt.start - step.start) if busy else step.duration))
    return out


OUTLIER_MADS = 5.0
"""A step whose time is further than this many (scaled) median absolute deviations from
the first fit is left out of the second (see :func:`fit_cost_model`)."""


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls

    # Columns scaled to unit norm so that features of very different sizes (a constant,
    # thousands of attended keys) weigh alike in the solver's stopping rule.
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    coef, _ = nnls(x / norms, y)
    return coef / norms


def fit_cost_model(traces: Sequence[Trace], meta: dict | None = None,
                   outlier_mads: float | None = OUTLIER_MADS) -> CostModel:
    """Non-negative least-squares fit of the step cost (see :func:`step_intervals`) over
    the steps of one or more real-runner traces.

    Non-negative because every feature is work a step does: no token, request or
    attended key can make a step *faster*. Plain least squares may trade two features
    that grow together (prompt tokens and prompt attention, in a short run) against each
    other and return a negative coefficient, which fits the data it saw and extrapolates
    to nonsense (a long enough prompt predicted to cost less than nothing).
    ``scipy.optimize.nnls`` keeps every coefficient >= 0 (Lawson and Hanson's algorithm).

    On a shared machine a few steps take many times what their work costs (another
    process took the cores). Least squares chases them, so the fit is made twice: the
    steps further than ``outlier_mads`` median absolute deviations from the first fit
    are left out of the second (``meta["fit"]["num_outliers"]`` counts them; None: one
    plain fit). The held-out check (:mod:`minivllm.sim.simulator_fit`) judges the result.
    """
    rows, y = [], []
    for trace in traces:
        for step, seconds in step_intervals(trace):
            rows.append(step_features(step.scheduled))
            y.append(seconds)
    x, y = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    if len(y) == 0:
        raise ValueError("the traces hold no steps to fit: run the real engine first")
    coef = _nnls(x, y)
    keep = np.ones(len(y), dtype=bool)
    if outlier_mads is not None:
        residual = y - x @ coef
        mad = 1.4826 * np.median(np.abs(residual - np.median(residual)))
        if mad > 0:
            keep = np.abs(residual - np.median(residual)) <= outlier_mads * mad
            coef = _nnls(x[keep], y[keep])
    pred = x @ coef
    meta = dict(meta or {})
    meta["fit"] = {
        "num_steps": len(y),
        "num_outliers": int((~keep).sum()),
        "total_measured_s": float(y.sum()),
        "total_predicted_s": float(pred.sum()),
        "rmse_s": float(np.sqrt(np.mean((pred - y) ** 2))),
        "r2": float(1 - np.sum((pred - y) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-12)),
    }
    return CostModel({name: float(c) for name, c in zip(FEATURES, coef)}, meta)
