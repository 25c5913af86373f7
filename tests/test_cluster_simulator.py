"""The cluster simulator (minivllm.sim.cluster_simulator): N simulated replicas behind a policy.

The reference is the single-engine simulator, which nobody wrote for this module: with
one replica every policy must give its results request by request. The rest checks what
a cluster must do whatever its size: every request finishes, no block leaks, nothing
happens before it arrives, the router sees the outstanding counts of the arrival time.
"""

from __future__ import annotations

import pytest

from minivllm.entrypoints.routing import ROUTING_POLICIES, PrefixAware
from minivllm.sim.cluster_simulator import simulate_cluster, sweep
from minivllm.sim.cost_model import CostModel
from minivllm.sim.replay import replay_workload
from minivllm.sim.simulator import make_simulated_engine
from minivllm.sim.workload import WorkloadRequest, document_workload, iter_workload

COST = CostModel.load()  # the shipped model: the same numbers on every machine


def docs(rate: float | None = 4.0, num_documents: int = 40, questions: int = 5, seed: int = 0):
    return document_workload(None, num_documents=num_documents, questions_per_document=questions,
                             seed=seed, document_len=128, output_len=(8, 32), rate=rate)


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_one_replica_is_the_single_engine_simulator(policy):
    workload = docs()
    engine = make_simulated_engine(COST, max_trace_steps=200)
    ref = replay_workload(engine, workload).outputs
    res = simulate_cluster(workload, 1, policy, cost_model=COST)
    assert res.num_finished == len(ref) == len(workload)
    got = {r.request_id: r for r in res.requests}
    for rid, out in ref.items():
        assert got[rid].ttft == out.metrics.ttft  # exactly: the same steps in the same order
        assert got[rid].e2e == out.metrics.e2e_latency
        assert got[rid].num_cached_tokens == out.metrics.num_cached_tokens
    stats = engine.kv_cache_manager.prefix_cache_stats
    assert res.hit_rate == stats.hit_rate > 0


def test_round_robin_spreads_requests_evenly():
    res = simulate_cluster(docs(), 4, "round_robin", cost_model=COST)
    assert res.requests_per_replica == [50, 50, 50, 50]
    by_arrival = sorted(res.requests, key=lambda r: r.arrival_time)
    assert [r.replica for r in by_arrival[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_prefix_aware_beats_round_robin_on_shared_documents():
    workload = docs()
    rates = {}
    for policy in ("round_robin", "prefix_aware"):
        res = simulate_cluster(workload, 4, policy, cost_model=COST)
        rates[policy] = res.hit_rate
        # where the hits come from: questions about one document on one replica
        if policy == "prefix_aware":
            homes = {}
            for r in res.requests:
                homes.setdefault(r.request_id.split("-")[0], set()).add(r.replica)
            assert sum(len(h) == 1 for h in homes.values()) > len(homes) // 2
    # The best any router can do: each document computed once and reused by its other
    # questions (its full blocks), everything else computed.
    workload_tokens = sum(r.num_prompt_tokens for r in workload)
    ideal = 40 * (5 - 1) * (128 // 16 * 16) / workload_tokens
    # Prefix-aware keeps a document's questions together and reaches it; round robin
    # sends the 5 questions to different replicas in turn and reuses a document only
    # where its turn comes round to the same replica again.
    assert rates["prefix_aware"] == pytest.approx(ideal), (rates, ideal)
    assert rates["round_robin"] < rates["prefix_aware"] - 0.3, rates


def test_prefix_aware_falls_back_to_balance_under_a_hot_prefix():
    # One document, asked 60 times at once: every request matches replica 0's cache.
    hot = docs(rate=None, num_documents=1, questions=60)
    greedy = simulate_cluster(hot, 4, PrefixAware(block_size=16, balance_threshold=10_000), cost_model=COST)
    assert greedy.requests_per_replica == [60, 0, 0, 0]  # a popular prefix pulls everything
    assert greedy.num_fallbacks == 0
    balanced = simulate_cluster(hot, 4, PrefixAware(block_size=16, balance_threshold=4), cost_model=COST)
    assert balanced.num_fallbacks > 0
    counts = balanced.requests_per_replica
    assert max(counts) - min(counts) <= 4 + 1, counts
    assert balanced.num_finished == 60


def test_a_prefix_policy_with_other_blocks_than_the_replicas_is_refused():
    with pytest.raises(ValueError, match="block_size=16"):
        simulate_cluster(docs(), 2, PrefixAware(block_size=32), cost_model=COST)


def test_bad_replica_counts_and_unsorted_arrivals_are_refused():
    with pytest.raises(ValueError, match="num_replicas"):
        simulate_cluster(docs(), 0, cost_model=COST)
    late_first = [WorkloadRequest("a", [1, 2, 3], 4, 2.0), WorkloadRequest("b", [1, 2, 3], 4, 1.0)]
    with pytest.raises(ValueError, match="sort the workload"):
        simulate_cluster(late_first, 2, cost_model=COST)


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_invariants_and_causality(policy):
    workload = docs(rate=8.0)  # busy enough that queues form
    arrival = {r.request_id: r.arrival_time for r in workload}
    res = simulate_cluster(workload, 3, policy, cost_model=COST, record_routing=True)
    assert res.num_finished == res.num_requests == len(workload)
    assert sorted(r.request_id for r in res.requests) == sorted(arrival)
    assert res.no_block_leaked
    for r in res.requests:
        assert r.arrival_time == arrival[r.request_id]
        assert r.arrival_time <= r.first_scheduled_time < r.first_token_time <= r.finished_time
        assert r.num_output_tokens == next(w.max_tokens for w in workload if w.request_id == r.request_id)
    assert res.simulated_seconds == max(r.finished_time for r in res.requests)
    # The router saw, at each arrival, exactly the requests routed before it to each
    # replica that had not finished by then: nothing from the future, nothing stale.
    summary = {r.request_id: r for r in res.requests}
    routed: list[str] = []
    for rid, t, seen in res.routing_log:
        want = [0] * 3
        for earlier in routed:
            s = summary[earlier]
            if s.finished_time > t:
                want[s.replica] += 1
        assert list(seen) == want, (rid, t)
        routed.append(rid)
    assert any(sum(seen) > 1 for _, _, seen in res.routing_log)  # the check saw queues


def test_a_streamed_workload_is_served_without_being_held():
    # A generator (as bench simulate uses for 10,000 requests): consumed as arrivals come.
    stream = iter_workload(None, 300, seed=1, prompt_len=(20, 200), output_len=(4, 24), rate=20.0)
    res = simulate_cluster(stream, 4, "least_outstanding", cost_model=COST)
    assert res.num_finished == res.num_requests == 300 and res.no_block_leaked
    assert next(stream, None) is None


def test_seeded_runs_are_reproducible():
    a = simulate_cluster(docs(seed=3), 4, "prefix_aware", cost_model=COST)
    b = simulate_cluster(docs(seed=3), 4, "prefix_aware", cost_model=COST)
    c = simulate_cluster(docs(seed=4), 4, "prefix_aware", cost_model=COST)
    assert a.requests == b.requests and a.replicas == b.replicas
    assert a.requests != c.requests


def test_sweep_gives_a_row_per_policy_and_count():
    seen = []
    rows = sweep(lambda n: docs(rate=2.0 * n, num_documents=10, questions=3), [1, 2],
                 ["round_robin", "prefix_aware"], cost_model=COST, on_result=seen.append)
    assert [(r.num_replicas, r.policy) for r in rows] == [
        (1, "round_robin"), (1, "prefix_aware"), (2, "round_robin"), (2, "prefix_aware")]
    assert [r.hit_rate for r in rows] == [s.hit_rate for s in seen]
    assert rows[0].hit_rate == rows[1].hit_rate  # one replica: the policy cannot matter
    assert all(r.num_requests == 30 and r.p99_ttft >= r.p50_ttft > 0 for r in rows)


def test_the_sweep_figure_draws_the_rows():
    from minivllm import viz

    rows = sweep(lambda n: docs(rate=2.0 * n, num_documents=10, questions=3), [1, 2, 4],
                 ["round_robin", "prefix_aware"], cost_model=COST)
    fig = viz.plot_cluster_sweep(rows, time_source=COST.label)
    assert tuple(fig.get_size_inches()) == viz.CLUSTER_SWEEP_SIZE
    hit_ax, ttft_ax = fig.axes
    lines = {line.get_gid(): line for a in fig.axes for line in a.get_lines()}
    for policy in ("round_robin", "prefix_aware"):
        mine = [r for r in rows if r.policy == policy]
        hit = lines[f"hit_rate:{policy}"]
        assert list(hit.get_xdata()) == [1, 2, 4]
        assert list(hit.get_ydata()) == pytest.approx([100 * r.hit_rate for r in mine])
        assert list(lines[f"p99_ttft:{policy}"].get_ydata()) == pytest.approx([1e3 * r.p99_ttft for r in mine])
        assert lines[f"mean_ttft:{policy}"].get_color() == viz.POLICY_COLORS[policy]
    with pytest.raises(ValueError, match="no sweep rows"):
        viz.plot_cluster_sweep([])


def test_cli_bench_simulate_cluster(capsys, tmp_path):
    from minivllm.entrypoints.cli import main

    assert main(["bench", "simulate-cluster", "--num-requests", "40", "--cluster-replicas", "1,2",
                 "--figures", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "40 requests (10 documents of 256 tokens, 4 questions each)" in out
    table = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [(r[0], r[1]) for r in table] == [(str(n), p) for n in (1, 2) for p in ROUTING_POLICIES]
    assert len({r[2] for r in table[:3]}) == 1  # one replica: one hit rate, whatever the policy
    assert (tmp_path / "cluster_sweep.png").exists()
    with pytest.raises(SystemExit, match="--cluster-policies takes names of round_robin"):
        main(["bench", "simulate-cluster", "--cluster-policies", "random"])
    with pytest.raises(SystemExit, match="--cluster-replicas takes integers >= 1"):
        main(["bench", "simulate-cluster", "--cluster-replicas", "0,2"])
