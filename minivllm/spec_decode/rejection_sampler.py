"""RejectionSampler: which drafts to keep, and the one token of the target's own after them.

The target model scored the request's last token and its k drafts in one pass, giving
k + 1 rows of logits: row ``j`` is the target's distribution for the token after draft
``j`` (row 0: after the last real token). Drafts are checked in order; the first one
rejected ends the check, and the target supplies the token in its place. If all k are
accepted, row k gives one more token for free (the *bonus* token). So a step yields
between 1 and k + 1 tokens, and never fewer than plain decoding.

* Greedy: draft ``j`` is accepted when it equals the argmax of row ``j``; the token after
  the accepted drafts is that row's argmax. The output is token for token what plain
  greedy decoding gives.
* Sampling (Leviathan et al. 2023; Chen et al. 2023): a draft drawn from a draft
  distribution ``q`` is accepted with probability ``min(1, p(x) / q(x))``, and on rejection
  the replacement is drawn from ``max(p - q, 0)``, renormalized. Then every emitted token
  has exactly the target's distribution ``p``. An n-gram draft is deterministic: ``q`` puts
  all its mass on the draft token ``d``, so the rule becomes "accept with probability
  ``p(d)``; else draw from ``p`` with ``d`` removed and renormalized".

In vLLM (0.34): ``vllm/v1/worker/gpu/spec_decode/rejection_sampler.py`` (batched on the
GPU with Triton).
"""

from __future__ import annotations

import torch

from minivllm.sample.sampler import SamplingError, target_probs
from minivllm.sampling_params import SamplingParams


class RejectionSampler:
    def __call__(self, logits: torch.Tensor, draft_token_ids: list[int], params: SamplingParams,
                 generator: torch.Generator) -> list[int]:
        """``logits``: ``[k + 1, vocab]``, the target's rows after the last token and after
        each of the ``k`` drafts. Returns the accepted drafts followed by one target token
        (1 to k + 1 tokens). Raises :class:`SamplingError` for NaN logits."""
        logits = logits.float()
        if logits.isnan().any():
            raise SamplingError("the model produced NaN logits for this request")
        if params.greedy:
            return self.greedy(logits, draft_token_ids)
        return self.random(logits, draft_token_ids, params, generator)

    def greedy(self, logits: torch.Tensor, draft_token_ids: list[int]) -> list[int]:
        target = logits.argmax(dim=-1).tolist()  # ties to the lowest id, like Sampler.greedy
        out = []
        for draft, best in zip(draft_token_ids, target):
            if draft != best:
                break
            out.append(draft)
        return out + [target[len(out)]]

    def random(self, logits: torch.Tensor, draft_token_ids: list[int], params: SamplingParams,
               generator: torch.Generator) -> list[int]:
        out = []
        for j, draft in enumerate(draft_token_ids):
            probs = target_probs(logits[j], params)
            if torch.rand((), generator=generator) < probs[draft]:
                out.append(draft)
                continue
            # Rejected: the residual max(p - q, 0) with q all on the draft is p without it.
            # (It cannot be all zero: the draft was rejected, so p(draft) < 1.)
            probs[draft] = 0.0
            out.append(int(torch.multinomial(probs / probs.sum(), 1, generator=generator)))
            return out
        bonus = target_probs(logits[len(draft_token_ids)], params)
        return out + [int(torch.multinomial(bonus, 1, generator=generator))]
