"""Speculative decoding (notebook 12): guess several tokens cheaply, check them in one pass.

A decode step computes one token per request, and on a small batch most of its time is
spent reading the weights, not computing: scoring 5 tokens of one request costs little
more than scoring 1. So a cheap *proposer* guesses the next k tokens (the drafts), the
target model scores the request's last token plus the k drafts in the ordinary packed
step, and the *rejection sampler* keeps the drafts the target agrees with, plus one
token of the target's own. Every step still yields at least one token, and the output is
exactly what the target alone would have produced (greedy: the same tokens; sampling:
the same distribution).

* ``ngram_proposer``: drafts copied from earlier in the request (prompt lookup).
* ``rejection_sampler``: which drafts to keep, and the token that follows them.
* ``metrics``: drafts proposed and accepted, per position, with vLLM's names.

The scheduler counts drafts in the token budget and gives them KV slots; after the step
it rolls ``num_computed_tokens`` back over the rejected ones (``Scheduler.update_from_output``).

In vLLM (0.34): ``vllm/v1/worker/gpu/spec_decode/`` (the speculators and
``rejection_sampler.py``) and ``vllm/v1/spec_decode/metrics.py``.
"""
