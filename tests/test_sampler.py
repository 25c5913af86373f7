"""The sampler on its own: greedy is the argmax, top-k and top-p keep exactly the tokens
they should, and draws follow the kept distribution (notebook 00's sampling section).

The sampler comes from ``components`` (tests/conftest.py): the engine's own, or a
learner's under ``minivllm check sampler`` (build_it_yourself/sampler.py).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from minivllm.sampling_params import SamplingParams

pytestmark = pytest.mark.checks("sampler")

PROBS = [0.5, 0.3, 0.1, 0.05, 0.05]
"""A distribution whose nucleus and top-k sets are easy to work out by hand."""


def draws(components, n: int, probs=PROBS, **params) -> Counter:
    """``n`` tokens drawn from ``probs`` (as logits) by the sampler, one seeded generator."""
    sampler = components.sampler(seed=0)
    logits = torch.tensor([[math.log(p) for p in probs]] * n)
    generator = torch.Generator().manual_seed(1234)
    p = SamplingParams(temperature=params.pop("temperature", 1.0), **params)
    tokens = sampler(logits, [p] * n, [generator] * n)
    assert all(isinstance(t, int) for t in tokens), tokens[:3]
    return Counter(tokens)


def test_greedy_takes_the_argmax_and_the_lowest_id_on_a_tie(components):
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 4.9], [-2.0, -3.0, -1.5, -9.0]])
    params = [SamplingParams(temperature=0.0)] * 3
    assert components.sampler()(logits, params, [None] * 3) == [1, 0, 2]


def test_top_k_keeps_the_k_most_likely_tokens(components):
    counts = draws(components, 400, top_k=2)
    assert set(counts) == {0, 1}, f"top_k=2 drew tokens {sorted(counts)}; only 0 and 1 are in the top 2"


def test_top_k_one_is_greedy_at_any_temperature(components):
    assert set(draws(components, 100, top_k=1, temperature=5.0)) == {0}


def test_top_p_keeps_the_smallest_nucleus_that_reaches_p(components):
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is tokens 0 and 1.
    counts = draws(components, 400, top_p=0.7)
    assert set(counts) == {0, 1}, f"top_p=0.7 drew tokens {sorted(counts)}; the nucleus is 0 and 1"
    # 0.5 + 0.3 < 0.85: token 2 joins.
    assert set(draws(components, 400, top_p=0.85)) == {0, 1, 2}


def test_top_p_always_keeps_the_most_likely_token(components):
    assert set(draws(components, 100, top_p=1e-9)) == {0}


def test_draws_follow_the_renormalized_distribution(components):
    """After top-k the kept probabilities are renormalized: 0.5 and 0.3 become 5/8 and 3/8."""
    n = 4000
    counts = draws(components, n, top_k=2)
    assert abs(counts[0] / n - 5 / 8) < 0.03, f"token 0 drawn {counts[0] / n:.3f} of the time, expected 0.625"
    counts = draws(components, n)  # no filter: the distribution itself
    for token, p in enumerate(PROBS):
        assert abs(counts[token] / n - p) < 0.03, f"token {token}: {counts[token] / n:.3f}, expected {p}"


def test_temperature_sharpens_and_flattens(components):
    n = 2000
    cold = draws(components, n, temperature=0.25)
    hot = draws(components, n, temperature=4.0)
    # p ** (1 / T), renormalized: T = 0.25 gives token 0 about 0.88, T = 4 about 0.27.
    assert cold[0] / n > 0.8, f"at temperature 0.25 token 0 should dominate, got {cold[0] / n:.2f}"
    assert hot[0] / n < 0.35, f"at temperature 4 the distribution should flatten, got {hot[0] / n:.2f}"


def test_the_same_seed_gives_the_same_draws(components):
    assert draws(components, 50, top_p=0.9) == draws(components, 50, top_p=0.9)
    sampler = components.sampler()
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0)
    one = [sampler(logits, [p], [torch.Generator().manual_seed(7)])[0] for _ in range(5)]
    assert len(set(one)) == 1, "a fresh generator with the same seed must draw the same token"
