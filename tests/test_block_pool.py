"""The block pool on its own: the free queue's order and the reference counts
(notebooks 03 and 07), checked against a plain model of what they must be.

The pool comes from ``components`` (tests/conftest.py): the engine's own, or a learner's
under ``minivllm check block_pool`` (build_it_yourself/block_pool.py).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.checks("block_pool")


def make_pool(components, num_blocks: int, enable_caching: bool = True):
    return components.classes["block_pool_cls"](num_blocks, enable_caching)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_new_blocks_come_from_the_front_of_the_free_queue(components):
    pool = make_pool(components, 5)
    taken = pool.get_new_blocks(2)
    assert ids(taken) == [0, 1] and [b.ref_cnt for b in taken] == [1, 1]
    assert pool.get_num_free_blocks() == 3
    pool.check_invariants()


def test_freed_blocks_join_the_back_in_the_order_given(components):
    pool = make_pool(components, 5)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c, a])  # c is freed first, so it is evicted first
    assert pool.get_num_free_blocks() == 4
    assert ids(pool.get_new_blocks(4)) == [3, 4, c.block_id, a.block_id], \
        "the free queue hands out the least recently freed block first (FIFO)"
    pool.check_invariants()


def test_a_shared_block_is_free_only_when_its_last_user_frees_it(components):
    pool = make_pool(components, 3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 2, "still owned by one request"
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    pool.check_invariants()


def test_touching_a_free_block_takes_it_out_of_the_free_queue(components):
    pool = make_pool(components, 3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    pool.touch([block])  # a prefix-cache hit on a free block
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert block not in pool.get_new_blocks(2), "an owned block was handed out again"
    pool.check_invariants()


def test_asking_for_more_blocks_than_are_free_fails_and_takes_none(components):
    pool = make_pool(components, 3)
    pool.get_new_blocks(2)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1
    pool.check_invariants()


def test_a_freed_cached_block_stays_findable_until_it_is_reused(components):
    pool = make_pool(components, 2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"prefix")
    pool.free_blocks([block])
    assert pool.get_cached_block(b"prefix") is block, "freeing keeps the cached content"
    pool.get_new_blocks(2)  # the pool runs out of never-used blocks and reuses it
    assert pool.get_cached_block(b"prefix") is None, "a reused block must be evicted from the cache"
    pool.check_invariants()


ops = st.lists(st.tuples(st.sampled_from(["get", "touch", "free"]), st.integers(0, 6)), max_size=40)


@settings(max_examples=80, deadline=None)
@given(num_blocks=st.integers(1, 8), ops=ops)
def test_random_operations_match_a_plain_model(components, num_blocks, ops):
    """A list in freeing order and a dict of counts is what the pool must behave like."""
    pool = make_pool(components, num_blocks)
    free = list(range(num_blocks))  # the model's free queue, front first
    refs = dict.fromkeys(range(num_blocks), 0)
    owned = []  # one entry per reference held, in the order taken
    for op, n in ops:
        if op == "get" and n <= len(free):
            got = ids(pool.get_new_blocks(n))
            expected, free[:n] = free[:n], []
            assert got == expected, f"get_new_blocks({n}) gave {got}, the free queue's front is {expected}"
            for i in got:
                refs[i] = 1
            owned += got
        elif op == "touch" and owned:
            i = owned[n % len(owned)]
            pool.touch([pool.blocks[i]])
            refs[i] += 1
            owned.append(i)
        elif op == "free" and owned:
            i = owned.pop(n % len(owned))
            pool.free_blocks([pool.blocks[i]])
            refs[i] -= 1
            if refs[i] == 0:
                free.append(i)
        assert pool.get_num_free_blocks() == len(free)
        assert {b.block_id: b.ref_cnt for b in pool.blocks} == refs
        pool.check_invariants()
    assert pool.usage == pytest.approx(1 - len(free) / num_blocks)
