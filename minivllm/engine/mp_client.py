"""AsyncMPClient: the engine-core client whose engine core runs in a process of its own (notebook 10).

* **Start.** ``start()`` starts the core process (``minivllm.utils.system_utils``) and returns at once; the core loads the model
  and answers ``Ready`` with the numbers the server needs to check prompts itself
  (``max_model_len`` depends on the KV cache it sized). Until then ``is_ready`` is
  False (``/health`` answers 503) and new requests wait for it.
* **Requests.** The front end tokenizes and checks with its own tokenizer and
  :class:`~minivllm.engine.processor.Processor`, and the client sends token ids (``AddRequest``;
  for ``n > 1``, one per child, as vLLM's front end does). Aborts leave at once
  (``Abort``); the core applies them before its next step.
* **Outputs.** One task reads the core's ``StepOutputs``: new token ids per request. The
  :class:`~minivllm.engine.output_processor.OutputProcessor`, the same class the in-process engine
  uses, makes the text (each token detokenized once, here), cuts it at stop strings
  (and tells the core with ``FinishRequests``) and hands the front end a ``RequestOutput``
  just like the in-process one.
* **Death.** If the core process exits (a failed step, a kill, out of memory), ``error``
  is set, ``/health`` answers 500 and every open stream ends with
  :class:`~minivllm.exceptions.EngineDeadError`; the reader notices within ``IDLE_POLL_MS``.
  A core that is alive but silent while requests are in flight (stopped with SIGSTOP,
  stuck in a system call) looks the same to its process table. So it gets
  ``VLLM_ENGINE_ITERATION_TIMEOUT_S`` seconds (vLLM's variable, 60 by default) between two
  messages. After that it is killed and counted dead too, so no request waits forever.
* **Shutdown.** ``Shutdown`` to the core, a join, and a kill if it does not go.

In vLLM: ``vllm/v1/engine/core_client.py`` (``AsyncMPClient``) and the
``OutputProcessor`` that ``AsyncLLM`` runs on what it receives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import tempfile
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from minivllm.config import COMPONENT_FIELDS, EngineConfig
from minivllm.engine.core_client import EngineCoreClient, OnDead, OnOutputs
from minivllm.engine.core_proc import (
    IDLE_POLL_MS,
    Abort,
    AddRequest,
    Failed,
    FinishRequests,
    FromCore,
    Ready,
    Shutdown,
    StepOutputs,
    Utility,
    UtilityResult,
    run_engine_core,
)
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.parallel_sampling import ParentRequest
from minivllm.engine.processor import ProcessedPrompt, Processor, check_priority
from minivllm.exceptions import EngineDeadError, ValidationError
from minivllm.metrics import RequestMetrics
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.utils.system_utils import describe_exit, get_mp_context, with_environment
from minivllm.worker.model_loader import resolve_model_dir

logger = logging.getLogger("minivllm")


class AsyncMPClient(EngineCoreClient):
    """An engine core in a process of its own (see the module's docstring)."""

    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """``config``: the engine core's settings (it is built in the other process; a
        learner's component must be a ``'module:Class'`` string to cross). The
        tokenizer is loaded here from ``config.model`` unless given."""
        config.verify()
        for name in COMPONENT_FIELDS:  # a class object would not reach a fresh interpreter
            if not isinstance(getattr(config, name), str):
                raise ValidationError(name, f"{name} must be a 'module:Class' string for an engine "
                                      f"core in its own process, got {getattr(config, name)!r}",
                                      getattr(config, name))
        self.config = config
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(resolve_model_dir(config.model))
        self.output_processor = OutputProcessor(self.tokenizer)
        """Text, stop strings, logprob dicts, n > 1 gathering: the core sends token ids only."""
        self._processor: Processor | None = None
        self._ready: Ready | None = None
        self._ready_event: asyncio.Event | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._task: asyncio.Task | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._num_sent = 0
        self._num_added = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self.iteration_timeout_s = iteration_timeout_s()
        """The longest the core may stay silent while it has work (see the module's docstring)."""

    @property
    def is_ready(self) -> bool:
        return self._ready is not None and self.error is None

    @property
    def processor(self) -> Processor:
        return self._processor

    @property
    def max_model_len(self) -> int | None:
        return self._ready.max_model_len if self._ready else None

    @property
    def max_num_seqs(self) -> int:
        return self._ready.max_num_seqs if self._ready else self.config.max_num_seqs

    @property
    def num_waiting_or_on_the_way(self) -> int:
        """"On their way" are the adds the core has not seen yet (all counts change on the loop)."""
        return self.num_waiting + self._num_sent - self._num_added

    def in_use(self, request_id: str) -> bool:
        return request_id in self.output_processor.request_states or request_id in self.output_processor.parents

    @property
    def pid(self) -> int | None:
        """The engine core process's id."""
        return self._process.pid if self._process is not None else None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        """Start the engine core process and start reading from it; returns before it is ready."""
        self._ready_event = asyncio.Event()
        self._dir = tempfile.TemporaryDirectory(prefix="minivllm-")
        to_core, from_core = (f"ipc://{self._dir.name}/{name}" for name in ("in", "out"))
        self._context = zmq.asyncio.Context()
        self._to_core = self._context.socket(zmq.PUSH)
        self._to_core.bind(to_core)
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.bind(from_core)
        self._process = get_mp_context().Process(
            target=with_environment, name="minivllm-engine-core", daemon=True,
            args=(dict(os.environ), run_engine_core, self.config, to_core, from_core,
                  logger.getEffectiveLevel()))
        self._process.start()
        self._task = asyncio.get_running_loop().create_task(self._run_loop(on_outputs, on_dead),
                                                            name="minivllm-core-reader")

    async def wait_ready(self) -> None:
        await self._ready_event.wait()
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error!r}")

    async def shutdown(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        process = self._process
        if process.is_alive():
            try:  # NOBLOCK: with no core connected (still starting, or dying) a send waits forever
                await self._to_core.send(self._encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
                await asyncio.to_thread(process.join, 10)
            except zmq.ZMQError:  # no core to hear it: stop the process instead
                process.terminate()
                await asyncio.to_thread(process.join, 5)
        if process.is_alive():  # it did not go in time
            process.kill()
            await asyncio.to_thread(process.join, 5)
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._context.term()
        self._dir.cleanup()

    # -- the reader ----------------------------------------------------------------------------
    async def _receive(self) -> FromCore:
        """The core's next message; EngineDeadError if its process has ended, or has been
        silent for ``iteration_timeout_s`` while requests or calls were in flight."""
        quiet = 0.0  # seconds of silence while requests or calls were in flight
        while True:
            polled = time.monotonic()
            if await self._from_core.poll(IDLE_POLL_MS):
                break
            if not self._process.is_alive():
                raise EngineDeadError(describe_exit("the engine core process", self._process.exitcode))
            in_flight = len(self.output_processor.request_states) + len(self._calls)
            if not in_flight or self._ready is None:  # idle, or loading the model: silence is fine
                quiet = 0.0
                continue
            # Only the time this process spent waiting counts: a poll that took far longer
            # than asked means this process itself was not running (stopped by SIGSTOP, then
            # resumed), and the core cannot be blamed for that.
            quiet += min(time.monotonic() - polled, 2 * IDLE_POLL_MS / 1000)
            if quiet > self.iteration_timeout_s:
                self._process.kill()  # SIGKILL: a stopped process does not act on SIGTERM
                raise EngineDeadError(
                    f"the engine core process (pid {self._process.pid}) sent nothing for "
                    f"{self.iteration_timeout_s:g} s with {in_flight} request(s) or call(s) in flight: "
                    f"stopped, or stuck? It was killed; VLLM_ENGINE_ITERATION_TIMEOUT_S "
                    f"sets this bound")
        message = self._decoder.decode(await self._from_core.recv())
        if isinstance(message, Failed):
            raise EngineDeadError(f"the engine core failed: {message.error}")
        return message

    async def _run_loop(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        try:
            ready = await self._receive()
            assert isinstance(ready, Ready), ready
            self._processor = Processor(self.tokenizer, ready.vocab_size, ready.max_model_len,
                                        ready.max_num_batched_tokens, ready.enable_chunked_prefill)
            self._ready = ready
            self._ready_event.set()
            logger.info("the engine core (pid %d) is ready", self._process.pid)
            while True:
                message = await self._receive()
                if isinstance(message, StepOutputs):
                    on_outputs(self._process_outputs(message))
                elif isinstance(message, UtilityResult):
                    future = self._calls.pop(message.call_id, None)
                    if future is not None and not future.done():
                        future.set_result(pickle.loads(message.result))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            if not isinstance(e, EngineDeadError):
                logger.exception("reading from the engine core failed")
            else:
                logger.error("%s; no more requests will be served", e)
            self.error = e
            on_dead(e)
            self.output_processor = OutputProcessor(self.tokenizer)
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(EngineDeadError(f"the engine failed: {e}"))
            self._ready_event.set()  # wake whoever waits for readiness: it will not come

    def _process_outputs(self, message: StepOutputs) -> list[RequestOutput]:
        self.num_waiting, self.num_running = message.num_waiting, message.num_running
        self.kv_cache_usage, self._num_added = message.kv_cache_usage, message.num_added
        processed = self.output_processor.process_outputs(message.outputs)
        if processed.finishes:  # stop strings found here: the core frees their blocks
            self._to_core.send(self._encoder.encode(FinishRequests(processed.finishes)))
        return processed.request_outputs

    # -- requests in and out ---------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                          priority: int = 0) -> None:
        """Send the request to the core; with n > 1, its n children (as vLLM's front end
        does: the core never sees a parent). The priority is checked here, as the prompt
        was: a request the core would refuse is never sent."""
        check_priority(priority, self.config.scheduling_policy)
        if params.n > 1:
            parent = ParentRequest(request_id, params)
            self.output_processor.parents.add(parent)
            children = parent.children()
        else:
            children = [(request_id, params)]
        ids = prompt.prompt_token_ids
        for child_id, child_params in children:
            self.output_processor.add_request(
                child_id, prompt.prompt, ids, params.stop, params.min_tokens, params.logprobs is not None,
                RequestMetrics(arrival_time=0.0, num_prompt_tokens=len(ids)))
            self._to_core.send(self._encoder.encode(
                AddRequest(child_id, list(ids), prompt.prompt, child_params, priority, prompt.cache_salt)))
            self._num_sent += 1

    def abort(self, request_ids: list[str]) -> None:
        if self.error is None and self._task is not None:
            self._to_core.send(self._encoder.encode(Abort(self.output_processor.parents.expand(request_ids))))

    async def get_metrics(self) -> list:
        """The core's metric records, fetched between two of its steps."""
        return await self._utility("get_metrics")

    async def reset_prefix_cache(self) -> bool:
        """The core forgets every cached block no request holds, between two steps."""
        return await self._utility("reset_prefix_cache")

    async def _utility(self, method: str) -> Any:
        """Call ``method`` of the core's engine (no arguments) and wait for its result."""
        await self.wait_ready()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        await self._to_core.send(self._encoder.encode(Utility(call_id, method)))
        return await future


def iteration_timeout_s() -> float:
    """``VLLM_ENGINE_ITERATION_TIMEOUT_S`` (vLLM's name; default 60): a positive number."""
    value = os.environ.get("VLLM_ENGINE_ITERATION_TIMEOUT_S", "60")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValidationError("VLLM_ENGINE_ITERATION_TIMEOUT_S", "VLLM_ENGINE_ITERATION_TIMEOUT_S "
                              f"must be a positive number of seconds, got {value!r}", value)
    return seconds
