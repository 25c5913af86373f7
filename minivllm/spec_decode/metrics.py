"""Speculative decoding's counters: drafts proposed, accepted, and where in the draft.

Counted when the drafts are verified, before stop rules: a draft the target agreed with
is *accepted* even if an earlier token of the same step then ended the request (vLLM
counts the same way). Two numbers summarize them:

* acceptance rate = accepted draft tokens / draft tokens;
* mean acceptance length = 1 + accepted draft tokens / drafts: the tokens one verifying
  step yields per request, counting the target's own token (1.0 means speculation never
  helped; k + 1 is the most it can give).

In vLLM: ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingStats``, ``SpecDecodingProm``),
whose Prometheus names these are (``vllm:`` there, ``minivllm:`` here).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    """k: the positions counted in ``num_accepted_tokens_per_pos``."""
    num_drafts: int = 0
    """Verifications: one per request per step that had at least one draft token."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    """Entry ``i``: how often the draft at position ``i`` (0 = first) was accepted."""

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: drafts are accepted as a prefix, so the first
        ``num_accepted_tokens`` positions each count one acceptance."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
