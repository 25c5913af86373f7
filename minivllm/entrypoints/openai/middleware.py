"""The server's two ASGI middlewares: what must happen around every request, before any
endpoint runs or whatever it answers.

* :class:`RequestGuard` settles the API key, the body's size and the tenant's limits
  before the body is read.
* :class:`CountResponses` counts responses by handler and status, for ``/metrics``.

Both are plain ASGI rather than Starlette's ``BaseHTTPMiddleware``, which would get in
the way of streaming and of noticing client disconnects.

In vLLM (0.34): ``AuthenticationMiddleware`` and the other middleware in
``vllm/entrypoints/serve/middleware/``.
"""

from __future__ import annotations

from collections.abc import Callable

from minivllm.entrypoints.openai.protocol import APIError
from minivllm.entrypoints.openai.tenants import RateLimited, Tenant, Tenants


class CountResponses:
    """Count responses by handler (its path, or "other") and status code into ``counts``."""

    def __init__(self, app: Callable, counts: dict[tuple[str, str], int], handlers: set[str]) -> None:
        self.app, self.counts, self.handlers = app, counts, handlers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        handler = scope["path"] if scope["path"] in self.handlers else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                key = (handler, str(message["status"]))
                self.counts[key] = self.counts.get(key, 0) + 1
            await send(message)

        await self.app(scope, receive, counting_send)


class RequestGuard:
    """What must be settled before a body is read: the API key (on ``/v1``), the body's
    size (413 above ``max_request_bytes``), then the tenant's limits (429 with
    ``Retry-After``, on ``/v1`` POSTs; ``minivllm.entrypoints.openai.tenants``).

    FastAPI reads and parses the body before it resolves an endpoint's dependencies, so a
    key checked there would let anyone without one make the server parse 1 MB of JSON;
    here the body is not even read. A body without ``Content-Length`` (chunked) is read
    here up to the limit and handed on; one with a ``Content-Length`` over it is refused
    unread. An admitted request's seat (a :class:`~minivllm.entrypoints.openai.tenants.Lease`)
    is put in the request's state for the endpoint, and released when the response has
    ended, however it ended.
    """

    def __init__(self, app: Callable, tenants: Tenants | None, max_request_bytes: int | None) -> None:
        self.app = app
        self.tenants = tenants
        self.max_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        tenant = None
        if self.tenants is not None and scope["path"].startswith("/v1"):
            tenant = self._tenant(headers)
            if tenant is None:
                error = APIError(401, "invalid or missing API key: send the header "
                                 "'Authorization: Bearer <key>'", "authentication_error",
                                 code="invalid_api_key")
                return await error.response()(scope, receive, send)
        if self.max_bytes is not None and scope["method"] not in ("GET", "HEAD"):
            length = headers.get(b"content-length")
            if length is not None:  # h11 has checked it is a number and the body matches it
                if int(length) > self.max_bytes:
                    return await self._too_large(int(length), scope, receive, send)
            else:
                body, size = await self._read(receive)
                if body is None:
                    return await self._too_large(size, scope, receive, send)
                receive = _replay(body, receive)
        if tenant is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            lease = self.tenants.admit(tenant)
        except RateLimited as e:
            response = APIError(429, str(e), "rate_limit_error", code=f"{e.reason}_limit").response()
            response.headers["Retry-After"] = str(e.retry_after)
            return await response(scope, receive, send)
        scope.setdefault("state", {})["tenant_lease"] = lease
        try:
            await self.app(scope, receive, send)
        finally:
            lease.release()

    def _tenant(self, headers: dict[bytes, bytes]) -> Tenant | None:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return self.tenants.authenticate(token.strip()) if scheme.lower() == b"bearer" else None

    async def _read(self, receive) -> tuple[bytes | None, int]:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return None, size
            more = message.get("more_body", False)
        return b"".join(chunks), size

    async def _too_large(self, size: int, scope, receive, send) -> None:
        error = APIError(413, f"the request body has more than {self.max_bytes} bytes "
                         f"(max_request_bytes); got {size}", code="request_too_large")
        await error.response()(scope, receive, send)


def _replay(body: bytes, receive: Callable) -> Callable:
    """A ``receive`` that hands out the body read already, then listens on (for the
    client's disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
