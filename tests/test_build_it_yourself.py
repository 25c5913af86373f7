"""The build-it-yourself track (build_it_yourself/, minivllm/check.py) is proven, not
decorative: for every piece,

(a) ``minivllm check PIECE <the engine's own class>`` passes, through the same hook a
    learner's class takes (the class is named as 'module:Class' and loaded by
    ``minivllm.config.load_component``);
(b) the stub as shipped fails, with a verdict that names the test and NotImplementedError;
(c) a deliberately wrong implementation (tests/wrong_pieces.py) fails: the checks can fail.

The whole suite, for its part, runs every test against the engine's own classes loaded
by name through the same hook (the ``components`` fixture of tests/conftest.py gives the
defaults of ``EngineConfig``'s component fields unless told otherwise), so ``make test``
passing is the proof that the project's own implementations pass through the hook.

The checks run in this process, as a notebook cell runs them; two tests run the
command itself.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.check import PIECES, REPO, run

STUBS = {
    "block_pool": "block_pool.py:MyBlockPool",
    "kv_cache_manager": "kv_cache_manager.py:MyKVCacheManager",
    "scheduler": "scheduler.py:MyScheduler",
    "preemption": "preemption.py:MyScheduler",
    "prefix_cache": "prefix_cache.py:MyKVCacheManager",
    "attention": "attention.py:MyAttentionBackend",
    "sampler": "sampler.py:MySampler",
}
WRONG = {  # piece -> (class in tests/wrong_pieces.py, a test it must fail)
    "block_pool": ("LifoBlockPool", "test_freed_blocks_join_the_back_in_the_order_given"),
    "kv_cache_manager": ("HeadFirstKVCacheManager", "test_eviction_is_least_recently_freed_and_tail_first"),
    "scheduler": ("UnchunkedScheduler", "test_budget_split_three_long_prompts"),
    "preemption": ("OldestVictimScheduler", "test_preemption_victim_is_the_most_recently_admitted"),
    "prefix_cache": ("UnchainedKVCacheManager", "test_a_block_hits_only_after_the_same_prefix"),
    "attention": ("UnmaskedAttentionBackend", "test_a_prompt_attends_causally"),
    "sampler": ("TopKIgnoringSampler", "test_top_k_keeps_the_k_most_likely_tokens"),
}
TESTS = Path(__file__).parent


def check(piece: str, spec: str, *select: str) -> subprocess.CompletedProcess:
    """The real command, in a fresh interpreter, as a learner runs it."""
    return subprocess.run([sys.executable, "-m", "minivllm.entrypoints.cli", "check", piece, spec, *select],
                          capture_output=True, text=True, cwd=REPO, timeout=600)


def counts(first_line: str, piece: str) -> tuple[int, int]:
    """(passed, total) from the verdict's first line, "PIECE: 16/18 checks passed (...)"."""
    m = re.match(rf"{piece}: (\d+)/(\d+) checks passed \(", first_line)
    assert m, f"not a verdict line: {first_line!r}"
    return int(m[1]), int(m[2])


def test_every_piece_has_a_stub_a_wrong_version_and_checks_in_its_files():
    assert set(STUBS) == set(WRONG) == set(PIECES)
    for piece, p in PIECES.items():
        assert (REPO / "build_it_yourself" / STUBS[piece].split(":")[0]).is_file()
        marked = [name for name in p.test_files
                  if f'"{piece}"' in (TESTS / name).read_text()]
        assert marked == list(p.test_files), f"{piece}: files without a checks({piece!r}) test"
    readme = (REPO / "build_it_yourself" / "README.md").read_text()
    for piece, stub in STUBS.items():
        assert f"minivllm check {piece} build_it_yourself/{stub}" in readme


# In this process (``minivllm.check.run``, what a notebook cell calls): a fresh
# interpreter per check would add its start-up (torch, transformers) 21 times.

@pytest.mark.parametrize("piece", list(PIECES))
def test_the_engines_own_class_passes_through_the_hook(piece):
    verdict = run(piece, PIECES[piece].engine_class, quiet=True)
    assert verdict.ok and verdict.total >= 5, str(verdict)
    assert "✓ all of the engine's" in str(verdict)


@pytest.mark.parametrize("piece", list(PIECES))
def test_the_stub_fails_with_a_readable_verdict(piece):
    verdict = run(piece, str(REPO / "build_it_yourself" / STUBS[piece]), quiet=True)
    text = str(verdict)
    assert not verdict.ok and verdict.passed < verdict.total, text
    assert counts(text.splitlines()[0], piece) == (verdict.passed, verdict.total)
    assert "✗ test_" in text and "NotImplementedError: My" in text, text


@pytest.mark.parametrize("piece", list(PIECES))
def test_a_wrong_implementation_fails(piece):
    """Only the check that catches the mistake runs (``select``, as a learner re-runs the
    one that failed with -k): the whole set would repeat the time of the first test."""
    cls, failing = WRONG[piece]
    verdict = run(piece, f"{TESTS / 'wrong_pieces.py'}:{cls}", select=failing, quiet=True)
    assert (verdict.passed, verdict.total) == (0, 1), str(verdict)
    assert verdict.failures[0].test.endswith(f"::{failing}"), str(verdict)


# The command itself: its exit status and output, in a fresh interpreter.

@pytest.mark.multiprocess
def test_the_command_passes_the_engines_sampler_and_fails_the_stub():
    ok = check("sampler", "minivllm.sample.sampler:Sampler")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    passed, total = counts(ok.stdout.splitlines()[0], "sampler")
    assert passed == total >= 5 and "✓" in ok.stdout
    stub = check("sampler", "build_it_yourself/sampler.py:MySampler", "-k", "greedy")
    assert stub.returncode == 1, stub.stdout + stub.stderr
    assert "NotImplementedError: MySampler.greedy" in stub.stdout
    assert "Traceback" not in stub.stdout + stub.stderr


@pytest.mark.multiprocess
def test_a_class_that_cannot_be_loaded_is_refused_with_status_2():
    result = check("block_pool", "build_it_yourself/no_such_file.py:MyBlockPool")
    assert result.returncode == 2 and "cannot be loaded" in result.stdout, result.stdout
