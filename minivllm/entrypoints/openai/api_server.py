"""An OpenAI-compatible HTTP server in front of the engine (notebook 10).

    minivllm serve --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``"stream": true`` gives server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``), ``GET /health`` and ``GET /metrics`` (Prometheus text). The OpenAPI
schema is at ``/openapi.json``.

The engine itself lives in :class:`~minivllm.engine.async_llm.AsyncLLMEngine`; the server
only translates, in four parts: the request and response bodies and the error shape
(``minivllm.entrypoints.openai.protocol``), the endpoints' work (``minivllm.entrypoints.openai.serving``), the metrics text
(``minivllm.entrypoints.openai.prometheus``), the API key and size checks (``minivllm.entrypoints.openai.middleware``); this
module wires them into a FastAPI app and runs it. Every failure gets OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` with the status a client expects:

    400  malformed JSON, a wrong type, an unsupported or removed field, an invalid
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

In vLLM (0.34): ``vllm/entrypoints/launchers/`` (``app.py``: ``build_app``) and the
endpoints' ``vllm/entrypoints/openai/*/serving.py``; ``vllm serve --api-key`` is the same flag.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLMEngine, AsyncMPEngine, EngineDeadError
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.llm import LLM
from minivllm.entrypoints.openai.base_protocol import IGNORED_FIELDS_HEADER
from minivllm.entrypoints.openai.chat_protocol import ChatCompletionResponse
from minivllm.entrypoints.openai.completion_protocol import CompletionResponse
from minivllm.entrypoints.openai.middleware import CountResponses, RequestGuard
from minivllm.entrypoints.openai.prometheus import CONTENT_TYPE
from minivllm.entrypoints.openai.protocol import (
    APIError,
    ErrorResponse,
    Health,
    ModelList,
    bad_request,
)
from minivllm.entrypoints.openai.serving import OpenAIServing
from minivllm.entrypoints.openai.tenants import Tenants
from minivllm.exceptions import ValidationError

logger = logging.getLogger("minivllm")

DEFAULT_MAX_WAITING = 128
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
"""1 MiB: a prompt as long as the model allows (8192 tokens) is some 40 KB of text."""

_ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in {
    400: "invalid request (param names the field)", 401: "missing or wrong API key",
    404: "unknown model", 413: "request body too large",
    429: "the API key's tenant is over a limit (Retry-After says when to retry)",
    500: "the request failed in the engine", 503: "too many requests waiting, or the engine stopped",
}.items()}


# Before OpenAPI 3.2 (FastAPI writes 3.1), the schema of an event stream describes one
# event as a client parses it: an object whose `data` is a JSON chunk, or "[DONE]" last.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "one JSON chunk; the last event's data is [DONE]"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def _json_and_sse(model: type) -> dict:
    ignored = {"description": "the request's fields this server accepted but did not act on "
                              "(vLLM's fields it lacks, unknown fields), comma-separated",
               "schema": {"type": "string"}}
    return {200: {"model": model, "description": "the result, or server-sent events with stream=true",
                  "content": {"text/event-stream": {"schema": _SSE_EVENT}},
                  "headers": {IGNORED_FIELDS_HEADER: ignored}}}


# -- the app -----------------------------------------------------------------------------
def build_app(
    llm: LLM | LLMEngine | None = None,
    *,
    api_key: str | Sequence[str] | None = None,
    tenants_file: str | None = None,
    cache_salt_per_key: bool = False,
    max_waiting: int | None = DEFAULT_MAX_WAITING,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    served_model_name: str | None = None,
    engine_process: bool | None = None,
    **llm_kwargs: Any,
) -> FastAPI:
    """The FastAPI app serving ``llm`` (an ``LLM`` or ``LLMEngine``), or an engine built
    from ``llm_kwargs`` (``model=...``, ``max_num_seqs=...``) when it is None.

    ``api_key`` (one or several), ``tenants_file`` and ``cache_salt_per_key``: who may
    call ``/v1``, with what limits, and whether each key's prompts are cached apart from
    the others' (``minivllm.entrypoints.openai.tenants``).

    ``engine_process``: run the engine core in a process of its own
    (:class:`~minivllm.engine.async_llm.AsyncMPEngine`, what ``minivllm serve`` does); the
    default when ``llm`` is None. With an ``llm`` given, the engine runs on a thread of
    this process (:class:`AsyncLLMEngine`): a built engine cannot move to another process.

    The app owns its async engine, started and stopped with the app's lifespan and
    reachable as ``app.state.engine``. Use one app per server run; an engine given as
    ``llm`` can be served again later by a fresh app.
    """
    _check_options(max_request_bytes)
    tenants = Tenants.from_options(api_key, tenants_file, cache_salt_per_key)
    async_engine, model_name = _async_engine(llm, engine_process, max_waiting, llm_kwargs)
    http_counts: dict[tuple[str, str], int] = {}
    serving = OpenAIServing(async_engine, served_model_name or model_name, http_counts, tenants)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()  # in its own process: loads the model while /health says 503
        yield
        await async_engine.shutdown()

    app = FastAPI(title="minivllm", version="0.1.0", lifespan=lifespan)
    app.state.engine = async_engine
    _add_exception_handlers(app)
    _add_routes(app, serving)
    if dev_mode():
        # vLLM's development endpoints, off by default as there: anyone who can reach the
        # server could otherwise empty the cache that every user's requests share.
        app.post("/reset_prefix_cache", responses={k: _ERRORS[k] for k in (401, 500)} | {409: {
            "model": ErrorResponse, "description": "a running request still holds cached blocks"}})(
            serving.reset_prefix_cache)
    handlers = {r.path for r in app.routes if hasattr(r, "path")}
    app.add_middleware(RequestGuard, tenants=tenants, max_request_bytes=max_request_bytes)
    app.add_middleware(CountResponses, counts=http_counts, handlers=handlers)  # outermost: counts 401/413 too
    return app


def _async_engine(llm: LLM | LLMEngine | None, engine_process: bool | None, max_waiting: int | None,
                  llm_kwargs: dict[str, Any]) -> tuple[AsyncLLMEngine, str]:
    """The app's async engine (see :func:`build_app`) and its model's name."""
    if llm is not None and llm_kwargs:
        raise TypeError(f"engine options {sorted(llm_kwargs)} only apply when build_app builds the LLM")
    if llm is not None and engine_process:
        raise ValueError("engine_process=True needs the engine's options, not a built engine: "
                         "pass llm=None and model=... instead")
    llm_kwargs.setdefault("max_trace_steps", 1000)  # a server runs for days: keep memory flat
    if llm is None and engine_process is not False:
        async_engine = AsyncMPEngine(EngineConfig(**llm_kwargs), max_waiting=max_waiting)
        return async_engine, async_engine.config.model
    if llm is None:  # built on the thread that will step it (core_client.InprocClient)
        async_engine = AsyncLLMEngine(lambda: LLM(**llm_kwargs).llm_engine, max_waiting=max_waiting)
        return async_engine, async_engine.client.engine.config.model
    engine = llm.llm_engine if isinstance(llm, LLM) else llm
    return AsyncLLMEngine(engine, max_waiting=max_waiting), engine.config.model


def dev_mode() -> bool:
    """Whether ``VLLM_SERVER_DEV_MODE`` (vLLM's name, e.g. ``VLLM_SERVER_DEV_MODE=1``)
    turns on the development endpoints (``POST /reset_prefix_cache``)."""
    value = os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip()
    if value not in ("0", "1", ""):
        raise ValidationError("VLLM_SERVER_DEV_MODE", f"VLLM_SERVER_DEV_MODE must be 0 or 1, "
                              f"got {value!r}", value)
    return value == "1"


def _check_options(max_request_bytes: int | None) -> None:
    if max_request_bytes is not None and (isinstance(max_request_bytes, bool)
                                          or not isinstance(max_request_bytes, int)
                                          or max_request_bytes < 1):
        raise ValidationError("max_request_bytes", f"max_request_bytes must be a positive "
                              f"integer or None, got {max_request_bytes!r}", max_request_bytes)


def _add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """The endpoints are :class:`OpenAIServing`'s methods; the decorators' arguments only
    describe them in the OpenAPI schema."""
    post_errors = {k: _ERRORS[k] for k in (400, 401, 404, 413, 429, 500, 503)}
    app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})(serving.list_models)
    app.post("/v1/completions", response_model=None,
             responses={**_json_and_sse(CompletionResponse), **post_errors})(serving.completions)
    app.post("/v1/chat/completions", response_model=None,
             responses={**_json_and_sse(ChatCompletionResponse), **post_errors})(serving.chat_completions)
    app.get("/health", response_model=Health, responses={500: {
        "model": ErrorResponse, "description": "the engine has stopped, and why"}})(serving.health)
    app.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
                             "description": "Prometheus text format"}})(serving.metrics)


def _add_exception_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape: ours (:class:`APIError`), FastAPI's for a body
    that does not parse or match the request model, a stopped engine, an unknown path."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            detail = err.get("ctx", {}).get("error", "")
            return bad_request(f"the request body is not valid JSON: {detail}").response()
        loc = [str(x) for x in err["loc"] if x != "body"]
        # For a union (prompt: str | list[int]) pydantic reports each branch; name the field.
        param = loc[0] if loc else None
        if param is None:
            return bad_request(f"the request body must be a JSON object: {err['msg']}").response()
        where = ".".join(loc)
        if err["type"] == "extra_forbidden":  # inside an object whose keys shape the output
            message = f"{where}: unknown field; this API has no such field"
        else:
            message = f"{where}: {err['msg']} (got {err.get('input')!r})"
        return bad_request(message[:500], param).response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return APIError(503, str(e), "service_unavailable").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), kind).response()


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


def run_server(host: str = "127.0.0.1", port: int = 8000, *, api_key: str | Sequence[str] | None = None,
               tenants_file: str | None = None, cache_salt_per_key: bool = False,
               max_waiting: int | None = DEFAULT_MAX_WAITING,
               max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES, engine_process: bool = True,
               uvicorn_log_level: str = "info", **llm_kwargs: Any) -> None:
    """Load the model and serve it until interrupted (what ``minivllm serve`` runs); the
    engine core runs in a process of its own unless ``engine_process`` is False.

    If the engine dies, the server stops and the process exits with status 1, saying why,
    so that a supervisor (systemd, Kubernetes, a router's health checks) sees a dead
    server rather than one that answers 500 forever. This is vLLM's behaviour, and so is
    ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``, which keeps the server up instead."""
    keep_alive = os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "0").strip()
    if keep_alive not in ("0", "1", ""):
        raise ValidationError("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH "
                              f"must be 0 or 1, got {keep_alive!r}", keep_alive)
    app = build_app(api_key=api_key, tenants_file=tenants_file, cache_salt_per_key=cache_salt_per_key,
                    max_waiting=max_waiting, max_request_bytes=max_request_bytes,
                    engine_process=engine_process, **llm_kwargs)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level))
    died: list[BaseException] = []

    def stop(error: BaseException) -> None:
        died.append(error)
        logger.error("the engine died (%s): the server stops and exits with status 1 "
                     "(VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps it up, answering 500)", error)
        server.should_exit = True

    if keep_alive != "1":
        app.state.engine.on_death.append(stop)
    logger.info("serving on http://%s:%d (OpenAI base_url http://%s:%d/v1)", host, port, host, port)
    server.run()
    if died:
        raise SystemExit(1)
