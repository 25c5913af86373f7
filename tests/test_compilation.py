"""The compiled model (``compilation_config``, ``minivllm.compilation``): the same greedy
tokens as transformers' generate(), through batching, chunking and preemption; two
graphs at start and none after; what it refuses, with the field named."""

from __future__ import annotations

import pytest
import torch
from helpers import all_blocks_free, hf_greedy, random_workload, run_engine
from torch._dynamo.utils import counters

from minivllm import LLM, EngineConfig
from minivllm.compilation import unified_attention
from minivllm.config import CompilationConfig
from minivllm.entrypoints.cli import build_parser
from minivllm.exceptions import ValidationError
from minivllm.worker.linear_plan import onednn_usable
from minivllm.worker.model_loader import make_tiny_model

VOCAB = 512


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_model("llama", vocab_size=VOCAB)
    prompts, lengths = random_workload(16, VOCAB, seed=1, max_len=100, max_out=40)
    return model, prompts, lengths, [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_inductor_compiled_tokens_equal_generate_under_chunking_and_preemption(tiny):
    """Inductor's code, with prefill chunks sharing steps with decodes and a cache small
    enough to preempt: token for token transformers' generate(). Warm-up traced both
    graphs; the workload, with steps from 1 to 64 tokens, traces none."""
    model, prompts, lengths, refs = tiny
    before = _graphs()
    llm = LLM(model, tokenizer=None, log_stats_interval=None, num_kv_blocks=24, max_num_batched_tokens=64,
              compilation_config={"mode": 3, "backend": "inductor"})
    engine = llm.llm_engine
    assert engine.compilation == CompilationConfig(3, "inductor")
    assert engine.model_runner.compile_seconds > 0
    warmed = _graphs()
    assert warmed - before == 2  # one token; any number
    assert run_engine(llm, prompts, lengths) == refs
    steps = list(llm.trace.steps)
    assert sum(len(s.preempted) for s in steps) > 0, "the small cache should force preemption"
    assert {s.num_tokens for s in steps} >= {1, 64}
    assert _graphs() == warmed, "a step traced the model again after warm-up"
    assert all_blocks_free(llm)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_traced_graph_tokens_equal_generate_for_each_architecture(arch):
    """The tracer's graph (backend "eager": traced, run op by op) of each architecture the
    engine serves, through a batch with prefix caching: the graph holds the whole model."""
    model = make_tiny_model(arch, vocab_size=VOCAB)
    prompts, lengths = random_workload(6, VOCAB, seed=5, max_len=60, max_out=20)
    prompts = prompts + [prompts[0] + [7, 8, 9]]  # shares a cached prefix with the first
    lengths = lengths + [10]
    llm = LLM(model, tokenizer=None, log_stats_interval=None, max_num_batched_tokens=48,
              compilation_config={"mode": 3, "backend": "eager"})
    assert run_engine(llm, prompts, lengths) == [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    assert all_blocks_free(llm)


@pytest.mark.parametrize("value, mode", [(3, 3), ({"mode": 3}, 3), ({"level": 3}, 3), (0, 0), ({}, 0),
                                         ({"mode": 3, "backend": "eager"}, 3)])
def test_compilation_config_takes_vllms_forms(value, mode):
    assert EngineConfig(compilation_config=value).compilation_config["mode"] == mode


@pytest.mark.parametrize("value, says", [
    (2, "mode must be one of"), ({"mode": 4}, "mode must be one of"),
    ({"mode": 3, "cudagraph_capture_sizes": [1, 2]}, "unknown keys ['cudagraph_capture_sizes']"),
    ({"mode": 3, "level": 3}, "not both"), ({"backend": "aot_eager"}, "'inductor' or 'eager'"),
    ("3", "must be a mode number"), (True, "must be a mode number")])
def test_bad_compilation_config_is_refused(value, says):
    with pytest.raises(ValidationError, match="compilation_config") as e:
        EngineConfig(compilation_config=value)
    assert says in str(e.value)


def test_enforce_eager_wins_and_mode_0_runs_eagerly(tiny):
    model = tiny[0]
    for kwargs in ({"compilation_config": 3, "enforce_eager": True}, {"compilation_config": 0}, {}):
        engine = LLM(model, tokenizer=None, log_stats_interval=None, **kwargs).llm_engine
        assert engine.compilation is None and engine.model_runner.compiled is None


@pytest.mark.parametrize("kwargs, field", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": {"num_cpu_blocks": 8}}}, "kv_transfer_config"),
    ({"linear_backend": "transposed"}, "linear_backend")])
def test_what_the_compiled_path_does_not_run_is_refused_naming_the_field(tiny, kwargs, field):
    with pytest.raises(ValidationError) as e:
        LLM(tiny[0], tokenizer=None, log_stats_interval=None, compilation_config=3, **kwargs)
    assert e.value.param == field and "enforce_eager=True" in str(e.value)


@pytest.mark.skipif(not onednn_usable(torch.device("cpu"), torch.float32), reason="no oneDNN here")
def test_a_fixed_onednn_linear_backend_is_refused_when_compiled(tiny):
    with pytest.raises(ValidationError, match="onednn"):
        LLM(tiny[0], tokenizer=None, log_stats_interval=None, compilation_config=3, linear_backend="onednn")


def test_the_command_line_takes_the_mode_and_enforce_eager():
    parser = build_parser()
    args = parser.parse_args(["serve", "--compilation-config", "3", "--enforce-eager"])
    assert args.compilation_config == 3 and args.enforce_eager is True
    args = parser.parse_args(["generate", "hi", "--compilation-config", '{"mode": 3, "backend": "eager"}'])
    assert EngineConfig(compilation_config=args.compilation_config).compilation_config == {"mode": 3,
                                                                                          "backend": "eager"}


def test_the_attention_op_outside_a_forward_context_says_how_to_call_it():
    q = torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="forward_context"):
        unified_attention(q, q[:, :2], q[:, :2], 0, 1.0)


def test_speculative_drafts_through_the_traced_graph_keep_the_tokens(tiny):
    """With n-gram drafts a request keeps several logits rows per step; the graph's logits
    rows are dynamic too."""
    model, prompts, lengths, refs = tiny
    repetitive = [p[:8] * 4 for p in prompts[:6]]  # something for prompt lookup to find
    llm = LLM(model, tokenizer=None, log_stats_interval=None, compilation_config={"mode": 3, "backend": "eager"},
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert run_engine(llm, repetitive, lengths[:6]) == [hf_greedy(model, p, n) for p, n in zip(repetitive, lengths[:6])]
    assert any(c.num_draft_tokens for s in llm.trace.steps for c in s.scheduled)
    assert all_blocks_free(llm)


@pytest.mark.parametrize("kwargs, backend", [({"quantization": "int8"}, "inductor"),
                                             ({"kv_cache_dtype": "fp8"}, "eager")])
def test_quantized_weights_and_an_8bit_cache_compile_to_the_same_tokens(tiny, kwargs, backend):
    """Int8 layers (their own forward, traced into the graph) and an fp8 cache (read inside
    the opaque op): the same greedy tokens as the same settings eager."""
    model, prompts, lengths, _ = tiny
    eager = LLM(model, tokenizer=None, log_stats_interval=None, **kwargs)
    compiled = LLM(model, tokenizer=None, log_stats_interval=None,
                   compilation_config={"mode": 3, "backend": backend}, **kwargs)
    assert run_engine(compiled, prompts[:6], lengths[:6]) == run_engine(eager, prompts[:6], lengths[:6])
