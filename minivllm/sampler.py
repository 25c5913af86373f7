"""Sampler: from the last position's logits to one token per request.

Greedy requests (temperature below ``SAMPLING_EPS``) take the argmax (ties go to the
lowest token id, as in transformers). Random requests apply temperature, then top-k,
then top-p, and draw from the remaining distribution with their own generator when they
carry a seed, so the same seed gives the same output whatever else shares the batch.
Top-k and top-p always keep at least the most likely token, however small ``top_p`` is.

A failure while sampling one row (NaN logits from the model, a distribution that cannot
be drawn from) belongs to that request alone: its slot in the result holds the exception
instead of a token, and the engine finishes that request with finish_reason "error"
while every other row keeps its token.
"""

from __future__ import annotations

import torch

from minivllm.sampling_params import SamplingParams


class SamplingError(RuntimeError):
    """Sampling one request's next token failed; only that request is affected."""


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k and outside the top-p nucleus."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token if the mass before it already reaches top_p. The top token always
        # stays: a top_p of 1e-46 is 0 in float32, and "mass >= 0" would drop them all.
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False
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
    ) -> list[int | SamplingError]:
        """``logits`` is ``[num_requests, vocab]``; returns one token id per row, or the
        :class:`SamplingError` that row raised."""
        logits = logits.float()
        tokens: list[int | SamplingError] = list(self.greedy(logits))
        has_nan = logits.isnan().any(dim=-1).tolist()
        for i, p in enumerate(params):
            if has_nan[i]:
                tokens[i] = SamplingError("the model produced NaN logits for this request")
            elif not p.greedy:
                try:
                    tokens[i] = self.sample(logits[i], p, generators[i] or self.generator)
                except Exception as e:  # isolated to this request by design
                    tokens[i] = e if isinstance(e, SamplingError) else SamplingError(
                        f"sampling failed: {type(e).__name__}: {e}")
        return tokens

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """The most likely token of each row of ``[num_requests, vocab]`` logits; a tie
        goes to the lowest token id (as in transformers)."""
        return logits.argmax(dim=-1).tolist()

    def sample(self, logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
        """One random token from one row of ``[vocab]`` logits: temperature, then top-k,
        then top-p, then a draw with ``generator``."""
        return int(torch.multinomial(target_probs(logits, p), 1, generator=generator))


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a random request draws from, on the CPU: temperature, then top-k,
    then top-p, then softmax, for one row of ``[vocab]`` logits. The rejection sampler
    (speculative decoding) accepts drafts against exactly this distribution."""
    # Divide in float64: a huge (finite) temperature overflows to inf in float32, and
    # -inf / inf is NaN. The result is then float32 again, like the logits.
    row = (logits.double() / p.temperature).float()
    probs = apply_top_k_top_p(row, p.top_k, p.top_p).softmax(-1).cpu()
    if not torch.isfinite(probs).all() or not probs.sum() > 0:
        raise SamplingError("the token distribution is not a valid probability distribution")
    return probs
