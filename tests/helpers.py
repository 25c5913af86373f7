"""Shared test helpers: the reference nobody here wrote is transformers' generate()."""

from __future__ import annotations

import dataclasses
import random

import torch
from transformers import GenerationConfig

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.config import COMPONENT_FIELDS, load_component
from minivllm.worker.attention import BACKEND_CLASSES, BACKENDS


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


class Components:
    """The classes the tests build the engine's parts from (the ``components`` fixture).

    ``given`` holds "field=spec" strings (``--component``) or (field, class) pairs
    (``minivllm check`` in a notebook); a field not given is the engine's own class,
    loaded from its default name by the engine's own hook (``load_component``), so the
    whole suite passing by default proves the hook, not a shortcut around it.
    """

    def __init__(self, given: list) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)
                    if f.name in COMPONENT_FIELDS}
        self.engine: dict[str, object] = {}
        """What was given, as LLM keyword arguments (empty: the engine's defaults)."""
        for item in given:
            field, spec = item.split("=", 1) if isinstance(item, str) else item
            if field not in defaults:
                raise ValueError(f"--component {field}: not one of {sorted(defaults)}")
            self.engine[field] = spec
        specs = {**defaults, **self.engine}
        if specs["attention_backend"] in BACKENDS:  # the reference runs on any machine
            specs["attention_backend"] = BACKEND_CLASSES["torch"]
        self.classes = {field: load_component(field, spec) for field, spec in specs.items()}

    def kv_cache_manager(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        return self.classes["kv_cache_manager_cls"](
            num_blocks, block_size, enable_caching, block_pool_cls=self.classes["block_pool_cls"])

    def scheduler(self, kv_cache_manager, max_num_seqs: int, max_num_batched_tokens: int,
                  max_model_len: int, enable_chunked_prefill: bool = True):
        return self.classes["scheduler_cls"](kv_cache_manager, max_num_seqs, max_num_batched_tokens,
                                             max_model_len, enable_chunked_prefill)

    def sampler(self, seed: int = 0):
        return self.classes["sampler_cls"](seed)

    def attention_backend(self, kv_caches, device):
        return self.classes["attention_backend"](kv_caches, device)
