"""The tools the throughput benchmark compares, each serving the same requests.

minivllm (continuous batching over a paged KV cache) against what a reader would
otherwise use: transformers ``generate()`` one request at a time (the loop a beginner
writes), padded static batches, and transformers' own continuous batching. Every tool
gets the same token ids, decodes greedily and ignores EOS, so each must return exactly
``max_tokens`` tokens per request and the greedy ones can be compared token by token
(notebook 02).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minivllm.engine.llm_engine import LLMEngine
from minivllm.sim.replay import replay_workload
from minivllm.sim.workload import WorkloadRequest

TOOLS = ("minivllm", "minivllm-torch-linear", "minivllm-onednn-linear", "minivllm-transposed-linear",
         "minivllm-async", "hf-generate", "hf-static", "hf-cb")
VARIANTS = {
    "minivllm-torch-linear": {"linear_backend": "torch"},
    "minivllm-onednn-linear": {"linear_backend": "onednn"},
    "minivllm-transposed-linear": {"linear_backend": "transposed"},
    "minivllm-async": {"async_scheduling": True},
}
"""The minivllm tools that are the reference engine with one setting changed."""
TOOL_LABELS = {
    "minivllm": "minivllm (continuous batching, paged KV)",
    "minivllm-torch-linear": "minivllm, linear_backend='torch'",
    "minivllm-onednn-linear": "minivllm, linear_backend='onednn'",
    "minivllm-transposed-linear": "minivllm, linear_backend='transposed'",
    "minivllm-async": "minivllm, async_scheduling=True",
    "hf-generate": "transformers generate(), one at a time",
    "hf-static": "transformers generate(), padded static batches",
    "hf-cb": "transformers continuous batching",
}


@dataclass
class ToolResult:
    tool: str
    wall_s: float
    output_tokens: int
    token_ids: list[list[int]]
    """Generated token ids per request, in workload order."""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


def run_minivllm(engine: LLMEngine, workload: Sequence[WorkloadRequest]) -> ToolResult:
    """All requests at once through the engine (the trace stays on ``engine.trace``)."""
    ids = {r.request_id for r in workload}
    if len(ids) != len(workload):
        raise ValueError("workload request ids must be unique")
    t = time.perf_counter()
    res = replay_workload(engine, [copy.copy(r) for r in workload])
    wall = time.perf_counter() - t
    tokens = [res.outputs[r.request_id].outputs[0].token_ids for r in workload]
    return ToolResult("minivllm", wall, sum(map(len, tokens)), tokens)


def _quiet_transformers() -> None:
    # eos_token_id=-1 (never stop) is deliberate; transformers warns about it every call.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def _gen_config(max_new_tokens: int, pad_token_id: int):
    from transformers import GenerationConfig

    # eos -1: no token ever matches, so exactly max_new_tokens come out (ignore_eos).
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                            eos_token_id=-1, pad_token_id=pad_token_id)


@torch.inference_mode()
def run_hf_generate(model, workload: Sequence[WorkloadRequest], pad_token_id: int = 0) -> ToolResult:
    """transformers ``generate()`` one request at a time: the loop a beginner writes."""
    _quiet_transformers()
    dev = model.device
    tokens = []
    t = time.perf_counter()
    for r in workload:
        ids = torch.tensor([r.prompt_token_ids], device=dev)
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             generation_config=_gen_config(r.max_tokens, pad_token_id))
        tokens.append(out[0, ids.shape[1]:].tolist())
    wall = time.perf_counter() - t
    return ToolResult("hf-generate", wall, sum(map(len, tokens)), tokens)


@torch.inference_mode()
def run_hf_static(model, workload: Sequence[WorkloadRequest], batch_size: int = 8,
                  pad_token_id: int = 0) -> ToolResult:
    """Padded static batches in arrival order: left padding plus an attention mask; each
    batch runs until its longest request is done (shorter ones' extra tokens are waste
    and are not counted)."""
    _quiet_transformers()
    dev = model.device
    tokens = []
    t = time.perf_counter()
    for b in range(0, len(workload), batch_size):
        batch = workload[b : b + batch_size]
        width = max(r.num_prompt_tokens for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - r.num_prompt_tokens :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.num_prompt_tokens :] = 1
        out = model.generate(ids.to(dev), attention_mask=mask.to(dev),
                             generation_config=_gen_config(max(r.max_tokens for r in batch), pad_token_id))
        for i, r in enumerate(batch):
            tokens.append(out[i, width : width + r.max_tokens].tolist())
    wall = time.perf_counter() - t
    return ToolResult("hf-static", wall, sum(map(len, tokens)), tokens)


@torch.inference_mode()
def run_hf_continuous(model, workload: Sequence[WorkloadRequest], page_size: int = 16,
                      max_batch_tokens: int = 512, num_blocks: int | None = None,
                      pad_token_id: int = 0) -> ToolResult:
    """transformers' own continuous batching (``ContinuousBatchingManager``) with a
    paged cache sized for the whole workload and minivllm's token budget. Its warm-up
    runs before the clock starts."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    _quiet_transformers()
    if num_blocks is None:
        num_blocks = sum(-(-(r.num_prompt_tokens + r.max_tokens) // page_size) for r in workload) + 16
    cfg = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=page_size,
                                   max_batch_tokens=max_batch_tokens, use_cuda_graph=False,
                                   auto_switch_to_flash=False)
    gen = _gen_config(max(r.max_tokens for r in workload), pad_token_id)
    results = {}
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cfg) as mgr:
        t = time.perf_counter()
        for r in workload:
            mgr.add_request(list(r.prompt_token_ids), request_id=f"req-{r.request_id}",
                            max_new_tokens=r.max_tokens, eos_token_id=-1)
        while len(results) < len(workload):
            out = mgr.get_result(timeout=1)
            if out is not None and out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"transformers CB failed on {out.request_id}: {out.error}")
                results[out.request_id] = out
            elif out is None and not mgr.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
        wall = time.perf_counter() - t
    tokens = [list(results[f"req-{r.request_id}"].generated_tokens) for r in workload]
    return ToolResult("hf-cb", wall, sum(map(len, tokens)), tokens)
