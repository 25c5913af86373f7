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

Each check runs the real command in a fresh interpreter, as a learner does.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.check import PIECES, REPO

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
    return subprocess.run([sys.executable, "-m", "minivllm.cli", "check", piece, spec, *select],
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


@pytest.mark.parametrize("piece", list(PIECES))
def test_the_engines_own_class_passes_through_the_hook(piece):
    result = check(piece, PIECES[piece].engine_class)
    assert result.returncode == 0, result.stdout + result.stderr
    passed, total = counts(result.stdout.splitlines()[0], piece)
    assert passed == total >= 5, result.stdout
    assert "✓ all of the engine's" in result.stdout


@pytest.mark.parametrize("piece", list(PIECES))
def test_the_stub_fails_with_a_readable_verdict(piece):
    result = check(piece, f"build_it_yourself/{STUBS[piece]}")
    assert result.returncode == 1, result.stdout + result.stderr
    passed, total = counts(result.stdout.splitlines()[0], piece)
    assert passed < total, result.stdout
    assert "✗ test_" in result.stdout and "NotImplementedError" in result.stdout, result.stdout
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("piece", list(PIECES))
def test_a_wrong_implementation_fails(piece):
    """Only the check that catches the mistake runs (``-k``, as a learner re-runs the one
    that failed): the whole set would repeat the time of (a) for nothing more."""
    cls, failing = WRONG[piece]
    result = check(piece, f"tests/wrong_pieces.py:{cls}", "-k", failing)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith(f"{piece}: 0/1 checks passed"), result.stdout
    assert "✗ test_" in result.stdout and f"::{failing}" in result.stdout, result.stdout


def test_a_class_that_cannot_be_loaded_is_refused_with_status_2():
    result = check("block_pool", "build_it_yourself/no_such_file.py:MyBlockPool")
    assert result.returncode == 2 and "cannot be loaded" in result.stdout, result.stdout
