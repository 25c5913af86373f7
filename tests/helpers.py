"""Shared test helpers: the reference nobody here wrote is transformers' generate()."""

from __future__ import annotations

import random

import torch
from transformers import GenerationConfig

from minivllm import LLM, SamplingParams


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers generate(), greedy, one request, never stopping at EOS."""
    saved = model.config._attn_implementation, model.generation_config
    model.set_attn_implementation("sdpa")
    # generate() merges the model's own generation config (which names an EOS) into ours.
    model.generation_config = GenerationConfig()
    try:
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            generation_config=config,
        )
    finally:
        model.set_attn_implementation(saved[0])
        model.generation_config = saved[1]
    return out[0, len(prompt_ids):].tolist()


def random_workload(n: int, vocab: int, seed: int = 0, min_len: int = 1, max_len: int = 100,
                    max_out: int = 40) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]
    lengths = [rng.randint(1, max_out) for _ in range(n)]
    return prompts, lengths


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_engine(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(n) for n in lengths],
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def all_blocks_free(llm: LLM) -> bool:
    kv = llm.llm_engine.kv_cache_manager
    kv.check_invariants()
    pool = kv.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
