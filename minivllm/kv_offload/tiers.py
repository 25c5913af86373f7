"""The two tiers below the engine's KV cache: a pool of blocks in RAM, and files on disk.

Each tier is a cache of *full* blocks keyed by their prefix-cache hash (``hash_block_tokens``:
equal hashes mean equal whole prefixes), and each evicts its least recently used block when
full. A block offloaded holds every layer's keys and values, ``[num_layers, 2, block_size,
num_kv_heads, head_dim]``.

* :class:`CpuTier`: a tensor of ``num_blocks`` such blocks, allocated once (on a GPU
  machine, pinned host memory that the GPU copies to and from directly; here the engine's
  cache is in RAM too, so a "transfer" is a memory copy). A block is *pending* from the
  step that stores it until the step has run, and only then can it be found.
* :class:`DiskTier`: one safetensors file per block, in a folder whose name says which model
  and cache layout wrote it (a block is only meaningful to the model that computed it). It
  survives the engine: a new engine over the same folder finds the blocks an earlier one
  left, and engines sharing the folder find each other's. Files are written to a temporary name and renamed, so a crash never leaves half a
  block under a real name.

In vLLM: ``vllm/v1/kv_offload/`` (``OffloadingManager``, the LRU manager, the CPU backend).
vLLM's own offloading stops at CPU memory; disk tiers are LMCache's and SGLang's HiCache's.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)


class CpuTier:
    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.pool = torch.zeros((num_blocks, *block_shape), dtype=dtype)
        self.slots: OrderedDict[bytes, int] = OrderedDict()
        """Findable blocks, least recently used first: hash -> slot in ``pool``."""
        self.pending: dict[bytes, int] = {}
        """Blocks whose store is in this step, not yet findable."""
        self.free = list(range(num_blocks))

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.slots

    def has(self, block_hash: bytes) -> bool:
        """Stored or being stored: no need to store it again."""
        return block_hash in self.slots or block_hash in self.pending

    def touch(self, block_hash: bytes) -> int:
        """Mark a block used (last to be evicted); its slot."""
        self.slots.move_to_end(block_hash)
        return self.slots[block_hash]

    def allocate(self, block_hash: bytes) -> tuple[int | None, tuple[bytes, int] | None]:
        """A slot for a block about to be stored, and the block evicted to make room
        ``(hash, slot)``, whose content is still in ``pool[slot]`` until the store runs.
        No slot (None) when every slot is pending (more stores in one step than slots)."""
        evicted = None
        if not self.free:
            if not self.slots:
                return None, None
            evicted = self.slots.popitem(last=False)
            self.free.append(evicted[1])
        slot = self.free.pop()
        self.pending[block_hash] = slot
        return slot, evicted

    def complete(self) -> None:
        """The step ran: its stored blocks can be found."""
        self.slots.update(self.pending)
        self.pending.clear()

    def drop_pending(self) -> list[bytes]:
        """The step failed: its stores never ran. Returns the hashes given up."""
        dropped = list(self.pending)
        self.free.extend(self.pending.values())
        self.pending.clear()
        return dropped


class DiskTier:
    def __init__(self, folder: Path, num_blocks: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.folder = folder
        self.num_blocks = num_blocks
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        folder.mkdir(parents=True, exist_ok=True)
        found = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        self.files: OrderedDict[bytes, None] = OrderedDict()
        """Blocks on disk, least recently used first (at start-up: oldest file first)."""
        for path in found:
            try:
                self.files[bytes.fromhex(path.stem)] = None
            except ValueError:  # not one of ours
                continue
        while len(self.files) > num_blocks:
            self.remove(next(iter(self.files)))

    def __contains__(self, block_hash: bytes) -> bool:
        """Known here, or written since by another engine over the same folder (a replica,
        or the engine before a restart that is still writing): the file is adopted."""
        if block_hash not in self.files and self.path(block_hash).exists():
            self.files[block_hash] = None
        return block_hash in self.files

    def path(self, block_hash: bytes) -> Path:
        return self.folder / f"{block_hash.hex()}.safetensors"

    def write(self, block_hash: bytes, block: torch.Tensor) -> None:
        """Store one block, evicting the least recently used file beyond ``num_blocks``."""
        path = self.path(block_hash)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({"kv": block.contiguous()}, str(tmp))
        os.replace(tmp, path)
        self.files[block_hash] = None
        self.files.move_to_end(block_hash)
        while len(self.files) > self.num_blocks:
            self.remove(next(iter(self.files)))

    def read(self, block_hash: bytes) -> torch.Tensor:
        """One block, checked against the layout; a file that cannot be read or does not
        fit is forgotten (and deleted) and the error raised, so it is never tried again."""
        try:
            block = self.load(block_hash)
        except Exception as e:
            self.forget(block_hash, e)
            raise
        self.files.move_to_end(block_hash)
        return block

    def load(self, block_hash: bytes) -> torch.Tensor:
        """One block from its file, checked against the layout (raises if it cannot be read
        or does not fit). It touches none of the tier's bookkeeping, so a background
        thread may call it; the caller then calls :meth:`forget` or :meth:`touch`."""
        block = load_file(str(self.path(block_hash)))["kv"]
        if tuple(block.shape) != self.block_shape or block.dtype != self.dtype:
            raise ValueError(f"holds {tuple(block.shape)} {block.dtype}, expected "
                             f"{self.block_shape} {self.dtype}")
        return block

    def touch(self, block_hash: bytes) -> None:
        """A block was read: it is the most recently used."""
        if block_hash in self.files:
            self.files.move_to_end(block_hash)

    def forget(self, block_hash: bytes, error: Exception) -> None:
        """A block's file could not be used: log it and remove it, so it is never tried again."""
        logger.warning("KV block file %s is unusable and is removed: %s", self.path(block_hash), error)
        self.remove(block_hash)

    def remove(self, block_hash: bytes) -> None:
        self.files.pop(block_hash, None)
        self.path(block_hash).unlink(missing_ok=True)
