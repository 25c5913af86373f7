"""The simulator from the command line: ``simulate`` and ``fit-simulator`` modes.

``minivllm bench simulate`` replays a long workload (10,000 requests by default) on the
shipped cost model, to show that the real scheduler and block manager keep every
invariant over thousands of requests and that memory stays flat.
``minivllm bench fit-simulator`` measures the real engine and fits a new cost model
(:mod:`minivllm.sim.simulator_fit`); ``minivllm bench calibrate`` does a short fit for this
machine and caches it, so later simulations use it. Notebook 09 explains them.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import minivllm
from minivllm.bench.common import engine_settings, load_tokenizer, save_figure
from minivllm.metrics import percentile
from minivllm.sim.cost_model import DEFAULT_COST_MODEL
from minivllm.sim.simulator import SimulationResult, simulate
from minivllm.sim.simulator_fit import (
    CalibrationError,
    calibrate,
    fit_simulator,
    plot_cost_model_fit,
)
from minivllm.sim.workload import iter_workload


def format_simulation(res: SimulationResult) -> str:
    rss = res.rss_samples
    grow = ""
    if len(rss) >= 2:
        grow = (f"; RSS {rss[0][1] / 2**20:.0f} MiB after {rss[0][0]} requests, "
                f"{rss[-1][1] / 2**20:.0f} MiB after {rss[-1][0]}")
    return (f"{res.num_finished}/{res.num_requests} requests finished in {res.wall_seconds:.1f} s of wall time "
            f"({res.num_steps} steps, {res.simulated_seconds:.0f} simulated s, {res.throughput:.0f} tok/s "
            f"simulated, {res.num_preemptions} preemptions); free blocks after: {res.free_blocks_after}/"
            f"{res.num_blocks}{grow}; TTFT p50 {percentile(res.ttft, 50):.2f} s, "
            f"p99 {percentile(res.ttft, 99):.2f} s")


def simulate_main(args: argparse.Namespace) -> int:
    """``minivllm bench simulate``: the chat workload, arrivals at ``--rate`` (or all at once)."""
    n = args.num_requests or 10000
    tok = load_tokenizer(args.model)
    res = simulate(iter_workload(tok, n, args.seed, rate=args.rate), **engine_settings(args))
    print(format_simulation(res))
    return 0


def fit_main(args: argparse.Namespace) -> int:
    """``minivllm bench fit-simulator``: fit, check, save (by default over the shipped model)."""
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    out = args.out or str(Path(minivllm.__file__).parent / "data" / DEFAULT_COST_MODEL)
    res = fit_simulator(args.model, n=args.num_requests or 32, out_path=out,
                        command=command or "python -m minivllm.bench fit-simulator")
    cm = res["cost_model"]
    print("coefficients (s):", {k: f"{v:.3e}" for k, v in cm.coefficients.items()})
    print("fit:", cm.meta["fit"])
    print("held out:", cm.meta["held_out"])
    print(f"saved {out}")
    save_figure(plot_cost_model_fit(cm, res["traces"]), args.figures, "simulator_fit.png")
    return 0


def calibrate_main(args: argparse.Namespace) -> int:
    """``minivllm bench calibrate``: fit this machine's cost model, check it, cache it."""
    try:
        res = calibrate(args.model, n=args.num_requests or 24)
    except CalibrationError as e:
        print(f"calibration failed: {e}", file=sys.stderr)
        return 1
    cm = res["cost_model"]
    held = cm.meta["held_out"]
    print(f"this machine: {cm.meta['cpu']}, torch {cm.meta['torch']}, "
          f"{cm.meta['torch_threads']} threads, linear backend {cm.meta['linear_backend']}")
    print("coefficients (ms):", {k: round(v * 1e3, 4) for k, v in cm.coefficients.items()})
    print(f"fit: {cm.meta['fit']['num_steps']} steps, R^2 {cm.meta['fit']['r2']:.3f}")
    print(f"held out ({held['workload']}): measured {held['measured_wall_s']:.2f} s, simulated "
          f"{held['predicted_s']:.2f} s, error {held['error']:+.1%}")
    print(f"saved {res['path']} ({cm.meta['calibration_seconds']:.0f} s); simulations on this "
          f"machine now use it")
    return 0
