"""The bodies of ``/v1/chat/completions``: messages in, an assistant message out.

A chat request is the shared sampling fields (:class:`~minivllm.entrypoints.openai.base_protocol.SamplingRequest`)
plus ``messages``, which the server renders with the model's chat template
(:mod:`minivllm.entrypoints.chat_utils`, which also checks them, as ``LLM.chat`` does). Logprobs are
asked for OpenAI's chat way: ``logprobs: true`` and a number of ``top_logprobs``; the
tool-calling fields are refused unless they ask for nothing.

In vLLM (0.34): ``vllm/entrypoints/openai/chat_completion/protocol.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, WithJsonSchema

from minivllm.entrypoints.chat_utils import ROLES
from minivllm.entrypoints.openai.base_protocol import (
    APIModel,
    FinishReason,
    SamplingRequest,
    Usage,
    bounded,
    ignored,
    unsupported,
)
from minivllm.exceptions import ValidationError, check_int
from minivllm.sampling_params import MAX_LOGPROBS

_TEXT_PART = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}


class ChatMessage(APIModel):
    """Checked by ``minivllm.entrypoints.chat_utils`` (the same checks as ``LLM.chat``); the schema
    says what it accepts."""

    role: Annotated[str, WithJsonSchema({"enum": list(ROLES)})]
    content: Annotated[Any, WithJsonSchema(
        {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]})]


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(json_schema_extra={"minItems": 1})]
    max_completion_tokens: bounded(int, minimum=1) = None
    """The newer OpenAI name for max_tokens."""
    logprobs: bool | None = None
    """OpenAI's: each generated token's logprob in ``choices[i].logprobs.content``."""
    top_logprobs: bounded(int, minimum=0, maximum=MAX_LOGPROBS) = None
    """OpenAI's: with ``logprobs``, also the ``top_logprobs`` most likely tokens per position."""
    tools: Any = unsupported([])
    tool_choice: Any = unsupported("none")
    parallel_tool_calls: Any = unsupported()
    functions: Any = unsupported([])
    function_call: Any = unsupported("none")

    # vLLM's chat fields that this server accepts but does not act on.
    echo: bool = ignored(False)
    add_generation_prompt: bool = ignored(True)
    """This server always ends the rendered chat with the assistant's turn opening."""
    continue_final_message: bool = ignored(False)
    documents: list[dict[str, str]] | None = ignored()
    chat_template: str | None = ignored()
    """This server always renders with the model's own chat template."""
    chat_template_kwargs: dict[str, Any] | None = ignored()
    media_io_kwargs: dict[str, Any] | None = ignored()
    mm_processor_kwargs: dict[str, Any] | None = ignored()
    reasoning_effort: str | None = ignored()
    include_reasoning: bool = ignored(True)
    return_prompt_text: bool | None = ignored(False)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing (vLLM's default)
            raise ValidationError("top_logprobs", "top_logprobs needs logprobs: true",
                                  self.top_logprobs)
        # Checked here too, so that an error names the field the client sent.
        top = check_int("top_logprobs", self.top_logprobs, minimum=0, maximum=MAX_LOGPROBS,
                        optional=True)
        return (top or 0) if self.logprobs else None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    """The UTF-8 bytes of ``token`` (a piece of a multi-byte character is U+FFFD's)."""


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]
    """The ``top_logprobs`` most likely tokens at this position, most likely first."""


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
