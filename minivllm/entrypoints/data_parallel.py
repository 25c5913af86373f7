"""Replicas on this machine: ``minivllm serve --data-parallel-size N`` (notebook 14).

    minivllm serve --data-parallel-size 2 --port 8000

The one-host shortcut to the router of :mod:`minivllm.entrypoints.router` (vLLM's option name):
:class:`LocalReplicas` starts N ``minivllm serve`` processes on free loopback ports, each
its own engine, KV cache and prefix cache, and :func:`run_data_parallel` puts the router
(:func:`minivllm.entrypoints.router_app.run_router`) in front of them on the user's port.

Why whole processes and not N engines in one: a replica is then exactly what a remote
replica is (a URL), so the router in front is the same code for one host or many. The
price is that a replica is a process the router must not leak: the children never
outlive it. They are ended when it stops (Ctrl-C, an exception, a normal exit: the
context manager's ``__exit__``), and the kernel ends them if it is killed
(``PR_SET_PDEATHSIG``, set in each child before it starts).

In vLLM: ``vllm serve --data-parallel-size N`` starts its engine cores with
``CoreEngineProcManager`` (``vllm/v1/engine/utils.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from minivllm.entrypoints.openai.tenants import load_tenants
from minivllm.entrypoints.router_app import run_router
from minivllm.exceptions import ValidationError
from minivllm.utils.system_utils import available_cpus, die_with_parent, free_port


def engine_argv(engine_kwargs: dict[str, Any]) -> list[str]:
    """EngineConfig keyword arguments as ``minivllm serve`` flags (the inverse of
    :func:`minivllm.engine.arg_utils.add_engine_arguments`)."""
    argv = []
    for name, value in engine_kwargs.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


class LocalReplicas:
    """N ``minivllm serve`` processes on free loopback ports; a context manager that ends
    them all, however the block is left.

        with LocalReplicas(2, ["--model", "smollm2-135m-instruct"]) as replicas:
            print(replicas.urls)
    """

    def __init__(self, n: int, serve_argv: Sequence[str], host: str = "127.0.0.1",
                 startup_timeout: float = 300.0, log_dir: str | os.PathLike | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        """``log_dir``: write replica i's output to ``log_dir/replica-i.log`` instead of this
        process's terminal (a notebook or benchmark that wants only its own output).
        ``env``: variables set for the replicas on top of this process's environment."""
        if n < 1:
            raise ValidationError("data_parallel_size", f"data_parallel_size must be >= 1, got {n}", n)
        self.n, self.serve_argv, self.host, self.startup_timeout = n, list(serve_argv), host, startup_timeout
        self.log_dir, self.env = log_dir, dict(env or {})
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.logs: list[Any] = []

    def start(self) -> LocalReplicas:
        try:
            for _ in range(self.n):
                port = free_port(self.host)
                cmd = [sys.executable, "-c", "import sys; from minivllm.entrypoints.cli import main; sys.exit(main())", "serve", "--host", self.host, "--port", str(port),
                       *self.serve_argv]
                out = None
                if self.log_dir is not None:
                    out = open(os.path.join(self.log_dir, f"replica-{len(self.procs)}.log"), "wb")
                    self.logs.append(out)
                self.procs.append(subprocess.Popen(cmd, preexec_fn=die_with_parent, stdout=out,
                                                   stderr=subprocess.STDOUT if out else None,
                                                   env={**os.environ, **self.env}))
                self.urls.append(f"http://{self.host}:{port}")
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        pending = set(range(self.n))
        while pending:
            for i in sorted(pending):
                if self.procs[i].poll() is not None:
                    where = "its log above"
                    if self.logs:
                        with open(self.logs[i].name, errors="replace") as f:
                            where = f"the end of {self.logs[i].name}:\n" + "".join(f.readlines()[-20:])
                    raise RuntimeError(f"replica {i} ({self.urls[i]}) exited with status "
                                       f"{self.procs[i].returncode} while starting; see {where}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(self.urls[i] + "/health", timeout=2.0).status_code == 200:
                        pending.discard(i)
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas {sorted(pending)} not ready after {self.startup_timeout:g} s")
            time.sleep(0.2)

    def stop(self, timeout: float = 15.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self.logs:
            f.close()

    def __enter__(self) -> LocalReplicas:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def replica_tenants(tenants_file: str, folder: str) -> str:
    """The tenants of ``tenants_file`` without their limits, written (readable by this
    user only) into ``folder``: what each replica is started with. The router holds the
    limits for all of them; a replica needs the keys to authenticate the forwarded request
    and to salt the prefix cache by key, and the names to count usage by tenant."""
    keys = [{"name": t.name, "api_key": t.api_key} for t in load_tenants(tenants_file)]
    path = os.path.join(folder, "replica-tenants.json")
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump({"tenants": keys}, f)
    return path


def run_data_parallel(size: int, serve_argv: Sequence[str], routing_policy: str, host: str, port: int,
                      tenants_file: str | None = None, backend: str = "mp", **router_kwargs: Any) -> None:
    """``minivllm serve --data-parallel-size N``: N replicas and the router in front
    (holding the limits of ``tenants_file``'s tenants, if given). ``backend``: "mp", local
    processes; "ray", Ray actors (:mod:`minivllm.entrypoints.ray_replicas`), named
    ``replica-i`` in the Ray namespace ``minivllm-serve-PORT``."""
    with tempfile.TemporaryDirectory() as folder:
        keys = None if tenants_file is None else replica_tenants(tenants_file, folder)
        if backend == "ray":  # the keys travel as text: the replica's node writes its own copy
            from minivllm.entrypoints.ray_replicas import RayReplicas

            files = {} if keys is None else {"--tenants": Path(keys).read_text()}
            replicas: Any = RayReplicas(size, serve_argv, namespace=f"minivllm-serve-{port}", files=files)
        else:
            os.environ.setdefault("OMP_NUM_THREADS", str(max(1, available_cpus() // size)))
            replicas = LocalReplicas(size, serve_argv if keys is None else [*serve_argv, "--tenants", keys])
        with replicas:
            run_router(replicas.urls, routing_policy, host, port, tenants_file=tenants_file, **router_kwargs)
