"""SamplingParams: how one request chooses its next token and when it stops.

A faithful subset of ``vllm.SamplingParams``. Everything is checked at construction,
completely: exact types (``True`` is not a count, ``1.5`` is not a ``top_k``, a float is
not a seed), finite numbers, ranges. A bad value raises
:class:`~minivllm.exceptions.ValidationError` (a ``ValueError``; ``ValidationTypeError``,
also a ``TypeError``, for a wrong type) whose ``param`` names the field and whose
message gives the value and what is allowed. So a bad request never reaches the engine,
where it would fail inside a step that other requests share.

The limits live here and nowhere else: the HTTP server publishes them in its OpenAPI
schema (``minivllm.entrypoints.openai.protocol``) but leaves the checking to this class.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from minivllm.config import SEED_MAX, SEED_MIN
from minivllm.exceptions import (
    ValidationError,
    ValidationTypeError,
    check_bool,
    check_float,
    check_int,
)
from minivllm.sample.structured_output import StructuredOutputsParams

SAMPLING_EPS = 1e-5
"""A temperature below this is greedy (vLLM's ``_SAMPLING_EPS``): dividing logits by
1e-40 would overflow float32, and the distribution is a point mass long before that."""
MAX_STOP_STRINGS = 16
"""At most this many stop strings; each is searched in the new text of every token."""
MAX_N = 16
"""At most this many completions per prompt (``n``): each is a request of its own, with
its own KV blocks past the shared prompt, so ``n`` multiplies the work and the memory."""
MAX_LOGPROBS = 20
"""The largest ``logprobs`` and ``prompt_logprobs`` (vLLM's default ``max_logprobs``, and
OpenAI's cap on ``top_logprobs``): each costs a ``topk`` that wide per position and that
many entries in every output (``minivllm.sample.logprobs``)."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 (or anything below ``SAMPLING_EPS``) means greedy; higher flattens the distribution."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability mass reaches top_p; in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 turns it off."""
    max_tokens: int | None = 16
    """Stop after this many generated tokens (finish_reason "length"). None: up to max_model_len."""
    min_tokens: int = 0
    """EOS, stop tokens and stop strings are ignored until this many tokens exist."""
    stop: str | list[str] | None = None
    """Stop when the text contains one of these; the text is cut before it."""
    stop_token_ids: list[int] | None = None
    """Stop when one of these token ids is generated (it stays in token_ids)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks use this)."""
    seed: int | None = None
    """Per-request random seed: same seed, same output, whatever else is in the batch."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated; in [-2, 2]
    (OpenAI's). Positive values push the model towards new tokens."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was already generated; in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Tokens already seen in the prompt *or* the output have their logit divided by this
    when positive, multiplied when negative (so > 1 always makes them less likely); > 0,
    1 is off (the CTRL paper's penalty, as in transformers)."""
    min_p: float = 0.0
    """Drop tokens whose probability (after temperature) is below min_p times the most
    likely token's; in [0, 1], 0 is off. Random sampling only: greedy is unchanged."""
    logit_bias: dict[int, float] | None = None
    """token id -> a number in [-100, 100] added to that token's logit before anything else
    (OpenAI's); -100 all but bans a token, 100 all but forces it."""
    n: int = 1
    """Completions to generate for the prompt, in [1, ``MAX_N``] (parallel sampling,
    ``minivllm.engine.parallel_sampling``): n child requests that share the prompt's KV blocks.
    With a ``seed``, child ``i`` samples with ``seed + i`` (as vLLM does)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Structured output: a JSON schema, regex, choice list or grammar the output must
    match, enforced by masking the logits (``minivllm.sample.structured_output``)."""
    logprobs: int | None = None
    """Per generated token: its log-probability and rank, plus the ``logprobs`` most likely
    tokens at that position; 0 is the chosen token alone, None is off; at most
    ``MAX_LOGPROBS``. The values are those of the model's raw logits (vLLM's default
    ``logprobs_mode="raw_logprobs"``): before logit_bias, penalties and temperature."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first (``RequestOutput.prompt_logprobs``).
    A request that asks does not take prefix-cache hits: its prompt must run through the
    model to give the logits."""

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check (and normalise) every field; raise ValidationError naming the first bad one.

        Run at construction and again by ``LLMEngine.add_request``, so a params object
        changed after it was made is checked before it can reach a step."""
        self.temperature = check_float("temperature", self.temperature, minimum=0)
        self.top_p = check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValidationError("top_p", f"top_p must be in (0, 1], got {self.top_p}", self.top_p)
        self.top_k = check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValidationError(
                "top_k", f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        self.max_tokens = check_int("max_tokens", self.max_tokens, minimum=1, optional=True)
        self.min_tokens = check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValidationError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                self.min_tokens)
        self.stop = _check_stop(self.stop)
        self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids)
        self.ignore_eos = check_bool("ignore_eos", self.ignore_eos)
        self.seed = check_int("seed", self.seed, minimum=SEED_MIN, maximum=SEED_MAX, optional=True)
        self.presence_penalty = check_float("presence_penalty", self.presence_penalty,
                                            minimum=-2, maximum=2)
        self.frequency_penalty = check_float("frequency_penalty", self.frequency_penalty,
                                             minimum=-2, maximum=2)
        self.repetition_penalty = check_float("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValidationError(
                "repetition_penalty", f"repetition_penalty must be > 0 (1 is off), got "
                                      f"{self.repetition_penalty}", self.repetition_penalty)
        self.min_p = check_float("min_p", self.min_p, minimum=0, maximum=1)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        self.n = check_int("n", self.n, minimum=1, maximum=MAX_N)
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            raise ValidationError(
                "seed", f"seed {self.seed} with n={self.n}: the children's seeds seed..seed+n-1 "
                        f"must be at most {SEED_MAX}", self.seed)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValidationTypeError(
                    "structured_outputs",
                    f"structured_outputs must be a StructuredOutputsParams, got "
                    f"{type(self.structured_outputs).__name__}", self.structured_outputs)
            self.structured_outputs.verify()
        self.logprobs = check_int("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS,
                                  optional=True)
        self.prompt_logprobs = check_int("prompt_logprobs", self.prompt_logprobs, minimum=0,
                                         maximum=MAX_LOGPROBS, optional=True)

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties is on (the sampler skips them otherwise)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _check_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValidationTypeError(
            "stop", f"stop must be a string or a list of strings, got {type(stop).__name__}", stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise ValidationError(
            "stop", f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", len(stop))
    for s in stop:
        if not isinstance(s, str):
            raise ValidationTypeError(
                "stop", f"stop must be a string or a list of strings, got an element {s!r} "
                        f"({type(s).__name__})", s)
        if not s:
            raise ValidationError("stop", "stop strings must be non-empty", s)
    return list(stop)


def _check_logit_bias(bias: object) -> dict[int, float]:
    """A dict of token id (an int, or a string of one: JSON keys are strings) to a bias in
    [-100, 100]. OpenAI refuses a bias outside that range, and so do we (vLLM clamps it
    silently). Token ids are checked against the vocabulary when the request is added."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValidationTypeError(
            "logit_bias", f"logit_bias must be a dict of token id to bias, got "
                          f"{type(bias).__name__}", bias)
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise ValidationError(
                "logit_bias", f"logit_bias keys must be token ids (integers >= 0, or strings "
                              f"of them), got {key!r}", key)
        out[int(token)] = check_float("logit_bias", value, minimum=-100, maximum=100)
    return out


def _check_token_ids(param: str, ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValidationTypeError(
            param, f"{param} must be a list of integers, got {type(ids).__name__}", ids)
    return [check_int(param, i, minimum=0) for i in ids]
