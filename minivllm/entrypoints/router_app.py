"""The router as an HTTP server: its FastAPI app and ``minivllm router`` (notebook 14).

The routing itself, choosing a replica, forwarding, health, is
:class:`minivllm.entrypoints.router.Router`; this module puts it behind the same
endpoints and the same guard (API keys, body size, tenants' limits) as ``minivllm
serve``, so a client cannot tell one server from a fleet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minivllm.entrypoints.openai.middleware import RequestGuard
from minivllm.entrypoints.openai.prometheus import CONTENT_TYPE, render_router_metrics
from minivllm.entrypoints.openai.protocol import APIError
from minivllm.entrypoints.openai.tenants import Tenants
from minivllm.entrypoints.router import (
    DEFAULT_HEALTH_INTERVAL,
    DEFAULT_READ_TIMEOUT,
    Router,
    relayed,
)
from minivllm.entrypoints.routing import NoReplicaAvailable, PrefixAware, RoutingPolicy, make_policy
from minivllm.exceptions import ValidationError

logger = logging.getLogger("minivllm")


async def models_from_any(router: Router, path: str, headers: dict) -> Response:
    """GET passed through to a healthy replica (``/v1/models``)."""
    for _ in (0, 1):
        try:  # not the policy: a round robin's turn is for generation requests
            i = RoutingPolicy.least_loaded(RoutingPolicy.healthy(router.replicas), router.replicas)
        except NoReplicaAvailable as e:
            raise APIError(503, str(e), "service_unavailable", code="no_healthy_replica") from None
        try:
            r = await router.client.get(router.replicas[i].name + path, headers=headers)
        except httpx.TransportError as e:
            router.take_out(i, f"{type(e).__name__}: {e}")
            continue
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"),
                        headers=relayed(r))
    raise APIError(503, "no replica answered", "service_unavailable", code="no_healthy_replica")


async def fleet_metrics(router: Router) -> bytes:
    """Every replica's samples with a ``replica`` label, then the router's own."""
    async def scrape(url: str) -> str:
        try:
            r = await router.client.get(url + "/metrics", timeout=5.0)
            return r.text if r.status_code == 200 else ""
        except httpx.HTTPError:
            return ""

    texts = await asyncio.gather(*(scrape(r.name) for r in router.replicas))
    own = [] if router.tenants is None else router.tenants.records("minivllm:router_tenant_")
    return render_router_metrics(router.replicas, texts, router.stats, own)


def build_router_app(replicas: Sequence[str], routing_policy: str = "round_robin", *,
                     model: str | None = None, tokenizer: Any = None, block_size: int = 16,
                     api_key: str | Sequence[str] | None = None, tenants_file: str | None = None,
                     prefill: Sequence[str] = (),
                     max_request_bytes: int | None = 1 << 20,
                     health_interval: float = DEFAULT_HEALTH_INTERVAL,
                     read_timeout: float = DEFAULT_READ_TIMEOUT) -> FastAPI:
    """The router's FastAPI app (``app.state.router`` is the :class:`Router`). For
    ``prefix_aware``, give the replicas' ``tokenizer`` or the ``model`` to load it from,
    and their ``block_size``. ``api_key`` and ``tenants_file`` are checked here, and the
    tenants' limits held here for every replica (the replicas need the keys too: the
    request is forwarded with its ``Authorization``). ``prefill``: the URLs of prefill
    instances, for disaggregated prefill (``replicas`` are then the decode instances)."""
    try:
        policy = make_policy(routing_policy, block_size=block_size)
    except ValueError as e:
        raise ValidationError("routing_policy", str(e), routing_policy) from None
    if isinstance(policy, PrefixAware) and tokenizer is None and model is not None:
        from minivllm.worker.model_loader import load_tokenizer  # here: the router needs no torch

        tokenizer = load_tokenizer(model)
    tenants = Tenants.from_options(api_key, tenants_file)
    router = Router(replicas, policy, tokenizer, health_interval=health_interval, read_timeout=read_timeout,
                    tenants=tenants, prefill_urls=prefill)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="minivllm router", version="0.1.0", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def generate(request: Request) -> Response:
        return await router.forward(request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        return await models_from_any(router, "/v1/models", auth)

    @app.get("/health")
    async def health() -> JSONResponse:
        states = [{"url": r.name, "healthy": r.healthy, "outstanding": r.outstanding} for r in router.replicas]
        if router.num_decode < len(states):  # disaggregated: say which instance does what
            for i, state in enumerate(states):
                state["role"] = "decode" if i < router.num_decode else "prefill"
        if not any(r.healthy for r in router.replicas[:router.num_decode]):
            return JSONResponse({"error": APIError(503, "no healthy replica", "service_unavailable").as_dict(),
                                 "replicas": states}, status_code=503)
        return JSONResponse({"status": "ok", "routing_policy": router.policy.name, "replicas": states})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await fleet_metrics(router), media_type=CONTENT_TYPE)

    app.add_middleware(RequestGuard, tenants=tenants, max_request_bytes=max_request_bytes)
    return app


def run_router(replicas: Sequence[str], routing_policy: str, host: str = "127.0.0.1", port: int = 8000,
               uvicorn_log_level: str = "info", **app_kwargs: Any) -> None:
    """Serve the router until interrupted (``minivllm router``)."""
    import uvicorn

    app = build_router_app(replicas, routing_policy, **app_kwargs)
    logger.info("routing (%s) to %s on http://%s:%d", routing_policy, ", ".join(replicas), host, port)
    uvicorn.run(app, host=host, port=port, log_level=uvicorn_log_level)

