"""``minivllm bench simulate-cluster``: the simulated scale-out, replicas x routing policies.

Each run serves the same kind of traffic: many documents, several questions about each
(:func:`~minivllm.sim.workload.document_workload`, interleaved), with Poisson arrivals at
``--rate-per-replica`` times the number of replicas, so every replica sees the same load
whatever the cluster's size. For each replica count of ``--cluster-replicas`` and each
policy of ``--cluster-policies`` it prints the cluster's prefix-cache hit rate, mean and
p99 time to first token, throughput and the balance (fewest and most requests on one
replica), and draws :func:`minivllm.viz.plot_cluster_sweep`. The times are simulated
(:mod:`minivllm.sim.cluster_simulator`), so 64 replicas take seconds of this machine's time.
"""

from __future__ import annotations

import argparse
import logging

from minivllm.bench.common import engine_settings, load_tokenizer, save_figure
from minivllm.entrypoints.routing import ROUTING_POLICIES
from minivllm.sim.cluster_simulator import ClusterResult, SweepRow, sweep
from minivllm.sim.cost_model import CostModel
from minivllm.sim.workload import document_workload

DEFAULT_REQUESTS = 2000
QUESTIONS_PER_DOCUMENT = 4
DOCUMENT_LEN = 256


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} takes integers >= 1, got {text!r}")
    return values


def _policies(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in ROUTING_POLICIES]
    if not names or unknown:
        raise SystemExit(f"--cluster-policies takes names of {', '.join(ROUTING_POLICIES)}, got {text!r}")
    return names


def format_row(row: SweepRow) -> str:
    return (f"{row.num_replicas:>4} {row.policy:<18} {100 * row.hit_rate:6.1f}% "
            f"{1e3 * row.mean_ttft:9.0f} {1e3 * row.p99_ttft:9.0f} {row.throughput:10.0f} "
            f"{row.min_requests:>5}-{row.max_requests:<5} {row.wall_seconds:6.1f}")


HEADER = (f"{'N':>4} {'policy':<18} {'hit':>7} {'TTFT ms':>9} {'p99 ms':>9} {'tok/s':>10} "
          f"{'balance':<11} {'wall s':>6}")


def main(args: argparse.Namespace) -> int:
    """``minivllm bench simulate-cluster``: replicas x routing policies on the simulator's clock."""
    counts = _ints(args.cluster_replicas, "--cluster-replicas")
    policies = _policies(args.cluster_policies)
    n = args.num_requests or DEFAULT_REQUESTS
    num_documents = max(1, n // QUESTIONS_PER_DOCUMENT)
    if args.rate_per_replica <= 0:
        raise SystemExit(f"--rate-per-replica must be > 0 requests/s, got {args.rate_per_replica}")
    tok = load_tokenizer(args.model)
    cost_model = CostModel.for_this_machine()

    def workload(replicas: int):
        return document_workload(tok, num_documents=num_documents, questions_per_document=QUESTIONS_PER_DOCUMENT,
                                 seed=args.seed, document_len=DOCUMENT_LEN,
                                 rate=args.rate_per_replica * replicas)

    print(f"{num_documents * QUESTIONS_PER_DOCUMENT} requests ({num_documents} documents of {DOCUMENT_LEN} "
          f"tokens, {QUESTIONS_PER_DOCUMENT} questions each), {args.rate_per_replica} req/s per replica; "
          f"times simulated by the {cost_model.label}")
    settings = engine_settings(args)
    print(f"each replica: {', '.join(f'{k} {v}' for k, v in settings.items())}, prefix caching on")
    print(HEADER)

    def check(res: ClusterResult) -> None:
        if res.num_finished != res.num_requests or not res.no_block_leaked:
            raise RuntimeError(f"{res.policy} on {res.num_replicas} replicas: {res.num_finished}/"
                               f"{res.num_requests} finished, blocks leaked: {not res.no_block_leaked}")
        print(format_row(res.row()), flush=True)

    # One KV-cache line per replica would bury the table; the header says what they share.
    logger = logging.getLogger("minivllm")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        rows = sweep(workload, counts, policies, cost_model=cost_model, on_result=check, **settings)
    finally:
        logger.setLevel(level)
    print(f"total wall time {sum(r.wall_seconds for r in rows):.0f} s")
    from minivllm.viz import plot_cluster_sweep

    save_figure(plot_cluster_sweep(rows, time_source=cost_model.label), args.figures, "cluster_sweep.png")
    return 0
