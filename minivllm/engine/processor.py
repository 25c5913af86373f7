"""Processor: a prompt and its SamplingParams in, checked token ids out, before anything is queued.

Everything that can be said about a request before it is queued is said here, once:
the prompt is tokenized (or a chat conversation templated, through ``chat_utils``), the
token ids are checked against the vocabulary, the SamplingParams are checked again (an
object changed after it was made cannot slip through), and the request must fit
``max_model_len`` and, without chunked prefill, one step's token budget. Every refusal
is a :class:`~minivllm.exceptions.ValidationError` whose ``param`` names the field.

Tokenizing and templating take time in proportion to the text but touch no engine state, so the async engine runs :meth:`Processor.process_prompt` on a thread of its own
and hands the :class:`ProcessedPrompt` to ``LLMEngine.add_request``, which then neither
tokenizes it again nor re-checks its ids.

In vLLM (0.34): ``vllm/v1/engine/input_processor.py`` (``InputProcessor.process_inputs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from minivllm.entrypoints.chat_utils import apply_chat_template
from minivllm.exceptions import ValidationError, ValidationTypeError, check_int
from minivllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt that has been tokenized and checked."""

    prompt_token_ids: list[int]
    prompt: str | None = None
    """Its text, when it came as text."""
    cache_salt: str | None = None
    """Salts its prefix-cache hashes (vLLM's ``cache_salt``): only prompts with the same
    salt share cached blocks."""


class Processor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, max_model_len: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill

    def process_prompt(self, prompt: str | dict | ProcessedPrompt) -> ProcessedPrompt:
        """Text is tokenized; ``{"prompt_token_ids": [...], "prompt": text, "cache_salt":
        salt}`` is checked (vLLM's ``TokensPrompt``; "prompt" and "cache_salt" optional)."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt_token_ids", "prompt", "cache_salt"})
            if unknown or "prompt_token_ids" not in prompt:
                raise ValidationError(
                    "prompt", "a dict prompt takes the key 'prompt_token_ids' (a list of token ids) "
                              "and optionally 'prompt' (its text) and 'cache_salt'; got the keys "
                              f"{sorted(prompt)}", sorted(prompt))
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValidationTypeError(
                    "prompt", f"'prompt' must be a string, got {type(text).__name__}", text)
            return ProcessedPrompt(self._check_token_ids(prompt["prompt_token_ids"]), text,
                                   check_cache_salt(prompt.get("cache_salt")))
        if isinstance(prompt, str):
            return ProcessedPrompt(self._encode(prompt), prompt)
        raise ValidationTypeError(
            "prompt", f"prompt must be a str or a {{'prompt_token_ids': [...]}} dict, "
                      f"got {type(prompt).__name__}", prompt)

    def process_chat(self, messages: object, add_generation_prompt: bool = True) -> ProcessedPrompt:
        """A conversation, checked and templated (``minivllm.entrypoints.chat_utils``)."""
        ids = apply_chat_template(self.tokenizer, messages, add_generation_prompt)
        return ProcessedPrompt(self._check_token_ids(ids))

    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        """The request's SamplingParams (the defaults when None), checked again."""
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValidationTypeError(
                "sampling_params", f"sampling params must be a SamplingParams, got "
                                   f"{type(params).__name__}", params)
        params.verify()
        return params

    def check_request(self, prompt: ProcessedPrompt, params: SamplingParams) -> None:
        """Refuse a request that could never be served. (max_model_len is at most what the
        KV cache holds, ``core.kv_cache_utils.size_kv_cache``, so a prompt that passes fits the cache on
        its own, however long the request grows.)"""
        n = len(prompt.prompt_token_ids)
        if not n:
            raise ValidationError("prompt", "the prompt is empty: it needs at least one token",
                                  prompt.prompt_token_ids)
        if n >= self.max_model_len:
            raise ValidationError(
                "prompt", f"the prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                          f"(prompt plus at least one generated token must fit)", n)
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            raise ValidationError(
                "prompt", f"the prompt has {n} tokens, more than max_num_batched_tokens "
                          f"{self.max_num_batched_tokens}, and chunked prefill is off", n)
        bad_stops = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stops:
            raise ValidationError(
                "stop_token_ids", f"stop_token_ids must be in [0, {self.vocab_size}), got {bad_stops}",
                bad_stops)
        bad_bias = [t for t in params.logit_bias if t >= self.vocab_size]
        if bad_bias:
            raise ValidationError(
                "logit_bias", f"logit_bias token ids must be in [0, {self.vocab_size}), got {bad_bias}",
                bad_bias)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValidationError(
                "prompt", "this engine has no tokenizer: pass {'prompt_token_ids': [...]}", text)
        try:
            return self.tokenizer.encode(text, add_special_tokens=False)
        except Exception as e:  # e.g. a lone surrogate, which JSON can carry
            raise ValidationError("prompt", f"the prompt cannot be tokenized: {e}", None) from None

    def _check_token_ids(self, ids: object) -> list[int]:
        """Prompt token ids: a list (or tuple) of exact integers in [0, vocab_size)."""
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValidationTypeError(
                "prompt", f"prompt_token_ids must be a list of integers, got {type(ids).__name__}"
                          + ("; pass ids.tolist()" if hasattr(ids, "tolist") else ""), ids)
        ids = list(ids)
        if not all(type(i) is int for i in ids):  # the fast path first: plain ints
            ids = [check_int("prompt", i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValidationError(
                "prompt", f"prompt token ids must be in [0, {self.vocab_size}), got "
                          f"{min(ids)}..{max(ids)}", [min(ids), max(ids)])
        return ids


def check_priority(priority: object, policy: str) -> int:
    """A request's priority as the engine takes it: an integer (lower runs first), and
    non-zero only under the "priority" policy. Like vLLM, a priority the engine would
    ignore is an error rather than a silent no-op."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValidationTypeError("priority", f"priority must be an integer, got {priority!r}",
                                  priority)
    if priority != 0 and policy != "priority":
        raise ValidationError(
            "priority", f"got priority {priority} but priority scheduling is not enabled "
                        f"(scheduling_policy={policy!r}; start the engine with "
                        f"scheduling_policy='priority')", priority)
    return priority


def check_cache_salt(salt: object) -> str | None:
    """A prompt's ``cache_salt``: None, or a non-empty string (vLLM's rule)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValidationError("cache_salt", f"cache_salt must be a non-empty string if given, "
                              f"got {salt!r}", salt)
    return salt
