"""An OpenAI-compatible HTTP server in front of the engine (notebook 10).

    minivllm serve --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``"stream": true`` gives server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``), ``GET /health`` and ``GET /metrics`` (Prometheus text). The OpenAPI
schema is at ``/openapi.json``.

The engine itself lives in :class:`~minivllm.async_engine.AsyncLLMEngine`; this module
only translates: JSON in (``minivllm.protocol``), ``SamplingParams`` and prompts to the
engine, outputs back to JSON, and every failure to OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` with the status a client expects:

    400  malformed JSON, a wrong type, an unknown or unsupported field, an invalid
         sampling value, a prompt that cannot fit, max_tokens beyond the model's length
         (``param`` names the field: it comes from the ValidationError that found it)
    401  a missing or wrong API key (when the server was started with one), checked
         before the body is read
    404  an unknown model name or path
    413  a body larger than ``max_request_bytes``, refused before it is read
    500  this request failed in the engine (finish_reason "error"); others carry on.
         In a stream the same error arrives as an event ``data: {"error": {...}}``.
    503  more than ``max_waiting`` requests waiting: retry later; or the engine has
         stopped (``/health`` then answers 500 and says why)

No request can take the server down: bad input is refused before it reaches the engine,
and what fails inside the engine for one request ends that request only.

In vLLM: ``vllm/entrypoints/openai/api_server.py`` and ``serving_chat.py`` /
``serving_completion.py``; ``vllm serve --api-key`` is the same flag.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
)
from minivllm.engine import LLMEngine
from minivllm.exceptions import ValidationError
from minivllm.llm import LLM
from minivllm.metrics import Counter, Gauge, Histogram
from minivllm.outputs import RequestOutput
from minivllm.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelList,
    SamplingRequest,
    UnsupportedField,
)
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")

DEFAULT_MAX_WAITING = 128
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
"""1 MiB: a prompt as long as the model allows (8192 tokens) is some 40 KB of text."""


# -- errors ------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def as_dict(self) -> dict:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.as_dict()}, status_code=self.status)


def _bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _invalid(e: Exception, prompt_field: str = "prompt") -> APIError:
    """A 400 for a validation error, ``param`` from the error itself. Problems with the
    prompt are reported against the field that carried it (``messages`` for chat)."""
    if isinstance(e, UnsupportedField):
        return _bad_request(str(e), e.field)
    param = getattr(e, "param", None)
    message = str(e)
    if not isinstance(e, ValidationError):  # every check raises ValidationError; say so if not
        logger.warning("a validation error without a field: %r", e)
    if param == "prompt":
        param = prompt_field
        if not message.startswith(prompt_field):
            message = f"{prompt_field}: {message}"
    return _bad_request(message, param)


_ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in {
    400: "invalid request (param names the field)", 401: "missing or wrong API key",
    404: "unknown model", 413: "request body too large",
    500: "the request failed in the engine", 503: "too many requests waiting, or the engine stopped",
}.items()}


def _json_and_sse(model: type) -> dict:
    return {200: {"model": model, "description": "the result, or server-sent events with stream=true",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


# -- metrics -----------------------------------------------------------------------------
_HELP = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV cache blocks in use (1 = full).",
    "request_success": "Finished requests, by finish reason.",
    "http_requests": "HTTP responses, by handler and status code.",
}


class EngineMetricsCollector:
    """A Prometheus collector that turns ``get_metrics()`` records into metric families.

    Records of one name (e.g. ``request_success`` for each finish reason) become one
    family with one sample per label set. Names keep vLLM's colon style; Prometheus
    allows colons, and ``prometheus_client`` adds ``_total`` to counters.
    """

    def __init__(self, records: list[Counter | Gauge | Histogram]) -> None:
        self.records = records

    def collect(self):
        families: dict[str, Any] = {}
        for rec in self.records:
            labels = getattr(rec, "labels", None) or {}
            family = families.get(rec.name)
            if family is None:
                kind = {Counter: CounterMetricFamily, Gauge: GaugeMetricFamily,
                        Histogram: HistogramMetricFamily}[type(rec)]
                doc = _HELP.get(rec.name.split(":")[-1], rec.name.split(":")[-1].replace("_", " "))
                family = families[rec.name] = kind(rec.name, doc, labels=sorted(labels))
            values = [labels[k] for k in sorted(labels)]
            if isinstance(rec, Histogram):
                buckets = [("+Inf" if le == float("inf") else repr(float(le)), n) for le, n in rec.buckets.items()]
                family.add_metric(values, buckets, rec.sum)
            else:
                family.add_metric(values, rec.value)
        yield from families.values()


class _CountResponses:
    """ASGI middleware counting responses by handler and status (for /metrics).

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would get in the way of
    streaming and of noticing client disconnects."""

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


class _RequestGuard:
    """ASGI middleware for what must be settled before a body is read: the API key (on
    ``/v1``), then the body's size (413 above ``max_request_bytes``).

    FastAPI reads and parses the body before it resolves an endpoint's dependencies, so a
    key checked there would let anyone without one make the server parse 1 MB of JSON;
    here the body is not even read. The key is compared as bytes, in constant time:
    ``secrets.compare_digest`` on two *strings* raises on non-ASCII, and a header is
    whatever a client sends. A body without ``Content-Length`` (chunked) is read here up
    to the limit and handed on; one with a ``Content-Length`` over it is refused unread.
    """

    def __init__(self, app: Callable, api_key: str | None, max_request_bytes: int | None) -> None:
        self.app = app
        self.api_key = None if api_key is None else api_key.encode()
        self.max_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith("/v1") and not self._authorized(headers):
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
        await self.app(scope, receive, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)

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


# -- the app -----------------------------------------------------------------------------
def build_app(
    llm: LLM | LLMEngine | None = None,
    *,
    api_key: str | None = None,
    max_waiting: int | None = DEFAULT_MAX_WAITING,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    served_model_name: str | None = None,
    **llm_kwargs: Any,
) -> FastAPI:
    """The FastAPI app serving ``llm`` (an ``LLM`` or ``LLMEngine``; built from
    ``llm_kwargs``, e.g. ``model=...``, ``max_num_seqs=...``, when None).

    The app owns one :class:`AsyncLLMEngine`, started and stopped with the app's lifespan
    and reachable as ``app.state.engine``. Use one app per server run; the engine itself
    can be served again later by a fresh app.
    """
    if max_request_bytes is not None and (isinstance(max_request_bytes, bool)
                                          or not isinstance(max_request_bytes, int)
                                          or max_request_bytes < 1):
        raise ValidationError("max_request_bytes", f"max_request_bytes must be a positive "
                              f"integer or None, got {max_request_bytes!r}", max_request_bytes)
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValidationError("api_key", "api_key must be a non-empty string or None", None)
    if llm is None:
        llm_kwargs.setdefault("max_trace_steps", 1000)  # a server runs for days: keep memory flat
        llm = LLM(**llm_kwargs)
    elif llm_kwargs:
        raise TypeError(f"engine options {sorted(llm_kwargs)} only apply when build_app builds the LLM")
    engine = llm.llm_engine if isinstance(llm, LLM) else llm
    async_engine = AsyncLLMEngine(engine, max_waiting=max_waiting)
    model_name = served_model_name or engine.config.model
    http_counts: dict[tuple[str, str], int] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.shutdown()

    app = FastAPI(title="minivllm", version="0.1.0", lifespan=lifespan)
    app.state.engine = async_engine

    # -- errors in OpenAI's shape --------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            detail = err.get("ctx", {}).get("error", "")
            return _bad_request(f"the request body is not valid JSON: {detail}").response()
        loc = [str(x) for x in err["loc"] if x != "body"]
        # For a union (prompt: str | list[int]) pydantic reports each branch; name the field.
        param = loc[0] if loc else None
        if param is None:
            return _bad_request(f"the request body must be a JSON object: {err['msg']}").response()
        where = ".".join(loc)
        if err["type"] == "extra_forbidden":
            message = f"{where}: unknown field; this API has no such field"
        else:
            message = f"{where}: {err['msg']} (got {err.get('input')!r})"
        return _bad_request(message[:500], param).response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return APIError(503, str(e), "service_unavailable").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), kind).response()

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{model_name!r}", "not_found_error", "model", "model_not_found")

    def sampling_params(body: SamplingRequest, default_max_tokens: int | None) -> SamplingParams:
        try:
            body.check_supported()
            return body.sampling_params(default_max_tokens)
        except (ValidationError, UnsupportedField) as e:
            raise _invalid(e) from None

    async def start(prompt: Any, params: SamplingParams, prefix: str, prompt_field: str) -> RequestStream:
        try:
            return await async_engine.add_request(f"{prefix}-{uuid.uuid4().hex}", prompt, params)
        except EngineOverloadedError as e:
            raise APIError(503, str(e), "service_unavailable", code="queue_full") from None
        except (ValueError, TypeError) as e:
            raise _invalid(e, prompt_field) from None
        except (EngineDeadError, asyncio.CancelledError):
            raise
        except Exception as e:  # preparing this one request failed: a 500 of its own
            logger.exception("preparing a request failed")
            raise APIError(500, f"the request could not be prepared: {e!r}", "server_error",
                           code="request_failed") from None

    # -- endpoints -----------------------------------------------------------------------
    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def list_models() -> dict:
        card = {"id": model_name, "object": "model", "created": int(time.time()),
                "owned_by": "minivllm", "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    post_errors = {k: _ERRORS[k] for k in (400, 401, 404, 413, 500, 503)}

    @app.post("/v1/completions", response_model=None,
              responses={**_json_and_sse(CompletionResponse), **post_errors})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        params = sampling_params(body, default_max_tokens=16)  # OpenAI's default here
        try:
            prompt = body.engine_prompt()
        except ValidationError as e:
            raise _invalid(e) from None
        stream = await start(prompt, params, "cmpl", "prompt")
        head = {"id": stream.request_id, "object": "text_completion",
                "created": int(time.time()), "model": model_name}

        def choice(out: RequestOutput, text: str, final: bool) -> dict:
            c = out.outputs[0]
            return {"index": 0, "text": text, "logprobs": None,
                    "finish_reason": c.finish_reason if final else None,
                    "stop_reason": c.stop_reason if final else None}

        if body.stream:
            def chunk(out: RequestOutput) -> dict | None:
                if not out.new_text and not out.finished:
                    return None
                return {**head, "choices": [choice(out, out.new_text, out.finished)]}
            return _sse(stream, chunk, head, body)
        out = await _unless_disconnected(request, _last(stream))
        if out is None:
            return Response(status_code=499)
        _raise_if_failed(out)
        result = {**head, "choices": [choice(out, out.outputs[0].text, True)], "usage": _usage(out)}
        if body.return_token_ids:
            result["choices"][0]["token_ids"] = out.outputs[0].token_ids
        return JSONResponse(result)

    @app.post("/v1/chat/completions", response_model=None,
              responses={**_json_and_sse(ChatCompletionResponse), **post_errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        renamed = body.max_tokens is None and body.max_completion_tokens is not None
        if renamed:
            body.max_tokens = body.max_completion_tokens
        try:
            params = sampling_params(body, default_max_tokens=None)  # as long as the model allows
        except APIError as e:
            if renamed and e.param == "max_tokens":  # name the field the client sent
                e.param, e.message = "max_completion_tokens", e.message.replace(
                    "max_tokens", "max_completion_tokens", 1)
            raise
        messages = [m.model_dump() for m in body.messages]  # checked by chat_utils, off the loop
        stream = await start(messages, params, "chatcmpl", "messages")
        head = {"id": stream.request_id, "object": "chat.completion",
                "created": int(time.time()), "model": model_name}

        if body.stream:
            head["object"] = "chat.completion.chunk"
            first = True

            def chunk(out: RequestOutput) -> dict | None:
                nonlocal first
                delta: dict[str, str] = {}
                if first:  # OpenAI's first chunk announces the role
                    delta["role"] = "assistant"
                    first = False
                if out.new_text or "role" in delta:
                    delta["content"] = out.new_text
                if not delta and not out.finished:
                    return None
                reason = out.outputs[0].finish_reason if out.finished else None
                return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": reason}]}
            return _sse(stream, chunk, head, body)
        out = await _unless_disconnected(request, _last(stream))
        if out is None:
            return Response(status_code=499)
        _raise_if_failed(out)
        c = out.outputs[0]
        message = {"role": "assistant", "content": c.text}
        choice = {"index": 0, "message": message, "logprobs": None,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if body.return_token_ids:
            choice["token_ids"] = c.token_ids
        return JSONResponse({**head, "choices": [choice], "usage": _usage(out)})

    @app.get("/health", response_model=Health, responses={500: {
        "model": ErrorResponse, "description": "the engine has stopped, and why"}})
    async def health() -> JSONResponse:
        if async_engine.error is not None:
            return APIError(500, f"the engine failed: {async_engine.error!r}", "server_error").response()
        return JSONResponse({"status": "ok", "num_requests_running": async_engine.num_running,
                             "num_requests_waiting": async_engine.num_queued})

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics() -> Response:
        records = await async_engine.get_metrics() if async_engine.error is None else []
        records += [Counter("minivllm:http_requests", n, {"handler": h, "status": s})
                    for (h, s), n in sorted(http_counts.items())]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(EngineMetricsCollector(records))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    handlers = {r.path for r in app.routes if hasattr(r, "path")}
    app.add_middleware(_RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes)
    app.add_middleware(_CountResponses, counts=http_counts, handlers=handlers)  # outermost: counts 401/413 too
    return app


# -- helpers for the endpoints -------------------------------------------------------------
def _raise_if_failed(out: RequestOutput) -> None:
    """A request that finished with finish_reason "error" is a 500 of its own."""
    c = out.outputs[0]
    if c.finish_reason == "error":
        raise APIError(500, f"the request failed: {c.error}", "server_error", code="request_failed")


def _usage(out: RequestOutput) -> dict[str, int]:
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    return last


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await ``work`` unless the client hangs up first; then cancel it (which aborts the
    request in the engine) and return None. A plain endpoint never notices a disconnect
    on its own: only streaming responses listen for one."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if not task.done():
        task.cancel()
        return None
    return task.result()


def _sse(stream: RequestStream, chunk: Callable[[RequestOutput], dict | None], head: dict,
         body: SamplingRequest) -> StreamingResponse:
    """Server-sent events: one ``data: {json}`` line per chunk, then ``data: [DONE]``.

    When the client disconnects, Starlette cancels this generator while it waits for the
    next output; ``stream.close()`` in ``finally`` then aborts the request.
    """
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    async def events() -> AsyncIterator[str]:
        # The status line (200) is long gone when something fails: report it in-band, as
        # a last event holding an error (the openai client raises it as an APIError).
        try:
            async for out in stream:
                if out.outputs[0].finish_reason == "error":
                    error = APIError(500, f"the request failed: {out.outputs[0].error}",
                                     "server_error", code="request_failed")
                    yield f"data: {json.dumps({'error': error.as_dict()})}\n\n"
                    break
                data = chunk(out)
                if data is not None:
                    yield f"data: {json.dumps(data)}\n\n"
                if out.finished and include_usage:
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(out)})}\n\n"
        except EngineDeadError as e:
            error = APIError(503, str(e), "service_unavailable")
            yield f"data: {json.dumps({'error': error.as_dict()})}\n\n"
        else:
            yield "data: [DONE]\n\n"
        finally:
            stream.close()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# -- running it ------------------------------------------------------------------------------
class _Server(uvicorn.Server):
    """uvicorn's server, but on shutdown it first ends the open streams (each client gets
    a last error event) rather than waiting for them and then cutting them off."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        engine = getattr(getattr(self.config.app, "state", None), "engine", None)
        if isinstance(engine, AsyncLLMEngine):
            engine.end_streams("the server is shutting down")
        await super().shutdown(sockets)


class ServerThread:
    """Serve an app with uvicorn on a background thread: for tests and notebooks.

        with ServerThread(build_app(llm)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

    ``port=0`` picks a free port; the socket is bound here, before the thread starts,
    so ``server.url`` is right at once and no other process can take the port.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        # A short graceful shutdown: streams still open after it are cut.
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2)
        self.app = app
        self.server = _Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="minivllm-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start; see the log above")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_server(host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None,
               max_waiting: int | None = DEFAULT_MAX_WAITING,
               max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES, **llm_kwargs: Any) -> None:
    """Load the model and serve it until interrupted (what ``minivllm serve`` runs)."""
    app = build_app(api_key=api_key, max_waiting=max_waiting, max_request_bytes=max_request_bytes,
                    **llm_kwargs)
    logger.info("serving on http://%s:%d (OpenAI base_url http://%s:%d/v1)", host, port, host, port)
    _Server(uvicorn.Config(app, host=host, port=port, log_level="info")).run()
