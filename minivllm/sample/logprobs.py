"""Log-probabilities: how sure the model was of each token, and what it nearly chose.

``SamplingParams(logprobs=k)`` asks, for every generated token, for its log-probability,
its rank in the vocabulary (1 = the most likely) and the ``k`` most likely tokens at that
position; ``prompt_logprobs=k`` asks the same for every prompt token after the first
(the first has nothing before it to be predicted from, so its entry is None). ``0`` gives
the chosen (or prompt) token alone; ``None`` turns it off. The shapes are vLLM's: one
``dict[token_id, Logprob]`` per position, holding the chosen token and the top-k (so
``k`` entries when the chosen token is among them, ``k + 1`` when it is not).

**Which logits.** vLLM V1 returns, by default (``logprobs_mode="raw_logprobs"``, its
``ModelConfig`` option), the log-softmax of the model's *raw* output: before
``logit_bias``, the penalties, temperature, min-p, top-k and top-p. Its other modes
(``"processed_logprobs"``, after all of them) must be asked for. minivllm implements the
default, and only it: a logprob here is what the model itself thinks, the same number
whatever the request's temperature, so it can be compared with transformers' forward pass
or another engine's. The logits are the very rows the sampler samples from (this step's,
of this request), taken before the processors change them.

**Cost.** Everything is batched: the model runner gathers the rows that ask (sampled rows
of requests with ``logprobs``, prompt positions of requests with ``prompt_logprobs``),
and :func:`compute_logprobs` runs one ``log_softmax`` and one ``topk`` over them. A step
in which no request asks does none of it.

What crosses from the engine core to the server is compact (:data:`PositionLogprobs`:
ids, values, ranks, no text); :func:`to_dict` turns it into vLLM's dict, decoding each
token with the tokenizer, on the side that holds one.

In vLLM: ``vllm/logprobs.py`` (``Logprob``), ``vllm/v1/sample/sampler.py``
(``gather_logprobs``), ``vllm/v1/engine/logprobs.py`` (``LogprobsProcessor``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.sampling_params import MAX_LOGPROBS

__all__ = ["MAX_LOGPROBS", "Logprob", "PositionLogprobs", "compute_logprobs", "to_dict"]

PositionLogprobs = tuple[list[int], list[float], list[int]]
"""One position, compact: token ids (the chosen one first, then the top-k, most likely
first), their log-probabilities, and their ranks (1 = the most likely)."""


@dataclass
class Logprob:
    """One token's entry at one position (vLLM's ``Logprob``)."""
    logprob: float
    rank: int | None = None
    """1 for the most likely token. The chosen token's rank counts the tokens at least as
    likely as it (vLLM's rule), so on a tie it is the larger of the tied ranks."""
    decoded_token: str | None = None
    """The token alone, decoded (``tokenizer.decode([id])``; a piece of a multi-byte
    character decodes to U+FFFD, as in vLLM)."""


def compute_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]
                     ) -> list[PositionLogprobs]:
    """Row ``i`` of ``[rows, vocab]`` logits scored ``token_ids[i]``; return, per row, that
    token's log-probability and rank and the ``num_top[i]`` most likely tokens.

    One ``log_softmax`` and one ``topk`` (as wide as the largest ``num_top``) for all rows
    together; the Python loop only slices lists."""
    if not token_ids:
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    chosen_values = chosen.squeeze(1).tolist()
    k = max(num_top)
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out = []
    for i, (token, n) in enumerate(zip(token_ids, num_top)):
        ids_i, values_i, ranks_i = [token], [chosen_values[i]], [ranks[i]]
        if n:
            ids_i += top_ids[i][:n]
            values_i += top_values[i][:n]
            ranks_i += range(1, n + 1)
        out.append((ids_i, values_i, ranks_i))
    return out


def to_dict(position: PositionLogprobs, tokenizer) -> dict[int, Logprob]:
    """vLLM's ``{token_id: Logprob}`` for one position: the chosen token first, then the
    top-k not already in (a dict keeps one entry per token)."""
    ids, values, ranks = position
    texts = ([tokenizer.decode([t]) for t in ids] if tokenizer is not None
             else [None] * len(ids))
    out: dict[int, Logprob] = {}
    for t, v, r, s in zip(ids, values, ranks, texts):
        if t not in out:
            out[t] = Logprob(v, r, s)
    return out
