"""The bodies of ``/v1/completions``: a prompt in, text out (OpenAI's legacy completions).

A completion request is the shared sampling fields (:class:`~minivllm.entrypoints.openai.base_protocol.SamplingRequest`)
plus a prompt, given as text or token ids, alone or as a batch of one (batches of more
are refused: one request, one prompt, as the engine schedules them). Its ``logprobs`` is
a number (how many alternatives per position), unlike chat's boolean.

In vLLM (0.34): ``vllm/entrypoints/openai/completion/protocol.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from minivllm.entrypoints.openai.base_protocol import (
    FinishReason,
    SamplingRequest,
    TokenIds,
    Usage,
    bounded,
    ignored,
    unsupported,
)
from minivllm.exceptions import ValidationError
from minivllm.sampling_params import MAX_LOGPROBS


class CompletionRequest(SamplingRequest):
    prompt: str | TokenIds | Annotated[list[str], Field(json_schema_extra={"maxItems": 1})] | \
        Annotated[list[TokenIds], Field(json_schema_extra={"maxItems": 1})]
    echo: Any = unsupported(False)
    logprobs: bounded(int, minimum=0, maximum=MAX_LOGPROBS) = None
    """OpenAI's (legacy completions): the chosen token's logprob and the ``logprobs`` most
    likely tokens at each position; 0 is the chosen token alone."""
    best_of: Any = unsupported(1)
    suffix: Any = unsupported()
    prompt_embeds: str | list[str] | None = ignored()
    """vLLM's: base64 tensors given instead of a prompt; here ``prompt`` is required."""

    def engine_prompt(self) -> str | dict:
        """The prompt as the engine takes it; a batch of one is unwrapped."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValidationError(
                    "prompt", f"prompt: only one prompt per request is supported, got {len(p)}",
                    len(p))
            p = p[0]
        return p if isinstance(p, str) else {"prompt_token_ids": p}

    def num_logprobs(self) -> int | None:
        return self.logprobs


class CompletionLogprobs(BaseModel):
    """OpenAI's completions logprobs: per generated token its text, its logprob, the most
    likely tokens there (text -> logprob, the chosen token included) and where its text
    starts in the completion. A logprob of -inf is sent as -9999.0 (JSON has no infinity)."""
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
