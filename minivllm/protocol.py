"""The bodies of the OpenAI-compatible API, as pydantic models (and so as its OpenAPI schema).

What this layer checks is what JSON can get wrong: the shape of the body and the *type*
of each field, exactly (no coercion: ``"0.5"`` is not a number, ``1.0`` is not an integer,
``1`` is not a boolean) and finite (``NaN`` and ``Infinity`` are refused). Unknown fields
are refused with a 400 naming them, and so are the OpenAI fields this server does not
implement (tools, ``best_of``, ``suffix``, ``echo``): a field that is accepted and silently ignored would change what a
client gets without telling it. Each unsupported field is accepted only with the value
that asks for nothing (``echo: false``, ``best_of: 1``, ...), which some clients send.

Value *ranges* (temperature >= 0, top_p in (0, 1], ...) are published in the schema, from
the constants in ``minivllm.sampling_params``, but checked by ``SamplingParams`` alone, so
a value the offline API refuses is refused over HTTP with the same message and ``param``.
Chat messages are checked the same way by ``minivllm.chat_utils``.

Errors have one shape, OpenAI's ``{"error": {"message", "type", "param", "code"}}``
(:class:`ErrorResponse`): the server raises an :class:`APIError` wherever it refuses
something, and the app answers it in that shape.

In vLLM (0.34): ``protocol.py`` beside each endpoint's serving code, e.g.
``vllm/entrypoints/openai/chat_completion/protocol.py``.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from minivllm.chat_utils import ROLES
from minivllm.exceptions import ValidationError, check_int
from minivllm.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRINGS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)
from minivllm.structured_output import StructuredOutputsParams

logger = logging.getLogger("minivllm")


class APIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def bounded(kind: type, **schema: Any) -> Any:
    """``kind | None`` whose schema carries bounds that ``SamplingParams`` enforces."""
    return Annotated[kind, Field(json_schema_extra=schema)] | None


TokenIds = list[Annotated[int, Field(json_schema_extra={"minimum": 0})]]


class UnsupportedField(ValueError):
    """A field this server does not implement, set to something other than its no-op."""

    def __init__(self, field: str, value: Any, noop: Any) -> None:
        super().__init__(f"{field} is not supported by this server (got {value!r}); leave it out"
                         + (f" or send {noop!r}" if noop is not None else ""))
        self.field = field


def unsupported(noop: Any = None) -> Any:
    """A field accepted only with the value that asks for nothing (``noop``, or null)."""
    allowed = "null" if noop is None else f"null or {noop!r}"
    return Field(None, description=f"Not supported by this server: refused unless {allowed}.",
                 json_schema_extra={"x-noop": noop})


class StreamOptions(APIModel):
    include_usage: bool = False


class JSONSchemaFormat(APIModel):
    """OpenAI's ``response_format.json_schema``."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """The JSON schema the output follows; left out, any JSON object."""
    strict: bool | None = None
    """OpenAI's opt-in to exact schema following; here the schema is always enforced
    (by masking the logits), so true, false and null all mean the same."""


class ResponseFormat(APIModel):
    """OpenAI's ``response_format``: plain text (the default), any JSON object, or JSON
    that follows a schema (structured output, ``minivllm.structured_output``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    """Required with type "json_schema", refused with the others."""


class StructuredOutputs(APIModel):
    """vLLM's ``structured_outputs`` request field (``StructuredOutputsParams`` in vLLM):
    exactly one of json, regex, choice, grammar and json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    """The output is JSON that follows this schema (``json`` in the request)."""
    regex: str | None = None
    """The output matches this regular expression."""
    choice: Annotated[list[str], Field(json_schema_extra={"minItems": 1})] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """The output matches this EBNF grammar (xgrammar's dialect)."""
    json_object: bool | None = None
    """True: the output is any JSON object."""
    disable_any_whitespace: bool = False
    """JSON only: no whitespace between tokens (by default any amount is allowed)."""


REMOVED_FIELDS = {
    "guided_json": '"structured_outputs": {"json": ...}',
    "guided_regex": '"structured_outputs": {"regex": ...}',
    "guided_choice": '"structured_outputs": {"choice": [...]}',
    "guided_grammar": '"structured_outputs": {"grammar": ...}',
    "guided_decoding_backend": "nothing (xgrammar is the only backend)",
    "guided_whitespace_pattern": ('nothing that sets a pattern here; "structured_outputs": '
                                  '{"disable_any_whitespace": true} allows no whitespace'),
}
"""Structured-output fields vLLM removed in v0.12 (it now ignores them, and the output
comes back unconstrained); here they are refused with what to send instead."""


class SamplingRequest(APIModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    max_tokens: bounded(int, minimum=1) = None
    temperature: bounded(float, minimum=0) = None
    top_p: bounded(float, exclusiveMinimum=0, maximum=1) = None
    top_k: bounded(int, minimum=-1) = None
    min_tokens: bounded(int, minimum=0) = None
    seed: bounded(int, minimum=SEED_MIN, maximum=SEED_MAX) = None
    stop: (Annotated[str, Field(json_schema_extra={"minLength": 1})]
           | Annotated[list[Annotated[str, Field(json_schema_extra={"minLength": 1})]],
                       Field(json_schema_extra={"maxItems": MAX_STOP_STRINGS})]
           | None) = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(json_schema_extra={"minimum": 1, "maximum": MAX_N})] = 1
    """Completions per prompt (parallel sampling): n choices, ``index`` 0..n-1."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    """vLLM's extension: add each choice's generated ``token_ids`` to the response."""
    user: str | None = None
    """An end-user id for the caller's own records; it changes nothing in the output."""
    priority: int = 0
    """vLLM's extension: lower runs first when the server runs with
    ``--scheduling-policy priority``; anything but 0 is refused (400) otherwise."""

    presence_penalty: bounded(float, minimum=-2, maximum=2) = None
    frequency_penalty: bounded(float, minimum=-2, maximum=2) = None
    repetition_penalty: bounded(float, exclusiveMinimum=0) = None
    """vLLM's extension (not OpenAI's): 1 is off."""
    min_p: bounded(float, minimum=0, maximum=1) = None
    """vLLM's extension (not OpenAI's): 0 is off."""
    logit_bias: Annotated[dict[str, float], Field(json_schema_extra={
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})] | None = None
    """OpenAI's: token id (a string, as JSON keys are) -> bias added to its logit."""
    response_format: ResponseFormat | None = None
    """Structured output (OpenAI's): ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "json_schema": {"name": ..., "schema": {...}}}``."""
    structured_outputs: StructuredOutputs | None = None
    """Structured output (vLLM's extension): ``{"json": schema}``, ``{"regex": ...}``,
    ``{"choice": [...]}``, ``{"grammar": ...}`` or ``{"json_object": true}``. Not
    together with a JSON ``response_format``."""

    def check_supported(self) -> None:
        """Raise :class:`UnsupportedField` for the first field asking for something
        this server does not do."""
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and "x-noop" in extra:
                value = getattr(self, name)
                if value is not None and not _same(value, extra["x-noop"]):
                    raise UnsupportedField(name, value, extra["x-noop"])
        if self.stream_options is not None and not self.stream:
            raise UnsupportedField("stream_options", self.stream_options.model_dump(), None)

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """The request's SamplingParams; SamplingParams checks every value."""
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or 0,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias=self.logit_bias,
            n=self.n,
            structured_outputs=self.structured_output_params(),
            logprobs=self.num_logprobs(),
        )

    def num_logprobs(self) -> int | None:
        """``SamplingParams.logprobs`` from this endpoint's fields (each names them its way)."""
        return None

    def structured_output_params(self) -> StructuredOutputsParams | None:
        """The structured output the request asks for, from ``response_format`` or
        ``structured_outputs`` (not both). A bad schema, regex or grammar is a
        ValidationError naming the field."""
        json_format = self.response_format is not None and not (
            self.response_format.type == "text" and self.response_format.json_schema is None)
        if json_format and self.structured_outputs is not None:
            raise ValidationError("structured_outputs", "structured_outputs: give either it or a "
                                  "JSON response_format, not both (each asks for structured output)", None)
        if json_format:
            field, kwargs = "response_format", self._response_format_kwargs()
        elif self.structured_outputs is not None:
            field, kwargs = "structured_outputs", self.structured_outputs.model_dump(by_alias=True)
        else:
            return None
        try:
            return StructuredOutputsParams(**kwargs)
        except ValidationError as e:
            message = re.sub(r"^structured_outputs(\.\w+)?", field, str(e)) if field == "response_format" else str(e)
            raise ValidationError(field, message, e.value) from None

    def _response_format_kwargs(self) -> dict:
        fmt = self.response_format
        if (fmt.type == "json_schema") != (fmt.json_schema is not None):
            raise ValidationError(
                "response_format", "response_format: json_schema is required with type "
                                   "'json_schema' and refused with any other type", fmt.type)
        if fmt.type == "json_object" or fmt.json_schema.schema_ is None:
            return {"json_object": True}
        return {"json": fmt.json_schema.schema_}


def _same(value: Any, noop: Any) -> bool:
    # bool is an int in Python: False == 0, but false is not the number 0 in JSON.
    return type(value) is type(noop) and value == noop or (
        isinstance(noop, (int, float)) and not isinstance(noop, bool)
        and type(value) in (int, float) and value == noop)


class CompletionRequest(SamplingRequest):
    prompt: str | TokenIds | Annotated[list[str], Field(json_schema_extra={"maxItems": 1})] | \
        Annotated[list[TokenIds], Field(json_schema_extra={"maxItems": 1})]
    echo: Any = unsupported(False)
    logprobs: bounded(int, minimum=0, maximum=MAX_LOGPROBS) = None
    """OpenAI's (legacy completions): the chosen token's logprob and the ``logprobs`` most
    likely tokens at each position; 0 is the chosen token alone."""
    best_of: Any = unsupported(1)
    suffix: Any = unsupported()

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


_TEXT_PART = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}


class ChatMessage(APIModel):
    """Checked by ``minivllm.chat_utils`` (the same checks as ``LLM.chat``); the schema
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

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValidationError("top_logprobs", "top_logprobs needs logprobs: true",
                                  self.top_logprobs)
        # Checked here too, so that an error names the field the client sent.
        top = check_int("top_logprobs", self.top_logprobs, minimum=0, maximum=MAX_LOGPROBS,
                        optional=True)
        return (top or 0) if self.logprobs else None


# -- responses (for the schema, and for clients reading it) ----------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """A refusal with its HTTP status, answered as an :class:`ErrorResponse`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def as_dict(self) -> dict:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.as_dict()}, status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def invalid_request(e: Exception, prompt_field: str = "prompt") -> APIError:
    """A 400 for a validation error, ``param`` from the error itself. Problems with the
    prompt are reported against the field that carried it (``messages`` for chat)."""
    if isinstance(e, UnsupportedField):
        return bad_request(str(e), e.field)
    param = getattr(e, "param", None)
    message = str(e)
    if not isinstance(e, ValidationError):  # every check raises ValidationError; say so if not
        logger.warning("a validation error without a field: %r", e)
    if param == "prompt":
        param = prompt_field
        if not message.startswith(prompt_field):
            message = f"{prompt_field}: {message}"
    return bad_request(message, param)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "abort"]


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]
    num_requests_running: int
    num_requests_waiting: int
