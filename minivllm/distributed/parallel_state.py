"""The tensor-parallel group: T processes that can sum a tensor across all of them.

Tensor parallelism needs exactly one collective operation in the forward pass: the
**all-reduce**, after which every rank holds the element-wise sum of every rank's tensor
(:mod:`minivllm.distributed.tensor_parallel` says where it happens: twice per decoder
layer). ``torch.distributed`` provides it over two transports:

- **gloo** on a CPU: TCP over the loopback interface, tensors copied through the kernel;
- **NCCL** on GPUs: NVLink or PCIe, GPU to GPU, never through the host.

The ranks find each other through a ``TCPStore``, a tiny key-value server that rank 0
opens. We bind it to port 0 and let the operating system choose a free port, which the
workers are then told: several engines (or several test cases) in one process never
fight over a fixed ``MASTER_PORT``.

We build the process group object directly (``ProcessGroupGloo(store, rank, size)``)
instead of calling ``torch.distributed.init_process_group``. That function sets one
*global* default group per process; an engine that owned it would stop a second engine
in the same process from having a group of its own. vLLM keeps its groups in
``vllm/distributed/parallel_state.py`` (``GroupCoordinator``) for the same reason.

Every all-reduce is timed (:attr:`TensorParallelGroup.comm_time`), so a step's time splits
into compute and communication. The time includes waiting for the slowest rank: an
all-reduce cannot finish before every rank has reached it, so a rank that computed
faster spends the difference here. On CUDA the time is taken between two
synchronizations, which costs a little overlap but measures what it says.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minivllm.utils.system_utils import get_mp_context, with_environment

HOST = "127.0.0.1"
"""Where the ranks meet when all are on this machine. Across machines (the Ray executor,
:mod:`minivllm.executor.ray_distributed_executor`) each rank gives the address Ray reports
for its node instead: rank 0's for the store, its own for its gloo device."""
TIMEOUT = datetime.timedelta(seconds=120)
"""How long a collective (or joining the group) may wait for a rank before it fails."""


def open_store(world_size: int, host: str = HOST) -> dist.TCPStore:
    """Rank 0's rendezvous server on a free port (``store.port`` tells which); it listens
    on every interface, ``host`` is where rank 0 itself reaches it."""
    return dist.TCPStore(host, 0, world_size, True, TIMEOUT, wait_for_workers=False)


def connect_store(port: int, world_size: int, host: str = HOST) -> dist.TCPStore:
    """A worker's connection to rank 0's store, at rank 0's ``host``."""
    return dist.TCPStore(host, port, world_size, False, TIMEOUT)


def backend_for(device: torch.device) -> str:
    """NCCL where the tensors are on CUDA, gloo on a CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class TensorParallelGroup:
    """This rank's place in the group, and the all-reduce that joins it to the others."""

    rank: int
    world_size: int
    process_group: dist.ProcessGroup
    comm_time: float = 0.0
    """Seconds spent in all-reduces since the last :meth:`reset_timing`."""
    num_all_reduces: int = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place; returns it (timed)."""
        cuda = tensor.is_cuda
        if cuda:
            torch.cuda.synchronize(tensor.device)
        t0 = time.perf_counter()
        self.process_group.allreduce([tensor]).wait()
        if cuda:
            torch.cuda.synchronize(tensor.device)
        self.comm_time += time.perf_counter() - t0
        self.num_all_reduces += 1
        return tensor

    def reset_timing(self) -> None:
        self.comm_time, self.num_all_reduces = 0.0, 0


def init_tensor_parallel_group(store: dist.Store, rank: int, world_size: int,
                               device: torch.device, host: str = HOST) -> TensorParallelGroup:
    """Join the group (blocks until all ``world_size`` ranks have joined). ``host``: the
    address the other ranks reach this one's gloo connections on."""
    if backend_for(device) == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
        pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = TIMEOUT
        # An explicit address (loopback on one machine): resolving the machine's hostname
        # may pick an interface that the other ranks cannot reach this one on.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        pg = dist.ProcessGroupGloo(store, rank, world_size, options)
    return TensorParallelGroup(rank, world_size, pg)


# -- the cost of one all-reduce, alone ---------------------------------------------------
def _latency_worker(rank: int, world_size: int, port: int, numel: int, iters: int) -> None:
    group = init_tensor_parallel_group(connect_store(port, world_size), rank, world_size,
                                       torch.device("cpu"))
    _time_all_reduces(group, numel, iters)


def _time_all_reduces(group: TensorParallelGroup, numel: int, iters: int) -> float:
    tensor = torch.ones(numel)
    for _ in range(10):  # warm-up: connections, buffers
        group.all_reduce(tensor)
    group.reset_timing()
    for _ in range(iters):
        group.all_reduce(tensor)
    return group.comm_time / iters


def measure_all_reduce(world_size: int, numel: int, iters: int = 200) -> float:
    """Seconds per all-reduce of ``numel`` float32 values among ``world_size`` CPU
    processes doing nothing else: the transport's own cost (gloo over loopback). In a
    real step an all-reduce also waits for the slowest rank to arrive; the difference
    between the two is that waiting."""
    store = open_store(world_size)
    ctx = get_mp_context()
    workers = [ctx.Process(target=with_environment,
                           args=(dict(os.environ), _latency_worker, r, world_size, store.port, numel, iters))
               for r in range(1, world_size)]
    for w in workers:
        w.start()
    try:
        group = init_tensor_parallel_group(store, 0, world_size, torch.device("cpu"))
        return _time_all_reduces(group, numel, iters)
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
