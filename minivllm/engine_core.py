"""The engine core in a process of its own, and the messages it exchanges (notebook 10).

An API server does two kinds of work. Network work: parsing HTTP, checking and
tokenizing prompts, detokenizing and writing a JSON event for every streamed token. And
engine work: scheduling, the forward pass, sampling. In one Python process both share
one interpreter lock, so every millisecond of JSON is a millisecond the model waits.
vLLM V1 therefore splits them (``EngineCoreProc``), and so does minivllm:

    API server process                              engine core process
    (AsyncMPEngine: HTTP, tokenize,    AddRequest   (EngineCoreProc: LLMEngine =
     chat template, detokenize, SSE)  ----------->   scheduler, KV cache manager,
                                         Abort       model runner, the step loop)
                                      ----------->
                                      <-----------
                                       StepOutputs
                                      (new token ids)

Two ZeroMQ sockets, one each way, carry msgpack messages (``msgspec`` encodes the
structs below). What crosses is small: token ids, never text; the step loop reads the
messages that arrived between two steps (adds and aborts), steps, and sends one
``StepOutputs`` per step. It never waits on a client: when it has work it only peeks at
its socket.

Lifecycle. The server starts this process (``minivllm.system_utils``: a fork of a clean
server process that has imported torch, nothing of the server's inherited) and is told
``Ready`` once the model is loaded. The process ignores Ctrl-C
(the server receives it too and shuts the core down in order, with ``Shutdown``), ends
on SIGTERM, and ends by itself when its parent has gone, so it never outlives the
server. A failed step is reported as ``Failed`` before the process exits.

Stop strings are still found here, by the engine's own detokenizer, because they finish
a request and free its blocks; vLLM finds them in the front end and sends an abort.

In vLLM: ``vllm/v1/engine/core.py`` (``EngineCoreProc``) and ``vllm/v1/engine/__init__.py``
(``EngineCoreRequest``, ``EngineCoreOutputs``).
"""

from __future__ import annotations

import logging
import pickle
import signal

import msgspec
import zmq

from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.processor import ProcessedPrompt
from minivllm.sampling_params import SamplingParams
from minivllm.system_utils import parent_alive

logger = logging.getLogger("minivllm")

IDLE_POLL_MS = 500
"""How often an idle core wakes up to check that its parent is still there."""


# -- server -> core ----------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    priority: int = 0
    """Lower runs first (``scheduling_policy="priority"``); the core's scheduler orders by it."""


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Utility(msgspec.Struct, tag=True):
    """Call an engine method between steps (``get_metrics``, ``reset_prefix_cache``); the
    answer is a UtilityResult."""
    call_id: int
    method: str


class Shutdown(msgspec.Struct, tag=True):
    pass


ToCore = AddRequest | Abort | Utility | Shutdown
"""Every message the server sends the core."""


# -- core -> server ----------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    """The model is loaded: the numbers the server needs to check prompts itself."""
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool


class EngineCoreOutput(msgspec.Struct, array_like=True):
    """What one request gained in one step: its new token ids, and how it ended."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[tuple[list[int], list[float], list[int]]] | None = None
    """With ``logprobs``: one compact entry (``minivllm.logprobs.PositionLogprobs``: ids,
    values, ranks; no text) per new token id."""
    prompt_logprobs: list[tuple[list[int], list[float], list[int]] | None] | None = None
    """With ``prompt_logprobs``: every prompt token's entry, sent once, when complete."""


class StepOutputs(msgspec.Struct, tag=True):
    """One step's outputs, and the scheduler as it is after it."""
    outputs: list[EngineCoreOutput]
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    num_added: int
    """Requests received since the core started: the server knows which are on their way."""


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    result: bytes
    """Pickled: metric records are plain dataclasses, and only this process's parent reads them."""


class Failed(msgspec.Struct, tag=True):
    """The core could not start, or a step failed; the process exits after sending it."""
    error: str


FromCore = Ready | StepOutputs | UtilityResult | Failed
"""Every message the core sends the server."""


# -- the process ---------------------------------------------------------------------------
class EngineCoreProc:
    """The busy loop: read what arrived, step, send what came out."""

    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine = engine
        self.inbox, self.outbox = inbox, outbox
        self.decoder = msgspec.msgpack.Decoder(ToCore)
        self.encoder = msgspec.msgpack.Encoder()
        self.num_added = 0
        self.num_sent: dict[str, int] = {}
        """Output tokens already sent, per unfinished request."""
        self.prompt_logprobs_sent: set[str] = set()
        """Unfinished requests whose prompt logprobs have been sent."""
        engine.decode_logprobs = False  # the server decodes the tokens of logprobs

    def send(self, message: FromCore) -> None:
        self.outbox.send(self.encoder.encode(message), copy=False)

    def run(self) -> None:
        engine = self.engine
        config = engine.config
        self.send(Ready(engine.max_model_len, config.max_num_seqs, engine.model.config.vocab_size,
                        config.max_num_batched_tokens, config.enable_chunked_prefill))
        while True:
            busy = engine.has_unfinished_requests()
            # Idle: block (but wake now and then to see if the parent is gone). Busy: peek.
            if not self.inbox.poll(0 if busy else IDLE_POLL_MS):
                if not parent_alive():
                    logger.warning("the server process has gone; the engine core exits")
                    return
                if not busy:
                    continue
            while self.inbox.poll(0):
                if not self.handle(self.decoder.decode(self.inbox.recv())):
                    return
            if engine.has_unfinished_requests():
                self.step()

    def handle(self, message: ToCore) -> bool:
        """Apply one message; False on Shutdown."""
        engine = self.engine
        if isinstance(message, AddRequest):
            self.num_added += 1
            try:
                engine.add_request(message.request_id,
                                   ProcessedPrompt(message.prompt_token_ids, message.prompt),
                                   message.params, priority=message.priority)
                self.num_sent[message.request_id] = 0
            except (ValueError, TypeError) as e:  # the server checked it; say so if it slipped
                self.send(StepOutputs([EngineCoreOutput(message.request_id, [], "error", error=str(e))],
                                      len(engine.scheduler.waiting), len(engine.scheduler.running),
                                      engine.kv_cache_manager.usage, self.num_added))
        elif isinstance(message, Abort):
            live = [i for i in message.request_ids if i in engine.scheduler.requests]
            if live:
                engine.abort_request(live)
        elif isinstance(message, Utility):
            result = getattr(engine, message.method)()
            self.send(UtilityResult(message.call_id, pickle.dumps(result)))
        elif isinstance(message, Shutdown):
            return False
        return True

    def step(self) -> None:
        outputs = []
        for out in self.engine.step():
            c = out.outputs[0]
            sent = self.num_sent.pop(out.request_id, 0)
            if not out.finished:
                self.num_sent[out.request_id] = len(c.token_ids)
            prompt_logprobs = None
            if out.prompt_logprobs is not None and out.request_id not in self.prompt_logprobs_sent:
                prompt_logprobs = [None] + [compact(d) for d in out.prompt_logprobs[1:]]
                self.prompt_logprobs_sent.add(out.request_id)
            if out.finished:
                self.prompt_logprobs_sent.discard(out.request_id)
            outputs.append(EngineCoreOutput(
                out.request_id, c.token_ids[sent:], c.finish_reason, c.stop_reason, c.error,
                out.num_cached_tokens,
                None if c.logprobs is None else [compact(d) for d in c.logprobs[sent:]],
                prompt_logprobs))
        scheduler = self.engine.scheduler
        self.send(StepOutputs(outputs, len(scheduler.waiting), len(scheduler.running),
                              self.engine.kv_cache_manager.usage, self.num_added))


def compact(position: dict) -> tuple[list[int], list[float], list[int]]:
    """One position's ``{token_id: Logprob}`` as ids, values and ranks, to cross as msgpack."""
    return list(position), [p.logprob for p in position.values()], [p.rank for p in position.values()]


def run_engine_core(config: EngineConfig, inbox_address: str, outbox_address: str,
                    log_level: int) -> None:
    """The engine core process's main function (the target of ``Process``)."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s (engine core): %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the server shuts us down in order
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(inbox_address)
    outbox.connect(outbox_address)
    outbox.setsockopt(zmq.LINGER, 2000)  # let the last message (Failed) leave before exit
    encoder = msgspec.msgpack.Encoder()
    try:
        core = EngineCoreProc(LLMEngine(config), inbox, outbox)
        core.run()
    except BaseException as e:
        logger.exception("the engine core failed")
        outbox.send(encoder.encode(Failed(f"{type(e).__name__}: {e}")))
        raise SystemExit(1) from None
    finally:
        inbox.close(linger=0)
        outbox.close()
        context.term()
