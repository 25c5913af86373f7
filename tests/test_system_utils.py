"""How the engine core and tensor-parallel workers are started (minivllm/utils/system_utils.py).

The orphan tests (test_engine_core, test_tensor_parallel) cover the other half: a child
notices that its parent has gone."""

from __future__ import annotations

import multiprocessing
import os
import sys

import pytest

from minivllm.utils.system_utils import PRELOAD, get_mp_context, with_environment

pytestmark = pytest.mark.multiprocess


def report(queue) -> None:
    """What a child found when its own code began."""
    import torch

    queue.put({"preloaded": [m for m in PRELOAD if m in sys.modules],
               "marker": os.environ.get("MINIVLLM_TEST_MARKER"),
               "threads": torch.get_num_threads(),
               "parent_pid": multiprocessing.parent_process().pid})


def start(ctx, env):
    queue = ctx.Queue()
    p = ctx.Process(target=with_environment, args=(env, report, queue))
    p.start()
    try:
        return queue.get(timeout=120)
    finally:
        p.join(30)
        assert p.exitcode == 0


def test_children_get_the_environment_of_now_and_the_imports_done_once(monkeypatch):
    ctx = get_mp_context()
    forkserver = "forkserver" in multiprocessing.get_all_start_methods()
    assert ctx.get_start_method() == ("forkserver" if forkserver else "spawn")

    monkeypatch.setenv("MINIVLLM_TEST_MARKER", "first")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    first = start(ctx, dict(os.environ))
    # Changed after the fork server started (and copied the environment of then):
    monkeypatch.setenv("MINIVLLM_TEST_MARKER", "second")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    second = start(ctx, dict(os.environ))

    assert (first["marker"], first["threads"]) == ("first", 1)
    assert (second["marker"], second["threads"]) == ("second", 2)
    assert first["parent_pid"] == second["parent_pid"] == os.getpid()
    if forkserver:  # the child's own code began with the libraries already imported
        assert first["preloaded"] == second["preloaded"] == list(PRELOAD)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this system")
def test_the_cores_to_share_out_are_those_the_process_may_run_on():
    """Held to one core (as ``taskset -c 0`` holds a process), a process counts one core
    to share out as threads, whatever the machine has."""
    import subprocess

    count = "from minivllm.utils.system_utils import available_cpus; print(available_cpus())"
    hold = "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
    held = subprocess.run([sys.executable, "-c", hold + count], capture_output=True, text=True, check=True)
    free = subprocess.run([sys.executable, "-c", count], capture_output=True, text=True, check=True)
    assert held.stdout.strip() == "1"
    assert free.stdout.strip() == str(len(os.sched_getaffinity(0)))
