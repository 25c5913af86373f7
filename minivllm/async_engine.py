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

In vLLM: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM``) does the same job, with the
engine core in a separate process talking over ZeroMQ instead of a thread. minivllm has
that too: :class:`~minivllm.core_client.AsyncMPEngine` keeps everything here (streams,
tokenizing, bounded waiting) and moves the engine core into its own process
(``minivllm.engine_core``); ``minivllm serve`` uses it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from minivllm.engine import LLMEngine
from minivllm.exceptions import ValidationError
from minivllm.outputs import RequestOutput
from minivllm.processor import ProcessedPrompt, Processor
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")

T = TypeVar("T")
Message = dict[str, Any]
Prompt = str | dict | list[Message]
"""A text prompt, ``{"prompt_token_ids": [...]}``, or a chat conversation (templated)."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are queued; the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The stepping loop failed; the engine serves nothing more (HTTP 500)."""


class RequestStream:
    """The outputs of one request, as an async iterator. Closing it (or cancelling the
    task that iterates it) before the request finished aborts the request."""

    def __init__(self, request_id: str, engine: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

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
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 reject_over_length: bool = True) -> None:
        """``max_waiting``: refuse new requests while this many are queued (None: no
        limit). ``reject_over_length``: refuse ``max_tokens`` that cannot fit after the
        prompt (what an API server should say) instead of clamping it (what the offline
        ``LLM`` does)."""
        self.engine = engine
        self.max_waiting = max_waiting
        self.reject_over_length = reject_over_length
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minivllm-engine")
        # One thread: requests are tokenized one after another, never on the stepping thread.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="minivllm-tokenize")
        self._streams: dict[str, RequestStream] = {}
        self._aborts: set[str] = set()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._engine_busy = False
        self._adding: set[str] = set()
        """Ids being tokenized or added, not yet in the scheduler's waiting queue."""
        self._counts_lock = threading.Lock()
        """Held while the stepping thread moves an id from ``_adding`` into ``num_waiting``
        (or refreshes the counts) and while ``num_queued`` reads them, so that no
        admission check sees a request counted twice (a spurious 503) or not at all."""
        self.num_waiting = 0
        """Requests the scheduler has not admitted yet, as of the last engine call."""
        self.num_running = 0
        self.kv_cache_usage = 0.0
        self.error: BaseException | None = None

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Start the stepping task on the running event loop."""
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run_loop(), name="minivllm-step-loop")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self.end_streams("the server is shutting down")
        if self.error is None:  # leave the engine clean for whoever uses it next
            await self.call(self._abort_all)
        await asyncio.to_thread(self._executor.shutdown, True)
        await asyncio.to_thread(self._tokenizer_pool.shutdown, True, cancel_futures=True)

    def end_streams(self, reason: str) -> None:
        """End every open stream with :class:`EngineDeadError` and abort its request, so
        clients get a clear last message instead of a cut connection."""
        for request_id, stream in self._streams.items():
            stream.put(EngineDeadError(reason))
            self._aborts.add(request_id)
        self._streams.clear()
        if self._wakeup is not None:
            self._wakeup.set()

    def _abort_all(self) -> None:
        pending = list(self.engine.scheduler.requests)
        if pending:
            self.engine.abort_request(pending)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self.error is None

    @property
    def is_ready(self) -> bool:
        """Ready to take requests (in one process: at once; see ``AsyncMPEngine``)."""
        return True

    @property
    def processor(self) -> Processor:
        """Tokenizes and checks prompts (on the tokenizer thread)."""
        return self.engine.processor

    @property
    def max_model_len(self) -> int | None:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.max_num_seqs

    @property
    def num_queued(self) -> int:
        """Requests that actually wait: those queued in the scheduler or on their way to
        it, less the seats (``max_num_seqs``) free for them at the next step."""
        with self._counts_lock:
            free_seats = max(0, self.max_num_seqs - self.num_running)
            return max(0, self.num_waiting + len(self._adding) - free_seats)

    # -- calls into the engine, always on the stepping thread -------------------------
    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the stepping thread, between two steps."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _snapshot(self, added: str | None = None) -> None:
        scheduler = self.engine.scheduler
        with self._counts_lock:
            self.num_waiting = len(scheduler.waiting)
            self.num_running = len(scheduler.running)
            if added is not None:
                self._adding.discard(added)  # now counted in num_waiting instead
        self.kv_cache_usage = self.engine.kv_cache_manager.usage

    def _add(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
             priority: int = 0) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, priority=priority)
            self._snapshot(added=request_id)
        finally:
            with self._counts_lock:
                self._adding.discard(request_id)  # refused by the engine: counted nowhere

    def _preprocess(self, prompt: Prompt, params: SamplingParams) -> ProcessedPrompt:
        """Template or tokenize (on the tokenizer thread, through the engine's
        :class:`~minivllm.processor.Processor`); refuse a ``max_tokens`` that cannot fit."""
        processor = self.processor
        if isinstance(prompt, list):  # chat messages
            processed = processor.process_chat(prompt)
        else:
            processed = processor.process_prompt(prompt)
        n, max_len = len(processed.prompt_token_ids), processor.max_model_len
        if self.reject_over_length and params.max_tokens is not None and 0 < n < max_len < n + params.max_tokens:
            raise ValidationError(
                "max_tokens",
                f"max_tokens is {params.max_tokens}, but the prompt has {n} tokens and the "
                f"model's maximum length is {max_len} tokens, so at most "
                f"{max_len - n} can be generated", params.max_tokens)
        return processed

    def _step(self, aborts: set[str]) -> tuple[list[RequestOutput], bool]:
        live = [i for i in aborts if self.engine.has_request(i)]
        if live:
            self.engine.abort_request(live)
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        self._snapshot()
        return outputs, self.engine.has_unfinished_requests()

    # -- the stepping loop -----------------------------------------------------------
    async def _run_loop(self) -> None:
        try:
            while True:
                if not (self._aborts or self._engine_busy or self._wakeup.is_set()):
                    await self._wakeup.wait()
                # Clear before stepping: a request added during this step sets it again.
                self._wakeup.clear()
                # Take the pending aborts here, on the loop: the thread gets its own set.
                aborts, self._aborts = self._aborts, set()
                outputs, self._engine_busy = await self.call(self._step, aborts)
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:  # None: its consumer has gone; drop it
                        stream.put(out)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug or out-of-memory in a step: fail loudly
            logger.exception("the engine step loop failed; no more requests will be served")
            self.error = e
            for stream in self._streams.values():
                stream.put(EngineDeadError(f"the engine failed: {e!r}"))
            self._streams.clear()

    def _abort_later(self, request_id: str) -> None:
        """Abort before the next step (if the request is still in the engine by then)."""
        self._streams.pop(request_id, None)
        self._aborts.add(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    # -- the public API ---------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                          priority: int = 0) -> RequestStream:
        """Queue a request and return the stream of its outputs (``priority``: lower runs
        first, with ``scheduling_policy="priority"`` only).

        Raises :class:`EngineOverloadedError` when ``max_waiting`` requests wait,
        :class:`~minivllm.exceptions.ValidationError` (``param`` names the field) for
        invalid input (nothing is queued then), and :class:`EngineDeadError` when the
        stepping loop has failed.
        """
        if self._task is None:
            self.start()
        if self.error is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.error!r}")
        if self.max_waiting is not None and self.num_queued >= self.max_waiting:
            raise EngineOverloadedError(
                f"the server is at capacity: {self.num_queued} requests are waiting "
                f"(max_waiting={self.max_waiting}); retry later"
            )
        if request_id in self._streams or request_id in self._aborts or request_id in self._adding:
            raise ValidationError("request_id", f"request_id {request_id!r} is already in use",
                                  request_id)
        stream = RequestStream(request_id, self)
        self._adding.add(request_id)
        try:
            loop = asyncio.get_running_loop()
            # Off the stepping thread: a long prompt must not pause everyone's tokens.
            engine_prompt = await loop.run_in_executor(self._tokenizer_pool, self._preprocess,
                                                       prompt, params)
        except BaseException:  # invalid, or cancelled: nothing was queued
            self._adding.discard(request_id)
            raise
        self._streams[request_id] = stream  # before the add: the first output may come soon
        try:
            await self.call(self._add, request_id, engine_prompt, params, priority)
        except (ValueError, TypeError):  # invalid input: nothing was queued
            stream.finished = True
            self._streams.pop(request_id, None)
            raise
        except BaseException:  # cancelled while waiting: the add may still run, so abort
            stream.close()
            raise
        finally:
            self._adding.discard(request_id)  # if the thread never got to it
        self._wakeup.set()
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
        self._aborts.add(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    async def get_metrics(self) -> list:
        """The engine's metric records (``LLMEngine.get_metrics``), read between steps."""
        return await self.call(self.engine.get_metrics)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block no request holds (``LLMEngine.reset_prefix_cache``),
        between steps; False when a running request still holds blocks."""
        return await self.call(self.engine.reset_prefix_cache)
