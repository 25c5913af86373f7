"""How minivllm starts its own processes: the engine core, tensor-parallel workers.

A new Python process pays for its imports before it runs a line of ours: torch and
transformers' model code took about 8 s of CPU on the 2-core AMD EPYC this was measured on. Python offers three ways
to start a process (``multiprocessing``'s *start methods*):

* ``spawn``: a fresh interpreter each time. Nothing is inherited, so it is always safe,
  and every process pays the 8 s again.
* ``fork``: a copy of the parent as it is, model, KV cache, threads and all. Instant, but
  unsafe once the parent runs threads (an asyncio server, torch's thread pool): a lock
  held by another thread at the moment of the copy stays held forever in the child.
* ``forkserver``: a *server* process is spawned once and imports what we list (torch and
  transformers' model code), nothing else; every later process is a fork of that clean
  server. No state of ours is copied, and the imports are already done: a start costs
  tens of milliseconds instead of seconds.

We use ``forkserver`` where the platform has it (Linux, macOS) and ``spawn`` elsewhere
(Windows). Two things a fork of the server does not get from us, and the helpers here
restore: the environment as it is *now* (the server copied ours when it started), see
:func:`with_environment`; and a way to notice that we have gone (the child's parent is
the server, so ``os.getppid()`` says nothing about us), see :func:`parent_alive`.

Both methods re-import the script that started them (as ``__mp_main__``): a script that
starts an engine core needs the usual ``if __name__ == "__main__":`` guard. Without it,
the child runs the script's ``LLM(...)`` again while it is still starting and tries to
start processes of its own. :func:`get_mp_context` notices this in the child and exits
it with :data:`EXIT_MAIN_REIMPORTED`. The parent, which sees only an exit code, then
names the missing guard (:func:`describe_exit`) instead of waiting on a child that will
never answer.

In vLLM: ``get_mp_context()`` in ``vllm/utils/system_utils.py`` (``fork`` by default,
``spawn`` once CUDA is initialised, set by ``VLLM_WORKER_MULTIPROC_METHOD``), and the
trade-offs in vLLM's ``docs/design/multiprocessing.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable
from multiprocessing.context import BaseContext

PRELOAD = ("torch", "transformers.modeling_utils")
"""What the fork server imports once: the libraries, not minivllm itself (so a child
always runs the package as it is on disk when the child starts)."""


EXIT_MAIN_REIMPORTED = 121
"""The exit code of a child that was re-importing the parent's script when the script
asked for a process of its own (the missing ``__main__`` guard)."""


def get_mp_context() -> BaseContext:
    """``forkserver`` (preloading :data:`PRELOAD`) where available, else ``spawn``.

    Called before every process minivllm starts. In a child that is still re-importing
    the parent's script (``multiprocessing`` marks such a process ``_inheriting``), it
    explains why on stderr and exits with :data:`EXIT_MAIN_REIMPORTED`. The exit is
    ``os._exit``, because a fork server's child turns an exception into exit code 1."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        print(f"minivllm: {missing_guard_advice()}", file=sys.stderr, flush=True)
        os._exit(EXIT_MAIN_REIMPORTED)
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def with_environment(environ: dict[str, str], target: Callable, *args) -> object:
    """A child's entry point: make ``os.environ`` the parent's (``environ``, taken when the
    child was started) and call ``target(*args)``. Start a process with
    ``ctx.Process(target=with_environment, args=(dict(os.environ), main, ...))``.

    torch read ``OMP_NUM_THREADS`` when the server imported it, so a value given since is
    applied here."""
    os.environ.clear()
    os.environ.update(environ)
    threads = environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    return target(*args)


def parent_alive() -> bool:
    """True while the process that started this one runs. ``multiprocessing`` keeps a
    pipe end open in the parent for each child it starts; it closes when the parent
    exits, however it exits (``spawn`` and ``forkserver`` alike)."""
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def missing_guard_advice() -> str:
    main = getattr(sys.modules.get("__main__"), "__file__", None) or "the script"
    return (f"{main} builds an engine when it is imported. minivllm starts its processes with "
            f"multiprocessing's forkserver or spawn, and both import the main script again in "
            f"the new process, so the script ran once more there. Put the code that builds the "
            f"engine under `if __name__ == \"__main__\":`.")


def describe_exit(what: str, exitcode: int | None) -> str:
    """Why a child process of ours is gone, for the error its parent raises."""
    if exitcode == EXIT_MAIN_REIMPORTED:
        return f"{what} exited while starting: {missing_guard_advice()}"
    if exitcode is not None and exitcode < 0:
        try:
            return f"{what} was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"{what} exited (exit code {exitcode})"


def available_cpus() -> int:
    """The cores this process may run on, which is what its processes share out as
    threads: the CPU affinity where the system reports one (Linux: ``taskset -c 0``, a
    container's ``--cpuset-cpus``), else ``os.cpu_count()``. The machine's count would
    give two threads per core under ``taskset -c 0``, and threads that take turns on one
    core make every step slower than one thread does."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now: the OS picks it (bind to port 0). Another program
    could take it before the replica binds; on a loopback interface that race is rare."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child before exec: the kernel sends SIGTERM when the parent dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
