"""Scheduler and block manager behaviour, driven without a model.

A fake "runner" samples token 1 for every request that reaches the end of its known
tokens, which is all the scheduler needs to see to move requests along.

The parts are built from ``components`` (tests/conftest.py): the engine's own classes,
or a learner's under ``minivllm check`` (the ``checks`` marks say for which pieces).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.core.kv_cache_manager import KVCacheManager, cdiv
from minivllm.core.scheduler import Scheduler
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.worker.model_runner import ModelRunnerOutput


def make_scheduler(components, num_blocks=1000, block_size=16, budget=1024, max_num_seqs=64,
                   max_model_len=4096, chunked=True, caching=False) -> Scheduler:
    kv = components.kv_cache_manager(num_blocks, block_size, enable_caching=caching)
    return components.scheduler(kv, max_num_seqs, budget, max_model_len, chunked)


def make_request(rid, prompt_len, max_tokens=8, first_token=0) -> Request:
    ids = [(first_token + i) % 1000 for i in range(prompt_len)]
    return Request(str(rid), ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), 0.0)


def fake_step(sched: Scheduler):
    out = sched.schedule()
    sampled = {s.request.request_id: [1] for s in out.scheduled if s.samples}
    sched.update_from_output(out, ModelRunnerOutput(sampled, 0.0))
    return out


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    kv.check_invariants()  # free xor owned; ref counts == number of tables listing a block
    assert len(sched.running) <= sched.max_num_seqs
    for r in sched.running:
        blocks = kv.req_to_blocks[r.request_id]
        assert len(blocks) >= cdiv(r.num_computed_tokens, kv.block_size)
    for r in sched.waiting:
        assert r.request_id not in kv.req_to_blocks or not kv.req_to_blocks[r.request_id]


@pytest.mark.checks("kv_cache_manager", "scheduler")
def test_budget_split_three_long_prompts(components):
    sched = make_scheduler(components, budget=1024)
    for i in range(3):
        sched.add_request(make_request(i, 800))
    first = fake_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [("0", 800), ("1", 224)]
    second = fake_step(sched)
    # Request 0 now decodes; request 1 finishes its prompt; request 2 starts with the rest.
    assert [(s.request.request_id, s.num_new_tokens, s.is_prefill) for s in second.scheduled] == [
        ("0", 1, False), ("1", 576, True), ("2", 447, True)
    ]
    third = fake_step(sched)
    assert [(s.request.request_id, s.num_new_tokens, s.is_prefill) for s in third.scheduled] == [
        ("0", 1, False), ("1", 1, False), ("2", 353, True)
    ]


@pytest.mark.checks("kv_cache_manager", "scheduler")
def test_without_chunking_a_prompt_waits_for_a_whole_budget(components):
    sched = make_scheduler(components, budget=1024, chunked=False)
    for i in range(3):
        sched.add_request(make_request(i, 800))
    first = fake_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [("0", 800)]
    second = fake_step(sched)
    # 1023 tokens of budget are left after the decode: the next prompt fits whole.
    assert [(s.request.request_id, s.num_new_tokens) for s in second.scheduled] == [("0", 1), ("1", 800)]


@pytest.mark.checks("scheduler")
def test_max_num_seqs_is_never_exceeded(components):
    sched = make_scheduler(components, max_num_seqs=3)
    for i in range(10):
        sched.add_request(make_request(i, 5, max_tokens=4))
    while sched.has_unfinished_requests():
        out = fake_step(sched)
        assert len(out.scheduled) <= 3
        assert len(sched.running) <= 3


@pytest.mark.checks("block_pool", "kv_cache_manager", "scheduler", "preemption")
def test_preemption_victim_is_the_most_recently_admitted(components):
    # 4 blocks of 4 tokens. Three 4-token prompts take 3 blocks; after one decode each
    # needs a second block, and only one is free.
    sched = make_scheduler(components, num_blocks=4, block_size=4, budget=64)
    for i in range(3):
        sched.add_request(make_request(i, 4, max_tokens=6))
    fake_step(sched)  # prefill all three, each samples a token
    out = fake_step(sched)
    assert out.preempted == ["2", "1"] or out.preempted == ["2"]
    assert out.preempted[0] == "2"
    victim = sched.requests["2"]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert sched.waiting[0] is victim  # back at the front of the queue
    assert victim.output_token_ids == [1]  # what it generated is kept for the recompute
    check_invariants(sched)
    while sched.has_unfinished_requests():
        fake_step(sched)
        check_invariants(sched)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 4
    assert victim.num_output_tokens == 6 and victim.status == RequestStatus.FINISHED_LENGTH


@pytest.mark.checks("kv_cache_manager", "scheduler", "preemption")
def test_resumed_request_recomputes_prompt_and_outputs(components):
    sched = make_scheduler(components, num_blocks=4, block_size=4, budget=64)
    for i in range(3):
        sched.add_request(make_request(i, 4, max_tokens=6))
    fake_step(sched)
    fake_step(sched)
    steps = []
    while sched.has_unfinished_requests():
        steps.append(fake_step(sched))
    resumed = [s for out in steps for s in out.scheduled if s.request.request_id == "2" and s.is_prefill]
    # Its first chunk back covers the prompt plus the token it had generated.
    assert resumed and resumed[0].num_computed_tokens == 0
    assert resumed[0].num_new_tokens == 5


@pytest.mark.checks("block_pool", "kv_cache_manager", "scheduler", "preemption", "prefix_cache")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(1, 96),
    max_num_seqs=st.integers(1, 8),
    caching=st.booleans(),
)
def test_random_workloads_keep_invariants(components, data, block_size, budget, max_num_seqs, caching):
    max_model_len = 64
    num_blocks = data.draw(st.integers(cdiv(max_model_len, block_size), 3 * cdiv(max_model_len, block_size)))
    sched = make_scheduler(components, num_blocks, block_size, budget, max_num_seqs, max_model_len, caching=caching)
    n = data.draw(st.integers(1, 12))
    arrivals = sorted(data.draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)))
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    outs = data.draw(st.lists(st.integers(1, 23), min_size=n, max_size=n))
    # A few shared prefixes so the prefix cache sees hits.
    firsts = data.draw(st.lists(st.sampled_from([0, 0, 7]), min_size=n, max_size=n))
    aborts = data.draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, n - 1)), max_size=4))
    requests = [make_request(i, lengths[i], outs[i], firsts[i]) for i in range(n)]
    step = 0
    added = 0
    while added < n or sched.has_unfinished_requests():
        while added < n and arrivals[added] <= step:
            sched.add_request(requests[added])
            added += 1
        for when, which in aborts:
            r = requests[which]
            if when == step and which < added and not r.is_finished:
                sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
        out = fake_step(sched)
        assert out.num_scheduled_tokens <= budget
        check_invariants(sched)
        step += 1
        assert step < 10_000, "no progress"
    for r in requests:
        assert r.is_finished
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert r.num_output_tokens == r.sampling_params.max_tokens or r.num_tokens >= max_model_len
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not sched.kv_cache_manager.req_to_blocks


# -- scheduling_policy="priority" (the engine's own Scheduler: the build-it-yourself
# pieces are first come, first served, so these tests check no learner's class) --------
def make_priority_scheduler(num_blocks=1000, block_size=16, budget=1024, max_num_seqs=64,
                            max_model_len=4096, policy="priority") -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
    return Scheduler(kv, max_num_seqs, budget, max_model_len, True, policy=policy)


def prioritized(rid, prompt_len, priority, max_tokens=8, arrival=0.0) -> Request:
    ids = [i % 1000 for i in range(prompt_len)]
    return Request(str(rid), ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                   arrival, priority=priority)


def admission_order(sched: Scheduler) -> list[str]:
    """Run to the end; the ids in the order they were first admitted."""
    order: list[str] = []
    while sched.has_unfinished_requests():
        out = fake_step(sched)
        order += [rid for rid in out.prefix_cache_hits if rid not in order]
    return order


@pytest.mark.parametrize("policy, expected", [
    ("fcfs", ["0", "1", "2", "3", "4"]),
    # lower first; equal priorities (0: "1" and "3"; 2: "0" and "4") in arrival order
    ("priority", ["1", "3", "2", "0", "4"]),
])
def test_admission_order_follows_the_policy(policy, expected):
    sched = make_priority_scheduler(max_num_seqs=1, policy=policy)
    for i, p in enumerate([2, 0, 1, 0, 2]):
        sched.add_request(prioritized(i, 5, p if policy == "priority" else 0, max_tokens=2))
    assert admission_order(sched) == expected


def test_priority_ties_go_by_arrival_time_then_by_order_added():
    sched = make_priority_scheduler(max_num_seqs=1)
    sched.add_request(prioritized("late", 5, 0, arrival=2.0))
    sched.add_request(prioritized("early", 5, 0, arrival=1.0))
    sched.add_request(prioritized("early-too", 5, 0, arrival=1.0))
    assert admission_order(sched) == ["early", "early-too", "late"]


def test_an_important_request_overtakes_a_queue_that_arrived_first():
    # Batch requests (priority 1) fill the queue; an interactive one (0) arriving after
    # them is admitted at the next free seat, ahead of all the batch requests still waiting.
    sched = make_priority_scheduler(max_num_seqs=2)
    for i in range(6):
        sched.add_request(prioritized(f"batch{i}", 20, 1, max_tokens=4))
    fake_step(sched)
    sched.add_request(prioritized("chat", 5, 0, max_tokens=4))
    order = admission_order(sched)
    assert order[0] == "chat", order
    assert order[1:] == [f"batch{i}" for i in range(2, 6)]


@pytest.mark.parametrize("priorities, victim, still_scheduled", [
    # fcfs-like when all are equal: the most recently admitted
    ([0, 0, 0], "2", ["0", "1"]),
    # the least important, though it already decoded this step: its tokens are taken
    # back and the requests after it are still scheduled (none skipped)
    ([3, 0, 0], "0", ["1", "2"]),
    # the least important is the one needing room: it preempts itself, and the more
    # important "2" (admitted before it, by priority) keeps running
    ([0, 5, 0], "1", ["0", "2"]),
])
def test_preemption_victim_is_the_least_important(priorities, victim, still_scheduled):
    # 4 blocks of 4 tokens: three 4-token prompts take 3; after one token each, the
    # next decodes need 3 more blocks and only one is free.
    sched = make_priority_scheduler(num_blocks=4, block_size=4, budget=64)
    for i, p in enumerate(priorities):
        sched.add_request(prioritized(i, 4, p, max_tokens=6))
    fake_step(sched)
    out = fake_step(sched)
    assert out.preempted == [victim]
    assert sorted(s.request.request_id for s in out.scheduled) == still_scheduled
    assert out.num_scheduled_tokens == len(still_scheduled)  # the victim's token was given back
    check_invariants(sched)
    while sched.has_unfinished_requests():
        fake_step(sched)
        check_invariants(sched)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 4


def test_the_victim_may_be_one_that_already_ran_this_step():
    # "old" (priority 3) is admitted first, so it is first in ``running`` and decodes
    # first each step; then two important requests fill the cache. When "a" needs a
    # block, "old" is evicted although it already got its token this step: that token is
    # taken back, and "b", after "a" in the loop, still runs (none skipped).
    sched = make_priority_scheduler(num_blocks=4, block_size=4, budget=64)
    sched.add_request(prioritized("old", 4, 3, max_tokens=6))
    fake_step(sched)
    sched.add_request(prioritized("a", 4, 0, max_tokens=6))
    sched.add_request(prioritized("b", 4, 0, max_tokens=6))
    fake_step(sched)
    out = fake_step(sched)
    assert out.preempted == ["old"]
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
    check_invariants(sched)
    while sched.has_unfinished_requests():
        fake_step(sched)
        check_invariants(sched)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 4


def test_a_priority_other_than_zero_needs_the_priority_policy():
    from minivllm.engine.processor import check_priority
    from minivllm.exceptions import ValidationError

    assert check_priority(0, "fcfs") == 0 and check_priority(-3, "priority") == -3
    with pytest.raises(ValidationError, match="priority scheduling is not enabled") as e:
        check_priority(1, "fcfs")
    assert e.value.param == "priority"
    with pytest.raises(TypeError, match="integer"):
        check_priority(1.0, "priority")
    with pytest.raises(ValueError, match="policy"):
        make_priority_scheduler(policy="lifo")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(1, 96),
    max_num_seqs=st.integers(1, 8),
)
def test_random_priorities_keep_order_and_invariants(data, block_size, budget, max_num_seqs):
    """Under random priorities, arrivals and memory pressure: the waiting queue is always
    in (priority, arrival) order; nobody is admitted while a more important request
    waits; every victim is less important than every request left running; equal
    priorities are first admitted in arrival order; every request finishes in full and
    every block is free at the end."""
    max_model_len = 64
    num_blocks = data.draw(st.integers(cdiv(max_model_len, block_size), 3 * cdiv(max_model_len, block_size)))
    sched = make_priority_scheduler(num_blocks, block_size, budget, max_num_seqs, max_model_len)
    n = data.draw(st.integers(1, 12))
    arrivals = sorted(data.draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)))
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    outs = data.draw(st.lists(st.integers(1, 23), min_size=n, max_size=n))
    priorities = data.draw(st.lists(st.integers(-2, 2), min_size=n, max_size=n))
    requests = [prioritized(i, lengths[i], priorities[i], outs[i], float(arrivals[i])) for i in range(n)]
    first_admitted: list[str] = []
    step = added = 0
    while added < n or sched.has_unfinished_requests():
        while added < n and arrivals[added] <= step:
            sched.add_request(requests[added])
            added += 1
        keys = {r.request_id: sched.priority_key(r) for r in sched.requests.values()}
        out = fake_step(sched)
        assert out.num_scheduled_tokens <= budget
        check_invariants(sched)
        waiting = [keys[r.request_id] for r in sched.waiting]
        assert waiting == sorted(waiting)
        for rid in out.prefix_cache_hits:  # admitted this step
            assert all(keys[rid] < k for k in waiting)
            if rid not in first_admitted:
                first_admitted.append(rid)
        for victim in out.preempted:
            assert all(keys[r.request_id] < keys[victim] for r in sched.running)
        step += 1
        assert step < 10_000, "no progress"
    for p in set(priorities):  # no overtaking among equals
        same = [r.request_id for r in requests if r.priority == p]
        assert [rid for rid in first_admitted if rid in same] == same
    for r in requests:
        assert r.num_output_tokens == r.sampling_params.max_tokens or r.num_tokens >= max_model_len
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
