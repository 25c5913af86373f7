"""AsyncLLMEngine: the engine behind an asyncio server (notebook 10).

``LLMEngine.step()`` is plain blocking Python: a model step takes tens to hundreds of
milliseconds, and an HTTP server that ran it on its event loop would stop accepting
connections, streaming tokens and noticing disconnects for that long. So:

* **One stepping thread.** Every call into the engine (add, abort, step, metrics) runs
  on a single worker thread, one after another. The engine is not thread-safe and
  never needs to be: the thread serialises it. The event loop only awaits.
* **Tokenizing elsewhere.** Chat templating and tokenization (the engine's
  ``Processor``) run on a second thread before the request reaches the stepping thread,
  so a long prompt never pauses the streams of everyone else. Only the checked token
  ids cross over, and the engine does not tokenize or check them again.
* **One background task** keeps that thread busy while any request is unfinished and
  sleeps when there is nothing to do.
* **One queue per request.** The task routes each ``RequestOutput`` to the queue of its
  request; ``generate()`` reads that queue and yields outputs as they come.
* **Cancellation.** When the consumer of a stream goes away (a client disconnect
  cancels it), its id joins a set of pending aborts; the stepping thread applies them
  just before the next step, so the request's KV blocks are free after that step.
* **Bounded waiting.** A new request is refused with :class:`EngineOverloadedError` at
  once while ``max_waiting`` requests actually wait (queued, or on their way, beyond the
  free seats of ``max_num_seqs``), rather than letting the queue, and everyone's wait,
  grow without bound. A burst that fits the free seats all gets in.
* **Isolation.** A request that fails on its own (finish_reason "error") ends its stream
  with that output; the others and the loop carry on. Only a failure of a step itself
  (the forward pass) stops the loop: then every stream ends with
  :class:`EngineDeadError` and ``error`` is set, which ``/health`` reports.

Where the engine runs is the business of an *engine-core client*
(``minivllm.engine.core_client``), chosen by composition: :class:`~minivllm.engine.core_client.InprocClient`
steps an ``LLMEngine`` on the thread described above; :class:`~minivllm.engine.mp_client.AsyncMPClient`
talks to an engine core in a process of its own (``minivllm.engine.core_proc``), which is
what ``minivllm serve`` uses (:class:`AsyncMPEngine`). Everything
above the client (streams, tokenizing, bounded waiting, aborts) is this class, the same
for both.

In vLLM: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM``) does the same job over its
``core_client.py`` (``AsyncMPClient``; the engine core in a separate process talking
over ZeroMQ).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from minivllm.config import EngineConfig
from minivllm.engine.core_client import EngineCoreClient, InprocClient
from minivllm.engine.mp_client import AsyncMPClient
from minivllm.engine.processor import ProcessedPrompt, Processor, check_cache_salt
from minivllm.exceptions import EngineDeadError, EngineOverloadedError, ValidationError
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine

__all__ = ["AsyncLLMEngine", "AsyncMPEngine", "EngineDeadError", "EngineOverloadedError", "RequestStream"]

logger = logging.getLogger("minivllm")

Message = dict[str, Any]
Prompt = str | dict | list[Message]
"""A text prompt, ``{"prompt_token_ids": [...]}``, or a chat conversation (templated)."""


class RequestStream:
    """The outputs of one request, as an async iterator. Closing it (or cancelling the
    task that iterates it) before the request finished aborts the request."""

    def __init__(self, request_id: str, engine: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.last: RequestOutput | None = None
        """The latest output handed out (what the request has used so far)."""

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the consumer (e.g. an HTTP client) has gone
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.last = item
        if item.finished:
            self.finished = True
            self._engine._streams.pop(self.request_id, None)
        return item

    def close(self) -> None:
        """Stop listening; abort the request if it has not finished."""
        if not self.finished:
            self.finished = True
            self._engine._abort_later(self.request_id)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine] | None = None, max_waiting: int | None = None,
                 reject_over_length: bool = True, *, client: EngineCoreClient | None = None) -> None:
        """``engine``: an ``LLMEngine`` to step on a thread of this process (or a function
        that builds one, called on that thread: ``InprocClient``); or ``client``:
        any engine-core client (``minivllm.engine.core_client``). ``max_waiting``: refuse new
        requests while this many are queued (None: no limit). ``reject_over_length``:
        refuse ``max_tokens`` that cannot fit after the prompt (what an API server should
        say) instead of clamping it (what the offline ``LLM`` does)."""
        if (engine is None) == (client is None):
            raise TypeError("AsyncLLMEngine takes an engine or a client, one of the two")
        self.client: EngineCoreClient = client or InprocClient(engine)
        self.max_waiting = max_waiting
        self.reject_over_length = reject_over_length
        # One thread: requests are tokenized one after another, never on the stepping thread.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="minivllm-tokenize")
        self._streams: dict[str, RequestStream] = {}
        self._adding: set[str] = set()
        """Ids being tokenized, not yet handed to the client (which counts them from then)."""
        self._started = False
        self._ended: str | None = None
        """Why the streams were ended (the server is stopping); None while it serves."""
        self.on_death: list[Callable[[BaseException], None]] = []
        """Called (on the event loop) with the error when the engine dies: ``minivllm
        serve`` stops the server then, as vLLM's does."""

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Start the client on the running event loop (an engine core process starts
        loading its model, and ``is_ready`` is False until it has)."""
        if not self._started:
            self._started = True
            self.client.start(self._route, self._fail_streams)

    async def shutdown(self) -> None:
        self.end_streams("the server is shutting down")
        if self._started:
            await self.client.shutdown()
        await asyncio.to_thread(self._tokenizer_pool.shutdown, True, cancel_futures=True)

    def end_streams(self, reason: str) -> None:
        """End every open stream with :class:`EngineDeadError` and abort its request, so
        clients get a clear last message instead of a cut connection. Requests added
        from now on are refused with the same reason."""
        self._ended = reason
        ids = list(self._streams)
        for stream in self._streams.values():
            stream.put(EngineDeadError(reason))
        self._streams.clear()
        if ids and self.client.error is None:
            self.client.abort(ids)

    def _route(self, outputs: list[RequestOutput]) -> None:
        """The client's outputs, each to its request's stream (on the event loop)."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:  # None: its consumer has gone; drop it
                stream.put(out)

    def _fail_streams(self, error: BaseException) -> None:
        """The client's engine has died: every open stream ends with EngineDeadError."""
        for stream in self._streams.values():
            stream.put(EngineDeadError(f"the engine failed: {error}"))
        self._streams.clear()
        for callback in self.on_death:
            callback(error)

    # -- what the server reads ----------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        """Why the engine died (``/health`` then answers 500); None while it serves."""
        return self.client.error

    @property
    def is_running(self) -> bool:
        return self._started and self.client.error is None

    @property
    def is_ready(self) -> bool:
        """Ready to take requests (an engine core process: once its model is loaded)."""
        return self.client.is_ready

    @property
    def processor(self) -> Processor:
        """Tokenizes and checks prompts (on the tokenizer thread)."""
        return self.client.processor

    @property
    def max_model_len(self) -> int | None:
        """None while an engine core process is still loading its model."""
        return self.client.max_model_len

    async def wait_ready(self) -> None:
        """Start the engine if needed and wait until it takes requests (an engine core
        process: until its model is loaded); :class:`EngineDeadError` if it failed."""
        self.start()
        if self.client.error is None:
            await self.client.wait_ready()
        if self.client.error is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.client.error!r}")

    @property
    def max_num_seqs(self) -> int:
        return self.client.max_num_seqs

    @property
    def num_waiting(self) -> int:
        """Requests the scheduler has not admitted yet, as of the last step."""
        return self.client.num_waiting

    @property
    def num_running(self) -> int:
        return self.client.num_running

    @property
    def kv_cache_usage(self) -> float:
        return self.client.kv_cache_usage

    @property
    def num_queued(self) -> int:
        """Requests that actually wait: those queued in the scheduler or on their way to
        it (being tokenized, or handed to the client and not yet seen by the scheduler),
        less the seats (``max_num_seqs``) free for them at the next step."""
        free_seats = max(0, self.max_num_seqs - self.num_running)
        return max(0, len(self._adding) + self.client.num_waiting_or_on_the_way - free_seats)

    def _preprocess(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None) -> ProcessedPrompt:
        """Template or tokenize, and check everything the processor checks (on the
        tokenizer thread): bad input is refused before it reaches the engine. A
        ``max_tokens`` that cannot fit is refused too."""
        processor = self.processor
        params = processor.check_params(params)
        if isinstance(prompt, list):  # chat messages
            processed = processor.process_chat(prompt)
        else:
            processed = processor.process_prompt(prompt)
        if cache_salt is not None:
            processed = dataclasses.replace(processed, cache_salt=check_cache_salt(cache_salt))
        processor.check_request(processed, params)
        n, max_len = len(processed.prompt_token_ids), processor.max_model_len
        if self.reject_over_length and params.max_tokens is not None and 0 < n < max_len < n + params.max_tokens:
            raise ValidationError(
                "max_tokens",
                f"max_tokens is {params.max_tokens}, but the prompt has {n} tokens and the "
                f"model's maximum length is {max_len} tokens, so at most "
                f"{max_len - n} can be generated", params.max_tokens)
        return processed

    def _abort_later(self, request_id: str) -> None:
        """Abort before the next step (if the request is still in the engine by then)."""
        self._streams.pop(request_id, None)
        if self.client.error is None:
            self.client.abort([request_id])

    # -- the public API ---------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                          priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """Queue a request and return the stream of its outputs (``priority``: lower runs
        first, with ``scheduling_policy="priority"`` only; ``cache_salt``: only requests
        with the same salt share prefix-cache blocks, and it replaces a dict prompt's own).

        Raises :class:`EngineOverloadedError` when ``max_waiting`` requests wait,
        :class:`~minivllm.exceptions.ValidationError` (``param`` names the field) for
        invalid input (nothing is queued then), and :class:`EngineDeadError` when the
        engine has failed.
        """
        await self.wait_ready()
        if self.max_waiting is not None and self.num_queued >= self.max_waiting:
            raise EngineOverloadedError(
                f"the server is at capacity: {self.num_queued} requests are waiting "
                f"(max_waiting={self.max_waiting}); retry later"
            )
        if request_id in self._streams or request_id in self._adding or self.client.in_use(request_id):
            raise ValidationError("request_id", f"request_id {request_id!r} is already in use",
                                  request_id)
        stream = RequestStream(request_id, self)
        self._adding.add(request_id)
        try:
            loop = asyncio.get_running_loop()
            # Off the stepping thread: a long prompt must not pause everyone's tokens.
            engine_prompt = await loop.run_in_executor(self._tokenizer_pool, self._preprocess,
                                                       prompt, params, cache_salt)
        except BaseException:  # invalid, or cancelled: nothing was queued
            self._adding.discard(request_id)
            raise
        # The engine may have died, or the server begun to stop, while the prompt was
        # tokenized: the streams have been ended then, and this one would never be.
        if self.client.error is not None or self._ended is not None:
            self._adding.discard(request_id)
            raise EngineDeadError(self._ended or f"the engine failed earlier: {self.client.error!r}")
        self._streams[request_id] = stream  # before the add: the first output may come soon
        # From here the client counts it (both lines run before anything else on the loop).
        self._adding.discard(request_id)
        try:
            await self.client.add_request(request_id, engine_prompt, params, priority)
        except (ValueError, TypeError):  # invalid input: nothing was queued
            stream.finished = True
            self._streams.pop(request_id, None)
            raise
        except BaseException:  # cancelled while waiting: the add may still run, so abort
            stream.close()
            raise
        return stream

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the outputs of one request as the engine produces them (vLLM's
        ``AsyncLLM.generate``). If the consumer is cancelled, or closes the generator
        early, the request is aborted."""
        stream = await self.add_request(request_id, prompt, params or SamplingParams(), priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a final output, finish_reason "abort".
        Part of the vLLM-shaped API (``AsyncLLM.abort``): the server never calls it, as
        closing a request's stream aborts it too."""
        self.client.abort([request_id])

    async def get_metrics(self) -> list:
        """The engine's metric records (``EngineCore.get_metrics``), read between steps."""
        return await self.client.get_metrics()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block no request holds (``EngineCore.reset_prefix_cache``),
        between steps; False when a running request still holds blocks."""
        return await self.client.reset_prefix_cache()

    async def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` where the engine runs, between two steps (the engine's own
        thread with :class:`~minivllm.engine.core_client.InprocClient`)."""
        return await self.client.call(fn, *args)


class AsyncMPEngine(AsyncLLMEngine):
    """The async engine over an engine core in its own process (``minivllm serve``): the
    same front end, with an :class:`~minivllm.engine.mp_client.AsyncMPClient`."""

    def __init__(self, config: EngineConfig, max_waiting: int | None = None,
                 reject_over_length: bool = True,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        super().__init__(max_waiting=max_waiting, reject_over_length=reject_over_length,
                         client=AsyncMPClient(config, tokenizer))

    @property
    def config(self) -> EngineConfig:
        return self.client.config

    @property
    def pid(self) -> int | None:
        """The engine core process's id."""
        return self.client.pid
