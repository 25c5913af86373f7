"""The engine's linear layers through oneDNN (minivllm.linear) against stock nn.Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_greedy
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.linear import onednn_available, onednn_linear, plain_linears, resolve_linear_backend
from minivllm.model_loader import make_tiny_model

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")
CPU = torch.device("cpu")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (1, 5, 64), (512, 64)])
def test_onednn_linear_matches_nn_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(64, 96, bias=bias)
    x = torch.randn(*shape, generator=g)
    expected = F.linear(x, layer.weight, layer.bias)
    with torch.inference_mode(), onednn_linear([layer]):
        out = layer(x)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_layers_are_plain_again_after_the_block_even_on_error():
    model = make_tiny_model("llama")
    linears = plain_linears(model)
    assert len(linears) == 7 * model.config.num_hidden_layers + 1  # q k v o gate up down, lm_head
    with pytest.raises(RuntimeError, match="boom"), onednn_linear(linears):
        assert all(type(m) is not nn.Linear for m in linears)
        raise RuntimeError("boom")
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


def test_resolve_linear_backend():
    assert resolve_linear_backend("torch", CPU, torch.float32) == "torch"
    assert resolve_linear_backend("auto", CPU, torch.float16) == "torch"
    assert resolve_linear_backend("auto", torch.device("cuda"), torch.float32) == "torch"
    expected = "onednn" if onednn_available() else "torch"
    assert resolve_linear_backend("auto", CPU, torch.float32) == expected
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        resolve_linear_backend("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        resolve_linear_backend("onednn", CPU, torch.float16)


@needs_onednn
def test_engine_uses_onednn_and_leaves_the_model_stock():
    """The default engine on a CPU computes through oneDNN, its greedy tokens equal stock
    generate()'s, and between steps the model is the user's plain model again."""
    model = make_tiny_model("qwen2", vocab_size=512)
    prompt = list(range(3, 40))
    ref = hf_greedy(model, prompt, 12)
    llm = LLM(model)
    assert llm.llm_engine.linear_backend == "onednn"
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref
    assert all(type(m) is nn.Linear for m in plain_linears(model)) and plain_linears(model)
    assert hf_greedy(model, prompt, 12) == ref
