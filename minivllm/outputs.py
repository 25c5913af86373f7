"""What the engine hands back: ``RequestOutput`` holding one ``CompletionOutput``.

Shaped like vLLM's, so ``outs[0].outputs[0].text`` works the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.metrics import RequestMetrics
from minivllm.sample.logprobs import Logprob

SampleLogprobs = list[dict[int, Logprob]]
"""One ``{token_id: Logprob}`` per generated token: the chosen token and the top-k."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""The same per prompt token, None for the first (nothing predicts it)."""


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
    logprobs: SampleLogprobs | None = None
    """With ``SamplingParams.logprobs``: one dict per token of ``token_ids``; else None."""
    cumulative_logprob: float | None = None
    """With ``logprobs``: the sum of the chosen tokens' logprobs (the log-probability of
    the whole output under the model's raw distribution); else None."""

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
    prompt_logprobs: PromptLogprobs | None = None
    """With ``SamplingParams.prompt_logprobs``: one entry per prompt token (None first);
    complete once the prompt has run, else None."""
