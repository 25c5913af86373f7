"""Incremental detokenization and stop strings: token ids in, the text a client may see out.

Decoding only the newest token is wrong: byte-level BPE can split one character (an
emoji, an accented letter) over several tokens, and some tokenizers decide spacing from
the neighbouring token. So, as vLLM does, we decode a small window of previous tokens
(``prefix_offset`` to ``read_offset``) with and without the new ones and emit the
difference, holding text back while it ends in an incomplete character ("\\ufffd").

Stop strings are text, not tokens ("\\n\\n" may arrive inside one token or across three),
so they are found here, where the text is made, not in the scheduler, which sees token
ids only. Two rules follow from streaming:

* A stop string is looked for only in the new text plus an overlap one character shorter
  than the longest stop string (a match that ends earlier was found a token ago).
* Until a request finishes, the last ``len(longest stop string) - 1`` characters are held
  back from the client: they could be the start of a stop string that the next token
  completes, and text once sent cannot be taken back.

In vLLM: ``vllm/v1/engine/detokenizer.py`` (``IncrementalDetokenizer.update``,
``get_next_output_text``, ``check_stop_strings``).
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

# How many prompt tokens seed the window, so the first output token decodes in context.
INITIAL_CONTEXT = 5


def check_stop_strings(text: str, new_char_count: int, stop: Sequence[str]) -> tuple[str, int] | None:
    """The stop string that appears first in ``text``, looking only where the last
    ``new_char_count`` characters could have completed one; returns it with the index
    where it starts (the text to keep is ``text[:index]``), or None."""
    if not stop:
        return None
    begin = max(0, len(text) - new_char_count - max(map(len, stop)) + 1)
    hits = [(text.find(s, begin), s) for s in stop]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
        return None
    index, string = min(hits)
    return string, index


class IncrementalDetokenizer:
    """The text of one request's output, grown one token at a time, cut at a stop string.

    ``stop`` and ``min_tokens`` are the request's ``SamplingParams`` fields: stop strings
    count only once at least ``min_tokens`` tokens have been generated.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, prompt_token_ids: list[int],
                 stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        context = prompt_token_ids[-INITIAL_CONTEXT:]
        self.token_ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        """The output text so far (cut before a stop string once one is found)."""
        self.stop = list(stop)
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self.sent = 0
        """Characters of text already handed out by :meth:`get_next_output_text`."""

    @property
    def stop_buffer_length(self) -> int:
        """Characters held back while the request runs: a stop string may start there."""
        return max(map(len, self.stop)) - 1 if self.stop else 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_token(self, token_id: int) -> str:
        """Append one token and return the text it completes (possibly "")."""
        self.token_ids.append(token_id)
        self.num_output_tokens += 1
        if self.tokenizer is None:
            return ""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""

    def update(self, token_id: int, stop_terminated: bool = False) -> str | None:
        """Detokenize one new token; return the stop string it completed, or None.

        On a match the text is cut before the stop string. ``stop_terminated``: the
        token already ended the request (EOS or a stop token id), so there is nothing to
        decide. Every token is checked, the last one allowed by ``max_tokens`` included:
        a stop string completed by that token makes the finish reason "stop", not
        "length" (as in vLLM, the detokenizer's stop beats the length cap).
        """
        delta = self.add_token(token_id)
        if stop_terminated or self.num_output_tokens < self.min_tokens:
            return None
        found = check_stop_strings(self.text, len(delta), self.stop)
        if found is None:
            return None
        string, index = found
        self.text = self.text[:index]
        return string

    def get_next_output_text(self, finished: bool) -> tuple[str, str]:
        """``(text, new_text)`` for the next output: everything that may be shown so far,
        and the part of it not handed out before. While the request runs, the last
        :attr:`stop_buffer_length` characters are held back."""
        visible = len(self.text)
        if not finished and self.stop:
            visible = max(self.sent, len(self.text) - self.stop_buffer_length)
        new_text = self.text[self.sent : visible]
        self.sent = max(self.sent, visible)
        return self.text[:visible], new_text
