"""Automatic prefix caching: same tokens as without it, exact hit counts, sane eviction.

The KV cache manager and block pool come from ``components`` (tests/conftest.py): the
engine's own, or a learner's under ``minivllm check`` (the ``checks`` marks say which).
"""

from __future__ import annotations

import random

import pytest
from helpers import all_blocks_free, greedy, hf_greedy, run_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import LLM
from minivllm.core.block_pool import hash_block_tokens
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams
from minivllm.worker.model_loader import make_tiny_model

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", vocab_size=VOCAB)


def run_both(model, components, prompts, lengths, **kw):
    on = LLM(model, enable_prefix_caching=True, **components.engine, **kw)
    off = LLM(model, enable_prefix_caching=False, **components.engine, **kw)
    a, b = run_engine(on, prompts, lengths), run_engine(off, prompts, lengths)
    assert all_blocks_free(on) and all_blocks_free(off)
    return on, a, b


@pytest.mark.checks("kv_cache_manager", "prefix_cache")
def test_shared_system_prompt(model, components):
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(70)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(10)]
    lengths = [rng.randint(4, 12) for _ in prompts]
    on, a, b = run_both(model, components, prompts, lengths, block_size=16)
    assert a == b == [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    stats = on.llm_engine.kv_cache_manager.prefix_cache_stats
    assert stats.hits >= 9 * 64  # every request after the first reuses the 4 full system blocks


@pytest.mark.checks("prefix_cache")
def test_multi_turn_chat_resending_history(model, components):
    rng = random.Random(1)
    history: list[int] = []
    on = LLM(model, block_size=8, **components.engine)
    off = LLM(model, block_size=8, enable_prefix_caching=False, **components.engine)
    hits = []
    for _turn in range(4):
        history = history + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))]
        before = on.llm_engine.kv_cache_manager.prefix_cache_stats.hits
        out_on = run_engine(on, [history], [6])[0]
        out_off = run_engine(off, [history], [6])[0]
        assert out_on == out_off == hf_greedy(model, history, 6)
        hits.append(on.llm_engine.kv_cache_manager.prefix_cache_stats.hits - before)
        history = history + out_on
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])
    assert hits == sorted(hits)  # each turn finds more of its history cached


@pytest.mark.checks("kv_cache_manager", "prefix_cache")
def test_identical_prompts_together_and_all_but_last_token(model, components):
    base = list(range(3, 40))
    prompts = [base, base, base, base[:-1] + [1], base[:-1] + [2]]
    on, a, b = run_both(model, components, prompts, [5] * 5, block_size=4, max_num_batched_tokens=64)
    assert a == b
    assert a[0] == a[1] == a[2]


@pytest.mark.checks("block_pool", "kv_cache_manager", "preemption", "prefix_cache")
def test_under_pressure_with_eviction_and_preemption(model, components):
    rng = random.Random(2)
    system = [rng.randrange(VOCAB) for _ in range(24)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(12)]
    lengths = [rng.randint(5, 25) for _ in prompts]
    on, a, b = run_both(model, components, prompts, lengths, block_size=4, num_kv_blocks=30, max_num_batched_tokens=48)
    assert a == b
    assert sum(len(s.preempted) for s in on.trace.steps) > 0
    stats = on.llm_engine.kv_cache_manager.prefix_cache_stats
    assert stats.hits > 0 and stats.preempted_queries > 0  # resumptions are counted apart


@pytest.mark.checks("block_pool", "kv_cache_manager", "prefix_cache")
def test_exact_hit_counts(components):
    kv = components.kv_cache_manager(num_blocks=20, block_size=16)
    params = SamplingParams(max_tokens=4)
    prefix = list(range(100, 148))  # 48 tokens = 3 full blocks
    first = Request("a", prefix, params, 0.0)
    blocks, hit = kv.get_computed_blocks(first)
    assert hit == 0
    assert kv.allocate_slots(first, 48) is not None
    kv.free(first)  # freed, but its blocks stay cached

    longer = Request("b", prefix + list(range(7)), params, 0.0)  # 55 tokens
    blocks, hit = kv.get_computed_blocks(longer)
    assert hit == 48 and len(blocks) == 3
    same = Request("c", prefix, params, 0.0)  # identical 48 tokens: the last is recomputed
    blocks, hit = kv.get_computed_blocks(same)
    assert hit == 32
    assert kv.prefix_cache_stats.queries == 48 + 55 + 48
    assert kv.prefix_cache_stats.hits == 48 + 32


def test_hash_is_a_chain_and_stable():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(None, [5, 6])  # parent matters
    # A fixed digest: the same in every process (not Python's salted hash()).
    assert a.hex()[:16] == hash_block_tokens(None, (1, 2, 3, 4)).hex()[:16]
    import hashlib
    from array import array

    assert a == hashlib.sha256(b"" + array("q", [1, 2, 3, 4]).tobytes()).digest()


def test_cache_salt_separates_prefixes(model):
    """vLLM's ``cache_salt``: a prompt hits only blocks cached under the same salt (or,
    unsalted, only unsalted ones), and the salt changes no token."""
    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(40)]  # 5 full blocks of 8
    llm = LLM(model, block_size=8)
    cached = []
    for salt in ["alice", "alice", "bob", None, None, "bob"]:
        p = {"prompt_token_ids": prompt} | ({} if salt is None else {"cache_salt": salt})
        out = llm.generate([p], greedy(4), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 4)
        cached.append(out.num_cached_tokens)
    # First of each salt: nothing; a repeat: every full block but the last token's.
    assert cached == [0, 32, 0, 0, 32, 32], cached
    assert all_blocks_free(llm)
    assert hash_block_tokens(None, [1, 2], "a") != hash_block_tokens(None, [1, 2])
    for bad in ["", 3]:
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate([{"prompt_token_ids": prompt, "cache_salt": bad}], greedy(1), use_tqdm=False)


@pytest.mark.checks("prefix_cache")
def test_a_block_hits_only_after_the_same_prefix(components):
    """Hashes are a chain: a block whose tokens equal a cached block's, but that follows
    different tokens, is no hit (its K/V were computed in another context)."""
    kv = components.kv_cache_manager(num_blocks=10, block_size=4)
    params = SamplingParams(max_tokens=1)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    first = Request("a", x + y + [9], params, 0.0)
    kv.get_computed_blocks(first)
    kv.allocate_slots(first, first.num_tokens)
    kv.free(first)  # blocks x and y stay cached
    moved = Request("b", y + x + [9], params, 0.0)  # the same blocks, the other way round
    assert kv.get_computed_blocks(moved)[1] == 0, "block y after x is not block y first"
    same = Request("c", x + y + [10], params, 0.0)
    assert kv.get_computed_blocks(same)[1] == 8, "the same two blocks in order are a hit"
    changed = Request("d", x[:3] + [0] + y + [9], params, 0.0)  # one token differs in block x
    assert kv.get_computed_blocks(changed)[1] == 0, "a block after a miss is no hit"


@pytest.mark.checks("block_pool", "kv_cache_manager")
def test_eviction_is_least_recently_freed_and_tail_first(components):
    kv = components.kv_cache_manager(num_blocks=6, block_size=2)
    params = SamplingParams(max_tokens=1)
    r = Request("r", [1, 2, 3, 4, 5, 6], params, 0.0)  # 3 full blocks
    kv.get_computed_blocks(r)
    kv.allocate_slots(r, 6)
    ids = kv.get_block_ids("r")
    kv.free(r)
    pool = kv.block_pool
    queue = list(pool.free_block_queue)
    # Never-used blocks first, then r's tail block, then its middle, then its first block.
    assert queue[-3:] == [ids[2], ids[1], ids[0]]
    assert all(pool.blocks[i].block_hash is not None for i in ids)  # still cached
    # Taking 4 new blocks evicts the 3 untouched ones and then r's tail block only.
    other = Request("o", [9] * 8, params, 0.0)
    kv.allocate_slots(other, 8)
    h = r.block_hashes
    assert pool.get_cached_block(h[2]) is None  # r's tail was evicted (the block reused)
    assert pool.get_cached_block(h[0]).block_id == ids[0]
    assert pool.get_cached_block(h[1]).block_id == ids[1]
    kv.free(other)
    # A hit on a free cached block takes it back out of the free queue.
    again = Request("g", [1, 2, 3, 4, 9], params, 0.0)
    blocks, hit = kv.get_computed_blocks(again)
    assert hit == 4
    kv.allocate_slots(again, 1, blocks)
    assert ids[0] not in pool.free_block_queue and pool.blocks[ids[0]].ref_cnt == 1
    kv.check_invariants()


@pytest.mark.checks("block_pool", "kv_cache_manager", "prefix_cache")
def test_shared_blocks_are_reference_counted(model, components):
    llm = LLM(model, block_size=4, **components.engine)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(1, 18))}
    engine.add_request("a", prompt, greedy(3))
    engine.add_request("b", prompt, greedy(3))
    engine.step()
    last = llm.trace.steps[-1]
    shared = {b for b, c in last.block_ref_counts.items() if c == 2}
    assert len(shared) == 4  # 16 of 17 tokens: 4 full blocks shared by both requests
    assert last.prefix_cache_hits == {"a": 0, "b": 16}
    while engine.has_unfinished_requests():
        engine.step()
    pool = engine.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert all(b.block_id in pool.free_block_queue for b in pool.cached_blocks.values())


@pytest.mark.checks("block_pool")
def test_reset_prefix_cache_refuses_while_in_use(model, components):
    llm = LLM(model, block_size=4, **components.engine)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": list(range(1, 10))}, greedy(5))
    engine.step()
    assert llm.reset_prefix_cache() is False
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache_manager.block_pool.cached_blocks
    assert llm.reset_prefix_cache() is True
    assert not engine.kv_cache_manager.block_pool.cached_blocks


@pytest.mark.checks("block_pool", "kv_cache_manager", "prefix_cache")
@settings(max_examples=40, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(8, 40),
    shapes=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 12)), min_size=1, max_size=10),
)
def test_random_shared_prefix_workloads_keep_ref_counts_exact(components, block_size, num_blocks, shapes):
    """Admit requests built from 3 shared prefixes, free them in a shuffled order."""
    prefixes = [[1] * 16, [1] * 8 + [2] * 8, [3] * 16]
    kv = components.kv_cache_manager(num_blocks, block_size)
    params = SamplingParams(max_tokens=1)
    live = []
    for i, (p, extra) in enumerate(shapes):
        r = Request(str(i), prefixes[p] + [5 + i] * extra, params, 0.0)
        hits, n = kv.get_computed_blocks(r)
        assert n % block_size == 0 and n < r.num_tokens
        r.num_computed_tokens = 0
        if kv.allocate_slots(r, r.num_tokens - n, hits) is None:
            continue
        r.num_computed_tokens = r.num_tokens
        live.append(r)
        kv.check_invariants()
    random.Random(len(shapes)).shuffle(live)
    for r in live:
        kv.free(r)
        kv.check_invariants()
    pool = kv.block_pool
    assert pool.get_num_free_blocks() == num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert all(b.block_id in pool.free_block_queue for b in pool.cached_blocks.values())


def test_reset_prefix_cache_is_a_development_endpoint(monkeypatch):
    """Off unless VLLM_SERVER_DEV_MODE=1, as in vLLM (anyone could empty the cache every
    user shares); on, it empties the cache of the engine on the server's thread."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from prometheus_client.parser import text_string_to_metric_families
    from tiny_chat import tiny_chat_llm

    from minivllm.entrypoints.openai.api_server import ServerThread, build_app
    from minivllm.exceptions import ValidationError

    llm = tiny_chat_llm()
    body = {"prompt": list(range(100, 140)), "max_tokens": 2, "ignore_eos": True}  # 2 full blocks

    def hits_of_one_request(url: str) -> float:
        def hits() -> float:
            text = httpx.get(url + "/metrics").text
            return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                        if s.name == "minivllm:prefix_cache_hits_total")
        before = hits()
        httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
        return hits() - before

    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    with ServerThread(build_app(llm)) as s:
        assert httpx.post(s.url + "/reset_prefix_cache").status_code == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "yes")
    with pytest.raises(ValidationError, match="VLLM_SERVER_DEV_MODE must be 0 or 1"):
        build_app(llm)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with ServerThread(build_app(llm)) as s:
        hits_of_one_request(s.url)
        assert hits_of_one_request(s.url) == 32, "the repeated prompt's two blocks were not found"
        assert httpx.post(s.url + "/reset_prefix_cache").status_code == 200
        assert hits_of_one_request(s.url) == 0, "the cache was not emptied"
