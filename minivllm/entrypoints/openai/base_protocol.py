"""What both generation endpoints' bodies share: the strict base model and the sampling fields.

``/v1/completions`` and ``/v1/chat/completions`` take the same sampling fields and differ
only in how the prompt arrives (:mod:`minivllm.entrypoints.openai.completion_protocol`,
:mod:`minivllm.entrypoints.openai.chat_protocol`), so the fields live once, on :class:`SamplingRequest`,
which also turns them into the engine's ``SamplingParams``.

Why every model derives from :class:`APIModel` (strict types, finite numbers): JSON can
get types wrong in ways Python would quietly coerce (``"0.5"`` as a number, ``1`` as a
boolean), so a wrong type or a bad value is a 400 naming the field.

Which fields a request may carry follows vLLM, because the clients people point at a
vLLM-compatible server (guidellm, ``vllm bench serve``, the openai SDK's ``extra_body``)
send vLLM's fields. Each field is one of four kinds:

- implemented: it does what it does in vLLM;
- unsupported (:func:`unsupported`): an OpenAI field asking for an output this server
  cannot give (``echo``, tools, ``best_of``): accepted only with the value that asks for
  nothing, refused otherwise, as the answer would not be what the client asked for;
- ignored (:func:`ignored`): a vLLM field this server does not act on (beam search,
  chat-template overrides, disaggregation parameters, ...): accepted with any value of
  the right type, and when the value asks for something, named in a warning log line
  and in the ``x-minivllm-ignored-fields`` response header;
- unknown (in neither API): accepted and named the same way, as vLLM accepts extra
  fields and logs their names. The one exception is a field vLLM removed or a field
  sent in the wrong place (:data:`REMOVED_FIELDS`), refused with what to send instead,
  as ignoring it would return unconstrained output.

In vLLM: ``OpenAIBaseModel`` and the shared request fields of
``vllm/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.exceptions import ValidationError
from minivllm.sample.structured_output import StructuredOutputsParams
from minivllm.sampling_params import MAX_N, MAX_STOP_STRINGS, SEED_MAX, SEED_MIN, SamplingParams


class APIModel(BaseModel):
    """Strict types, finite numbers, and no unknown keys: used for the nested objects
    whose keys change what the output is (a constraint spec, a message), where a typo
    must not pass unnoticed."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class OpenAIModel(APIModel):
    """A request body, or an object in it, that takes unknown keys as vLLM does (kept in
    ``model_extra``, reported by :meth:`SamplingRequest.ignored_fields`)."""
    model_config = ConfigDict(extra="allow")

IGNORED_FIELDS_HEADER = "x-minivllm-ignored-fields"
"""The response header naming the request's fields this server accepted but did not act
on (comma-separated), as vLLM's "fields were present in the request but ignored" log."""


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


def ignored(noop: Any = None) -> Any:
    """A vLLM field this server accepts but does not act on: ``noop`` (or null) asks for
    nothing; any other value is reported as ignored."""
    return Field(None if noop is None else noop,
                 description=f"vLLM's field; accepted but ignored by this server (it acts "
                             f"as if {'null' if noop is None else repr(noop)} was sent).",
                 json_schema_extra={"x-ignored": noop})


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    """A last chunk (``choices: []``) carrying the request's ``usage``."""
    continuous_usage_stats: bool | None = False
    """vLLM's extension: with ``include_usage``, every chunk also carries ``usage`` so far
    (that choice's ``completion_tokens``), as vLLM sends it."""


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
    that follows a schema (structured output, ``minivllm.sample.structured_output``)."""

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

MISPLACED_FIELDS = {
    "disable_any_whitespace": '"structured_outputs": {"disable_any_whitespace": true}',
}
"""Fields that exist only inside an object, sent at the top level: refused too."""


class SamplingRequest(OpenAIModel):
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
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    """vLLM's extension: add each choice's generated ``token_ids`` to the response."""
    user: str | None = None
    """An end-user id for the caller's own records; it changes nothing in the output."""
    priority: int = 0
    """vLLM's extension: lower runs first when the server runs with
    ``--scheduling-policy priority``; anything but 0 is refused (400) otherwise."""
    cache_salt: bounded(str, minLength=1) = None
    """vLLM's extension: mixed into the prompt's first prefix-cache hash, so only
    requests with the same salt share cached blocks (and time to first token tells no one
    what another user sent)."""

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

    # vLLM's fields that this server accepts but does not act on (see the module's docstring).
    use_beam_search: bool = ignored(False)
    length_penalty: float = ignored(1.0)
    """Beam search's; it changes nothing without beam search either."""
    watermarking: bool | None = ignored(False)
    include_stop_str_in_output: bool = ignored(False)
    skip_special_tokens: bool = ignored(True)
    """This server always skips special tokens when it detokenizes."""
    spaces_between_special_tokens: bool = ignored(True)
    add_special_tokens: bool = ignored(False)
    """This server never adds special tokens (a BOS) to a prompt."""
    truncate_prompt_tokens: int | None = ignored()
    truncation_side: Literal["left", "right"] | None = ignored()
    allowed_token_ids: list[int] | None = ignored()
    bad_words: list[str] = ignored([])
    prompt_logprobs: int | None = ignored()
    logprob_token_ids: list[int] | None = ignored()
    return_tokens_as_token_ids: bool | None = ignored(False)
    return_token_offsets: bool | None = ignored(False)
    return_mm_kwargs: bool = ignored(True)
    routed_experts_prompt_start: int = ignored(0)
    request_id: str | None = ignored()
    """vLLM names the request with it; here every request gets a fresh id."""
    session_id: str | None = ignored()
    kv_transfer_params: dict[str, Any] | None = ignored()
    ec_transfer_params: dict[str, Any] | None = ignored()
    vllm_xargs: dict[str, Any] | None = ignored()
    repetition_detection: dict[str, Any] | None = ignored()
    thinking_token_budget: int | None = ignored()
    stream_interval: int | None = ignored()
    """vLLM batches this many tokens into a chunk; here every step's tokens go at once."""

    def ignored_fields(self) -> list[str]:
        """The fields this request carries that the server will not act on: vLLM's
        fields set to something other than their no-op, and unknown fields (vLLM's
        rule: accepted, and their names logged)."""
        names = []
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and "x-ignored" in extra:
                value = getattr(self, name)
                if value is not None and not _same(value, extra["x-ignored"]):
                    names.append(name)
        names += sorted(self.model_extra or {})
        if self.stream_options is not None:
            names += [f"stream_options.{k}" for k in sorted(self.stream_options.model_extra or {})]
        return names

    def ignored_fields_header(self) -> dict[str, str]:
        """The response header naming :meth:`ignored_fields` (``{}`` when there are none).
        A field's name is any JSON string: each is escaped to printable ASCII, as a header
        must be (a raw "\\r\\n" would start a header of the client's choosing), and the
        list is cut at 1,000 characters."""
        value = ",".join(name.encode("unicode_escape").decode("ascii") for name in self.ignored_fields())
        if len(value) > 1000:
            value = value[:997] + "..."
        return {IGNORED_FIELDS_HEADER: value} if value else {}

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
        for name in self.model_extra or {}:
            if name in REMOVED_FIELDS:
                raise ValidationError(name, f"{name}: removed from vLLM's API in v0.12 (vLLM ignores "
                                      f"it now, so the output would come back unconstrained); send "
                                      f"{REMOVED_FIELDS[name]}", None)
            if name in MISPLACED_FIELDS:
                raise ValidationError(name, f"{name}: unknown field at the top level of the body; "
                                      f"send {MISPLACED_FIELDS[name]}", None)

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


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "abort"]
"""Why a choice ended: a stop condition, ``max_tokens``, or the request was aborted."""
