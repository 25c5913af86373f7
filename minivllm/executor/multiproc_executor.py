"""MultiprocExecutor: the tensor-parallel worker processes, and each step's broadcast.

With ``tensor_parallel_size=T`` the engine's own process is rank 0: it keeps the
scheduler, the KV cache manager and the sampler, and its model runner runs a forward
pass on rank 0's shard. Ranks 1..T-1 are worker processes that own nothing but their
shard of the weights and their shard of the KV cache (``num_kv_heads / T`` heads, the
same block ids as rank 0: the block tables rank 0 sends are valid everywhere). A step::

    rank 0: schedule -> prepare inputs -> send them to every worker --+
                                                                      |  (a pipe each)
    every rank: forward on its shard, meeting at each all-reduce <----+
    rank 0: logits (lm_head is replicated) -> sample
    workers: reply with their compute and communication seconds

What is sent is small: the token ids, positions, cache slots, block tables and sequence
boundaries of the flat batch, as numpy arrays; each rank builds its own attention
metadata from them. (vLLM broadcasts ``SchedulerOutput`` through a shared-memory ring
buffer, ``vllm/distributed/device_communicators/shm_broadcast.py``, and each worker keeps
its own copy of the request states; a pipe per worker is enough here.)

**How the weights reach the workers.** The model object itself is handed to each
worker as an argument of its process (``minivllm.utils.system_utils``): torch pickles a
CPU tensor as a handle to shared memory, not as bytes, so the full weights are not
copied; each worker then keeps only its own slices (``shard_model``) and lets go of the
rest. This works for a checkpoint and for a model made in memory (``make_tiny_model``)
alike. On CUDA the model is sent from the CPU and each worker moves its shard to its
own GPU (``cuda:rank``).

**The linear-backend plan still applies.** Rank 0 chooses the plan as without tensor
parallelism (``minivllm.worker.linear``: measured on the full model, by row count), and every
rank runs its sharded layers through it: the sharded layers are still plain
``nn.Linear`` (so ``planned_linear`` swaps them as usual, and their all-reduce hooks
stay on them), and a plan chooses by the number of rows, which sharding does not change.

**Workers never outlive the engine.** Each worker waits for its next message with a
timeout and exits when its parent process has gone (or its pipe closed); it ignores
Ctrl-C (the parent, which gets it too, shuts the workers down). :meth:`MultiprocExecutor.shutdown` (from
``LLM.close()``, the engine's garbage collection through ``weakref.finalize``, or the
interpreter's exit) asks each worker to stop, then terminates and kills what is left.
A failed step shuts the workers down too: after an error mid-forward the ranks no
longer agree on which all-reduce comes next, so the group cannot be reused.

In vLLM: ``vllm/v1/executor/multiproc_executor.py`` (``MultiprocExecutor``,
``WorkerProc``) and ``vllm/v1/worker/gpu_worker.py``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import nn

from minivllm.core.scheduler import SchedulerOutput
from minivllm.distributed.parallel_state import (
    HOST,
    TensorParallelGroup,
    connect_store,
    init_tensor_parallel_group,
    open_store,
)
from minivllm.distributed.tensor_parallel import check_tensor_parallel_size, shard_model
from minivllm.executor.abstract import Executor
from minivllm.utils.system_utils import (
    available_cpus,
    describe_exit,
    get_mp_context,
    parent_alive,
    with_environment,
)
from minivllm.worker.attention import ATTN_IMPLEMENTATION, AttentionMetadata, get_attn_backend
from minivllm.worker.linear_plan import LinearPlan, planned_linear
from minivllm.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger("minivllm")

POLL_S = 0.5
"""How often a waiting worker checks that its parent is still there."""
STARTUP_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 300.0
MAX_TIMINGS = 10_000


@dataclass
class StepTiming:
    """One step's forward pass on every rank, split into compute and communication."""

    compute_time: list[float]
    """Per rank: seconds of the forward pass outside the all-reduces."""
    comm_time: list[float]
    """Per rank: seconds inside the all-reduces (including waiting for slower ranks)."""
    num_all_reduces: int
    """On each rank: 2 per decoder layer."""

    @property
    def forward_time(self) -> float:
        """Rank 0's forward pass, compute plus communication."""
        return self.compute_time[0] + self.comm_time[0]

    @property
    def comm_share(self) -> float:
        """Rank 0's fraction of the forward pass spent communicating."""
        return self.comm_time[0] / self.forward_time if self.forward_time > 0 else 0.0


@dataclass
class WorkerArgs:
    rank: int
    world_size: int
    port: int
    model: nn.Module
    """The whole (unsharded) model, on the CPU; its tensors travel as shared memory."""
    device_type: str
    attention_backend: type
    kv_cache_shape: tuple[int, ...]
    num_layers: int
    dtype: torch.dtype
    linear_plan: LinearPlan
    num_threads: int


def step_message(metadata: AttentionMetadata, input_ids: torch.Tensor,
                 position_ids: torch.Tensor) -> dict[str, np.ndarray]:
    """What a worker needs to run one step: the flat batch and the common metadata."""
    message = {f.name: getattr(metadata, f.name).cpu().numpy() for f in fields(AttentionMetadata)}
    message["input_ids"] = input_ids.cpu().numpy()
    message["position_ids"] = position_ids.cpu().numpy()
    return message


@dataclass
class ShardWorker:
    """What a worker keeps between steps: its shard of the model and of the KV cache,
    and its place in the group."""
    decoder: nn.Module
    backend: object
    linears: object
    group: TensorParallelGroup
    device: torch.device

    def execute_model(self, message: dict) -> tuple[float, float, int]:
        return run_step(message, self.decoder, self.backend, self.linears, self.group, self.device)


def worker_device(args: WorkerArgs) -> torch.device:
    """The worker's device: rank r's GPU (``cuda:r``) on CUDA, the CPU otherwise."""
    torch.set_num_threads(args.num_threads)
    device = torch.device(args.device_type, args.rank) if args.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def start_shard_worker(args: WorkerArgs, device: torch.device, store, host: str = HOST) -> ShardWorker:
    """Join the group, keep this rank's shard of ``args.model`` and allocate its KV cache
    (the same for a worker process here and a Ray actor on another machine)."""
    group = init_tensor_parallel_group(store, args.rank, args.world_size, device, host)
    model, args.model = args.model, None
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    shard_model(model, group)
    model = model.to(device=device, dtype=args.dtype)
    kv_caches = [(torch.zeros(args.kv_cache_shape, dtype=args.dtype, device=device),
                  torch.zeros(args.kv_cache_shape, dtype=args.dtype, device=device))
                 for _ in range(args.num_layers)]
    backend = get_attn_backend(args.attention_backend, kv_caches, device)
    return ShardWorker(model.get_decoder(), backend, args.linear_plan.assign(model), group, device)


def worker_main(conn) -> None:
    """A worker process's main function: get its :class:`WorkerArgs`, join the group,
    shard, then run steps."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: rank 0 shuts us down
    try:
        args: WorkerArgs = conn.recv()
    except (EOFError, OSError):
        return  # rank 0 went before sending them
    try:
        device = worker_device(args)
        conn.send(("loaded", None))
        worker = start_shard_worker(args, device, connect_store(args.port, args.world_size))
        conn.send(("ready", None))
    except BaseException as e:
        conn.send(("error", f"rank {args.rank} failed to start: {type(e).__name__}: {e}"))
        return
    while True:
        try:
            if not conn.poll(POLL_S):
                if not parent_alive():
                    return  # the engine's process has gone
                continue
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        try:
            conn.send(("ok", worker.execute_model(message)))
        except BaseException as e:
            conn.send(("error", f"rank {args.rank}: {type(e).__name__}: {e}"))
            return


@torch.inference_mode()
def run_step(message: dict, decoder: nn.Module, backend, linears, group: TensorParallelGroup,
             device: torch.device) -> tuple[float, float, int]:
    """One forward pass of a worker's shard (no logits: rank 0 samples). Returns
    (compute seconds, communication seconds, all-reduces)."""
    tensors = {k: torch.from_numpy(v).to(device) for k, v in message.items()}
    metadata = backend.build_metadata(AttentionMetadata(
        **{f.name: tensors[f.name] for f in fields(AttentionMetadata)}))
    group.reset_timing()
    t0 = time.perf_counter()
    with planned_linear(linears):
        decoder(input_ids=tensors["input_ids"], position_ids=tensors["position_ids"],
                attn_backend=backend, attn_metadata=metadata, use_cache=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    return elapsed - group.comm_time, group.comm_time, group.num_all_reduces


def _stop_workers(processes: list, conns: list, grace: float = 5.0) -> None:
    """Ask every worker to stop and give them ``grace`` seconds; terminate, then kill,
    those that do not. (Holds no reference to the executor, so ``weakref.finalize`` can
    call it when the executor is collected, or at the interpreter's exit.)"""
    for conn in conns:
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for conn in conns:
        conn.close()


class MultiprocExecutor(Executor):
    """Rank 0's side of tensor parallelism: starts the workers, shards rank 0's own
    model, builds rank 0's model runner, and runs each step's broadcast and gather."""

    def __init__(self, model: nn.Module, tensor_parallel_size: int, device: torch.device,
                 dtype: torch.dtype, attention_backend: type, kv_cache_shape: tuple[int, ...],
                 num_layers: int, linear_plan: LinearPlan,
                 make_model_runner: Callable[..., ModelRunner]) -> None:
        """``model`` is rank 0's full model; it is sharded in place once the workers have
        their copy. ``kv_cache_shape`` is one rank's: ``num_kv_heads / T`` heads.
        ``make_model_runner(num_kv_heads=...)`` builds rank 0's runner, once its model is
        sharded (a runner prepares its linear layers for the weights it is given)."""
        t = self.world_size = tensor_parallel_size
        check_tensor_parallel_size(model.config, t)
        if device.type == "cuda" and torch.cuda.device_count() < t:
            raise ValueError(f"tensor_parallel_size {t} needs {t} GPUs, one per rank; "
                             f"this machine has {torch.cuda.device_count()}")
        self.timings: deque[StepTiming] = deque(maxlen=MAX_TIMINGS)
        """The last steps' :class:`StepTiming`, in order (also in the step trace)."""
        self.closed = False
        store = self._store = open_store(t)
        ctx = get_mp_context()
        if multiprocessing.current_process().daemon:
            # The engine core of `minivllm serve` is a daemon process, and Python refuses
            # children to daemons (their exit would orphan them). Ours end by themselves
            # when this process goes (the parent check above), so lift the flag.
            multiprocessing.current_process().daemon = False
        # Workers get an equal share of the cores; rank 0 keeps its own setting.
        threads = max(1, available_cpus() // t)
        cpu_model = model if device.type == "cpu" else _cpu_copy(model)
        self.processes, self.conns = [], []
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self.conns)
        for rank in range(1, t):
            parent_conn, child_conn = ctx.Pipe()
            p = ctx.Process(target=with_environment, args=(dict(os.environ), worker_main, child_conn),
                            name=f"minivllm-tp-worker-{rank}", daemon=False)
            p.start()
            child_conn.close()
            self.processes.append(p)
            self.conns.append(parent_conn)
        try:
            # The arguments go down each worker's pipe rather than with the start: the model
            # is one shared-memory handle per tensor, hundreds of them, more than a fork
            # server passes along with a start (256). Pickled now: the model may change after.
            for rank, conn in enumerate(self.conns, start=1):
                try:
                    conn.send(WorkerArgs(rank, t, store.port, cpu_model, device.type, attention_backend,
                                         kv_cache_shape, num_layers, dtype, linear_plan, threads))
                except OSError:  # the worker is gone (its pipe is broken): say why
                    self.processes[rank - 1].join(10)
                    raise self._dead(rank) from None
            self._wait_all("loaded", STARTUP_TIMEOUT_S)
            self.group = init_tensor_parallel_group(store, 0, t, device)
            self.sharded = shard_model(model, self.group)
            self._wait_all("ready", STARTUP_TIMEOUT_S)
            self.model_runner = make_model_runner(num_kv_heads=kv_cache_shape[2])
        except BaseException:
            self.shutdown(grace=0)
            raise
        logger.info("tensor parallelism: %d ranks (%s), worker pids %s", t,
                    "NCCL" if device.type == "cuda" else "gloo", self.worker_pids)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def _receive(self, rank: int, timeout: float) -> tuple[str, object]:
        conn, process = self.conns[rank - 1], self.processes[rank - 1]
        deadline = time.monotonic() + timeout
        while not conn.poll(POLL_S):
            if not process.is_alive():
                raise self._dead(rank)
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel worker {rank} did not answer in {timeout:.0f} s")
        try:
            return conn.recv()
        except (EOFError, OSError):  # its end of the pipe closed: it is exiting, say why
            process.join(10)
            raise self._dead(rank) from None

    def _dead(self, rank: int) -> RuntimeError:
        process = self.processes[rank - 1]
        return RuntimeError(describe_exit(f"tensor-parallel worker {rank} (pid {process.pid})",
                                          process.exitcode))

    def _wait_all(self, expected: str, timeout: float) -> list[object]:
        answers = []
        for rank in range(1, self.world_size):
            kind, value = self._receive(rank, timeout)
            if kind == "error":
                raise RuntimeError(str(value))
            if kind != expected:
                raise RuntimeError(f"tensor-parallel worker {rank} sent {kind!r}, expected {expected!r}")
            answers.append(value)
        return answers

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Rank 0 prepares the step and sends its inputs; every rank runs its forward
        pass (meeting at each all-reduce); rank 0 samples from its logits."""
        runner = self.model_runner
        step = runner.prepare_step(scheduler_output)
        inputs = step.inputs
        try:
            self.start_step(step_message(inputs["attn_metadata"], inputs["input_ids"], inputs["position_ids"]))
            t0 = time.perf_counter()
            logits = runner.forward(step)
            if logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)
            parallel = self.finish_step(time.perf_counter() - t0)
        except BaseException as e:  # the ranks are out of step: the group is done
            if self.closed:  # shut down before this step: nothing new to say
                raise
            dead = self._dead_worker()
            self.shutdown(grace=0)
            if dead is not None and isinstance(e, Exception):  # say which worker, not only gloo's "reset by peer"
                raise dead from e
            raise
        output = runner.sample_step(step, logits)
        output.parallel = parallel
        return output

    def _dead_worker(self) -> RuntimeError | None:
        """After a failed step: the error naming a worker that died, if one did."""
        time.sleep(0.1)  # a worker that died broke the all-reduce: let it be reaped
        dead = [rank for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]
        return self._dead(dead[0]) if dead else None

    def start_step(self, message: dict[str, np.ndarray]) -> None:
        """Send the step's inputs to every worker (they start their forward at once)."""
        if self.closed:
            raise RuntimeError("the tensor-parallel workers have been shut down (after close() or "
                               "a failed step); make a new LLM")
        self._send_step(message)
        self.group.reset_timing()

    def _send_step(self, message: dict[str, np.ndarray]) -> None:
        """The transport: a pipe per worker."""
        for conn in self.conns:
            conn.send(message)

    def finish_step(self, forward_time: float) -> StepTiming:
        """After rank 0's own forward (``forward_time`` seconds): every rank's timing."""
        comm, num = self.group.comm_time, self.group.num_all_reduces
        computes, comms = [forward_time - comm], [comm]
        for compute_s, comm_s, _ in self._step_replies():
            computes.append(compute_s)
            comms.append(comm_s)
        timing = StepTiming(computes, comms, num)
        self.timings.append(timing)
        return timing

    def _step_replies(self) -> list[tuple[float, float, int]]:
        """Every worker's (compute s, communication s, all-reduces) for the step."""
        return self._wait_all("ok", STEP_TIMEOUT_S)

    def shutdown(self, grace: float = 5.0) -> None:
        """Stop the workers (idempotent). After a failed step they may be stuck in an
        all-reduce that will never complete: then ``grace=0`` terminates them at once."""
        self.closed = True
        if self._finalizer.detach() is not None:
            _stop_workers(self.processes, self.conns, grace)


def _cpu_copy(model: nn.Module) -> nn.Module:
    """A CPU copy of a GPU model, to hand to the workers (CUDA tensors shared between
    processes stay tied to the GPU they were made on)."""
    import copy

    return copy.deepcopy(model).cpu()
