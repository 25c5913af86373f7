"""``minivllm check PIECE SPEC``: run the engine's own tests for one piece on your class.

The build-it-yourself track (``build_it_yourself/``, its README says the order) has the
learner write the engine's core, one piece at a time, as a class that takes the place of
the engine's own through a config field (``minivllm.config.COMPONENT_FIELDS``). This
module runs the tests the engine itself passes for that piece, with the learner's class
plugged in, and prints a verdict a learner can act on::

    block_pool: 16/18 checks passed (build_it_yourself/block_pool.py:MyBlockPool, 9.1 s)
      ✗ test_block_pool.py::test_freed_blocks_join_the_back_in_the_order_given
          AssertionError: the free queue hands out the least recently freed block first (FIFO)

The tests are the engine's (``tests/``): each is marked ``@pytest.mark.checks(PIECE,
...)`` for the pieces it checks, and builds the engine's parts from the ``components``
fixture (``tests/conftest.py``), which is the engine's own classes unless a class is
given. So the same tests pass on the engine's classes in ``make test``, and the end-to-end
ones compare tokens with transformers' ``generate()`` through the same hook.

From a notebook: ``minivllm.check.run("block_pool", MyBlockPool)`` (a class, or a spec
such as ``"my_pool.py:MyBlockPool"``) prints the same verdict and returns it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from minivllm.config import load_component
from minivllm.exceptions import ValidationError


@dataclass(frozen=True)
class Piece:
    """One piece of the engine a learner writes."""

    field: str
    """The EngineConfig field the class plugs into."""
    engine_class: str
    """The engine's own class, the solution to peek at: 'module:Class'."""
    writes: str
    """What the learner implements."""
    test_files: tuple[str, ...]
    """The test files (under tests/) holding this piece's ``checks`` tests."""
    notebook: str


PIECES: dict[str, Piece] = {
    "block_pool": Piece(
        "block_pool_cls", "minivllm.core.block_pool:BlockPool",
        "BlockPool.get_new_blocks, touch, free_blocks: the free queue and reference counts",
        ("test_block_pool.py", "test_scheduler.py", "test_prefix_caching.py", "test_engine.py"),
        "03_paged_kv_cache"),
    "kv_cache_manager": Piece(
        "kv_cache_manager_cls", "minivllm.core.kv_cache_manager:KVCacheManager",
        "KVCacheManager.allocate_slots and free: block tables that grow and shrink",
        ("test_scheduler.py", "test_prefix_caching.py", "test_engine.py"),
        "03_paged_kv_cache"),
    "scheduler": Piece(
        "scheduler_cls", "minivllm.core.scheduler:Scheduler",
        "Scheduler.schedule: the token-budget loop with chunked prefill",
        ("test_scheduler.py", "test_engine.py"),
        "04_continuous_batching, 06_chunked_prefill"),
    "preemption": Piece(
        "scheduler_cls", "minivllm.core.scheduler:Scheduler",
        "Scheduler.preempt_victim: choose the victim, free it, queue it for recompute",
        ("test_scheduler.py", "test_prefix_caching.py", "test_engine.py"),
        "08_preemption"),
    "prefix_cache": Piece(
        "kv_cache_manager_cls", "minivllm.core.kv_cache_manager:KVCacheManager",
        "KVCacheManager.update_block_hashes and find_longest_cache_hit: the hash chain "
        "and the hit rule",
        ("test_prefix_caching.py", "test_scheduler.py", "test_engine.py"),
        "07_prefix_caching"),
    "attention": Piece(
        "attention_backend", "minivllm.worker.attention:TorchAttentionBackend",
        "AttentionBackend.write_kv and attend: the reference paged attention",
        ("test_attention.py", "test_engine.py"),
        "05_paged_attention_triton"),
    "sampler": Piece(
        "sampler_cls", "minivllm.sample.sampler:Sampler",
        "Sampler.greedy and sample: greedy, temperature, top-k, top-p",
        ("test_sampler.py", "test_engine.py"),
        "00_quickstart"),
}

REPO = Path(__file__).resolve().parent.parent
"""The repository this package was installed from (editable): its tests/ are the checks."""


@dataclass
class Failure:
    test: str
    message: str


@dataclass
class Verdict:
    piece: str
    spec: str
    passed: int = 0
    skipped: int = 0
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return self.passed + len(self.failures)

    @property
    def ok(self) -> bool:
        """Every check ran and passed (a skipped one neither passes nor fails)."""
        return not self.failures and self.passed > 0

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        lines = [f"{self.piece}: {self.passed}/{self.total} checks passed "
                 f"({self.spec}, {self.seconds:.1f} s)"]
        if self.skipped:
            lines[0] += f", {self.skipped} skipped"
        for f in self.failures:
            lines.append(f"  ✗ {f.test}")
            lines += [f"      {line}" for line in f.message.splitlines()]
        if self.ok:
            lines.append(f"  ✓ all of the engine's {self.piece} checks pass on your class.")
        return "\n".join(lines)


def _message(report) -> str:
    """The first two lines of what went wrong, each cut to a readable length."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()][:2]
    return "\n".join(line if len(line) <= 200 else line[:197] + "..." for line in lines)


class _Plugin:
    """Hands the class to the tests (the ``components`` fixture) and keeps the results."""

    def __init__(self, field_name: str, cls: type, verdict: Verdict) -> None:
        self.given = (field_name, cls)
        self.verdict = verdict
        self.failed: dict[str, str] = {}
        self.passed: set[str] = set()
        self.skipped: set[str] = set()

    def pytest_configure(self, config) -> None:
        config.option.components = [*config.option.components, self.given]

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.failed[report.nodeid] = _message(report)

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            self.failed.setdefault(report.nodeid, _message(report))
        elif report.skipped and report.when in ("setup", "call"):
            self.skipped.add(report.nodeid)
        elif report.passed and report.when == "call":
            self.passed.add(report.nodeid)


def run(piece: str, spec: str | type, *, select: str | None = None, quiet: bool = False) -> Verdict:
    """Run the engine's tests for ``piece`` on the class ``spec`` (a class, 'module:Class'
    or 'path/to/file.py:Class'); print the verdict (unless ``quiet``) and return it.
    A verdict is true when every check passed. ``select``: only the checks whose names
    match this pytest ``-k`` expression (to re-run one failing check quickly)."""
    import pytest  # a dev dependency (make setup installs it): only this command needs it

    if piece not in PIECES:
        raise ValueError(f"no piece {piece!r}; the pieces are: {', '.join(PIECES)}")
    p = PIECES[piece]
    tests = REPO / "tests"
    if not (tests / "conftest.py").is_file():
        raise FileNotFoundError(
            f"minivllm check runs the engine's own tests, which live in the repository's "
            f"tests/ folder; there is none at {tests}. Run it from a clone of the repository "
            f"installed with `make setup` (an editable install).")
    if isinstance(spec, str) and spec.rpartition(":")[0].endswith(".py"):
        where, _, name = spec.rpartition(":")  # the file relative to here, not to the repo
        spec = f"{Path(where).expanduser().resolve()}:{name}"
    cls = load_component(p.field, spec)  # a ValidationError here names what is missing
    shown = spec if isinstance(spec, str) else f"{cls.__module__}.{cls.__qualname__}"
    verdict = Verdict(piece, _short(shown) + (f", -k {select!r}" if select else ""))
    plugin = _Plugin(p.field, cls, verdict)
    args = [str(tests / name) for name in p.test_files] + [
        "--piece", piece, "-p", "no:cacheprovider", "-p", "no:terminal", "-o", "addopts=",
        "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), "--hypothesis-seed=0",
        "--hypothesis-profile=minivllm-check",
    ] + (["-k", select] if select else [])
    start = time.perf_counter()
    cwd = os.getcwd()
    os.chdir(REPO)  # hypothesis keeps its example database here (.hypothesis/, ignored by git)
    try:
        pytest.main(args, plugins=[plugin])
    finally:
        os.chdir(cwd)
    verdict.seconds = time.perf_counter() - start
    verdict.passed = len(plugin.passed - set(plugin.failed))
    verdict.skipped = len(plugin.skipped - set(plugin.failed))
    verdict.failures = [Failure(node.split("tests/", 1)[-1], message)
                        for node, message in plugin.failed.items()]
    if not quiet:
        print(verdict)
    return verdict


def _short(spec: str) -> str:
    """A file spec relative to the working folder when it is inside it."""
    where, _, name = spec.rpartition(":")
    try:
        return f"{Path(where).relative_to(Path.cwd())}:{name}"
    except ValueError:
        return spec


def main(piece: str, spec: str, select: str | None = None) -> int:
    """The ``minivllm check`` command: 0 when every check passed, 1 when one failed,
    2 when the class cannot be loaded."""
    try:
        verdict = run(piece, spec, select=select)
    except (ValidationError, FileNotFoundError) as e:
        print(f"minivllm check {piece}: {e}")
        return 2
    return 0 if verdict.ok else 1
