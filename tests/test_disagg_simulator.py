"""The disaggregated simulator (minivllm.sim.disagg_simulator): a prefill pool and a decode
pool on one simulated time line.

What must hold: a request's first token costs its prefill on the prefill pool, its KV's
bytes over the transfer bandwidth and its last partial block on the decode pool; the
decode pool computes nothing else of any prompt; every request finishes with its tokens,
nothing happens before it arrives, and no block of either pool is left owned.
"""

from __future__ import annotations

import pytest

from minivllm.sim.cost_model import CostModel
from minivllm.sim.disagg_simulator import attainment, goodput_sweep, simulate_disaggregated
from minivllm.sim.workload import WorkloadRequest, make_workload

COST = CostModel.load()  # the shipped model: the same numbers on every machine
BYTES = float(COST.meta["kv_bytes_per_token"])


def test_one_request_pays_its_prefill_its_transfer_and_its_last_block():
    request = WorkloadRequest("r", list(range(100, 200)), max_tokens=5)  # 100 tokens: 6 full blocks of 16
    fast = simulate_disaggregated([request], 1, 1, transfer_gb_per_s=2.0, cost_model=COST)
    slow = simulate_disaggregated([request], 1, 1, transfer_gb_per_s=1.0, cost_model=COST)
    [a], [b] = fast.requests, slow.requests
    assert fast.transferred_bytes == 96 * BYTES
    assert fast.decode_prefill_tokens == 4  # only the last partial block is computed again
    assert b.ttft - a.ttft == pytest.approx(96 * BYTES / 1e9 - 96 * BYTES / 2e9, rel=1e-9)
    assert b.tpot == pytest.approx(a.tpot) and a.num_output_tokens == 5
    assert fast.no_block_leaked and slow.no_block_leaked


def test_every_request_finishes_and_no_block_leaks():
    workload = make_workload(None, 60, seed=3, prompt_len=(20, 400), output_len=(1, 40), rate=4.0)
    res = simulate_disaggregated(workload, 2, 2, cost_model=COST, block_size=16)
    assert len(res.requests) == 60
    assert sorted(s.num_output_tokens for s in res.requests) == sorted(r.max_tokens for r in workload)
    assert all(s.arrival_time < s.first_token_time <= s.finished_time for s in res.requests)
    full = [(len(r.prompt_token_ids) - 1) // 16 * 16 for r in workload]
    assert res.decode_prefill_tokens == sum(len(r.prompt_token_ids) for r in workload) - sum(full)
    assert res.transferred_bytes == sum(int(f * BYTES) for f in full)
    assert res.no_block_leaked


def test_the_goodput_sweep_compares_the_split_with_as_many_colocated():
    def workload(rate):
        return make_workload(None, 30, seed=1, prompt_len=(64, 256), output_len=(4, 16), rate=rate)

    rows = goodput_sweep(workload, [0.05, 50.0], 1, 1, ttft_bound=1e9, tpot_bound=1e9, cost_model=COST)
    assert [(r["rate"], r["layout"]) for r in rows] == [
        (0.05, "1P+1D"), (0.05, "2 colocated"), (50.0, "1P+1D"), (50.0, "2 colocated")]
    assert all(r["requests"] == 30 and r["attainment"] == 1.0 for r in rows)  # bounds nobody misses
    busy = [r for r in rows if r["rate"] == 50.0]
    assert all(r["ttft_p90"] > q["ttft_p90"] for r, q in zip(busy, rows[:2]))  # a queue at 50 req/s
    assert attainment([], 1.0, 1.0) == 0.0


@pytest.mark.parametrize("kwargs", [dict(num_prefill=0), dict(num_decode=True), dict(transfer_gb_per_s=0)])
def test_bad_sizes_are_refused(kwargs):
    args = dict(num_prefill=1, num_decode=1, transfer_gb_per_s=1.0) | kwargs
    with pytest.raises(ValueError):
        simulate_disaggregated([], cost_model=COST, **args)


def test_bench_simulate_disagg_prints_the_sweep_and_each_layouts_goodput(capsys):
    from minivllm.entrypoints.cli import main

    assert main(["bench", "simulate-disagg", "--num-requests", "20", "--disagg-rates", "0.05",
                 "--pools", "1:1", "--ttft-bound", "1000", "--tpot-bound", "10"]) == 0
    out = capsys.readouterr().out
    assert "| 0.05 | 1P+1D | 100% |" in out and "| 0.05 | 2 colocated | 100% |" in out
    assert "goodput of 1P+1D (the highest rate swept with >= 90% within both bounds): 0.05 req/s" in out


@pytest.mark.parametrize(("argv", "flag"), [
    (["simulate-disagg", "--pools", "1:0"], "--pools"), (["simulate-disagg", "--pools", "2"], "--pools"),
    (["simulate-disagg", "--disagg-rates", "0.5,nan"], "--disagg-rates"),
    (["simulate-disagg", "--tpot-bound", "0"], "--tpot-bound"),
    (["simulate-disagg", "--transfer-gb-per-s", "inf"], "--transfer-gb-per-s"),
    (["disagg", "--long-rate", "0"], "--long-rate"), (["disagg", "--duration", "nan"], "--duration"),
    (["disagg", "--chatters", "-1"], "--chatters")])
def test_bad_bench_flags_are_refused_by_name(argv, flag, capsys):
    from minivllm.entrypoints.cli import main

    assert main(["bench", *argv]) == 2
    assert flag in capsys.readouterr().out


def test_the_sweep_refuses_a_bound_that_is_not_a_time():
    with pytest.raises(ValueError, match="ttft_bound"):
        goodput_sweep(lambda rate: [], [1.0], 1, 1, ttft_bound=float("nan"), tpot_bound=0.1, cost_model=COST)
