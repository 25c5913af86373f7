"""OffloadingConnector: prefix-cache blocks that spill to RAM and disk, and come back.

The engine's KV cache is small and fast (GPU memory in vLLM; a fixed 1 GiB here). When it
is full, the prefix cache evicts the least recently freed block, and a later request with
that prefix computes it again. This connector keeps a copy of every full block it sees
computed in a bigger, slower tier, so an evicted prefix is *loaded* instead:

    engine cache (fast, small)  ->  CPU tier (RAM, ``num_cpu_blocks``)  ->  disk tier (files)

* **Store**, as blocks are computed: each step, the blocks that became full (and are in
  no tier yet) get a slot in the CPU tier; each attention layer copies its keys and values
  there right after writing them (``save_kv_layer``). When the CPU tier is full, its least
  recently used block *spills* to the disk tier first, if there is one.
* **Load**, on admission: after the local prefix cache gave its hits, the blocks right after
  them are looked up in the CPU tier, then on disk (``get_num_new_matched_tokens``). They are
  copied into the request's new blocks before the forward pass (``start_load_kv``), and the
  request starts computing after them, exactly as after a local hit. A load that reads from
  disk runs in the background instead, on a thread of its own: a few milliseconds a block,
  which would otherwise stretch the step that everyone else's next token waits for. The
  request waits aside (``WAITING_FOR_REMOTE_KVS``) and is admitted once ``get_finished``
  reports its blocks arrived.
* **Restart**: at shutdown the CPU tier is written to disk, and a new engine over the same
  folder finds every block there.

Tokens are identical with the connector on and off: a loaded block holds the bytes the
engine computed for that very prefix (the hash chain covers every token before it).

In vLLM: ``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py`` (CPU
only, asynchronous on CUDA streams, configured with ``kv_connector_extra_config``'s
``num_cpu_blocks``; or ``--kv-offloading-size``); a disk tier is LMCache's
(``LMCacheConnectorV1``).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter as Tally
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
)
from minivllm.exceptions import ValidationError, check_int, check_keys, check_path
from minivllm.kv_offload.tiers import CpuTier, DiskTier
from minivllm.metrics import Counter, Gauge, Metric

if TYPE_CHECKING:
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.scheduler import SchedulerOutput
    from minivllm.request import Request

EXTRA_CONFIG = {"num_cpu_blocks": "blocks the CPU tier holds (required)",
                "disk_path": "folder of the disk tier (none: no disk tier)",
                "num_disk_blocks": "blocks the disk tier holds (default 4096)"}


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    loads: list[tuple[int, bytes, str, int | None]] = field(default_factory=list)
    """(engine block id, hash, tier "cpu" or "disk", CPU slot) of each block to load."""
    recvs: dict[str, list[tuple[int, bytes, str, int | None]]] = field(default_factory=dict)
    """Request id -> the same, for the requests whose load runs in the background."""
    spills: list[tuple[bytes, int]] = field(default_factory=list)
    """(hash, CPU slot) of blocks evicted from the CPU tier, to write to disk first."""
    stores: list[tuple[int, int, bytes]] = field(default_factory=list)
    """(engine block id, CPU slot, hash) of each block to copy, layer by layer, as the
    forward pass writes it."""


@dataclass
class OffloadingStats:
    queries: int = 0
    """Tokens of admitted requests looked up (vLLM's ``external_prefix_cache_queries``)."""
    hits: Tally = field(default_factory=Tally)
    """Tokens loaded, by tier."""
    bytes: Tally = field(default_factory=Tally)
    """Bytes moved, by transfer ("device_to_cpu", "cpu_to_disk", "cpu_to_device", "disk_to_device")."""
    seconds: Tally = field(default_factory=Tally)
    """Seconds spent moving them, by transfer."""


class OffloadingConnector(KVConnectorBase_V1):
    def __init__(self, config: KVTransferConfig, kv_cache_manager: KVCacheManager,
                 block_shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> None:
        """``block_shape``: one offloaded block, ``(num_layers, 2, block_size, num_kv_heads,
        head_dim)``; ``layout``: a description of the model and cache that computed the
        blocks (the disk folder is named by its hash, so no other model reads them)."""
        num_cpu, disk_path, num_disk = self.parse_extra_config(config)
        self.saves = config.kv_role != "kv_consumer"
        self.loads = config.kv_role != "kv_producer"
        self.write_through = config.kv_role == "kv_producer"
        """A producer writes each stored block to disk in the step that computed it."""
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.block_bytes = torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.cpu = CpuTier(num_cpu, block_shape, dtype)
        self.disk: DiskTier | None = None
        if disk_path:
            digest = hashlib.sha256(layout.encode()).hexdigest()[:16]
            folder = Path(disk_path).expanduser() / digest
            self.disk = DiskTier(folder, num_disk, block_shape, dtype)
            (folder / "layout.txt").write_text(layout + "\n")
        self.stats = OffloadingStats()
        self._matched: dict[str, tuple[int, list[tuple[bytes, str]]]] = {}
        """request id -> (first block looked up, the (hash, tier) found after it)."""
        self._loads: list[tuple[int, bytes, str, int | None]] = []
        self._recvs: dict[str, list[tuple[int, bytes, str, int | None]]] = {}
        self._inflight: dict[str, Future] = {}
        """Request id -> its background load (worker side)."""
        self._loader: ThreadPoolExecutor | None = None
        self._num_stored: dict[str, int] = {}
        """request id -> how many of its leading blocks have been offered for storing."""
        self._pending_owner: dict[bytes, tuple[str, int]] = {}
        self._invalid: set[int] = set()
        """Engine blocks whose load failed this step."""

    @staticmethod
    def parse_extra_config(config: KVTransferConfig) -> tuple[int, str | None, int]:
        """(CPU tier blocks, disk folder or None, disk tier blocks), each checked."""
        extra = config.kv_connector_extra_config
        check_keys("kv_connector_extra_config", extra, EXTRA_CONFIG, "OffloadingConnector")
        if config.kv_role != "kv_both":
            raise ValidationError("kv_role", "OffloadingConnector saves and loads its own blocks: "
                                  f"kv_role must be 'kv_both', got {config.kv_role!r}", config.kv_role)
        if "num_cpu_blocks" not in extra:
            raise ValidationError("num_cpu_blocks", "OffloadingConnector needs kv_connector_extra_config"
                                  '["num_cpu_blocks"]: how many blocks the CPU tier holds', extra)
        num_cpu = check_int("num_cpu_blocks", extra["num_cpu_blocks"], minimum=1)
        num_disk = check_int("num_disk_blocks", extra.get("num_disk_blocks", 4096), minimum=1)
        disk_path = extra.get("disk_path")
        if disk_path is not None:
            check_path("disk_path", disk_path)
        elif "num_disk_blocks" in extra:
            raise ValidationError("num_disk_blocks", "num_disk_blocks needs a disk_path", extra)
        return num_cpu, disk_path, num_disk

    # -- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The blocks after the hits found in a tier, and whether any comes from disk (the
        load then runs in the background)."""
        if not self.loads or request.scores_prompt:  # prompt logprobs need every position's logits
            return 0, False
        start = num_computed_tokens // self.block_size
        end = (request.num_tokens - 1) // self.block_size  # the last token always runs
        found = []
        for block_hash in request.block_hashes[start:end]:
            tier = "cpu" if block_hash in self.cpu else \
                "disk" if self.disk is not None and block_hash in self.disk else None
            if tier is None:
                break
            found.append((block_hash, tier))
        self._matched[request.request_id] = (start, found)
        return len(found) * self.block_size, any(tier == "disk" for _, tier in found)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is None:  # admitted after its background load: nothing more to look up
            return
        start, found = matched
        if request.metrics.num_preemptions == 0:
            self.stats.queries += request.num_tokens
        loads = []
        for j, (block_hash, tier) in enumerate(found[:num_external_tokens // self.block_size]):
            slot = self.cpu.touch(block_hash) if tier == "cpu" else None
            loads.append((block_ids[start + j], block_hash, tier, slot))
            self.stats.hits[tier] += self.block_size
        if any(tier == "disk" for _, _, tier, _ in loads):
            self._recvs[request.request_id] = loads
        else:
            self._loads += loads

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingMetadata:
        """This step's loads (from admissions), and the blocks it fills that no tier holds."""
        for block_hash in self.cpu.drop_pending():  # the last step failed: its stores never ran
            request_id, index = self._pending_owner[block_hash]
            self._num_stored[request_id] = min(self._num_stored.get(request_id, 0), index)
        self._pending_owner.clear()
        # Background loads stay asked for until the worker side starts them: a step that
        # fails before its forward pass must not leave a request waiting for nothing.
        meta = OffloadingMetadata(loads=self._loads, recvs=dict(self._recvs))
        self._loads = []
        for s in scheduler_output.scheduled if self.saves else ():
            request, rid = s.request, s.request.request_id
            computed = s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids)
            num_full = min(computed // self.block_size, len(request.block_hashes))
            start = self._num_stored.get(rid, 0)
            table = self.kv_cache_manager.get_block_ids(rid) if num_full > start else []
            for i in range(start, num_full):
                block_hash = request.block_hashes[i]
                if block_hash in self.cpu:
                    self.cpu.touch(block_hash)
                    continue
                if self.cpu.has(block_hash) or (self.disk is not None and block_hash in self.disk):
                    continue
                slot, evicted = self.cpu.allocate(block_hash)
                if slot is None:  # every CPU slot is taken by this step's stores
                    num_full = i
                    break
                if evicted is not None and self.disk is not None:
                    meta.spills.append(evicted)
                meta.stores.append((table[i], slot, block_hash))
                self._pending_owner[block_hash] = (rid, i)
            self._num_stored[rid] = max(start, num_full)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.cpu.complete()
        self._pending_owner.clear()

    def request_finished(self, request: Request) -> None:
        """Also: wait for a background load into its blocks (they are freed next); what it
        read is counted, but failed blocks are not reported (they are nobody's any more)."""
        rid = request.request_id
        self._num_stored.pop(rid, None)
        self._matched.pop(rid, None)
        self._recvs.pop(rid, None)  # parked, and gone before its load started
        if (load := self._inflight.pop(rid, None)) is not None:
            self._absorb(load.result(), report=False)

    # -- worker side ------------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Loads first, then spills: a block loaded this step may sit in a CPU slot that
        this step's stores reuse, or in a file that a spill pushes out of the disk tier.
        A background load copies its RAM blocks now, for the same reason, and hands its
        disk blocks to the loader thread."""
        meta = self._metadata
        for block_id, block_hash, tier, slot in meta.loads:
            t0 = time.perf_counter()
            try:
                block = self.cpu.pool[slot] if tier == "cpu" else self.disk.read(block_hash)
            except Exception:  # logged and forgotten by the tier; the block is recomputed
                self._invalid.add(block_id)
                continue
            self._copy_in(block_id, block)
            self._count(f"{tier}_to_device", 1, t0)
        for rid, loads in meta.recvs.items():
            if self._recvs.pop(rid, None) is None:  # started already, or the request is gone
                continue
            for block_id, _, _, slot in (load for load in loads if load[2] == "cpu"):
                t0 = time.perf_counter()
                self._copy_in(block_id, self.cpu.pool[slot])
                self._count("cpu_to_device", 1, t0)
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="minivllm-kv-load")
            disk = [(block_id, block_hash) for block_id, block_hash, tier, _ in loads if tier == "disk"]
            self._inflight[rid] = self._loader.submit(self._read_from_disk, disk)
        for block_hash, slot in meta.spills:
            if block_hash not in self.disk:  # a producer's blocks are there already
                t0 = time.perf_counter()
                self.disk.write(block_hash, self.cpu.pool[slot])
                self._count("cpu_to_disk", 1, t0)

    def wait_for_save(self) -> None:
        """A producer's blocks go on to disk now, where the consumer looks for them."""
        meta = self._metadata
        if self.write_through and meta is not None:
            for _, slot, block_hash in meta.stores:
                t0 = time.perf_counter()
                self.disk.write(block_hash, self.cpu.pool[slot])
                self._count("cpu_to_disk", 1, t0)

    def _copy_in(self, block_id: int, block: torch.Tensor) -> None:
        for layer, (k, v) in enumerate(self.kv_caches):
            k[block_id] = block[layer, 0]
            v[block_id] = block[layer, 1]

    def _read_from_disk(self, loads: list[tuple[int, bytes]]) -> list[tuple[int, bytes, Exception | None, float]]:
        """On the loader thread: read each block's file into its engine block. The forward
        pass runs meanwhile, on blocks that are not these (the request is in no step).
        Touches no bookkeeping: (block id, hash, error or None, seconds) of each goes
        back to the engine's thread (:meth:`_absorb`)."""
        done = []
        for block_id, block_hash in loads:
            t0 = time.perf_counter()
            try:
                self._copy_in(block_id, self.disk.load(block_hash))
                done.append((block_id, block_hash, None, time.perf_counter() - t0))
            except Exception as e:
                done.append((block_id, block_hash, e, 0.0))
        return done

    def _absorb(self, done: list[tuple[int, bytes, Exception | None, float]], report: bool = True) -> None:
        """A background load's results, on the engine's thread: count the blocks read,
        forget the files that failed, and (``report``) name their blocks as invalid."""
        for block_id, block_hash, error, seconds in done:
            if error is not None:
                self.disk.forget(block_hash, error)
                if report:
                    self._invalid.add(block_id)
                continue
            self.disk.touch(block_hash)
            self.stats.seconds["disk_to_device"] += seconds
            self.stats.bytes["disk_to_device"] += self.block_bytes

    def get_finished(self) -> KVConnectorOutput:
        """The background loads that are over, and the blocks that failed to load."""
        finished = {rid for rid, load in self._inflight.items() if load.done()}
        for rid in finished:
            self._absorb(self._inflight.pop(rid).result())
        invalid, self._invalid = self._invalid, set()
        return KVConnectorOutput(finished_recving=finished, invalid_block_ids=invalid)

    def save_kv_layer(self, layer_idx, kv_layer, attn_metadata) -> None:
        meta = self._metadata
        if meta is None or not meta.stores:
            return
        t0 = time.perf_counter()
        k, v = kv_layer
        # One copy per block: each is a contiguous run of bytes on both sides. (A single
        # indexed assignment into the pool's strided view measured 50 times slower.)
        for block_id, slot, _ in meta.stores:
            self.cpu.pool[slot, layer_idx, 0].copy_(k[block_id])
            self.cpu.pool[slot, layer_idx, 1].copy_(v[block_id])
        self._count("device_to_cpu", len(meta.stores) / len(self.kv_caches), t0)

    def _count(self, transfer: str, num_blocks: float, t0: float) -> None:
        self.stats.seconds[transfer] += time.perf_counter() - t0
        self.stats.bytes[transfer] += round(num_blocks * self.block_bytes)

    # -- both -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish the background loads, and write the CPU tier's blocks to disk, so that
        the next engine finds them."""
        for rid in list(self._inflight):
            self._absorb(self._inflight.pop(rid).result(), report=False)
        if self._loader is not None:
            self._loader.shutdown()
            self._loader = None
        if self.disk is None:
            return
        for block_hash, slot in self.cpu.slots.items():
            if block_hash not in self.disk:
                t0 = time.perf_counter()
                self.disk.write(block_hash, self.cpu.pool[slot])
                self._count("cpu_to_disk", 1, t0)

    def get_metrics(self) -> list[Metric]:
        p, s = "minivllm:", self.stats
        tiers = ("cpu", "disk") if self.disk is not None else ("cpu",)
        return [
            Counter(p + "external_prefix_cache_queries", s.queries),
            Counter(p + "external_prefix_cache_hits", sum(s.hits.values())),
            *(Counter(p + "kv_offload_hits", s.hits[t], {"tier": t}) for t in tiers),
            *(Gauge(p + "kv_offload_blocks", len(self.cpu.slots) if t == "cpu" else len(self.disk.files),
                    {"tier": t}) for t in tiers),
            *(Counter(p + "kv_offload_bytes", n, {"transfer_type": t}) for t, n in sorted(s.bytes.items())),
            *(Counter(p + "kv_offload_seconds", x, {"transfer_type": t})
              for t, x in sorted(s.seconds.items())),
        ]
