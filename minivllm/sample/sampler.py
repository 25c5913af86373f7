"""Sampler: from the last position's logits to one token per request.

Greedy requests (temperature below ``SAMPLING_EPS``) take the argmax (ties go to the
lowest token id, as in transformers). Random requests apply temperature, then top-k,
then top-p, and draw from the remaining distribution with their own generator when they
carry a seed, so the same seed gives the same output whatever else shares the batch.
Top-k and top-p always keep at least the most likely token, however small ``top_p`` is.

Before any of that, :func:`apply_logits_processors` changes the logits of the requests
that ask for it, the whole batch at once (vLLM's order): ``logit_bias`` is added, then the
repetition penalty (tokens seen in the prompt or the output), then the frequency and
presence penalties (tokens seen in the output only), then, for requests with structured
output, the grammar's mask (every token the grammar forbids gets ``-inf``;
``minivllm.sample.structured_output``). Greedy takes the argmax of those logits. ``min_p`` comes
after temperature and before top-k/top-p. Rows of requests that ask for none of this are
not touched.

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


LOGIT_LIMIT = 1e30
"""Penalized logits are clipped to this magnitude: far beyond any real logit, and still
finite in float32 after dividing by the smallest temperature (``SAMPLING_EPS``)."""


def token_counts(token_ids: list[list[int]], vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]``: how many times each token occurs in each row's list. The
    lists are padded to one width with ``vocab_size``, an id no token has, counted in a
    spare last column that is then dropped: one ``scatter_add_`` for the whole batch."""
    width = max(map(len, token_ids), default=0)
    padded = torch.full((len(token_ids), width), vocab_size, dtype=torch.int64)
    for i, ids in enumerate(token_ids):  # building the tensor, once per step
        padded[i, :len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.int64)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]],
                    output_ids: list[list[int]], params: list[SamplingParams]) -> torch.Tensor:
    """Repetition, frequency and presence penalties on ``[rows, vocab]`` float logits, one
    row per entry of the lists; returns new logits.

    * repetition (CTRL, as transformers and vLLM): a token seen in the prompt or the output
      has its logit divided by the penalty when positive and multiplied when negative, so
      a penalty above 1 makes it less likely whatever its sign;
    * frequency (OpenAI): minus the penalty times the token's count in the output;
    * presence (OpenAI): minus the penalty once if the token is in the output at all.
    """
    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64, device=logits.device).unsqueeze(1)

    vocab, dtype = logits.shape[-1], logits.dtype
    out_counts = token_counts(output_ids, vocab).to(logits.device)
    seen = (token_counts(prompt_ids, vocab).to(logits.device) > 0) | (out_counts > 0)
    # In float64, then back within +-LOGIT_LIMIT: any penalty > 0 is allowed (vLLM's
    # rule), and 1e-300 would be 0 in float32 (a division by zero) or turn a logit into
    # inf, and inf - inf in the softmax is NaN. Clipped, such a token is merely certain
    # (or impossible), and the request samples instead of failing.
    logits = logits.double()
    rep = column([p.repetition_penalty for p in params])
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - column([p.frequency_penalty for p in params]) * out_counts
    logits = logits - column([p.presence_penalty for p in params]) * (out_counts > 0)
    return logits.clamp(-LOGIT_LIMIT, LOGIT_LIMIT).to(dtype)


def apply_logits_processors(logits: torch.Tensor, params: list[SamplingParams],
                            prompt_ids: list[list[int]], output_ids: list[list[int]],
                            grammars: list | None = None) -> torch.Tensor:
    """``logit_bias``, then the penalties, on the rows of ``[rows, vocab]`` logits whose
    request asks for them; row ``i`` belongs to ``params[i]`` and has seen
    ``prompt_ids[i]`` and ``output_ids[i]``. Returns float logits; every other row keeps
    exactly its values, and when no row asks, the logits come back as they came.

    The model runner calls this once per step for every row it will sample from, before
    the sampler and the rejection sampler (speculative decoding), so both draw from the
    same logits. A row that scores a draft counts the drafts before it as output, as if
    they had been generated (vLLM does the same).

    ``grammars``: per row, the ``GrammarState`` of a request with structured output, or
    None. Those rows are masked last (a mask commutes with the rest: ``-inf`` stays
    ``-inf`` under any bias, penalty or temperature); an empty or all-None list masks
    nothing. ``params`` may be empty when no row asks for a bias or a penalty."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    penalized = [i for i, p in enumerate(params) if p.has_penalties]
    constrained = [i for i, g in enumerate(grammars or []) if g is not None]
    if not biased and not penalized and not constrained:
        return logits
    logits = logits.float().clone()
    if biased:
        rows = [i for i in biased for _ in params[i].logit_bias]
        tokens = [t for i in biased for t in params[i].logit_bias]
        values = [b for i in biased for b in params[i].logit_bias.values()]
        logits.index_put_((torch.tensor(rows), torch.tensor(tokens)),
                          torch.tensor(values, dtype=logits.dtype).to(logits.device),
                          accumulate=True)
    if penalized:
        rows = torch.tensor(penalized, device=logits.device)
        logits[rows] = apply_penalties(logits[rows], [prompt_ids[i] for i in penalized],
                                       [output_ids[i] for i in penalized],
                                       [params[i] for i in penalized])
    if constrained:
        from minivllm.sample.structured_output import (
            apply_grammar_bitmask,  # xgrammar only when used
        )
        logits = apply_grammar_bitmask(logits, constrained, [grammars[i] for i in constrained])
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Mask (to -inf) every token less likely than ``min_p`` times the most likely one.
    Unlike top-p the cut scales with the model's confidence: a sure model keeps few tokens,
    an unsure one many. The most likely token always stays."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))


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
    """The distribution a random request draws from, on the CPU: temperature, then min-p,
    then top-k, then top-p, then softmax, for one row of ``[vocab]`` logits. The rejection
    sampler (speculative decoding) accepts drafts against exactly this distribution."""
    # Divide in float64: a huge (finite) temperature overflows to inf in float32, and
    # -inf / inf is NaN. The result is then float32 again, like the logits.
    row = (logits.double() / p.temperature).float()
    if p.min_p > 0:
        row = apply_min_p(row, p.min_p)
    probs = apply_top_k_top_p(row, p.top_k, p.top_p).softmax(-1).cpu()
    if not torch.isfinite(probs).all() or not probs.sum() > 0:
        raise SamplingError("the token distribution is not a valid probability distribution")
    return probs
