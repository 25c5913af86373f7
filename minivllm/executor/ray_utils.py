"""Ray, for the engine's workers and for replicas: imported only when asked for.

Ray is an optional extra (``pip install "minivllm[ray]"``): nothing in minivllm imports
it unless ``distributed_executor_backend="ray"`` or ``--data-parallel-backend ray`` asks,
and then :func:`import_ray` refuses that setting, naming the extra to install, instead
of a bare ``ModuleNotFoundError``.

**Which cluster.** :func:`init_ray` joins the cluster that ``ray start`` made on this
machine, or the one ``RAY_ADDRESS`` names (``ray.init()``'s own rule); with neither, Ray
starts a private one-node cluster inside this process's session, which is how a
notebook gets one. Two machines::

    machine A$ ray start --head --port 6379
    machine B$ ray start --address A:6379
    machine A$ minivllm serve --tensor-parallel-size 2 --distributed-executor-backend ray

In vLLM: ``vllm/v1/executor/ray_utils.py`` (``initialize_ray_cluster``: ``ray.init``, the
placement group, and the checks that the cluster can hold it).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from minivllm.exceptions import ValidationError

logger = logging.getLogger("minivllm")

EXTRA = 'pip install "minivllm[ray]"'
PLACEMENT_TIMEOUT_S = 60.0
"""How long to wait for Ray to find room for a placement group before saying so."""


def import_ray(setting: str = "distributed_executor_backend") -> Any:
    """The ``ray`` module; without it, a ValidationError on ``setting`` (the option that
    asked for Ray) that names the extra to install, as a bad value would be refused."""
    try:
        import ray
    except ImportError:
        raise ValidationError(setting, f"{setting} 'ray' needs Ray, an optional extra: {EXTRA}",
                              "ray") from None
    return ray


def init_ray(namespace: str | None = None, setting: str = "distributed_executor_backend") -> Any:
    """Connect to the Ray cluster (or start a local one) once per process; returns ``ray``."""
    ray = import_ray(setting)
    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no telemetry unless asked (as vLLM)
        t0 = time.perf_counter()
        # Workers' prints reach this process's terminal (log_to_driver) only where a person
        # reads it; the engine's own logger says what matters.
        ray.init(namespace=namespace, log_to_driver=False, include_dashboard=False,
                 configure_logging=False)
        logger.info("Ray: connected in %.1f s, %d node(s), resources %s", time.perf_counter() - t0,
                    len([n for n in ray.nodes() if n["Alive"]]), ray.cluster_resources())
    return ray


def node_ip() -> str:
    """The address Ray reports for this process's node: where other nodes reach it."""
    return import_ray().util.get_node_ip_address()


def wait_for_placement(pg: Any, what: str, timeout: float = PLACEMENT_TIMEOUT_S) -> None:
    """Wait until Ray has reserved ``pg``'s bundles; if it cannot, remove it and say what
    the cluster has (a placement group waits forever by default)."""
    ray = import_ray()
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"Ray found no room for {what} in {timeout:g} s: it asks for {pg.bundle_specs}, and the "
            f"cluster has {ray.available_resources()} free of {ray.cluster_resources()}. Add a node "
            f"(ray start --address HEAD:PORT) or ask for less") from None
