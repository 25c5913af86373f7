"""The bodies of the OpenAI-compatible API, as pydantic models (and so as its OpenAPI schema).

What this layer checks is what JSON can get wrong: the shape of the body and the *type*
of each field, exactly (no coercion: ``"0.5"`` is not a number, ``1.0`` is not an integer,
``1`` is not a boolean) and finite (``NaN`` and ``Infinity`` are refused). Which fields
are accepted follows vLLM (:mod:`~minivllm.entrypoints.openai.base_protocol` says how): the OpenAI fields
this server cannot honour (tools, ``best_of``, ``suffix``, ``echo``) are refused unless
they ask for nothing; vLLM's fields it does not act on, and unknown fields, are accepted
and named in a warning and in the ``x-minivllm-ignored-fields`` response header, so
that a client built for vLLM (guidellm, ``vllm bench serve``) works unchanged and still
learns what was not done.

Value *ranges* (temperature >= 0, top_p in (0, 1], ...) are published in the schema, from
the constants in ``minivllm.sampling_params``, but checked by ``SamplingParams`` alone, so
a value the offline API refuses is refused over HTTP with the same message and ``param``.
Chat messages are checked the same way by ``minivllm.entrypoints.chat_utils``.

Errors have one shape, OpenAI's ``{"error": {"message", "type", "param", "code"}}``
(:class:`ErrorResponse`): the server raises an :class:`APIError` wherever it refuses
something, and the app answers it in that shape.

The bodies live one concept to a module, as in vLLM: the strict base model and the
fields both endpoints share in :mod:`~minivllm.entrypoints.openai.base_protocol`, each
endpoint's request and response in :mod:`~minivllm.entrypoints.openai.completion_protocol`
and :mod:`~minivllm.entrypoints.openai.chat_protocol`; the error shape and the small
bodies (models, health) here. Import each name from the module that defines it.

In vLLM (0.34): ``protocol.py`` beside each endpoint's serving code, e.g.
``vllm/entrypoints/openai/chat_completion/protocol.py``.
"""

from __future__ import annotations

import logging
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from minivllm.entrypoints.openai.base_protocol import UnsupportedField
from minivllm.exceptions import ValidationError

logger = logging.getLogger("minivllm")


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
