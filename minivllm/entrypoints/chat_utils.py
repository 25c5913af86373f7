"""Chat messages in, prompt token ids out: validation and the model's chat template.

Both the offline ``LLM.chat`` and the HTTP server's ``/v1/chat/completions`` come
through here, so both accept the same messages and refuse the same mistakes with a
:class:`~minivllm.exceptions.ValidationError` whose ``param`` is ``"messages"`` and whose
message says which message and what is wrong. A message is ``{"role", "content"}``;
``content`` is a string or OpenAI's list of content parts. This model reads text only, so
only text parts (``{"type": "text", "text": "..."}``) are accepted, joined with newlines as
vLLM does; an image part is refused, not dropped (the model would otherwise answer a
message it never saw).

In vLLM (0.34): ``vllm/renderers/chat_utils/`` (``parse_chat_messages``; the chat
template in ``chat_template.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from minivllm.exceptions import ValidationError, ValidationTypeError

ROLES = ("system", "user", "assistant")


def parse_chat_messages(messages: Any) -> list[dict[str, str]]:
    """Validate a conversation and flatten each message to ``{"role", "content": str}``."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise ValidationTypeError(
            "messages", f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                        f"{type(messages).__name__}", messages)
    if not messages:
        raise ValidationError("messages", "messages: at least one message is needed", messages)
    return [_parse_message(i, m) for i, m in enumerate(messages)]


def _parse_message(i: int, message: Any) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ValidationTypeError(
            "messages", f"{where} must be a dict with 'role' and 'content', got "
                        f"{type(message).__name__}", message)
    unknown = sorted(set(message) - {"role", "content"})
    if unknown:
        raise ValidationError(
            "messages", f"{where}: the field(s) {unknown} are not supported; a message has "
                        f"'role' and 'content'", unknown)
    for key in ("role", "content"):
        if message.get(key) is None:
            raise ValidationError("messages", f"{where} has no '{key}'", message)
    role = message["role"]
    if role not in ROLES:
        raise ValidationError(
            "messages", f"{where}.role must be one of {ROLES}, got {role!r}", role)
    return {"role": role, "content": _parse_content(where, message["content"])}


def _parse_content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (bytes, dict)) or not isinstance(content, Sequence):
        raise ValidationTypeError(
            "messages", f"{where}.content must be a string or a list of content parts, got "
                        f"{type(content).__name__}", content)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise ValidationTypeError(
                "messages", f"{at} must be a dict such as {{'type': 'text', 'text': '...'}}, got "
                            f"{type(part).__name__}", part)
        kind = part.get("type")
        if kind != "text":
            raise ValidationError(
                "messages", f"{at}: content parts of type {kind!r} are not supported: this model "
                            f"reads text only (type 'text')", kind)
        if sorted(part) != ["text", "type"]:
            raise ValidationError(
                "messages", f"{at}: a text part has exactly the keys 'type' and 'text', got "
                            f"{sorted(part)}", sorted(part))
        if not isinstance(part["text"], str):
            raise ValidationTypeError(
                "messages", f"{at}.text must be a string, got {type(part['text']).__name__}",
                part["text"])
        texts.append(part["text"])
    return "\n".join(texts)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase | None, messages: Any,
                        add_generation_prompt: bool = True) -> list[int]:
    """Validate ``messages`` and turn them into prompt token ids with the tokenizer's
    chat template. A template that refuses the conversation (some raise on roles out of
    order) is the caller's mistake too: a ValidationError, not a crash."""
    conversation = parse_chat_messages(messages)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValidationError(
            "messages", "this model has no chat template; send a prompt instead", None)
    try:
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    except jinja2.TemplateError as e:
        raise ValidationError("messages", f"the chat template refused the messages: {e}",
                              None) from None
    except (ValueError, TypeError) as e:  # the tokenizer, e.g. on a lone surrogate
        raise ValidationError("messages", f"the messages cannot be tokenized: {e}", None) from None
    if hasattr(ids, "keys"):  # a BatchEncoding in recent transformers
        ids = ids["input_ids"]
    return list(ids)
