"""Request: one prompt's journey through the engine, described by counts.

The single idea to carry away (from vLLM V1): a request is not "in prefill" or "in
decode". It has ``num_tokens`` known tokens (prompt plus generated) and
``num_computed_tokens`` of them already have KV in the cache. Each step the scheduler
gives it some of the difference: the whole prompt, a chunk of it, or the one token just
sampled. Prefill, chunked prefill, decode and resume-after-preemption are one code path.
"""

from __future__ import annotations

import enum

from minivllm.metrics import RequestMetrics
from minivllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    """Admitted with blocks allocated, while a KV connector loads some of them in the
    background (an asynchronous load): the request is in no step until they arrive."""
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    """Something that belongs to this request alone failed (its sampling, its
    detokenization); the message is in ``Request.error``. Other requests are unaffected."""

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
     RequestStatus.FINISHED_ERROR)
)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        eos_token_id: int | None = None,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.priority = priority
        """Lower runs first, under the "priority" scheduling policy (ignored under "fcfs")."""
        self.cache_salt = cache_salt
        """Mixed into the first block's prefix-cache hash: only requests with the same salt
        (or none) share cached blocks (vLLM's ``cache_salt``)."""
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        """Tokens being sampled for this request by a step still running, not yet known
        here (async scheduling, ``minivllm.core.async_scheduler``; always 0 without it)."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        """What went wrong, when the request finished with status FINISHED_ERROR."""
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids))
        self.spec_token_ids: list[int] = []
        """Draft tokens proposed to follow ``all_token_ids`` (speculative decoding): not
        part of the request's tokens until the target model accepts them."""
        self.grammar = None
        """Structured output: the request's ``GrammarState`` (``minivllm.sample.structured_output``)
        when its params have ``structured_outputs``, set by the engine when it is added. The
        scheduler advances it over each token the request keeps."""
        self.logprobs: list | None = [] if sampling_params.logprobs is not None else None
        """One ``PositionLogprobs`` (``minivllm.sample.logprobs``) per output token, when the request
        asks for ``logprobs``; None otherwise."""
        self.prompt_logprobs: list | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        """With ``prompt_logprobs``: None for the first prompt token, then one
        ``PositionLogprobs`` per prompt token, filled in as the prompt's chunks run."""
        # Block hashes of this request's full blocks (prefix caching), extended as it grows.
        self.block_hashes: list[bytes] = []
        # No tensors here, not even a seeded request's random generator: the model runner
        # keeps that (ModelRunner.generators), so the scheduler's side imports no torch.

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt positions are still to be scored (``prompt_logprobs``): they need
        their logits, so neither the prefix cache nor a KV connector may skip them."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
