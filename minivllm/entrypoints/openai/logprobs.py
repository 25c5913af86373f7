"""Log-probabilities in OpenAI's two shapes: the completions endpoint's parallel lists
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) and the chat endpoint's
``content`` entries (token, logprob, UTF-8 bytes, and the top alternatives).

The engine's logprobs (``minivllm.sample.logprobs``) hold one dict per position, the chosen
token first; this module only re-shapes them, for whole responses and stream chunks alike.

In vLLM (0.34): ``_create_completion_logprobs`` and ``_create_chat_logprobs`` in the
endpoints' ``serving.py``.
"""

from __future__ import annotations

from minivllm.outputs import SampleLogprobs
from minivllm.sample.logprobs import Logprob


def _openai_logprob(value: float) -> float:
    """OpenAI's stand-in for a logprob of -inf (JSON has no infinity)."""
    return max(value, -9999.0)


class CompletionLogprobsMaker:
    """The completions endpoint's ``logprobs`` for the positions not yet sent (all of them
    at once without streaming, each chunk's own when streaming). ``text_offset`` counts
    the characters of the tokens before, over the whole completion (vLLM's rule)."""

    def __init__(self) -> None:
        self.num_sent = 0
        self.text_offset = 0

    def __call__(self, positions: SampleLogprobs) -> dict:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for position in positions[self.num_sent:]:
            chosen = next(iter(position.values()))  # the chosen token comes first
            token = chosen.decoded_token or ""
            tokens.append(token)
            token_logprobs.append(_openai_logprob(chosen.logprob))
            top_logprobs.append({p.decoded_token or "": _openai_logprob(p.logprob)
                                 for p in position.values()})
            text_offset.append(self.text_offset)
            self.text_offset += len(token)
        self.num_sent = len(positions)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": text_offset}


def chat_logprobs(positions: SampleLogprobs, top_logprobs: int) -> dict:
    """The chat endpoint's ``logprobs``: per token its text, logprob and UTF-8 bytes, and
    the ``top_logprobs`` most likely tokens there (by rank; the chosen one only if it is
    among them)."""
    def entry(p: Logprob) -> dict:
        token = p.decoded_token or ""
        return {"token": token, "logprob": _openai_logprob(p.logprob), "bytes": list(token.encode())}

    content = []
    for position in positions:
        chosen = next(iter(position.values()))
        top = sorted(position.values(), key=lambda p: p.rank)[:top_logprobs]
        content.append({**entry(chosen), "top_logprobs": [entry(p) for p in top]})
    return {"content": content}
