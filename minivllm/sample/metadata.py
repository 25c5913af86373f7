"""SamplingMetadata: the layout of one step's logits rows, worked out once.

The forward pass returns logits only at the rows sampling needs (``logits_to_keep``),
laid out request by request: a request that samples owns one row, at its last token, or
with ``k`` draft tokens (speculative decoding) ``k + 1`` consecutive rows, its last
token's and one per draft. After every request's rows come the rows of prompt positions
whose ``prompt_logprobs`` are asked for.

Four things read that layout in a step: the logits processors (``logit_bias``, penalties,
grammar masks, which need each row's request and what it has generated so far), the
sampler, the rejection sampler and the logprobs. The model runner builds this record
once in ``prepare_step`` and hands it to each, so the layout is decided in one place
(vLLM: ``vllm/v1/sample/metadata.py``, built by the input batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.request import Request
from minivllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    requests: list[Request]
    """The requests that sample this step, in the order of their rows."""
    drafts: list[list[int]]
    """Each request's draft tokens (empty without speculative decoding)."""
    first_rows: list[int]
    """Request ``i`` owns rows ``first_rows[i]`` to ``first_rows[i] + len(drafts[i])``."""
    num_sample_rows: int
    """Rows of the sampling requests; the prompt-logprob rows follow them."""
    generators: list[torch.Generator | None]
    """Per request: its private generator (a request with a seed) or None (the sampler's
    shared one)."""
    row_params: list[SamplingParams]
    """Per row: its request's params, and what the row has seen (the prompt, and the
    tokens generated before it: a row that scores draft ``j`` comes after drafts
    ``0..j-1``). Empty when no request uses ``logit_bias`` or penalties, so a step without
    them pays nothing for these lists."""
    row_prompts: list[list[int]]
    row_outputs: list[list[int]]
    grammars: list
    """Per row: the request's grammar state (structured output) or None; empty when no
    request has one."""
    prompt_rows: list[tuple[str, int, int, int]]
    """(request id, index in the flat batch, prompt token it predicts, top tokens wanted)
    for each prompt position whose logprobs are asked for: the rows after the sampler's."""

    @classmethod
    def build(cls, requests: list[tuple[Request, list[int]]],
              prompt_rows: list[tuple[str, int, int, int]],
              generator: Callable[[Request], torch.Generator | None]) -> SamplingMetadata:
        """From the sampling requests with their drafts (in row order), the prompt-logprob
        rows, and how to get a request's private generator."""
        reqs = [r for r, _ in requests]
        drafts = [d for _, d in requests]
        first_rows, row = [], 0
        for d in drafts:
            first_rows.append(row)
            row += len(d) + 1
        params, prompts, outputs = [], [], []
        if any(r.sampling_params.logit_bias or r.sampling_params.has_penalties for r in reqs):
            for req, d in requests:
                for j in range(len(d) + 1):
                    params.append(req.sampling_params)
                    prompts.append(req.prompt_token_ids)
                    outputs.append(req.output_token_ids + d[:j])
        grammars = []
        if any(r.grammar is not None for r in reqs):
            for req, d in requests:
                if req.grammar is not None and d:
                    raise RuntimeError(f"request {req.request_id} has a grammar and drafts; the "
                                       f"engine never proposes drafts for it")
                grammars += [req.grammar] + [None] * len(d)
        return cls(reqs, drafts, first_rows, row, [generator(r) for r in reqs],
                   params, prompts, outputs, grammars, prompt_rows)

    def rows_of(self, i: int) -> slice:
        """The rows of request ``i``: one, or ``1 + len(drafts)`` with drafts."""
        return slice(self.first_rows[i], self.first_rows[i] + len(self.drafts[i]) + 1)
