"""The simulator calibrates itself to the machine: a cost model per CPU, torch and engine
settings, used when present, and a warning, said once, when only the shipped one fits."""

from __future__ import annotations

import logging

import pytest
import torch

from minivllm.sim import cost_model
from minivllm.sim.cost_model import CostModel, calibration_key, calibration_path
from minivllm.sim.simulator import make_simulated_engine


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A model cache with no calibration in it, and a process that has warned of nothing.

    The model converted in the real cache is linked in and its measured linear plans
    copied: the calibration under test needs no cost model of its own, and converting
    the GGUF again was half of this module's time."""
    import shutil

    from minivllm.worker.linear import PLAN_FILE
    from minivllm.worker.model_loader import DEFAULT_MODEL, cache_root

    real = cache_root()
    if (real / DEFAULT_MODEL).is_dir():
        (tmp_path / DEFAULT_MODEL).symlink_to(real / DEFAULT_MODEL, target_is_directory=True)
    if (real / PLAN_FILE).is_file():
        shutil.copy(real / PLAN_FILE, tmp_path / PLAN_FILE)
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_model, "_warned", set())  # the warned-once memory lives there
    return tmp_path


def test_the_key_changes_with_a_backend_the_dtype_or_torch(monkeypatch):
    base = calibration_path(calibration_key())
    assert calibration_path(calibration_key()) == base  # stable
    assert calibration_path(calibration_key(linear_backend="torch")) != \
        calibration_path(calibration_key(linear_backend="onednn"))
    assert calibration_path(calibration_key(dtype="bfloat16")) != base
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert calibration_path(calibration_key()) != base
    assert calibration_key()["cpu"]  # the CPU's name, whatever the OS calls it


def test_without_a_calibration_the_shipped_model_is_used_and_said_so_once(empty_cache, caplog):
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        engine = make_simulated_engine()
        make_simulated_engine()
    warnings = [r.getMessage() for r in caplog.records if "calibrated" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "minivllm bench calibrate" in warnings[0] and "shipped" in warnings[0]
    assert "shipped" in engine.trace.time_source


def test_a_calibration_for_this_machine_is_used_without_a_warning(empty_cache, caplog):
    mine = CostModel({n: 1e-3 for n in cost_model.FEATURES},
                     {"source": "calibrated on this machine", "cpu": "this CPU"})
    mine.save(calibration_path(calibration_key()))
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        engine = make_simulated_engine()
    assert not [r for r in caplog.records if "calibrated" in r.getMessage()]
    assert engine.model_runner.cost_model.coefficients == mine.coefficients
    assert engine.trace.time_source == "simulated (cost model calibrated on this machine, CPU this CPU)"
    # another backend is another machine, as far as step costs go
    other = make_simulated_engine(linear_backend="torch")
    assert "shipped" in other.trace.time_source


def test_figures_of_simulated_time_name_their_cost_model(empty_cache):
    from minivllm import viz
    from minivllm.bench import (
        chunked_prefill_benchmark,
        latency_benchmark,
        plot_chunked_prefill,
        plot_latency_vs_rate,
    )

    engine = make_simulated_engine(CostModel({n: 1e-3 for n in cost_model.FEATURES},
                                             {"source": "a test model"}))
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": [1] * 20},
                           simulator_params(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    texts = [t.get_text() for t in viz.plot_request_timeline(engine.trace).axes[0].texts]
    assert any("a test model" in t for t in texts), texts
    points = latency_benchmark(lambda: make_simulated_engine(), [1.0], n=3)
    fig = plot_latency_vs_rate(points)
    assert "shipped" in fig.get_suptitle()
    model = CostModel({n: 1e-3 for n in cost_model.FEATURES}, {"source": "a test model"})
    results = chunked_prefill_benchmark(
        lambda **kw: make_simulated_engine(model, **kw), num_decodes=2, decode_prompt_len=8,
        decode_tokens=4, long_prompt_len=64, inject_after_steps=1, chunk_budget=32)
    assert "a test model" in plot_chunked_prefill(results).axes[0].get_title()


def simulator_params(max_tokens: int):
    from minivllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.real_model
def test_calibrate_fits_checks_and_caches_this_machines_model(empty_cache, monkeypatch):
    from minivllm.sim import simulator_fit
    from minivllm.sim.simulator_fit import CalibrationError, calibrate

    # The real measure-and-fit, once (four requests: too few for a good model, so any
    # held-out error is accepted here).
    measured = []
    fit = simulator_fit.fit_simulator
    monkeypatch.setattr(simulator_fit, "fit_simulator",
                        lambda *a, **kw: measured.append(fit(*a, **kw)) or measured[-1])
    res = calibrate(n=4, max_error=float("inf"))
    cm = res["cost_model"]
    assert res["path"] == calibration_path(calibration_key()) and res["path"].exists()
    assert min(cm.coefficients.values()) >= 0
    held = cm.meta["held_out"]
    assert held["measured_wall_s"] > 0 and held["predicted_s"] > 0
    assert held["measured_steps"] > 0 and "seed=12" in held["workload"]
    assert CostModel.for_this_machine().coefficients == cm.coefficients

    # A model that misses its held-out check is refused, and nothing is saved. The same
    # measurements again (a second real run would only repeat them), against a bound of
    # zero, which any real measurement misses.
    res["path"].unlink()
    monkeypatch.setattr(simulator_fit, "fit_simulator", lambda *a, **kw: measured[0])
    with pytest.raises(CalibrationError, match="nothing was saved"):
        calibrate(n=4, max_error=0.0)
    assert not calibration_path(calibration_key()).exists()
