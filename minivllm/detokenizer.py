"""Incremental detokenization: turn a growing list of token ids into growing text.

Decoding only the newest token is wrong: byte-level BPE can split one character (an
emoji, an accented letter) over several tokens, and some tokenizers decide spacing from
the neighbouring token. So, as vLLM does, we decode a small window of previous tokens
(``prefix_offset`` to ``read_offset``) with and without the new ones and emit the
difference, holding text back while it ends in an incomplete character ("\\ufffd").
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# How many prompt tokens seed the window, so the first output token decodes in context.
INITIAL_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        context = prompt_token_ids[-INITIAL_CONTEXT:]
        self.token_ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_token(self, token_id: int) -> str:
        """Append one token and return the text it completes (possibly "")."""
        self.token_ids.append(token_id)
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
