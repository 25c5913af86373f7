"""Sampler: from the last position's logits to one token per request.

Greedy requests take the argmax (ties go to the lowest token id, as in transformers).
Random requests apply temperature, then top-k, then top-p, and draw from the remaining
distribution with their own generator when they carry a seed, so the same seed gives the
same output whatever else shares the batch.
"""

from __future__ import annotations

import torch

from minivllm.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k and outside the top-p nucleus."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token if the mass before it already reaches top_p (the top token stays).
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # Unseeded random requests draw from the engine's generator (seeded by LLM(seed=)).
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """``logits`` is ``[num_requests, vocab]``; returns one token id per row."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if p.greedy:
                continue
            row = apply_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = row.softmax(-1).cpu()
            gen = generators[i] or self.generator
            tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
        return tokens
