"""SamplingParams: how one request chooses its next token and when it stops.

A faithful subset of ``vllm.SamplingParams``. Invalid values raise ``ValueError`` at
construction, naming the value and the limit, so a bad request never reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy (argmax); higher flattens the distribution."""
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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
