"""The one error type for a value that can never be served, naming the field it is about.

Every entry point (``SamplingParams``, ``EngineConfig``/``LLM``, ``LLMEngine.add_request``,
``LLM.chat``) validates completely and at once, and raises :class:`ValidationError`
with ``param`` set to the offending field: the server then answers 400 with that
``param`` in OpenAI's error shape, without guessing the field from the message. A value
of the wrong *type* (``True`` for an int, a float seed, ``stop=[1]``) raises
:class:`ValidationTypeError`, which is both a ``TypeError`` and a ``ValidationError``,
so ``except TypeError`` and ``except ValidationError`` both catch it.

In vLLM: ``vllm/exceptions.py`` (``VLLMValidationError``, a ``ValueError`` with
``parameter`` and ``value``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any


class ValidationError(ValueError):
    """A value outside what is allowed; ``param`` names the field, ``value`` is what came."""

    def __init__(self, param: str | None, message: str, value: Any = None) -> None:
        super().__init__(message)
        self.param = param
        self.value = value


class ValidationTypeError(ValidationError, TypeError):
    """A value of the wrong type for its field."""


# -- checks shared by every entry point ------------------------------------------------------
# ``bool`` is a subclass of ``int`` in Python, so ``isinstance(True, int)`` is True; a flag
# passed where a count is meant is a mistake, and these helpers refuse it.


def check_int(param: str, value: Any, minimum: int | None = None, maximum: int | None = None,
              optional: bool = False) -> int | None:
    """An exact integer (not a bool, not a float, even 2.0) within [minimum, maximum]."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValidationTypeError(
            param, f"{param} must be an integer{' or None' if optional else ''}, "
                   f"got {value!r} ({type(value).__name__})", value)
    value = int(value)
    _check_range(param, value, minimum, maximum)
    return value


def check_float(param: str, value: Any, minimum: float | None = None,
                maximum: float | None = None, optional: bool = False) -> float | None:
    """A finite real number (an int is fine, a bool or a string is not) within bounds."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValidationTypeError(
            param, f"{param} must be a number{' or None' if optional else ''}, "
                   f"got {value!r} ({type(value).__name__})", value)
    value = float(value)
    if not math.isfinite(value):
        raise ValidationError(param, f"{param} must be a finite number, got {value}", value)
    _check_range(param, value, minimum, maximum)
    return value


def check_keys(param: str, value: dict, known: Any, owner: str | None = None) -> None:
    """Refuse a settings dict with keys nobody reads, naming them and the known ones: a
    typo is an error rather than a setting silently left at its default."""
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValidationError(param, f"{owner or param}: unknown keys {unknown}; known: {sorted(known)}",
                              value)


def check_path(param: str, value: Any) -> str:
    """A folder or file name: a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ValidationTypeError(param, f"{param} must be a non-empty path string, got {value!r}", value)
    return value


def check_bool(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValidationTypeError(
            param, f"{param} must be True or False, got {value!r} ({type(value).__name__})", value)
    return value


def _check_range(param: str, value: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and maximum is not None and not minimum <= value <= maximum:
        raise ValidationError(param, f"{param} must be in [{minimum}, {maximum}], got {value}", value)
    if minimum is not None and value < minimum:
        raise ValidationError(param, f"{param} must be >= {minimum}, got {value}", value)
    if maximum is not None and value > maximum:
        raise ValidationError(param, f"{param} must be <= {maximum}, got {value}", value)


class EngineOverloadedError(RuntimeError):
    """Too many requests are queued; the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine's step loop (or its engine core process) failed; it serves nothing
    more (HTTP 500). vLLM: ``vllm/v1/engine/exceptions.py``."""
