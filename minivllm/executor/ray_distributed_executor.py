"""RayDistributedExecutor: the tensor-parallel workers as Ray actors, on any node (notebook 14).

    LLM("smollm2-135m-instruct", tensor_parallel_size=3, distributed_executor_backend="ray")
    minivllm serve --tensor-parallel-size 3 --distributed-executor-backend ray

The step is :class:`~minivllm.executor.multiproc_executor.MultiprocExecutor`'s: rank 0 is
the engine's own process, prepares the step, sends its inputs to ranks 1..T-1, runs its
own shard's forward pass (meeting the others at each all-reduce) and samples. What Ray
changes is everything around the step, the part that decides whether the ranks may sit
on different machines:

* **Where the workers run.** A *placement group* reserves one bundle of CPUs per worker,
  packed onto as few nodes as hold them (``PACK``, vLLM's default): two machines' worth of
  ranks go to two machines, and a group that cannot fit is refused, saying what the
  cluster has, instead of waiting forever. One actor per bundle is a worker.
* **How the ranks meet.** Rank 0 opens the rendezvous store at the address Ray reports
  for its node, and each rank binds its gloo connections to its own node's address
  (:mod:`minivllm.distributed.parallel_state`): the same all-reduce, across a network.
* **Where the weights come from.** A worker on another machine cannot map this process's
  memory, so each actor loads the model itself, by name (it must be installed there,
  like minivllm): vLLM's workers do the same from disk. A model made in memory (a test's
  tiny model) has no name to load; it travels once through Ray's object store instead.
* **How a step's inputs travel.** One actor call per worker
  (``execute_model.remote(message)``); its reply, an object reference, is read after
  rank 0's own forward pass. A call costs about a millisecond on one machine, more than
  a pipe: vLLM replaces the calls with Ray's *compiled graphs*, channels set up once.

A worker that dies breaks the group as in the ``mp`` backend: the step fails naming its
rank, and the engine stops (the other ranks could not agree on the next all-reduce).
Actors are not restarted: a rank that comes back empty cannot rejoin a group in mid-step.
Workers end with the engine (``shutdown``) and with the process that made them (Ray
kills the actors of a driver that exits).

On CUDA this backend is refused for now: rank 0's GPU belongs to the engine's process,
which is no actor, so Ray could hand the same GPU to a worker. The ``mp`` backend covers
one GPU machine.

In vLLM: ``vllm/v1/executor/ray_executor.py`` (``RayDistributedExecutor``) with
``ray_utils.py`` (``RayWorkerWrapper``, ``initialize_ray_cluster``).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from minivllm.distributed.parallel_state import (
    connect_store,
    init_tensor_parallel_group,
    open_store,
)
from minivllm.distributed.tensor_parallel import check_tensor_parallel_size, shard_model
from minivllm.executor.multiproc_executor import (
    MAX_TIMINGS,
    STARTUP_TIMEOUT_S,
    STEP_TIMEOUT_S,
    MultiprocExecutor,
    StepTiming,
    WorkerArgs,
    start_shard_worker,
    worker_device,
)
from minivllm.executor.ray_utils import import_ray, init_ray, node_ip, wait_for_placement
from minivllm.utils.system_utils import available_cpus
from minivllm.worker.linear_plan import LinearPlan
from minivllm.worker.model_runner import ModelRunner

logger = logging.getLogger("minivllm")


class RayWorkerWrapper:
    """One worker rank, as a Ray actor (the class is made remote when the executor starts,
    so that importing this module never imports Ray)."""

    def __init__(self) -> None:
        self.args: WorkerArgs | None = None
        self.worker = None

    def where(self) -> tuple[str, str, int]:
        """(node address, node id, pid): where Ray put this rank."""
        ray = import_ray()
        return node_ip(), ray.get_runtime_context().get_node_id(), os.getpid()

    def load(self, args: WorkerArgs, model: nn.Module | None, model_name: str | None) -> float:
        """Load the whole model here (by name, or as sent); returns the seconds it took."""
        t0 = time.perf_counter()
        self.device = worker_device(args)
        if model is None:
            from minivllm.worker.model_loader import load_model

            model = load_model(model_name, args.dtype, torch.device("cpu"))[0]
        args.model, self.args = model, args
        return time.perf_counter() - t0

    def join(self, store_host: str) -> None:
        """Join rank 0's group, keep this rank's shard, allocate its KV cache."""
        args = self.args
        store = connect_store(args.port, args.world_size, store_host)
        self.worker = start_shard_worker(args, self.device, store, host=node_ip())

    def execute_model(self, message: dict[str, np.ndarray]) -> tuple[float, float, int]:
        return self.worker.execute_model(message)


def _remote_worker_class(ray: Any, num_cpus: int) -> Any:
    # No restarts: a rank that comes back has lost its shard and its place in the group.
    return ray.remote(num_cpus=num_cpus, max_restarts=0)(RayWorkerWrapper)


def _stop_actors(ray: Any, actors: list, placement_group: list) -> None:
    """Kill the actors and release their reservation (idempotent; holds no reference to
    the executor, so ``weakref.finalize`` can call it)."""
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # the actor is gone already, or Ray is shutting down
            pass
    actors.clear()
    for pg in placement_group:
        try:
            ray.util.remove_placement_group(pg)
        except Exception:
            pass
    placement_group.clear()


class RayDistributedExecutor(MultiprocExecutor):
    """Rank 0's side of tensor parallelism over Ray actors: the same step as
    :class:`MultiprocExecutor`, with workers Ray placed, possibly on other nodes."""

    def __init__(self, model: nn.Module, tensor_parallel_size: int, device: torch.device,
                 dtype: torch.dtype, attention_backend: type, kv_cache_shape: tuple[int, ...],
                 num_layers: int, linear_plan: LinearPlan,
                 make_model_runner: Callable[..., ModelRunner], model_name: str | None = None) -> None:
        """As :class:`MultiprocExecutor`, plus ``model_name``: the name every worker loads
        its weights by (None: ``model`` was made in memory; it is sent through Ray)."""
        t = self.world_size = tensor_parallel_size
        check_tensor_parallel_size(model.config, t)
        if device.type != "cpu":
            raise ValueError("distributed_executor_backend='ray' runs CPU ranks only for now (on CUDA "
                             "rank 0's GPU is not Ray's to place); use 'mp' on one GPU machine")
        t0 = time.perf_counter()
        ray = self._ray = init_ray()
        self.timings: deque[StepTiming] = deque(maxlen=MAX_TIMINGS)
        self.closed = False
        self.processes, self.conns = [], []  # none of the mp backend's own
        threads = max(1, available_cpus() // t)  # each worker's CPUs, as with "mp"
        self.actors: list = []
        self._placement: list = []
        self._finalizer = weakref.finalize(self, _stop_actors, ray, self.actors, self._placement)
        self._pending: list = []
        try:
            pg = ray.util.placement_group([{"CPU": threads}] * (t - 1), strategy="PACK")
            self._placement.append(pg)
            wait_for_placement(pg, f"{t - 1} tensor-parallel worker(s) of {threads} CPU(s)")
            strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
            worker_cls = _remote_worker_class(ray, threads)
            self.actors += [worker_cls.options(scheduling_strategy=strategy(pg, placement_group_bundle_index=i)).remote()
                            for i in range(t - 1)]
            host = node_ip()
            store = self._store = open_store(t, host)
            model_ref = None if model_name is not None else ray.put(model)
            args = [WorkerArgs(rank, t, store.port, None, device.type, attention_backend, kv_cache_shape,
                               num_layers, dtype, linear_plan, threads) for rank in range(1, t)]
            load_s = self._get([a.load.remote(w, model_ref, model_name) for a, w in zip(self.actors, args)],
                               STARTUP_TIMEOUT_S)
            joined = [a.join.remote(host) for a in self.actors]
            self.group = init_tensor_parallel_group(store, 0, t, device, host)
            self.sharded = shard_model(model, self.group)
            self._get(joined, STARTUP_TIMEOUT_S)
            self.placement = self._get([a.where.remote() for a in self.actors], STARTUP_TIMEOUT_S)
            """Per worker (rank 1 first): (node address, node id, pid)."""
            self.model_runner = make_model_runner(num_kv_heads=kv_cache_shape[2])
        except BaseException:
            self.shutdown(grace=0)
            raise
        self.startup_time = time.perf_counter() - t0
        """Seconds from connecting to Ray to every rank ready (the workers' loads included)."""
        logger.info("tensor parallelism over Ray: %d ranks (gloo) on %d node(s), workers at %s, loaded "
                    "in %s s; ready in %.1f s", t, self.num_nodes, [ip for ip, _, _ in self.placement],
                    [round(s, 1) for s in load_s], self.startup_time)

    @property
    def worker_pids(self) -> list[int]:
        return [pid for _, _, pid in getattr(self, "placement", [])]

    @property
    def num_nodes(self) -> int:
        """How many Ray nodes the ranks are on (rank 0's included)."""
        here = self._ray.get_runtime_context().get_node_id()
        return len({here, *(node for _, node, _ in self.placement)})

    def _get(self, refs: list, timeout: float) -> list:
        """``ray.get`` that names the rank whose actor died instead of Ray's long report."""
        ray = self._ray
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"tensor-parallel workers did not answer in {timeout:.0f} s") from None
        except ray.exceptions.RayActorError as e:
            raise self._died(e) from None
        except ray.exceptions.RayTaskError as e:  # the worker raised: its own error, unwrapped
            raise RuntimeError(f"a tensor-parallel worker failed: {e.cause!r}") from None

    def _died(self, e: Exception) -> RuntimeError:
        dead = getattr(e, "actor_id", None)
        rank = next((r for r, a in enumerate(self.actors, start=1) if a._actor_id.hex() == dead), "?")
        return RuntimeError(f"tensor-parallel worker {rank} (a Ray actor) died: {str(e).splitlines()[0]}")

    def _dead_worker(self) -> RuntimeError | None:
        """After a failed step: the step's call to a worker that died fails with Ray's
        RayActorError (the others fail with gloo's broken connection, or hang in it)."""
        ray, pending, self._pending = self._ray, self._pending, []
        for ref in pending:
            try:
                ray.get(ref, timeout=5)
            except ray.exceptions.RayActorError as e:
                return self._died(e)
            except Exception:  # a live rank whose all-reduce broke, or one still stuck in it
                continue
        return None

    def _send_step(self, message: dict[str, np.ndarray]) -> None:
        """The transport: one actor call per worker, the inputs stored once for all."""
        ref = self._ray.put(message)
        self._pending = [a.execute_model.remote(ref) for a in self.actors]

    def _step_replies(self) -> list[tuple[float, float, int]]:
        pending, self._pending = self._pending, []
        return self._get(pending, STEP_TIMEOUT_S)

    def shutdown(self, grace: float = 5.0) -> None:
        self.closed = True
        if self._finalizer.detach() is not None:
            _stop_actors(self._ray, self.actors, self._placement)
