"""What the engine hands back: ``RequestOutput`` holding one ``CompletionOutput``.

Shaped like vLLM's, so ``outs[0].outputs[0].text`` works the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.metrics import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """None while running; then "stop", "length", "abort" or "error"."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it (None for EOS or length)."""
    error: str | None = None
    """With finish_reason "error": what failed (for this request only; others ran on)."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    new_text: str = ""
    """Text added since the previous output of this request (for streaming)."""
