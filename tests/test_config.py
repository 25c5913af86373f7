"""EngineConfig is the one source of the engine's settings: LLM's keyword arguments, the
command line's flags and the KV-cache sizing all follow it."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from minivllm import LLM, EngineConfig
from minivllm.config import DEFAULT_KV_CACHE_MEMORY
from minivllm.core.kv_cache_utils import size_kv_cache
from minivllm.engine.arg_utils import add_engine_arguments, engine_kwargs
from minivllm.entrypoints.cli import GENERATE_SETTINGS, SERVE_SETTINGS
from minivllm.exceptions import ValidationError


def test_llm_keyword_arguments_are_the_engine_config_fields_with_their_defaults():
    params = inspect.signature(LLM.__init__).parameters
    llm_args = {name: p.default for name, p in params.items() if name not in ("self", "tokenizer")}
    config = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert llm_args == config


def test_cli_flags_come_from_the_fields():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, SERVE_SETTINGS)
    defaults = engine_kwargs(parser.parse_args([]))
    assert defaults == {name: getattr(EngineConfig(), name) for name in SERVE_SETTINGS}
    given = engine_kwargs(parser.parse_args([
        "--max-num-seqs", "3", "--kv-cache-memory", "1000000", "--no-enable-prefix-caching",
        "--log-stats-interval", "0.5", "--attention-backend", "torch"]))
    config = EngineConfig(**given)
    assert (config.max_num_seqs, config.kv_cache_memory, config.enable_prefix_caching,
            config.log_stats_interval, config.attention_backend) == (3, 1000000, False, 0.5, "torch")
    with pytest.raises(SystemExit):  # choices come from the field too
        parser.parse_args(["--dtype", "float64"])
    help_text = parser.format_help()
    for f in dataclasses.fields(EngineConfig):
        if f.name in SERVE_SETTINGS:
            assert f.metadata["help"][:30] in " ".join(help_text.split())
    assert set(GENERATE_SETTINGS) < set(SERVE_SETTINGS)


def test_kv_cache_sizing():
    per_token = 1000
    # Default: 1 GiB, but no more than max_num_seqs requests of full length can use.
    size = size_kv_cache(EngineConfig(max_num_seqs=2), per_token, model_max_len=100)
    assert (size.num_blocks, size.max_model_len) == (2 * 7, 100)  # 7 blocks of 16 hold 100 tokens
    size = size_kv_cache(EngineConfig(), per_token, model_max_len=10_000_000)
    assert size.num_blocks == DEFAULT_KV_CACHE_MEMORY // (per_token * 16)
    assert size.max_model_len == size.num_tokens == size.num_blocks * 16
    # An explicit budget or block count wins.
    assert size_kv_cache(EngineConfig(kv_cache_memory=160_000), per_token, 100).num_blocks == 10
    size = size_kv_cache(EngineConfig(num_kv_blocks=5, block_size=4), per_token, 100)
    assert (size.num_blocks, size.block_bytes, size.max_model_len) == (5, 4000, 20)
    # What could never work is refused, naming the setting.
    for config, param in [(EngineConfig(kv_cache_memory=100), "kv_cache_memory"),
                          (EngineConfig(max_model_len=200), "max_model_len"),
                          (EngineConfig(num_kv_blocks=2, max_model_len=64), "max_model_len")]:
        with pytest.raises(ValidationError) as e:
            size_kv_cache(config, per_token, model_max_len=100)
        assert e.value.param == param
