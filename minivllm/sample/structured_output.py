"""Structured output: a grammar decides which tokens may come next.

Ask a language model for JSON and it usually gives JSON, until it does not. Structured
output (*guided decoding* until vLLM renamed it in 2025) makes "usually" into "always"
without touching the model: before each token is sampled, every token that could not
continue a valid output has its logit set to ``-inf``, so the sampler cannot pick it,
however likely the model found it. The model still chooses among the tokens that
remain, so its output is the most likely valid continuation it can find, not a
template filled in.

Three pieces, all of them from `xgrammar <https://github.com/mlc-ai/xgrammar>`_ (the
library vLLM uses by default), one per stage of a request's life:

* **compile** (once per grammar, when the request is added): the JSON schema, regex,
  choice list or EBNF grammar becomes a pushdown automaton, and xgrammar precomputes,
  for each of its states, which of the vocabulary's tokens are always, never or
  sometimes allowed. This needs the tokenizer (a token is a string of bytes) and the
  model's vocabulary size (the logits may be wider than ``len(tokenizer)``; the padding
  ids are never allowed). Compiled grammars are cached: a thousand requests with one
  schema compile it once.
* **fill the bitmask** (every step, per request with a grammar): the request's
  *matcher* (its position in the automaton) writes one bit per token, 32 tokens to an
  int32, and the bits are applied to that request's row of logits
  (:func:`apply_grammar_bitmask`). Rows of requests without a grammar are not touched.
* **accept the token** (after sampling): the matcher advances over the token that was
  sampled. When the output is complete the grammar allows only the end-of-sequence
  token; once that is accepted the matcher is *terminated* and the request finishes
  (finish_reason "stop"), even with ``ignore_eos`` or before ``min_tokens``: there is
  nothing valid left to generate.

The matcher is the request's only state here, and it moves only forward, one final token
at a time. That is why nothing ever rolls it back: the scheduler advances it in
``update_from_output`` (after sampling has succeeded, so a failed step leaves it
untouched), a preempted request keeps its output tokens and so its matcher's position
(recomputing the KV cache changes no token), and the engine never proposes speculative
drafts for a request with a grammar (``Drafter.propose``), so no token is ever
accepted and then rejected. (vLLM does roll matchers back, to verify drafts against the
grammar; xgrammar's ``GrammarMatcher.rollback`` is what it uses.)

In vLLM: ``vllm/v1/structured_output/`` (``StructuredOutputManager``, the xgrammar
backend) and ``StructuredOutputsParams`` in ``vllm/sampling_params.py``.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from minivllm.exceptions import ValidationError, ValidationTypeError, check_bool

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""vLLM's ways of giving the grammar; exactly one is set."""
JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""What ``json_object`` asks for: any JSON object (OpenAI's "json_object" response
format). xgrammar's builtin JSON grammar would also allow a top-level array."""


def _xgrammar():
    """xgrammar, imported when first needed (it is an optional extra, and slow to import)."""
    try:
        import xgrammar
    except ImportError:
        raise ValidationError(
            "structured_outputs", "structured output needs xgrammar: pip install 'minivllm[structured]'",
            None) from None
    return xgrammar


@dataclass
class StructuredOutputsParams:
    """Which outputs a request allows; exactly one of the five ways must be set, for
    example::

        SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        SamplingParams(structured_outputs=StructuredOutputsParams(
            json={"type": "object", "properties": {"n": {"type": "integer"}}}))
    """

    json: dict | str | None = None
    """A JSON schema, as a dict or its JSON text: the output is one JSON value it accepts."""
    regex: str | None = None
    """The output matches this regular expression, whole (as ``re.fullmatch``)."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's dialect, GBNF-like) whose ``root`` rule the output matches."""
    json_object: bool | None = None
    """True: the output is any JSON object."""
    disable_any_whitespace: bool = False
    """JSON only: no whitespace between tokens (``{"a":1}``). By default any amount is
    allowed, as the JSON standard does; a small or random model can then pour newlines
    into the output until ``max_tokens`` runs out."""

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check the fields, and that the grammar parses (a bad schema or regex is refused
        here, with the library's message, not later inside a step)."""
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValidationError(
                "structured_outputs",
                f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
                f"got {', '.join(kinds) if kinds else 'none'}", kinds)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValidationTypeError(
                "structured_outputs",
                f"structured_outputs.json must be a JSON schema (a dict or a "
                f"string), got {type(self.json).__name__}", self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValidationTypeError(
                    "structured_outputs",
                    f"structured_outputs.{name} must be a string, got "
                    f"{type(value).__name__}", value)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValidationTypeError(
                    "structured_outputs",
                    f"structured_outputs.choice must be a non-empty list of "
                    f"strings, got {self.choice!r}", self.choice)
            self.choice = list(self.choice)
        if self.json_object is not None:
            check_bool("structured_outputs", self.json_object)
        self.disable_any_whitespace = check_bool("structured_outputs", self.disable_any_whitespace)
        if self.disable_any_whitespace and self.kind not in ("json", "json_object"):
            raise ValidationError(
                "structured_outputs",
                f"structured_outputs.disable_any_whitespace applies to json and "
                f"json_object only, not to {self.kind}", self.kind)
        self.parse()

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    def schema_text(self) -> str:
        """The JSON schema as text (json and json_object only)."""
        if self.json_object:
            return JSON_OBJECT_SCHEMA
        return self.json if isinstance(self.json, str) else _json.dumps(self.json)

    def choice_ebnf(self) -> str:
        """The choice list as an EBNF grammar: ``root ::= "yes" | "no"``. JSON's string
        escapes are also xgrammar's, so json.dumps quotes each choice safely."""
        return "root ::= " + " | ".join(_json.dumps(c, ensure_ascii=False) for c in self.choice)

    def parse(self):
        """The grammar, parsed but not compiled (no tokenizer needed): an
        ``xgrammar.Grammar``. Raises ValidationError with the parser's message."""
        xgr = _xgrammar()
        try:
            if self.kind in ("json", "json_object"):
                return xgr.Grammar.from_json_schema(
                    self.schema_text(), any_whitespace=not self.disable_any_whitespace)
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.regex)
            return xgr.Grammar.from_ebnf(self.grammar if self.kind == "grammar" else self.choice_ebnf())
        except Exception as e:  # xgrammar raises RuntimeError (or its own) with the parser's text
            raise ValidationError(
                "structured_outputs",
                f"structured_outputs.{self.kind} is not valid: "
                f"{_last_line(e)}", getattr(self, self.kind)) from None


def _last_line(e: Exception) -> str:
    """xgrammar's messages start with a C++ source location; keep what the user needs."""
    text = str(e).strip()
    first, _, rest = text.partition("\n")
    head = first.split(": ", 1)[-1] if first.startswith("[") else first
    return (head + (" " + rest.strip() if rest.strip() else ""))[:500]


class GrammarState:
    """One request's place in its grammar (an xgrammar ``GrammarMatcher``)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``bitmask``."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it (the
        matcher is then unchanged)."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The output is complete and the end-of-sequence token has been accepted."""
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles a request's StructuredOutputsParams for one tokenizer and vocabulary, with a
    cache, and hands each request a matcher of its own (the engine has one of these)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        xgr = _xgrammar()
        stop = None if eos_token_id is None else [eos_token_id]
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info)  # caches what it compiles

    def compile(self, params: StructuredOutputsParams):
        kind, c = params.kind, self.compiler
        try:
            if kind in ("json", "json_object"):
                return c.compile_json_schema(params.schema_text(),
                                             any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return c.compile_regex(params.regex)
            return c.compile_grammar(params.grammar if kind == "grammar" else params.choice_ebnf())
        except Exception as e:
            raise ValidationError("structured_outputs", f"structured_outputs.{kind} could not be "
                                  f"compiled: {_last_line(e)}", getattr(params, kind)) from None

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher at the start of the request's grammar."""
        return GrammarState(_xgrammar().GrammarMatcher(self.compile(params)))


def apply_grammar_bitmask(logits, rows: list[int], states: list[GrammarState]):
    """Set to ``-inf`` the logits of every token the grammar forbids, in place, for the
    rows ``rows`` of ``[num_rows, vocab]`` float32 logits (``states[i]`` guides row
    ``rows[i]``). One int32 bitmask row per constrained request, filled by its matcher, then
    one call applies them all; the other rows are not read or written."""
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    for i, state in enumerate(states):
        state.fill_bitmask(bitmask, i)
    constrained = logits[rows]
    xgr.apply_token_bitmask_inplace(constrained, bitmask, vocab_size=logits.shape[-1])
    logits[rows] = constrained
    return logits
