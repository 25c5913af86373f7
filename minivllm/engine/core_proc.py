"""The engine core in a process of its own, and the messages it exchanges (notebook 10).

An API server does two kinds of work. Network work: parsing HTTP, checking and
tokenizing prompts, detokenizing and writing a JSON event for every streamed token. And
engine work: scheduling, the forward pass, sampling. In one Python process both share
one interpreter lock, so every millisecond of JSON is a millisecond the model waits.
vLLM V1 therefore splits them (``EngineCoreProc``), and so does minivllm:

    API server process                              engine core process
    (AsyncMPEngine: HTTP, tokenize,    AddRequest   (EngineCoreProc: EngineCore =
     chat template, SSE;              ----------->   scheduler, KV cache manager,
     OutputProcessor: detokenize,      Abort,        model runner, the step loop)
     stop strings, logprob dicts)     FinishRequests
                                      ----------->
                                      <-----------
                                       StepOutputs
                                      (new token ids)

Two ZeroMQ sockets, one each way, carry msgpack messages (``msgspec`` encodes the
structs below). What crosses is small: token ids, never text; the step loop reads the
messages that arrived between two steps (adds and aborts), steps, and sends one
``StepOutputs`` per step. It never waits on a client: when it has work it only peeks at
its socket.

Lifecycle. The server starts this process (``minivllm.utils.system_utils``: a fork of a clean
server process that has imported torch, nothing of the server's inherited) and is told
``Ready`` once the model is loaded. The process ignores Ctrl-C
(the server receives it too and shuts the core down in order, with ``Shutdown``), ends
on SIGTERM, and ends by itself when its parent has gone, so it never outlives the
server. A failed step is reported as ``Failed`` before the process exits.

The core never makes text: it runs an :class:`~minivllm.engine.core.EngineCore`, whose
steps give token ids, and trusts the server to have checked every request. Stop strings are text, so the server's ``OutputProcessor`` finds them, and sends
``FinishRequests`` to free the request's blocks (vLLM sends an abort). Until it arrives
the core may run the request one step more; the server drops what that step gave.

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
from minivllm.engine.core import EngineCore
from minivllm.engine.output_processor import EngineCoreOutput, FrontEndFinish
from minivllm.engine.processor import ProcessedPrompt
from minivllm.sampling_params import SamplingParams
from minivllm.utils.system_utils import parent_alive

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
    cache_salt: str | None = None
    """Salts the prompt's prefix-cache hashes (``Request.cache_salt``)."""


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class FinishRequests(msgspec.Struct, tag=True):
    """Requests the server's output processor finished (a stop string, text it could
    not make): the core frees them with the reason the client was given."""
    finishes: list[FrontEndFinish]


class Utility(msgspec.Struct, tag=True):
    """Call an engine method between steps (``get_metrics``, ``reset_prefix_cache``); the
    answer is a UtilityResult."""
    call_id: int
    method: str


class Shutdown(msgspec.Struct, tag=True):
    pass


ToCore = AddRequest | Abort | FinishRequests | Utility | Shutdown
"""Every message the server sends the core."""


# -- core -> server ----------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    """The model is loaded: the numbers the server needs to check prompts itself."""
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool


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

    def __init__(self, engine: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine = engine
        self.inbox, self.outbox = inbox, outbox
        self.decoder = msgspec.msgpack.Decoder(ToCore)
        self.encoder = msgspec.msgpack.Encoder()
        self.num_added = 0

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
                                   ProcessedPrompt(message.prompt_token_ids, message.prompt,
                                                   message.cache_salt),
                                   message.params, priority=message.priority)
            except (ValueError, TypeError) as e:  # the server checked it; say so if it slipped
                self.send(StepOutputs([EngineCoreOutput(message.request_id, [], "error", error=str(e))],
                                      len(engine.scheduler.waiting), len(engine.scheduler.running),
                                      engine.kv_cache_manager.usage, self.num_added))
        elif isinstance(message, Abort):
            live = [i for i in message.request_ids if i in engine.scheduler.requests]
            if live:
                engine.abort_requests(live)
        elif isinstance(message, FinishRequests):
            engine.finish_requests(message.finishes)
        elif isinstance(message, Utility):
            result = getattr(engine, message.method)()
            self.send(UtilityResult(message.call_id, pickle.dumps(result)))
        elif isinstance(message, Shutdown):
            return False
        return True

    def step(self) -> None:
        outputs = self.engine.step()  # EngineCoreOutputs: new token ids, no text
        scheduler = self.engine.scheduler
        self.send(StepOutputs(outputs, len(scheduler.waiting), len(scheduler.running),
                              self.engine.kv_cache_manager.usage, self.num_added))


class Terminated(Exception):
    """SIGTERM reached the engine core (a service manager stops the whole group)."""


def _terminate(signum, frame) -> None:
    raise Terminated


def run_engine_core(config: EngineConfig, inbox_address: str, outbox_address: str,
                    log_level: int) -> None:
    """The engine core process's main function (the target of ``Process``). It ends on
    Shutdown, when the server is gone, or on SIGTERM (as vLLM's does: a service manager
    such as systemd sends it to every process of the service), each time after the engine
    has shut down in order, so a KV connector keeps what should outlive it."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s (engine core): %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the server shuts us down in order
    signal.signal(signal.SIGTERM, _terminate)
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(inbox_address)
    outbox.connect(outbox_address)
    outbox.setsockopt(zmq.LINGER, 2000)  # let the last message (Failed) leave before exit
    encoder = msgspec.msgpack.Encoder()
    core = None
    try:
        core = EngineCoreProc(EngineCore(config), inbox, outbox)
        core.run()
    except Terminated:
        logger.info("SIGTERM: the engine core stops")
    except BaseException as e:
        logger.exception("the engine core failed")
        outbox.send(encoder.encode(Failed(f"{type(e).__name__}: {e}")))
        raise SystemExit(1) from None
    finally:
        if core is not None:
            core.engine.shutdown()
        inbox.close(linger=0)
        outbox.close()
        context.term()
