"""Routing policies (minivllm.entrypoints.routing): what each one chooses, on hand-made replicas."""

from __future__ import annotations

import pytest

from minivllm.entrypoints.routing import (
    NoReplicaAvailable,
    PrefixAware,
    ReplicaState,
    block_hashes,
    make_policy,
)


def replicas(*outstanding: int) -> list[ReplicaState]:
    return [ReplicaState(f"r{i}", n) for i, n in enumerate(outstanding)]


def test_round_robin_cycles_and_skips_unhealthy():
    policy = make_policy("round_robin")
    rs = replicas(0, 0, 0)
    assert [policy.choose([1], rs) for _ in range(4)] == [0, 1, 2, 0]
    rs[2].healthy = False
    assert [policy.choose([1], rs) for _ in range(3)] == [1, 0, 1]


def test_least_outstanding_picks_the_idlest():
    policy = make_policy("least_outstanding")
    assert policy.choose([1], replicas(3, 1, 2)) == 1
    assert policy.choose([1], replicas(2, 2, 2)) == 0  # ties: lowest index


def test_no_healthy_replica_is_a_clear_error():
    rs = replicas(0, 0)
    for r in rs:
        r.healthy = False
    for name in ("round_robin", "least_outstanding", "prefix_aware"):
        with pytest.raises(NoReplicaAvailable, match="no healthy replica"):
            make_policy(name).choose([1, 2, 3], rs)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="round_robin, least_outstanding, prefix_aware"):
        make_policy("random")


def test_block_hashes_cover_full_blocks_and_chain():
    assert len(block_hashes(list(range(9)), 4)) == 2
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4), block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second block, different first: a different prefix


def test_prefix_aware_follows_the_longest_cached_prefix():
    policy = PrefixAware(block_size=4, balance_threshold=8)
    rs = replicas(0, 0)
    doc_a, doc_b = list(range(100, 112)), list(range(200, 212))
    assert policy.choose(doc_a + [1], rs) == 0        # nothing cached anywhere: least loaded
    rs[0].outstanding = 1
    assert policy.choose(doc_b + [2], rs) == 1        # nothing cached: the idle replica
    rs[1].outstanding = 1
    # follow-ups go where their document's blocks are, whatever the load order says
    rs[0].outstanding = 5
    assert policy.choose(doc_a + [3, 4, 5], rs) == 0
    assert policy.choose(doc_b + [6], rs) == 1
    assert policy.fallbacks == 0


def test_prefix_aware_falls_back_when_the_cached_replica_is_saturated():
    policy = PrefixAware(block_size=4, balance_threshold=2)
    rs = replicas(0, 0)
    doc = list(range(100, 108))
    assert policy.choose(doc, rs) == 0
    rs[0].outstanding = 3  # 3 more than replica 1: past the threshold of 2
    assert policy.choose(doc + [1], rs) == 1
    assert policy.fallbacks == 1
    # replica 1 now holds the prefix too: both match, the less busy one wins
    rs[1].outstanding = 1
    assert policy.choose(doc + [2], rs) == 1


def test_prefix_aware_forgets_a_replica_that_left():
    policy = PrefixAware(block_size=4)
    rs = replicas(0, 0)
    doc = list(range(8))
    assert policy.choose(doc, rs) == 0
    rs[0].outstanding, rs[1].outstanding = 1, 2
    assert policy.choose(doc, rs) == 0
    policy.forget("r0")
    assert policy.matched_blocks(block_hashes(doc, 4), rs[0]) == 0


def test_prefix_aware_memory_is_bounded():
    policy = PrefixAware(block_size=2, max_blocks_per_replica=3)
    rs = replicas(0)
    policy.choose(list(range(20)), rs)
    assert len(policy.seen["r0"]) == 3


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "2"])
def test_the_router_refuses_a_health_interval_that_is_not_a_positive_number(bad):
    from minivllm.entrypoints.router import Router
    from minivllm.exceptions import ValidationError

    with pytest.raises(ValidationError, match="health_interval must be a number of seconds > 0"):
        Router(["http://127.0.0.1:1"], make_policy("round_robin"), health_interval=bad)
