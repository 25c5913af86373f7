"""The router: one OpenAI-compatible endpoint in front of several replicas (notebook 14).

    minivllm router --replica http://10.0.0.1:8000 --replica http://10.0.0.2:8000 \\
        --routing-policy prefix_aware --port 8000
    minivllm serve --data-parallel-size 2 --port 8000      # the same, on this machine

One engine has one KV cache; when it is full or busy, more engines are the answer: N
*replicas*, each a whole ``minivllm serve`` with its own KV cache and prefix cache. A
client should still see one server, so a router takes each request, picks a replica with
a policy from :mod:`minivllm.entrypoints.routing` and forwards the HTTP request unchanged. The
router does no model work; it is a small asynchronous proxy (FastAPI in, an
``httpx.AsyncClient`` out) and only knows what it sees: requests it sent and has not
seen finish (``ReplicaState.outstanding``), and which replicas answered.

Why a separate router process and not N engines inside one server: a replica is a URL,
so replicas may run on other machines (one per GPU, one per host) and the router in
front of them is the same code. ``minivllm serve --data-parallel-size N`` is the
one-host shortcut (vLLM's option name): N ``minivllm serve`` processes on free local
ports (:mod:`minivllm.entrypoints.data_parallel`) and this router in front of them on the user's port.

Cache-aware routing needs the prompt's tokens: ``prefix_aware`` hashes the prompt's full
KV blocks with the prefix cache's own hash, so the router loads the model's *tokenizer*
(not the model) and applies the chat template exactly as the server does
(:func:`~minivllm.entrypoints.chat_utils.apply_chat_template`); its ``block_size`` must be the
replicas'. The other policies never look at the prompt.

Failures. A replica that refuses or drops a connection, or answers 5xx while its
``/health`` is not 200, leaves the rotation (``healthy = False``, and ``prefix_aware``
forgets its cache); a background task probes every replica's ``/health`` every ``health_interval``
seconds, brings a recovered one back and takes out one that fails two probes in a row. A request that failed before anything reached the client is
retried once on another replica; a stream that breaks after its first bytes ends with an
error event in the server's shape (``data: {"error": {...}}``), since its status line
has been sent. With no healthy replica the answer is a 503 at once. No request waits on
a dead replica: connecting times out, and a replica that leaves the rotation ends its
requests in flight at once (a stopped one keeps its sockets open: only the probe tells).

``/metrics`` re-exports every replica's samples with a ``replica`` label, plus the
router's own: requests per replica, retries, replicas healthy, requests in flight
(:func:`minivllm.entrypoints.openai.prometheus.render_router_metrics`).

Tenants. With ``--tenants`` the router, not each replica, holds every tenant's limits:
a replica sees only its share of a tenant's requests. It charges each request the usage
it reads off the answer as it relays it (:mod:`minivllm.entrypoints.router_usage`). The
app around the router, its endpoints and its guard, is
:mod:`minivllm.entrypoints.router_app`.

Disaggregated prefill (``minivllm router --prefill URL --replica URL``): each request
goes first, as one unstreamed token, to the least busy prefill server (a ``kv_producer``,
which stores the prompt's KV), then unchanged to a replica chosen by the policy (a
``kv_consumer``, which loads it): ``Router._prefill``.

In vLLM: ``vllm serve --data-parallel-size N`` (an internal load balancer across engine
cores) and, for cache-aware routing across hosts, ``vllm-project/router`` and the
production stack's router; SGLang's router keeps the same approximate prefix tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from minivllm.entrypoints.openai.base_protocol import IGNORED_FIELDS_HEADER
from minivllm.entrypoints.openai.protocol import APIError
from minivllm.entrypoints.openai.serving import unless_disconnected
from minivllm.entrypoints.openai.tenants import Lease, Tenants
from minivllm.entrypoints.router_usage import UsageWatcher, ask_for_usage, usage_of
from minivllm.entrypoints.routing import (
    NoReplicaAvailable,
    PrefixAware,
    ReplicaState,
    RoutingPolicy,
    normalize_url,
    prefill_request,
    prompt_token_ids,
)
from minivllm.exceptions import ValidationError

logger = logging.getLogger("minivllm")
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per forwarded request

T = TypeVar("T")
DEFAULT_HEALTH_INTERVAL = 2.0
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_READ_TIMEOUT = 600.0
"""Longest silence from a replica mid-request (a long prompt's prefill sends nothing)."""


def relayed(upstream: httpx.Response) -> dict[str, str]:
    """The replica's response headers that mean something to the client."""
    return {k: upstream.headers[k] for k in (IGNORED_FIELDS_HEADER, "retry-after") if k in upstream.headers}


class ReplicaFailed(Exception):
    """The replica could not serve the request: refused, reset, a 5xx with /health not ok, out of rotation."""


@dataclass
class RouterStats:
    requests: dict[str, int] = field(default_factory=dict)
    """Requests forwarded, per replica URL (a retried request counts on both)."""
    retries: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    """Times each replica was taken out of rotation (a failed request or two failed probes)."""
    prefill_failures: int = 0
    """Disaggregated: requests whose prefill instance failed, so the decode instance computed
    the whole prompt itself."""


# -- the router ------------------------------------------------------------------------------
class Router:
    """Chooses a replica per request and forwards it; keeps the replicas' health.

    Invariant: ``replicas[i].outstanding`` counts the requests forwarded to replica i whose
    response the router has not finished relaying (it is what ``least_outstanding`` and
    ``prefix_aware``'s saturation test read)."""

    def __init__(self, replica_urls: Sequence[str], policy: RoutingPolicy, tokenizer: Any = None,
                 health_interval: float = DEFAULT_HEALTH_INTERVAL,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 read_timeout: float = DEFAULT_READ_TIMEOUT, tenants: Tenants | None = None,
                 prefill_urls: Sequence[str] = ()) -> None:
        """``prefill_urls``: disaggregated prefill. Each request is first sent, as one token
        (:func:`~minivllm.entrypoints.routing.prefill_request`), to the least busy of these
        ``kv_producer`` servers, then as it came to a replica (a ``kv_consumer``) chosen by
        ``policy``, which loads the prompt's KV the producer stored."""
        urls = [normalize_url(u) for u in replica_urls]
        self.num_decode = len(urls)
        urls += [normalize_url(u) for u in prefill_urls]
        if not self.num_decode:  # prefill servers alone answer nothing but one token
            raise ValidationError("replica", "the router needs at least one --replica URL", None)
        if len(set(urls)) != len(urls):
            raise ValidationError("replica", f"a replica is listed twice: {urls}", urls)
        for name, value in (("health_interval", health_interval), ("connect_timeout", connect_timeout),
                            ("read_timeout", read_timeout)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValidationError(name, f"{name} must be a number of seconds > 0, got {value!r}", value)
        if isinstance(policy, PrefixAware) and tokenizer is None:
            raise ValidationError("routing_policy", "prefix_aware routing needs the model's "
                                  "tokenizer (--model) to hash the prompt's blocks", None)
        self.replicas = [ReplicaState(u) for u in urls]
        self.policy = policy
        self.tokenizer = tokenizer
        self.tenants = tenants
        """The API keys' owners and their limits, held here for all the replicas (None: open)."""
        self.health_interval = health_interval
        self.timeout = httpx.Timeout(read_timeout, connect=connect_timeout)
        self.stats = RouterStats(requests={u: 0 for u in urls}, failures={u: 0 for u in urls})
        self.client: httpx.AsyncClient | None = None
        self._out = [asyncio.Event() for _ in urls]  # set: replica i left the rotation

    # -- lifecycle (the app's lifespan) --------------------------------------------------
    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=None))
        self._prober = asyncio.create_task(self._probe_forever())

    async def stop(self) -> None:
        self._prober.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._prober
        await self.client.aclose()

    # -- health ----------------------------------------------------------------------------
    def take_out(self, i: int, why: str) -> None:
        replica = self.replicas[i]
        if replica.healthy:  # counted once, however many of its requests saw it fail
            logger.warning("replica %s is out of rotation: %s", replica.name, why)
            self.stats.failures[replica.name] += 1
        replica.healthy = False
        self._out[i].set()
        if isinstance(self.policy, PrefixAware):  # when it comes back its cache is not ours to guess
            self.policy.forget(replica.name)

    async def is_ok(self, i: int) -> bool:
        try:
            r = await self.client.get(self.replicas[i].name + "/health", timeout=2.0)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def _probe_forever(self) -> None:
        """In when /health says 200, out after two failed probes (SIGSTOP keeps the socket open)."""
        missed = [0] * len(self.replicas)
        while True:
            await asyncio.sleep(self.health_interval)
            for i, replica in enumerate(self.replicas):
                ok = await self.is_ok(i)
                missed[i] = 0 if ok else missed[i] + 1
                if ok and not replica.healthy:
                    logger.info("replica %s is back in rotation", replica.name)
                    replica.healthy, self._out[i] = True, asyncio.Event()
                elif replica.healthy and missed[i] >= 2:
                    self.take_out(i, "its /health did not answer 200 twice in a row")

    # -- choosing ---------------------------------------------------------------------------
    def choose(self, token_ids: list[int]) -> int:
        try:
            i = self.policy.choose(token_ids, self.replicas[:self.num_decode])
        except NoReplicaAvailable as e:
            raise APIError(503, f"{e}; the router retries them every {self.health_interval:g} s",
                           "service_unavailable", code="no_healthy_replica") from None
        self.stats.requests[self.replicas[i].name] += 1
        return i

    # -- forwarding -------------------------------------------------------------------------
    async def forward(self, request: Request) -> Response:
        """POST /v1/completions and /v1/chat/completions: at most two tries, on two replicas."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # the replica answers the 400
        streaming = isinstance(body, dict) and body.get("stream") is True
        token_ids = await asyncio.to_thread(prompt_token_ids, self.tokenizer, request.url.path, body)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        lease: Lease | None = getattr(request.state, "tenant_lease", None)  # a tenant's seat
        wanted = None  # a tenant's stream: the usage the client asked for (router_usage)
        if lease is not None and streaming and (asked := ask_for_usage(body))[0] is not None:
            raw, wanted, headers["content-type"] = asked[0], asked[1:], "application/json"
        if self.num_decode < len(self.replicas) and isinstance(body, dict):
            refused = await unless_disconnected(request, self._prefill(request.url.path, body, headers))
            if refused is None or refused.status_code != 200:  # the client left, or a bad request
                return Response(status_code=499) if refused is None else refused
        for attempt in (0, 1):
            i = self.choose(token_ids)
            replica = self.replicas[i]
            replica.outstanding += 1
            try:
                if streaming:  # lowers outstanding itself, when the relay ends
                    return await self._stream(i, request.url.path, raw, headers, lease, wanted)
                try:
                    result = await unless_disconnected(request, self._send(i, request.url.path, raw, headers))
                finally:
                    replica.outstanding -= 1
                if lease is not None and result is not None and result.status_code == 200:
                    lease.usage = usage_of(result.body)
                return Response(status_code=499) if result is None else result
            except ReplicaFailed as e:
                self.take_out(i, str(e))
                if attempt == 0:
                    self.stats.retries += 1
                    continue
                raise APIError(502, f"the request failed on two replicas; last: {e}", "server_error",
                               code="replica_failed") from None
        raise AssertionError("unreachable")

    def _failed(self, i: int, e: Exception | None, status: int | None = None) -> ReplicaFailed:
        what = f"HTTP {status}" if e is None else f"{type(e).__name__}: {e}"
        return ReplicaFailed(f"replica {self.replicas[i].name}: {what}")

    async def _unless_out(self, i: int, step: Awaitable[T]) -> T:
        """``step``, or :class:`ReplicaFailed` once replica i leaves the rotation (not
        ``read_timeout``, 600 s by default, later)."""
        task, out = asyncio.ensure_future(step), asyncio.ensure_future(self._out[i].wait())
        try:
            await asyncio.wait((task, out), return_when=asyncio.FIRST_COMPLETED)
        finally:
            out.cancel()
            if not task.done():  # out of rotation, or the caller itself was cancelled (raising)
                task.cancel()
        if task.cancelled() or not task.done():
            raise ReplicaFailed(f"replica {self.replicas[i].name}: out of rotation (its /health "
                                f"stopped answering) with the request in flight")
        return task.result()

    async def _prefill(self, path: str, body: dict, headers: dict) -> Response:
        """Disaggregated prefill: the prompt computed by a prefill instance, which stores its
        KV for the decode instance. A 4xx is the request's own fault and is the answer; a
        prefill instance that fails is taken out, logged and counted, and the decode
        instance then computes the prompt itself (the same tokens, later)."""
        prefill = [i for i in range(self.num_decode, len(self.replicas)) if self.replicas[i].healthy]
        why = "no prefill instance is in rotation"
        if prefill:
            i = RoutingPolicy.least_loaded(prefill, self.replicas)
            self.stats.requests[self.replicas[i].name] += 1
            self.replicas[i].outstanding += 1
            try:
                r = await self._send(i, path, json.dumps(prefill_request(body)).encode(),
                                     {**headers, "content-type": "application/json"})
                if r.status_code < 500:
                    return r
                why = f"HTTP {r.status_code}"
            except ReplicaFailed as e:
                self.take_out(i, str(e))
                why = str(e)
            finally:
                self.replicas[i].outstanding -= 1
        self.stats.prefill_failures += 1
        logger.warning("disaggregated prefill failed (%s): the decode instance computes the prompt", why)
        return Response(status_code=200)

    async def _send(self, i: int, path: str, raw: bytes, headers: dict) -> Response:
        try:
            r = await self._unless_out(i, self.client.post(self.replicas[i].name + path, content=raw,
                                                           headers=headers))
        except httpx.TransportError as e:
            raise self._failed(i, e) from None
        if r.status_code >= 500 and not await self.is_ok(i):
            raise self._failed(i, None, r.status_code)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"),
                        headers=relayed(r))

    async def _stream(self, i: int, path: str, raw: bytes, headers: dict, lease: Lease | None = None,
                      wanted: tuple[bool, bool] | None = None) -> Response:
        """Wait for the replica's first bytes before answering the client: until then a
        failure can still be retried elsewhere. After that, relay; a break becomes a last
        error event. ``outstanding`` falls when the relay ends, however it ends. With
        ``wanted``, the chunks' usage is read into ``lease`` and relayed only as asked."""
        replica = self.replicas[i]
        upstream, handed_over = None, False
        try:
            req = self.client.build_request("POST", replica.name + path, content=raw, headers=headers)
            try:
                upstream = await self._unless_out(i, self.client.send(req, stream=True))
                if upstream.status_code != 200:  # an error answer, as JSON: relay it whole
                    content = await upstream.aread()
                    if upstream.status_code >= 500 and not await self.is_ok(i):
                        raise self._failed(i, None, upstream.status_code)
                    return Response(content, status_code=upstream.status_code,
                                    media_type=upstream.headers.get("content-type"), headers=relayed(upstream))
                chunks = upstream.aiter_raw()
                first = await self._unless_out(i, chunks.__anext__())
            except httpx.TransportError as e:
                raise self._failed(i, e) from None
            except StopAsyncIteration:
                raise self._failed(i, None, 200) from None  # a stream that ended before it began

            watcher = UsageWatcher(*(wanted or (True, True)), lease=lease, passthrough=wanted is None)

            async def relay() -> AsyncIterator[bytes]:
                last = b"\n\n"
                try:
                    data = first
                    while True:
                        if data := watcher.feed(data):
                            yield (last := data)
                        data = await self._unless_out(i, chunks.__anext__())
                except StopAsyncIteration:
                    if rest := watcher.rest():
                        yield rest
                except (httpx.TransportError, ReplicaFailed) as e:
                    if rest := watcher.rest():
                        yield (last := rest)
                    self.take_out(i, f"{type(e).__name__}: {e}")
                    error = APIError(502, f"the replica {replica.name} failed mid-stream "
                                     f"({type(e).__name__}: {e}); the answer is incomplete",
                                     "server_error", code="replica_failed")
                    cut = b"" if last.endswith(b"\n\n") else b"\n\n"  # end a half-sent event first
                    yield cut + f"data: {json.dumps({'error': error.as_dict()})}\n\n".encode()
                finally:
                    await upstream.aclose()
                    replica.outstanding -= 1

            handed_over = True
            return StreamingResponse(relay(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **relayed(upstream)})
        finally:
            if not handed_over:  # an error answer, a failure, or the client left: done here
                if upstream is not None:
                    await upstream.aclose()
                replica.outstanding -= 1
