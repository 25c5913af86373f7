"""Replicas as Ray actors: ``minivllm serve --data-parallel-size N --data-parallel-backend ray``.

    ray start --head --port 6379                 # machine A (and `ray start --address A:6379` on B)
    minivllm serve --data-parallel-size 2 --data-parallel-backend ray --host 0.0.0.0 --port 8000

:class:`~minivllm.entrypoints.data_parallel.LocalReplicas` starts N ``minivllm serve``
processes on this machine. :class:`RayReplicas` asks Ray to start them wherever the
cluster has room, and to start them again when they die; the router in front is the
same, because a replica is still a URL.

* **Placement.** A placement group reserves one bundle of CPUs per replica, spread over
  the nodes (``SPREAD``: one replica per machine where there are enough, so that two
  replicas do not share one machine's cores while another idles).
* **One actor per replica.** :class:`ReplicaActor` starts ``minivllm serve`` on its node
  as its child, on a port a task in its bundle found free there, and returns once the server answers
  ``/health`` (or fails, with the end of the server's log). The child dies with the
  actor (``PR_SET_PDEATHSIG``), and the actor dies with its child: a thread waits on
  it and exits the actor's process when the server exits, so that a crashed server is
  a dead actor.
* **Restarts.** Ray restarts a dead actor (``max_restarts``) in the same bundle, with
  the same arguments, so on the same node and port: its ``__init__`` runs again and
  starts a fresh server at the URL the router knows. The
  router took the replica out of rotation when its requests failed (a request that had
  not started streaming is retried on another replica) and its health probe brings it
  back once ``/health`` answers.

Why actors and not Ray Serve deployments: Ray Serve would bring its own HTTP proxy and
its own request routing, and replace the router this course teaches (its policies,
prefix-aware among them). Actors keep the router and add only what Ray is for here:
placement on a cluster, restarts and one view of every process.

In vLLM: ``vllm serve --data-parallel-size N --data-parallel-backend ray`` places each
data-parallel engine core as a Ray actor (``CoreEngineActorManager``,
``vllm/v1/engine/utils.py``) behind one API server; here each replica is a whole server.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from minivllm.exceptions import ValidationError
from minivllm.executor.ray_utils import import_ray, init_ray, node_ip, wait_for_placement
from minivllm.utils.system_utils import available_cpus, die_with_parent, free_port

MAX_RESTARTS = 100
"""How often Ray may restart one replica over a run (a crash loop ends after this many)."""


class ReplicaActor:
    """One replica: a ``minivllm serve`` child process on this actor's node."""

    def __init__(self, index: int, port: int, serve_argv: Sequence[str], env: Mapping[str, str],
                 startup_timeout: float, files: Mapping[str, str]) -> None:
        self.index, self.host, self.port = index, node_ip(), port
        self.log_path = os.path.join(tempfile.gettempdir(), f"minivllm-replica-{index}-{os.getpid()}.log")
        cmd = [sys.executable, "-c", "import sys; from minivllm.entrypoints.cli import main; sys.exit(main())",
               "serve", "--host", self.host, "--port", str(self.port), *serve_argv]
        self.folder = tempfile.TemporaryDirectory(prefix="minivllm-replica-")  # this node's copies
        for flag, text in files.items():
            path = os.path.join(self.folder.name, flag.strip("-") + ".json")
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(text)
            cmd += [flag, path]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, preexec_fn=die_with_parent, stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, **env})
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {index} exited with status {self.proc.returncode} while "
                                   f"starting; the end of {self.log_path} on {self.host}:\n{self._tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url() + "/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"replica {index} not ready after {startup_timeout:g} s")
            time.sleep(0.2)
        threading.Thread(target=self._exit_with_server, daemon=True).start()

    def _tail(self, lines: int = 20) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def _exit_with_server(self) -> None:
        self.proc.wait()
        os._exit(1)  # a dead server is a dead actor: Ray restarts both

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def where(self) -> tuple[str, int, int]:
        """(Ray's node id, the actor's pid, its server's pid)."""
        return import_ray().get_runtime_context().get_node_id(), os.getpid(), self.proc.pid


def _free_port_on_node() -> int:
    """Run as a task in a replica's bundle: a free port on that node (see :func:`free_port`)."""
    return free_port(node_ip())


class RayReplicas:
    """N replicas as Ray actors; a context manager like
    :class:`~minivllm.entrypoints.data_parallel.LocalReplicas` (``urls``, ``start``, ``stop``).

        with RayReplicas(2, ["--model", "smollm2-135m-instruct"]) as replicas:
            print(replicas.urls)
    """

    def __init__(self, n: int, serve_argv: Sequence[str], num_cpus: int | None = None,
                 startup_timeout: float = 300.0, env: Mapping[str, str] | None = None,
                 namespace: str | None = None, files: Mapping[str, str] | None = None) -> None:
        """``num_cpus``: each replica's share of a node (default: this machine's cores / n).
        ``namespace``: the Ray namespace the actors are named in (``replica-0``, ...), so that
        another program on the cluster can find them with ``ray.get_actor``. ``files``:
        ``{flag: text}``, each text written to a file on the replica's own node (readable by
        its user only) and its path passed after the flag, e.g. ``{"--tenants": json}``: a
        path on this machine means nothing on another."""
        if n < 1:
            raise ValidationError("data_parallel_size", f"data_parallel_size must be >= 1, got {n}", n)
        self.n, self.serve_argv, self.startup_timeout = n, list(serve_argv), startup_timeout
        self.num_cpus = num_cpus or max(1, available_cpus() // n)
        self.env = {"OMP_NUM_THREADS": str(self.num_cpus), **(env or {})}
        self.namespace, self.files = namespace, dict(files or {})
        self.actors: list[Any] = []
        self.urls: list[str] = []
        self.placement_group = None
        self.startup_time: float | None = None
        """Seconds from connecting to Ray to every replica answering."""

    def start(self) -> RayReplicas:
        t0 = time.perf_counter()
        ray = init_ray(self.namespace, setting="data_parallel_backend")
        try:
            self.placement_group = ray.util.placement_group([{"CPU": self.num_cpus}] * self.n, strategy="SPREAD")
            wait_for_placement(self.placement_group, f"{self.n} replica(s) of {self.num_cpus} CPU(s)")
            strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
            bundles = [strategy(self.placement_group, placement_group_bundle_index=i) for i in range(self.n)]
            find_port = ray.remote(num_cpus=0)(_free_port_on_node)
            ports = ray.get([find_port.options(scheduling_strategy=b).remote() for b in bundles])
            actor_cls = ray.remote(num_cpus=self.num_cpus, max_restarts=MAX_RESTARTS)(ReplicaActor)
            self.actors = [actor_cls.options(name=f"replica-{i}", scheduling_strategy=bundles[i]).remote(
                i, ports[i], self.serve_argv, self.env, self.startup_timeout, self.files) for i in range(self.n)]
            try:
                self.urls = ray.get([a.url.remote() for a in self.actors])
            except ray.exceptions.RayActorError as e:  # a server that did not start: say why
                raise RuntimeError(f"a replica failed to start: {getattr(e, 'error_msg', e)}") from None
        except BaseException:
            self.stop()
            raise
        self.startup_time = time.perf_counter() - t0
        return self

    def where(self) -> list[tuple[str, int, int]]:
        """Per replica: (node id, the actor's pid, its server's pid), as now (the pids
        change when Ray restarts a replica). An actor Ray is restarting answers once it is
        up again: its new server can answer ``/health`` (and a router take it back) a
        moment before the actor has finished starting, and Ray refuses calls until then."""
        ray = import_ray()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                return ray.get([a.where.remote() for a in self.actors])
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        """Kill every replica for good (no restart) and release the reservation."""
        ray = import_ray()
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None

    def __enter__(self) -> RayReplicas:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
