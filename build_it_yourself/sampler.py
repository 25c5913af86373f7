"""Build it yourself, piece 7: the sampler (greedy, temperature, top-k, top-p).

Read first: notebook 00 (quickstart: sampling parameters).
Check:      minivllm check sampler build_it_yourself/sampler.py:MySampler
Solution:   minivllm/sample/sampler.py (the engine's Sampler: greedy, sample, apply_top_k_top_p)

The model gives one row of logits (``[vocab]``) per request that samples this step. The
engine's ``Sampler.__call__`` (kept) calls ``greedy`` on all rows, then ``sample`` for
each request whose ``temperature`` is above zero, and isolates a failure to its request.
"""

from __future__ import annotations

import torch

from minivllm.sample.sampler import Sampler, SamplingError  # noqa: F401  (SamplingError: for you)
from minivllm.sampling_params import SamplingParams


class MySampler(Sampler):
    def greedy(self, logits: torch.Tensor) -> list[int]:
        """The most likely token of each row of ``logits`` (``[num_requests, vocab]``),
        as a list of ints. A tie goes to the lowest token id (as in transformers)."""
        raise NotImplementedError("MySampler.greedy: the most likely token of each row "
                                  "(see its docstring)")

    def sample(self, logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
        """One token drawn from one row of ``logits`` (``[vocab]``), in this order:

        1. temperature: divide the logits by ``p.temperature`` (below 1 sharpens, above
           1 flattens; tip: divide in float64, a huge temperature overflows float32);
        2. top-k: if ``p.top_k`` is above zero (and below the vocabulary size), keep the
           ``top_k`` largest logits (set the others to ``-inf``);
        3. top-p: keep the smallest set of most likely tokens whose probability reaches
           ``p.top_p`` (sort descending; drop a token when the mass *before* it already
           reaches ``top_p``); the most likely token is always kept;
        4. softmax over what is left, and draw one token with
           ``torch.multinomial(probs, 1, generator=generator)``: always through
           ``generator``, so a seeded request draws the same tokens in any batch.

        If the distribution cannot be drawn from (NaN, all zero) raise ``SamplingError``.
        """
        raise NotImplementedError("MySampler.sample: temperature, top-k, top-p, then draw "
                                  "(see its docstring)")
