"""NgramProposer: drafts copied from the request's own earlier tokens (prompt lookup).

When a model repeats or edits text it was given (code, a quotation, a form), the next
tokens often follow a phrase that already occurred. The proposer takes the request's
last ``n`` tokens, finds the most recent earlier place where the same ``n`` tokens
appeared, and proposes the (up to) ``k`` tokens that followed them there. It tries the
longest ``n`` first (``prompt_lookup_max`` down to ``prompt_lookup_min``): a longer match
is better evidence. No second model, no training: a few list comparisons per request.

In vLLM (0.34): ``vllm/v1/worker/gpu/spec_decode/ngram/speculator.py``
(``NgramGPUSpeculator``, method "ngram"), which also looks for the longest suffix n-gram
within ``[prompt_lookup_min, prompt_lookup_max]`` (a Triton kernel on the GPU). Which occurrence wins a tie here (the most recent) is this
module's choice, not checked against vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int = 4,
                 prompt_lookup_min: int = 1) -> None:
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def propose(self, token_ids: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """Up to ``min(k, max_drafts)`` draft tokens to follow ``token_ids``; [] when no
        suffix of at least ``prompt_lookup_min`` tokens occurred before.

        Of the matches, the longest suffix wins (up to ``prompt_lookup_max``); among equally
        long ones, the most recent (its continuation is the likeliest to still apply)."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        n = len(token_ids)
        if k <= 0 or n < 2:
            return []
        last = token_ids[-1]
        best_len, best_end = 0, -1
        # Candidate ends: earlier positions holding the last token, newest first. The match
        # length is counted backwards from there, at most max_n.
        for end in range(n - 2, -1, -1):
            if token_ids[end] != last:
                continue
            length = 1
            while length < self.max_n and length <= end and \
                    token_ids[end - length] == token_ids[n - 1 - length]:
                length += 1
            if length > best_len:
                best_len, best_end = length, end
                if length == self.max_n:
                    break
        if best_len < self.min_n:
            return []
        return list(token_ids[best_end + 1 : best_end + 1 + k])
