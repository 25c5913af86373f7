"""Drafter: the engine's side of speculative decoding, between two steps (notebook 12).

After each step it counts the drafts the target accepted (the metrics), and proposes
the next step's drafts for every request that goes on, cut to one length for the step:
none while more than ``disable_by_batch_size`` requests run, else the length an
:class:`~minivllm.spec_decode.draft_length.AdaptiveDraftLength` has measured to pay at
this batch size, else the full k. The scheduler then schedules each request's drafts
after its last token.

In vLLM: the GPU model runner's ``drafter`` (``propose_draft_token_ids``), called after
sampling, with the scheduler reading the drafts back (``update_draft_token_ids``).
"""

from __future__ import annotations

from minivllm.config import SpeculativeConfig
from minivllm.core.scheduler import SchedulerOutput
from minivllm.request import Request
from minivllm.spec_decode.draft_length import AdaptiveDraftLength
from minivllm.spec_decode.metrics import SpecDecodingStats
from minivllm.spec_decode.ngram_proposer import NgramProposer


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max,
                                      config.prompt_lookup_min)
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        self.draft_length = AdaptiveDraftLength(config.num_speculative_tokens) if config.adaptive else None
        """Measures which draft length pays at each batch size ("adaptive"); None when fixed."""

    def count_accepted(self, scheduler_output: SchedulerOutput,
                       sampled: dict[str, list[int]]) -> dict[str, int]:
        """Drafts accepted per request that had drafts this step (counted before stop
        rules, as vLLM counts them), recorded in the metrics."""
        accepted = {}
        for s in scheduler_output.scheduled:
            tokens = sampled.get(s.request.request_id)
            if s.spec_token_ids and tokens is not None:  # None: its sampling failed
                accepted[s.request.request_id] = len(tokens) - 1
                self.stats.observe_draft(len(s.spec_token_ids), len(tokens) - 1)
        return accepted

    def observe_step(self, num_tokens: int, model_time: float, decode_only: bool) -> None:
        """What the step gave, for the adaptive draft length's measurement."""
        if self.draft_length is not None:
            self.draft_length.observe_step(num_tokens, model_time, decode_only)

    def propose(self, updated: list[Request], num_running: int) -> None:
        """Drafts for each request that just got its tokens and goes on. Never more than
        could be kept: one token of the target's own always follows the drafts, so at
        most ``max_tokens - 1`` more, and no position past ``max_model_len``.

        A request with structured output (a grammar) gets no drafts: the proposer does not
        know the grammar, and a draft it forbids would still be scored and could be
        accepted, as the rejection sampler checks drafts against the target's logits,
        not the grammar (vLLM masks each draft position and rolls the matcher back; here
        such a request simply decodes one token per step, every token masked)."""
        going_on = [r for r in updated if not r.is_finished]
        for request in going_on:
            if request.grammar is not None:
                continue  # its spec_token_ids stay empty (the scheduler emptied them)
            room = self.max_model_len - request.num_tokens
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - request.num_output_tokens - 1)
            request.spec_token_ids = self.proposer.propose(request.all_token_ids, room)
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running > limit:
            k = 0
        elif self.draft_length is not None:
            k = self.draft_length.choose(len(going_on))
        else:
            return
        for request in going_on:
            del request.spec_token_ids[k:]
