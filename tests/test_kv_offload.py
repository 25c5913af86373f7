"""The KV connector's offloading tiers: prefix-cache blocks that spill to RAM and disk.

What must hold: tokens identical with the connector on and off (and to transformers'
generate), a prefix evicted from the engine's cache served from RAM, from disk, and from
disk after a restart, counted per tier; no block left owned; bad configs refused by name.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from helpers import all_blocks_free, greedy, hf_greedy, run_engine

from minivllm import LLM
from minivllm.entrypoints.openai.prometheus import render_metrics
from minivllm.exceptions import ValidationError
from minivllm.kv_offload.tiers import DiskTier
from minivllm.request import RequestStatus
from minivllm.worker.model_loader import make_tiny_model

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", vocab_size=VOCAB)


def offload(num_cpu_blocks: int, disk_path=None) -> dict:
    extra = {"num_cpu_blocks": num_cpu_blocks}
    if disk_path is not None:
        extra["disk_path"] = str(disk_path)
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def metric(llm: LLM, name: str, **labels) -> float:
    return sum(m.value for m in llm.get_metrics()
               if m.name == "minivllm:" + name and all(m.labels.get(k) == v for k, v in labels.items()))


def admitted_hits(llm: LLM, request_index: int) -> tuple[int, int]:
    """(local prefix-cache hits, tokens loaded by the connector) of a request when admitted."""
    rid = str(request_index)
    step = next(s for s in llm.trace.steps if rid in s.prefix_cache_hits)
    return step.prefix_cache_hits[rid], step.external_cache_hits[rid]


SMALL = dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, log_stats_interval=None)


def test_identical_tokens_with_offloading_under_eviction_and_preemption(model):
    rng = random.Random(3)
    systems = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(3)]
    prompts = [rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
               for _ in range(10)]
    lengths = [rng.randint(10, 24) for _ in prompts]
    on = LLM(model, **SMALL, max_num_seqs=4, kv_transfer_config=offload(64))
    off = LLM(model, **SMALL, max_num_seqs=4)
    a, b = run_engine(on, prompts, lengths), run_engine(off, prompts, lengths)
    assert a == b == [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    assert sum(len(s.preempted) for s in on.trace.steps) > 0
    assert metric(on, "kv_offload_hits", tier="cpu") > 0  # the small cache evicted, RAM gave back
    assert metric(on, "external_prefix_cache_hits") == sum(
        sum(s.external_cache_hits.values()) for s in on.trace.steps)
    assert metric(on, "kv_offload_bytes", transfer_type="cpu_to_device") > 0
    assert all_blocks_free(on)
    text = render_metrics(on.get_metrics()).decode()  # what /metrics serves
    hits = int(metric(on, "kv_offload_hits", tier="cpu"))
    assert f'minivllm:kv_offload_hits_total{{tier="cpu"}} {hits}.0' in text
    assert "minivllm:external_prefix_cache_queries_total" in text


def evict_with_other_prompts(llm: LLM, rng: random.Random, n: int = 3) -> None:
    """Three unrelated 40-token prompts: each takes 11 of the 16 blocks, so every cached
    block of an earlier request is reused for them."""
    others = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(n)]
    for p in others:
        run_engine(llm, [p], [4])


def test_an_evicted_prefix_comes_back_from_ram_from_disk_and_after_a_restart(model, tmp_path):
    rng = random.Random(4)
    prefix = [rng.randrange(VOCAB) for _ in range(24)]  # 6 full blocks of 4
    again = [prefix + [rng.randrange(VOCAB) for _ in range(5)] for _ in range(3)]
    expect = [hf_greedy(model, p, 6) for p in again]

    # RAM: the CPU tier holds everything, the engine's 16 blocks do not.
    ram = LLM(model, **SMALL, kv_transfer_config=offload(64))
    run_engine(ram, [prefix], [4])
    evict_with_other_prompts(ram, rng)
    assert run_engine(ram, [again[0]], [6]) == [expect[0]]
    assert admitted_hits(ram, 4) == (0, 24)  # nothing left locally; all six blocks from RAM
    assert metric(ram, "kv_offload_hits", tier="cpu") == 24

    # Disk: a 4-block CPU tier spills the prefix's blocks to disk as the others arrive.
    disk = LLM(model, **SMALL, kv_transfer_config=offload(4, tmp_path))
    run_engine(disk, [prefix], [4])
    evict_with_other_prompts(disk, rng)
    assert run_engine(disk, [again[1]], [6]) == [expect[1]]
    assert admitted_hits(disk, 4) == (0, 24)
    assert metric(disk, "kv_offload_hits", tier="disk") == 24
    assert metric(disk, "kv_offload_bytes", transfer_type="cpu_to_disk") > 0
    assert all_blocks_free(disk)
    disk.close()  # writes the CPU tier to disk too

    # Restart: a new engine over the same folder starts with the blocks on disk.
    restarted = LLM(model, **SMALL, kv_transfer_config=offload(4, tmp_path))
    assert run_engine(restarted, [again[2]], [6]) == [expect[2]]
    assert admitted_hits(restarted, 0) == (0, 24)
    assert metric(restarted, "kv_offload_hits", tier="disk") == 24


def test_another_model_never_reads_the_blocks(model, tmp_path):
    prompt = list(range(10, 40))
    first = LLM(model, **SMALL, kv_transfer_config=offload(4, tmp_path))
    run_engine(first, [prompt], [3])
    first.close()
    other_model = make_tiny_model("llama", vocab_size=VOCAB, seed=1)
    other = LLM(other_model, **SMALL, kv_transfer_config=offload(4, tmp_path))
    assert run_engine(other, [prompt], [5]) == [hf_greedy(other_model, prompt, 5)]
    assert metric(other, "external_prefix_cache_hits") == 0
    assert len(list(tmp_path.iterdir())) == 2  # one folder per model


def test_an_unreadable_disk_block_is_recomputed(model, tmp_path):
    """A block file that cannot be read (another process removed it, a torn disk) is
    dropped, and the request computes from there: the same tokens, nothing hangs."""
    prompt = list(range(50, 80))
    first = LLM(model, **SMALL, kv_transfer_config=offload(4, tmp_path))
    run_engine(first, [prompt], [3])
    first.close()
    files = sorted(tmp_path.glob("*/*.safetensors"))
    assert len(files) == 8  # 30 prompt tokens and 2 of the 3 outputs computed: 32 = 8 blocks
    for f in files[::2]:
        f.write_bytes(b"not a block")
    again = LLM(model, **SMALL, kv_transfer_config=offload(4, tmp_path))
    assert run_engine(again, [prompt + [1, 2]], [6]) == [hf_greedy(model, prompt + [1, 2], 6)]
    assert any(not f.exists() for f in files[::2])  # a bad file was read, and forgotten
    assert all_blocks_free(again)


@pytest.mark.parametrize("config, field", [
    ({"kv_connector": "NixlConnector"}, "kv_connector"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "sender"}, "kv_role"),
    ({"kv_connector": "OffloadingConnector", "color": 1}, "kv_transfer_config"),
    ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {}}, "num_cpu_blocks"),
    ({"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"num_cpu_blocks": 0}}, "num_cpu_blocks"),
    ({"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"num_cpu_blocks": 4, "size": 1}}, "kv_connector_extra_config"),
    ({"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"num_cpu_blocks": 4, "disk_path": 7}}, "disk_path"),
    ({"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"num_cpu_blocks": 4, "num_disk_blocks": 8}}, "num_disk_blocks"),
    ({"kv_connector": "SharedStorageConnector",
      "kv_connector_extra_config": {"shared_storage_path": ""}}, "shared_storage_path"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"num_cpu_blocks": 4}}, "kv_role"),
])
def test_bad_configs_are_refused_by_name(model, config, field):
    with pytest.raises(ValidationError) as e:
        LLM(model, **SMALL, kv_transfer_config=config)
    assert e.value.param == field


def test_the_connector_needs_prefix_caching(model):
    with pytest.raises(ValidationError, match="enable_prefix_caching"):
        LLM(model, **SMALL, enable_prefix_caching=False, kv_transfer_config=offload(4))


def shared(role: str, path) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def test_disaggregated_prefill_through_a_shared_folder(model, tmp_path):
    """A prefill engine computes the prompts (max_tokens=1, as vLLM's proxy sends them); a
    decode engine over the same folder loads every full block and computes only the last
    partial one, and generates exactly what one engine alone does."""
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(20, 40))] for _ in range(4)]
    prefill = LLM(model, **SMALL, kv_transfer_config=shared("kv_producer", tmp_path))
    # Room for every request at once: a preempted request would recompute its output
    # tokens too, and when that happens depends on when the loads arrive.
    decode = LLM(model, **{**SMALL, "num_kv_blocks": 64}, kv_transfer_config=shared("kv_consumer", tmp_path))
    run_engine(prefill, prompts, [1] * len(prompts))
    assert metric(prefill, "external_prefix_cache_hits") == 0  # a producer never loads
    outputs = run_engine(decode, prompts, [8] * len(prompts))
    assert outputs == [hf_greedy(model, p, 8) for p in prompts]
    for i, p in enumerate(prompts):
        local, loaded = admitted_hits(decode, i)
        assert (local, loaded) == (0, (len(p) - 1) // 4 * 4)
    computed = sum(s.num_prefill_tokens for s in decode.trace.steps)
    assert computed == sum(len(p) - (len(p) - 1) // 4 * 4 for p in prompts)  # 1 to 4 each
    assert metric(decode, "num_preemptions") == 0
    assert not list(tmp_path.glob("*/*.tmp*"))  # every file complete under its real name
    assert all_blocks_free(prefill) and all_blocks_free(decode)


def test_example_connector_is_vllms_current_name_for_the_shared_folder(model, tmp_path):
    """vLLM renamed SharedStorageConnector to ExampleConnector; a decode engine configured
    with the new name loads what a producer under the old name wrote, and generates what
    transformers does."""
    prompt = [random.Random(8).randrange(VOCAB) for _ in range(21)]
    run_engine(LLM(model, **SMALL, kv_transfer_config=shared("kv_producer", tmp_path)), [prompt], [1])
    decode = LLM(model, **SMALL, kv_transfer_config={**shared("kv_consumer", tmp_path),
                                                     "kv_connector": "ExampleConnector"})
    assert run_engine(decode, [prompt], [6]) == [hf_greedy(model, prompt, 6)]
    assert admitted_hits(decode, 0) == (0, 20)
    assert all_blocks_free(decode)


def test_shared_storage_needs_its_folder(model):
    with pytest.raises(ValidationError) as e:
        LLM(model, **SMALL, kv_transfer_config={"kv_connector": "SharedStorageConnector"})
    assert e.value.param == "shared_storage_path"


def held_disk_reads(monkeypatch, reads: list | None = None) -> threading.Event:
    """Every disk read of a KV block waits until the returned event is set (and, once
    done, is appended to ``reads``)."""
    gate, load = threading.Event(), DiskTier.load

    def held(self, block_hash):
        assert gate.wait(60), "the test never released the disk reads"
        block = load(self, block_hash)
        if reads is not None:
            reads.append(block_hash)
        return block

    monkeypatch.setattr(DiskTier, "load", held)
    return gate


def prefilled(model, tmp_path, prompt: list[int], num_kv_blocks: int = SMALL["num_kv_blocks"]) -> LLM:
    """A decode engine over a folder where a prefill engine has put ``prompt``'s blocks."""
    run_engine(LLM(model, **SMALL, kv_transfer_config=shared("kv_producer", tmp_path)), [prompt], [1])
    return LLM(model, **{**SMALL, "num_kv_blocks": num_kv_blocks},
               kv_transfer_config=shared("kv_consumer", tmp_path))


def test_a_load_from_disk_runs_in_the_background_while_others_decode(model, tmp_path, monkeypatch):
    """While a request's KV comes off disk it waits aside (WAITING_FOR_REMOTE_KVS), in no
    step, and another request decodes step after step; once the blocks are there it is
    admitted with them, computes only its last partial block, and both generate exactly
    what transformers does. Every block is free at the end."""
    rng = random.Random(6)
    long, short = [rng.randrange(VOCAB) for _ in range(33)], [rng.randrange(VOCAB) for _ in range(5)]
    decode = prefilled(model, tmp_path, long)
    gate = held_disk_reads(monkeypatch)
    engine = decode.llm_engine
    engine.add_request("short", {"prompt_token_ids": short}, greedy(12))
    engine.add_request("long", {"prompt_token_ids": long}, greedy(6))
    tokens: dict[str, list[int]] = {"short": [], "long": []}
    for _ in range(5):
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        assert engine.scheduler.requests["long"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(tokens["short"]) == 5 and tokens["long"] == []  # the load held nobody's step
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    assert tokens == {"short": hf_greedy(model, short, 12), "long": hf_greedy(model, long, 6)}
    admitted = next(s for s in decode.trace.steps if "long" in s.prefix_cache_hits)
    assert (admitted.prefix_cache_hits["long"], admitted.external_cache_hits["long"]) == (0, 32)
    assert [c.num_new_tokens for c in admitted.scheduled if c.request_id == "long"] == [1]
    assert metric(decode, "kv_offload_hits", tier="disk") == 32
    assert metric(decode, "kv_offload_bytes", transfer_type="disk_to_device") > 0
    assert all_blocks_free(decode)


def test_a_request_that_runs_out_of_room_beside_arrived_kv_steps_aside(model, tmp_path, monkeypatch):
    """A request whose KV has arrived holds all its blocks while it waits to be admitted.
    If they are the blocks the one running request needed, that request is preempted in
    a step that computes nothing; the next step admits the arrived one, and both end with
    exactly transformers' tokens. (This step once raised "scheduler made no progress".)"""
    rng = random.Random(9)
    long, short = [rng.randrange(VOCAB) for _ in range(33)], [rng.randrange(VOCAB) for _ in range(5)]
    decode = prefilled(model, tmp_path, long, num_kv_blocks=12)  # long holds 9, short gets 3
    reads: list = []
    gate = held_disk_reads(monkeypatch, reads)
    engine = decode.llm_engine
    engine.add_request("short", {"prompt_token_ids": short}, greedy(12))
    engine.add_request("long", {"prompt_token_ids": long}, greedy(6))
    tokens: dict[str, list[int]] = {"short": [], "long": []}

    def step():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids

    for _ in range(7):  # short's 12 tokens fill its 3 blocks; long's blocks are still on disk
        step()
    assert engine.scheduler.requests["short"].num_tokens == 12
    gate.set()
    deadline = time.monotonic() + 60
    while len(reads) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the loader thread hands its result over
    step()  # short's 12th token; the load has arrived: long waits to be admitted, holding 9 blocks
    step()  # short's 13th token needs a 4th block: short steps aside, nothing is computed
    only_preempted = decode.trace.steps[-1]
    assert (only_preempted.scheduled, only_preempted.preempted) == ([], ["short"])
    while engine.has_unfinished_requests():
        step()
    assert tokens == {"short": hf_greedy(model, short, 12), "long": hf_greedy(model, long, 6)}
    assert metric(decode, "num_preemptions") >= 1
    assert all_blocks_free(decode)


def test_aborting_a_request_while_its_kv_loads_frees_every_block(model, tmp_path, monkeypatch):
    """The abort waits for the load into the request's blocks (they must not be written
    after they are freed), then nothing is left: no block owned, no request pending."""
    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(29)]
    decode = prefilled(model, tmp_path, prompt)
    gate = held_disk_reads(monkeypatch)
    engine = decode.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt}, greedy(4))
    engine.step()
    assert engine.scheduler.requests["r"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    threading.Timer(0.2, gate.set).start()
    engine.abort_request("r")
    assert gate.is_set()  # the abort waited for the load
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort"]
    assert not engine.has_unfinished_requests()
    assert all_blocks_free(decode)
    assert run_engine(decode, [prompt], [4]) == [hf_greedy(model, prompt, 4)]  # the blocks are still on disk
