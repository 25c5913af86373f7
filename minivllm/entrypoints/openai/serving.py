"""The endpoints' work: an OpenAI request in, the engine's outputs back as OpenAI JSON or
server-sent events.

:class:`OpenAIServing` holds what every endpoint needs (the async engine and the served
model's name) and has one method per endpoint; ``minivllm.entrypoints.openai.api_server`` registers them as
FastAPI routes. Each method reads the same way: check the model name, make the
``SamplingParams`` (the request model does: ``minivllm.entrypoints.openai.protocol``), start the request on
the :class:`~minivllm.engine.async_llm.AsyncLLMEngine`, then either stream chunks (:func:`sse`)
or wait for the last output and answer once. Every refusal is an
:class:`~minivllm.entrypoints.openai.protocol.APIError`, which the app turns into OpenAI's error shape.

In vLLM (0.34): ``vllm/entrypoints/openai/completion/serving.py`` and
``chat_completion/serving.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.engine.async_llm import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
)
from minivllm.engine.processor import check_cache_salt
from minivllm.entrypoints.openai.base_protocol import (
    IGNORED_FIELDS_HEADER,
    SamplingRequest,
    UnsupportedField,
)
from minivllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
from minivllm.entrypoints.openai.completion_protocol import CompletionRequest
from minivllm.entrypoints.openai.logprobs import CompletionLogprobsMaker, chat_logprobs
from minivllm.entrypoints.openai.prometheus import CONTENT_TYPE, render_metrics
from minivllm.entrypoints.openai.protocol import APIError, invalid_request
from minivllm.entrypoints.openai.tenants import Lease, Tenants
from minivllm.exceptions import ValidationError
from minivllm.metrics import Counter
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str,
                 http_counts: dict[tuple[str, str], int], tenants: Tenants | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.http_counts = http_counts
        """Responses by (handler, status), counted by ``middleware.CountResponses``."""
        self.tenants = tenants
        """The API keys' owners, their limits and usage (None: an open server)."""

    # -- what every generating endpoint does first -----------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", "not_found_error", "model", "model_not_found")

    def sampling_params(self, body: SamplingRequest, default_max_tokens: int | None) -> SamplingParams:
        try:
            body.check_supported()
            return body.sampling_params(default_max_tokens)
        except (ValidationError, UnsupportedField) as e:
            raise invalid_request(e) from None

    async def start(self, request: Request, body: SamplingRequest, prompt: Any, params: SamplingParams,
                    prefix: str, prompt_field: str) -> RequestStream:
        """Queue the request; its tenant's seat (``RequestGuard`` admitted it) learns its
        stream, to charge what it uses, and says which ``cache_salt`` it runs with."""
        lease: Lease | None = getattr(request.state, "tenant_lease", None)
        try:
            salt = check_cache_salt(body.cache_salt)
            salt = salt if lease is None else lease.cache_salt(salt)
            stream = await self.engine.add_request(f"{prefix}-{uuid.uuid4().hex}", prompt, params,
                                                   body.priority, salt)
            if lease is not None:
                lease.stream = stream
            return stream
        except EngineOverloadedError as e:
            raise APIError(503, str(e), "service_unavailable", code="queue_full") from None
        except (ValueError, TypeError) as e:
            raise invalid_request(e, prompt_field) from None
        except (EngineDeadError, asyncio.CancelledError):
            raise
        except Exception as e:  # preparing this one request failed: a 500 of its own
            logger.exception("preparing a request failed")
            raise APIError(500, f"the request could not be prepared: {e!r}", "server_error",
                           code="request_failed") from None

    # -- the endpoints -------------------------------------------------------------------
    async def list_models(self) -> dict:
        # Clients ask for the model list first (guidellm does, at start): while an engine
        # process loads, answer once its maximum length is known, not with a null.
        await self.engine.wait_ready()
        card = {"id": self.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "minivllm", "max_model_len": self.engine.max_model_len}
        return {"object": "list", "data": [card]}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        params = self.sampling_params(body, default_max_tokens=16)  # OpenAI's default here
        try:
            prompt = body.engine_prompt()
        except ValidationError as e:
            raise invalid_request(e) from None
        stream = await self.start(request, body, prompt, params, "cmpl", "prompt")
        headers = ignored_fields_header(body, stream.request_id)
        head = {"id": stream.request_id, "object": "text_completion",
                "created": int(time.time()), "model": self.model_name}

        makers: dict[int, CompletionLogprobsMaker] = {}  # per choice: its positions sent so far

        def choice(c: CompletionOutput, text: str, final: bool) -> dict:
            logprobs = None
            if params.logprobs is not None:
                logprobs = makers.setdefault(c.index, CompletionLogprobsMaker())(c.logprobs or [])
            return {"index": c.index, "text": text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason if final else None,
                    "stop_reason": c.stop_reason if final else None}

        if body.stream:
            deltas = ChoiceDeltas()

            def chunk(out: RequestOutput) -> list[dict]:
                # A choice with no new text waits: its tokens' logprobs go with its next chunk.
                return [{**head, "choices": [choice(c, text, final)]}
                        for c, text, final, _ in deltas.new(out) if text or final]
            return sse(stream, chunk, head, body, headers)
        out = await unless_disconnected(request, last_output(stream))
        if out is None:
            return Response(status_code=499)
        if (error := failure(out)) is not None:
            raise error
        choices = [choice(c, c.text, True) for c in out.outputs]
        if body.return_token_ids:
            for c, ch in zip(out.outputs, choices):
                ch["token_ids"] = c.token_ids
        return JSONResponse({**head, "choices": choices, "usage": usage(out)}, headers=headers)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        params = self._chat_sampling_params(body)
        messages = [m.model_dump() for m in body.messages]  # checked by chat_utils, off the loop
        stream = await self.start(request, body, messages, params, "chatcmpl", "messages")
        headers = ignored_fields_header(body, stream.request_id)
        head = {"id": stream.request_id, "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name}
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return sse(stream, _chat_chunks(head, params.logprobs), head, body, headers)
        out = await unless_disconnected(request, last_output(stream))
        if out is None:
            return Response(status_code=499)
        if (error := failure(out)) is not None:
            raise error
        choices = []
        for c in out.outputs:
            message = {"role": "assistant", "content": c.text}
            choice = {"index": c.index, "message": message,
                      "logprobs": None if params.logprobs is None else chat_logprobs(c.logprobs or [], params.logprobs),
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return JSONResponse({**head, "choices": choices, "usage": usage(out)}, headers=headers)

    def _chat_sampling_params(self, body: ChatCompletionRequest) -> SamplingParams:
        """As for a completion, with OpenAI's newer name ``max_completion_tokens`` for
        ``max_tokens``: an error names the field the client sent."""
        renamed = body.max_tokens is None and body.max_completion_tokens is not None
        if renamed:
            body.max_tokens = body.max_completion_tokens
        try:
            return self.sampling_params(body, default_max_tokens=None)  # as long as the model allows
        except APIError as e:
            if renamed and e.param == "max_tokens":
                e.param, e.message = "max_completion_tokens", e.message.replace(
                    "max_tokens", "max_completion_tokens", 1)
            raise

    async def health(self) -> JSONResponse:
        if self.engine.error is not None:
            return APIError(500, f"the engine failed: {self.engine.error!r}", "server_error").response()
        if not self.engine.is_ready:  # the engine core process is still loading the model
            return APIError(503, "the engine is starting; retry shortly", "service_unavailable").response()
        return JSONResponse({"status": "ok", "num_requests_running": self.engine.num_running,
                             "num_requests_waiting": self.engine.num_queued})

    async def reset_prefix_cache(self) -> Response:
        """``POST /reset_prefix_cache`` (a development endpoint, as in vLLM): forget every
        cached block, so that the next requests start from a cold cache (a benchmark
        that compares policies on the same server). Refused while requests hold blocks."""
        if self.engine.error is not None:
            return APIError(500, f"the engine failed: {self.engine.error!r}", "server_error").response()
        if not await self.engine.reset_prefix_cache():
            return APIError(409, "requests are running and hold cached blocks: the prefix cache "
                            "was not reset; retry when they have finished", "conflict").response()
        return Response(status_code=200)

    async def metrics(self) -> Response:
        records = await self.engine.get_metrics() if self.engine.error is None else []
        records += [Counter("minivllm:http_requests", n, {"handler": h, "status": s})
                    for (h, s), n in sorted(self.http_counts.items())]
        records += self.tenants.records() if self.tenants is not None else []
        return Response(render_metrics(records), media_type=CONTENT_TYPE)


def _chat_chunks(head: dict, top_logprobs: int | None = None) -> Callable[[RequestOutput], list[dict]]:
    """The chunk maker of a chat stream: OpenAI's first chunk of each choice announces
    the role. With logprobs (``top_logprobs`` not None) each chunk carries the entries of
    its own choice's tokens sent since that choice's last chunk."""
    deltas = ChoiceDeltas()
    num_sent: dict[int, int] = {}  # per choice: positions whose logprobs were sent

    def chunk(out: RequestOutput) -> list[dict]:
        chunks = []
        for c, text, final, first in deltas.new(out):
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            if not delta and not final:
                continue  # its tokens' logprobs go with the choice's next chunk
            logprobs = None
            if top_logprobs is not None:
                positions = c.logprobs or []
                logprobs = chat_logprobs(positions[num_sent.get(c.index, 0):], top_logprobs)
                num_sent[c.index] = len(positions)
            chunks.append({**head, "choices": [{"index": c.index, "delta": delta, "logprobs": logprobs,
                                                "finish_reason": c.finish_reason if final else None}]})
        return chunks

    return chunk


class ChoiceDeltas:
    """What each choice of a stream gained since its last chunk. An output holds each
    completion as it stands (with n > 1, all n, whichever progressed), and a completion's
    text only ever grows, so its new text is what follows the part already sent; its
    finish_reason is sent once."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}
        """Characters sent, per choice index."""
        self.done: set[int] = set()

    def new(self, out: RequestOutput) -> list[tuple[CompletionOutput, str, bool, bool]]:
        """``(completion, new text, finished now, first time seen)`` for every completion."""
        result = []
        for c in out.outputs:
            first = c.index not in self.sent
            text = c.text[self.sent.get(c.index, 0):]
            self.sent[c.index] = max(self.sent.get(c.index, 0), len(c.text))
            final = c.finished() and c.index not in self.done
            if final:
                self.done.add(c.index)
            result.append((c, text, final, first))
        return result


# -- helpers for the endpoints -------------------------------------------------------------
def failure(out: RequestOutput) -> APIError | None:
    """The 500 of a request that finished with finish_reason "error" (any of its n
    completions), or None."""
    for c in out.outputs:
        if c.finish_reason == "error":
            return APIError(500, f"the request failed: {c.error}", "server_error", code="request_failed")
    return None


def usage(out: RequestOutput, index: int | None = None) -> dict[str, int]:
    """The request's usage; with ``index``, choice ``index``'s so far (what vLLM's
    ``continuous_usage_stats`` puts in each chunk of that choice)."""
    # With n > 1 the prompt counts once and every completion's tokens count (OpenAI's rule).
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs if index is None or c.index == index)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def ignored_fields_header(body: SamplingRequest, request_id: str) -> dict[str, str]:
    """The response header naming the fields this request carried that the server does
    not act on (vLLM's fields it lacks, unknown fields), logged once as vLLM logs them."""
    header = body.ignored_fields_header()
    if header:
        logger.warning("request %s: fields accepted but ignored (this server does not act on "
                       "them): %s", request_id, header[IGNORED_FIELDS_HEADER].replace(",", ", "))
    return header


async def last_output(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    return last


async def unless_disconnected(request: Request, work: Any) -> Any:
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


def sse(stream: RequestStream, chunk: Callable[[RequestOutput], list[dict]], head: dict,
        body: SamplingRequest, headers: dict[str, str] | None = None) -> StreamingResponse:
    """Server-sent events: one ``data: {json}`` line per chunk, then ``data: [DONE]``.

    ``stream_options`` as vLLM reads them: ``include_usage`` adds a last chunk with the
    request's usage and no choices; with it, ``continuous_usage_stats`` also puts a
    ``usage`` in every chunk, counting that chunk's choice's tokens so far (so a load
    generator can time each token without parsing text).

    When the client disconnects, Starlette cancels this generator while it waits for the
    next output; ``stream.close()`` in ``finally`` then aborts the request.
    """
    options = body.stream_options
    include_usage = options is not None and bool(options.include_usage)
    continuous_usage = include_usage and bool(options.continuous_usage_stats)

    async def events() -> AsyncIterator[str]:
        # The status line (200) is long gone when something fails: report it in-band, as
        # a last event holding an error (the openai client raises it as an APIError).
        try:
            async for out in stream:
                if (error := failure(out)) is not None:
                    yield f"data: {json.dumps({'error': error.as_dict()})}\n\n"
                    break
                for data in chunk(out):  # one chunk per choice that progressed
                    if continuous_usage:
                        data["usage"] = usage(out, data["choices"][0]["index"])
                    yield f"data: {json.dumps(data)}\n\n"
                if out.finished and include_usage:
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(out)})}\n\n"
        except EngineDeadError as e:
            error = APIError(503, str(e), "service_unavailable")
            yield f"data: {json.dumps({'error': error.as_dict()})}\n\n"
        else:
            yield "data: [DONE]\n\n"
        finally:
            stream.close()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **(headers or {})})
