"""OutputProcessor: token ids in, ``RequestOutput``\\ s out (notebook 10).

The engine core deals in token ids. What a user reads is made from them here, once per
token: the text (an :class:`~minivllm.engine.detokenizer.IncrementalDetokenizer` per request),
the cut at a stop string, vLLM's logprob dicts, and the gathering of an ``n > 1``
request's children into one output. Every front end uses this one class: the offline
``LLM`` and the thread server (through ``LLMEngine.step``), and the API server whose
engine core runs in another process (``minivllm.engine.core_client``), so the text is the same
everywhere and each token is detokenized once.

A stop string is text, so only this side can see it. When one is completed the output
is cut there and finished with reason "stop", and the core, which would otherwise go
on generating, is told to finish the request too (:class:`FrontEndFinish`). In one
process that happens before the step ends; across processes it arrives before the
core's next step or the one after, and what the core generated meanwhile is dropped
here (vLLM does the same: its output processor aborts the request in the core).

In vLLM: ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``, ``RequestState``)
and ``vllm/v1/engine/detokenizer.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgspec
from transformers import PreTrainedTokenizerBase

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.parallel_sampling import ParentRequests
from minivllm.metrics import RequestMetrics
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sample.logprobs import to_dict

logger = logging.getLogger("minivllm")


class EngineCoreOutput(msgspec.Struct, array_like=True):
    """What one request gained in one step of the engine core: its new token ids, and
    how it ended. Token ids only, never text; the same in one process and across two
    (where msgpack carries it)."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[tuple[list[int], list[float], list[int]]] | None = None
    """With ``logprobs``: one compact entry (``minivllm.sample.logprobs.PositionLogprobs``: ids,
    values, ranks; no text) per new token id."""
    prompt_logprobs: list[tuple[list[int], list[float], list[int]] | None] | None = None
    """With ``prompt_logprobs``: every prompt token's entry (None first), sent once, when
    the whole prompt has run."""


class FrontEndFinish(msgspec.Struct, array_like=True):
    """A request the output processor finished while the core still runs it: a stop
    string was completed (``finish_reason`` "stop", ``stop_reason`` the string), or its
    text could not be made ("error", ``error`` says why). ``num_output_tokens``: the
    tokens kept, the one that completed the stop string the last of them."""
    request_id: str
    finish_reason: str
    num_output_tokens: int
    stop_reason: str | None = None
    error: str | None = None


@dataclass
class RequestState:
    """What the front end keeps of one unfinished request."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    """With ``logprobs``: vLLM's ``{token_id: Logprob}`` dicts so far, one per token."""
    prompt_logprobs: list | None = None


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    """One per request that progressed (a parent's for the children of an ``n > 1`` request)."""
    finishes: list[FrontEndFinish]
    """Requests finished here that the core has not finished: it must be told."""


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        """``tokenizer`` None: no text (token ids only), e.g. under the simulator."""
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parents = ParentRequests()
        """Requests with ``n > 1``: the core sees only their children (``minivllm.engine.parallel_sampling``)."""

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    stop: list[str], min_tokens: int, logprobs: bool, metrics: RequestMetrics) -> None:
        """Start the state of one request (one child of an ``n > 1`` request)."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, stop, min_tokens)
        self.request_states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, detokenizer, metrics, logprobs=[] if logprobs else None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """Text, stop strings and logprobs for one step's outputs. Outputs of requests
        this side has already finished (or never knew) are dropped."""
        request_outputs, finishes = [], []
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            completion, new_text, finish = self._update(state, out)
            if finish is not None:
                finishes.append(finish)
            if completion.finish_reason is not None:
                del self.request_states[out.request_id]
            state.metrics.num_cached_tokens = out.num_cached_tokens
            request_outputs.append(RequestOutput(
                out.request_id, state.prompt, state.prompt_token_ids, [completion],
                completion.finish_reason is not None, state.metrics, out.num_cached_tokens,
                new_text, state.prompt_logprobs))
        return OutputProcessorOutput(self.parents.gather(request_outputs), finishes)

    def _update(self, state: RequestState, out: EngineCoreOutput
                ) -> tuple[CompletionOutput, str, FrontEndFinish | None]:
        """Detokenize the new ids and check stop strings: the request's completion now,
        the text it adds for a stream, and what the core must be told.

        Several ids arrive at once with speculative decoding: a stop string completed by
        one of them drops those after it, so the output is exactly what one token per
        step would have given."""
        finish_reason, stop_reason, error = out.finish_reason, out.stop_reason, out.error
        # Ended by the core (EOS, a stop token id, its grammar, max_tokens reached by a
        # token that completes no stop string...): the last token has nothing to decide
        # unless the core stopped for length, where a stop string still wins, as in vLLM.
        stop_terminated = finish_reason is not None and finish_reason != "length"
        new = out.new_token_ids
        finish = None
        try:
            for i, token in enumerate(new):
                stop = state.detokenizer.update(token, stop_terminated and i == len(new) - 1)
                if stop is not None:
                    new = new[:i + 1]
                    if finish_reason is None:
                        finish = FrontEndFinish(out.request_id, "stop", len(state.token_ids) + len(new), stop)
                    finish_reason, stop_reason = "stop", stop
                    break
        except Exception as e:  # this request's text alone: finish it, not the step
            error = f"detokenization failed: {type(e).__name__}: {e}"
            logger.warning("request %s failed: %s", out.request_id, error)
            if finish_reason is None:
                finish = FrontEndFinish(out.request_id, "error", len(state.token_ids) + len(new), error=error)
            finish_reason = "error"
        state.token_ids.extend(new)
        cumulative = None
        if state.logprobs is not None:
            state.logprobs.extend(to_dict(p, self.tokenizer) for p in (out.new_logprobs or [])[:len(new)])
            cumulative = sum(next(iter(d.values())).logprob for d in state.logprobs)
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = [None if p is None else to_dict(p, self.tokenizer)
                                     for p in out.prompt_logprobs]
        text, new_text = state.detokenizer.get_next_output_text(finish_reason is not None)
        return CompletionOutput(
            0, text, list(state.token_ids), finish_reason, stop_reason, error,
            None if state.logprobs is None else list(state.logprobs), cumulative), new_text, finish
