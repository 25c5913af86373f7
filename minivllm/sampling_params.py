"""SamplingParams: how one request chooses its next token and when it stops.

A faithful subset of ``vllm.SamplingParams``. Everything is checked at construction,
completely: exact types (``True`` is not a count, ``1.5`` is not a ``top_k``, a float is
not a seed), finite numbers, ranges. A bad value raises
:class:`~minivllm.exceptions.ValidationError` (a ``ValueError``; ``ValidationTypeError``,
also a ``TypeError``, for a wrong type) whose ``param`` names the field and whose
message gives the value and what is allowed. So a bad request never reaches the engine,
where it would fail inside a step that other requests share.

The limits live here and nowhere else: the HTTP server publishes them in its OpenAPI
schema (``minivllm.protocol``) but leaves the checking to this class.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.exceptions import (
    ValidationError,
    ValidationTypeError,
    check_bool,
    check_float,
    check_int,
)

SAMPLING_EPS = 1e-5
"""A temperature below this is greedy (vLLM's ``_SAMPLING_EPS``): dividing logits by
1e-40 would overflow float32, and the distribution is a point mass long before that."""
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""Seeds are signed 64-bit integers, as in OpenAI's API (torch accepts this range)."""
MAX_STOP_STRINGS = 16
"""At most this many stop strings; each is searched in the new text of every token."""


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


def _check_token_ids(param: str, ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValidationTypeError(
            param, f"{param} must be a list of integers, got {type(ids).__name__}", ids)
    return [check_int(param, i, minimum=0) for i in ids]
