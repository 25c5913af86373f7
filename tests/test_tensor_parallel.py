"""Tensor parallelism (minivllm.distributed): T processes, one model split by heads.

The reference is transformers' generate() and the engine at T=1: greedy tokens must be
identical. Every engine here starts T-1 worker processes (a few seconds each on two
cores), so the models are tiny and the engines few; every wait is bounded.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import all_blocks_free, hf_greedy, random_workload, run_engine

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.exceptions import ValidationError
from minivllm.worker.model_loader import make_tiny_model

pytestmark = pytest.mark.multiprocess

VOCAB = 512


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie has exited: it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def worker_pids(llm: LLM) -> list[int]:
    return llm.llm_engine.executor.worker_pids


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_process_starts():
    import multiprocessing

    model = make_tiny_model("llama", vocab_size=VOCAB)  # 4 heads, 2 KV heads
    before = set(multiprocessing.active_children())
    with pytest.raises(ValidationError, match="4 attention heads and 2 KV heads") as e:
        LLM(model, tensor_parallel_size=3, log_stats_interval=0)
    assert e.value.param == "tensor_parallel_size"
    assert set(multiprocessing.active_children()) == before
    with pytest.raises(ValidationError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


@pytest.mark.parametrize("arch,tp,heads,kv_heads", [
    ("llama", 2, 6, 6),    # multi-head attention
    ("qwen2", 3, 6, 3),    # grouped-query attention, q/k/v biases
    ("mistral", 2, 4, 2),  # grouped-query attention
])
def test_greedy_tokens_identical_to_t1_and_generate(arch, tp, heads, kv_heads):
    """Batching, chunked prefill (16-token budget, prompts up to 40) and preemption
    (14 blocks of 4 tokens for 8 requests of up to 56), at T ranks."""
    model = make_tiny_model(arch, vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
                            num_attention_heads=heads, num_key_value_heads=kv_heads)
    prompts, lengths = random_workload(8, VOCAB, seed=3, min_len=5, max_len=40, max_out=16)
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    settings = dict(log_stats_interval=0, max_num_batched_tokens=16, block_size=4, num_kv_blocks=14,
                    linear_backend="torch")
    one = LLM(model, **settings)
    assert run_engine(one, prompts, lengths) == refs
    with LLM(model, tensor_parallel_size=tp, **settings) as llm:
        pids = worker_pids(llm)
        assert len(pids) == tp - 1 and all(alive(p) for p in pids)
        assert run_engine(llm, prompts, lengths) == refs
        steps = list(llm.trace.steps)
        assert any(s.preempted for s in steps)
        assert max(map(len, prompts)) > 16  # so some prompts went in chunks of the budget
        # Rank 0's KV cache holds its share of the KV heads; the caller's model is whole.
        assert llm.llm_engine.model_runner.kv_caches[0][0].shape[2] == kv_heads // tp
        assert model.model.layers[0].self_attn.q_proj.weight.shape == (48, 48)
        # Every rank's forward, split; 2 all-reduces per decoder layer.
        for s in steps:
            assert len(s.parallel.comm_time) == len(s.parallel.compute_time) == tp
            assert s.parallel.num_all_reduces == 2 * model.config.num_hidden_layers
            assert all(c > 0 for c in s.parallel.comm_time)
    assert wait_gone(pids, timeout=10)


def test_two_engines_at_once_then_garbage_collection_and_a_failed_step_end_the_workers():
    model = make_tiny_model("llama", vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
                            num_attention_heads=6, num_key_value_heads=2)
    prompts, lengths = random_workload(3, VOCAB, seed=5, max_len=20, max_out=8)
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    settings = dict(tensor_parallel_size=2, log_stats_interval=0, linear_backend="torch")
    a, b = LLM(model, **settings), LLM(model, **settings)  # each group on its own free port
    assert run_engine(a, prompts[:1], lengths[:1]) == refs[:1]
    assert run_engine(b, prompts, lengths) == refs
    assert run_engine(a, prompts, lengths) == refs
    pids_a, pids_b = worker_pids(a), worker_pids(b)
    del a
    gc.collect()
    assert wait_gone(pids_a, timeout=10)
    assert all(alive(p) for p in pids_b)

    # A step that fails on rank 0 ends the workers (they would wait in an all-reduce).
    def fail(*args):
        raise RuntimeError("injected failure")

    b.llm_engine.model.model.layers[0].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        run_engine(b, prompts, lengths)
    assert wait_gone(pids_b, timeout=5)
    with pytest.raises(RuntimeError, match="shut down"):
        run_engine(b, prompts, lengths)


PARENT = """
import os, signal
from minivllm import LLM, SamplingParams
from minivllm.worker.model_loader import make_tiny_model

if __name__ == "__main__":
    llm = LLM(make_tiny_model("llama", num_attention_heads=4, num_key_value_heads=2),
              tensor_parallel_size=2, log_stats_interval=0, linear_backend="torch")
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)
    print(*llm.llm_engine.executor.worker_pids, flush=True)
    if "{how}" == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no atexit: as if it crashed
    # Ctrl-C in the middle of a long generate(): KeyboardInterrupt in the main thread.
    # Python installs that handler only if SIGINT was not ignored when it started, and a
    # background job of a non-interactive shell (a CI runner) starts with it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGALRM, lambda *a: os.kill(os.getpid(), signal.SIGINT))
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    llm.generate([{{"prompt_token_ids": [1, 2, 3]}}] * 8,
                 SamplingParams(max_tokens=900, ignore_eos=True), use_tqdm=False)
    print("not interrupted", flush=True)
"""


@pytest.mark.parametrize("how", ["kill", "ctrl-c"])
def test_workers_end_when_the_engine_process_is_killed_or_interrupted(tmp_path, how):
    path = tmp_path / "parent.py"
    path.write_text(PARENT.replace("{how}", how).replace("{{", "{").replace("}}", "}"))
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=90,
                          cwd=os.getcwd())
    assert proc.returncode != 0 and "not interrupted" not in proc.stdout
    if how == "ctrl-c":
        assert "KeyboardInterrupt" in proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1, proc.stderr
    assert wait_gone(pids, timeout=10)


UNGUARDED = """
from minivllm import LLM
from minivllm.worker.model_loader import make_tiny_model

llm = LLM(make_tiny_model("llama", num_attention_heads=4, num_key_value_heads=2),
          tensor_parallel_size=2, log_stats_interval=0, linear_backend="torch")
print("built", flush=True)
"""


def test_a_script_without_the_main_guard_is_told_so_in_seconds(tmp_path):
    """The worker re-imports the script (forkserver, spawn) and would build the LLM again:
    it exits at once, and the parent names the missing guard instead of waiting on it."""
    path = tmp_path / "unguarded.py"
    path.write_text(UNGUARDED)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120,
                          cwd=os.getcwd())
    assert proc.returncode != 0 and "built" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: tensor-parallel worker 1"), proc.stderr[-2000:]
    assert str(path) in last and 'if __name__ == "__main__":' in last
    print(f"told in {time.monotonic() - start:.1f} s")  # the bound is the subprocess timeout


def test_a_worker_killed_mid_step_is_named_at_once():
    llm = LLM(make_tiny_model("llama", vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2),
              tensor_parallel_size=2, log_stats_interval=0, linear_backend="torch")
    pid = llm.llm_engine.executor.worker_pids[0]
    timer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    timer.start()
    with pytest.raises(RuntimeError, match=f"worker 1 \\(pid {pid}\\) was killed by SIGKILL"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4,
                     SamplingParams(max_tokens=100_000, ignore_eos=True), use_tqdm=False)
    timer.join()
    assert all_blocks_free(llm)  # the failed step's requests were finished, their blocks freed


@pytest.mark.real_model
def test_smollm2_with_three_ranks_is_token_identical_to_one():
    """SmolLM2-135M: 9 query heads and 3 KV heads, so 3 query heads and 1 KV head per rank."""
    from minivllm.worker.model_loader import load_model

    model, tokenizer = load_model()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
               for text in ("What is the capital of France?", "Write a haiku about the sea.")]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    lengths = [12, 12]
    one = run_engine(LLM(model, tokenizer=tokenizer, log_stats_interval=0), prompts, lengths)
    with pytest.raises(ValidationError, match="9 attention heads and 3 KV heads"):
        LLM(model, tokenizer=tokenizer, tensor_parallel_size=2, log_stats_interval=0)
    with LLM(model, tokenizer=tokenizer, tensor_parallel_size=3, log_stats_interval=0) as llm:
        assert run_engine(llm, prompts, lengths) == one


def test_the_command_line_takes_tensor_parallel_size():
    from minivllm.entrypoints.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--tensor-parallel-size", "3"]).tensor_parallel_size == 3
    assert parser.parse_args(["generate", "hi", "--tensor-parallel-size", "3"]).tensor_parallel_size == 3
    assert parser.parse_args(["bench", "tensor-parallel", "--tp-sizes", "1,3"]).tp_sizes == "1,3"


def test_bench_compares_sizes_splits_the_forward_and_reports_a_refused_size(capsys):
    from minivllm.bench.tensor_parallel import compare

    model = make_tiny_model("llama", vocab_size=VOCAB, num_attention_heads=6, num_key_value_heads=6,
                            hidden_size=48, intermediate_size=96)
    prompts, _ = random_workload(3, VOCAB, seed=7, max_len=12)
    rows = compare("tiny", model, [1, 2, 4], prompts, 4, linear_backend="torch")
    one, two, four = rows
    assert two["identical_to_T1"] is True and two["tokens"] == one["tokens"]
    assert two["decode_comm_ms"] > 0 and one["decode_comm_ms"] == 0
    assert two["all_reduces_per_step"] == 2 * model.config.num_hidden_layers
    assert "6 attention heads" in four["refused"]
    assert "T=4: refused" in capsys.readouterr().out
