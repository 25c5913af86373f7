import os

import torch

# Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when the
# kernel modules are first imported, so it must be set before any test imports them.
# Without a GPU the kernels then run on the CPU through Triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs pytest-xdist workers, one per core by default. Each worker then gets its
# share of the cores (and so do the processes it starts: notebook kernels, engine cores,
# servers, which read OMP_NUM_THREADS): torch's default of one thread per core in every
# worker would put twice as many busy threads as cores on the machine.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _share = max(1, (os.cpu_count() or 1) // _workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Not MPLBACKEND=Agg in os.environ: nbval's notebook kernels would inherit it and lose
# their inline figures. Selecting the backend in this process only is enough for tests.
import matplotlib  # noqa: E402

matplotlib.use("Agg")


# -- the build-it-yourself track: which implementation the tests run against -------------
# `minivllm check PIECE SPEC` (minivllm/check.py) runs the tests marked
# @pytest.mark.checks(PIECE) with the learner's class given for that piece's config
# field. The same works by hand, with pytest's full output:
#   pytest tests/test_scheduler.py --piece scheduler --component scheduler_cls=my.py:MyScheduler
# Without these options every test runs against the engine's own classes (loaded by
# name through the same hook, minivllm.config.load_component).
import pytest  # noqa: E402
from helpers import Components  # noqa: E402
from hypothesis import settings  # noqa: E402

# minivllm check selects this profile: one failure per property test, not an
# ExceptionGroup of several, so the verdict's line is the assertion's own message.
settings.register_profile("minivllm-check", report_multiple_bugs=False)
# The long run of the engine's state machine (tests/test_engine_stateful.py), which does
# 1,000 examples otherwise: pytest tests/test_engine_stateful.py --hypothesis-profile long
settings.register_profile("long", max_examples=100_000)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("minivllm", "build it yourself (minivllm check)")
    group.addoption("--piece", default=None, metavar="PIECE",
                    help="run only the tests marked @pytest.mark.checks(..., PIECE, ...)")
    group.addoption("--component", action="append", default=[], dest="components",
                    metavar="FIELD=SPEC",
                    help="run the tests with this class for an EngineConfig component field, "
                         "e.g. scheduler_cls=my_scheduler.py:MyScheduler (repeatable)")
    parser.getgroup("minivllm-server", "the server tests").addoption(
        "--engine-process", action="store_true",
        help="run test_server.py against an engine core in its own process (build_app's "
             "default without an llm) instead of the offline LLM on a thread")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With --piece, keep a test when each of its `checks` marks names the piece: a
    parametrized test may carry one on the test and one on each parameter, and
    `checks()` naming no piece keeps that parameter out of every check."""
    piece = config.getoption("piece")
    if piece is not None:
        keep, drop = [], []
        for item in items:
            marks = list(item.iter_markers("checks"))
            (keep if marks and all(piece in m.args for m in marks) else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    items.sort(key=_long_runs_first(items))


# Marks that tell a module (or a notebook) takes minutes rather than seconds.
_LONG = ("wheelhouse", "multiprocess", "real_model", "docs", "browser")


def _long_runs_first(items: list[pytest.Item]):
    """Sort key that puts the long test files first, keeping each file's tests in order.

    `make test` hands whole files to its two workers (--dist loadscope) in this order, and
    a worker that draws a four-minute file last runs on alone while the other has nothing
    left to do. Longest first: the file that builds a wheelhouse, then the notebooks, then
    the files marked as starting processes or loading the real model, then the rest."""
    def files_marked(*names: str) -> set:
        return {item.path for item in items if any(item.get_closest_marker(m) for m in names)}

    wheelhouse, long_files = files_marked("wheelhouse"), files_marked(*_LONG)

    def rank(item: pytest.Item) -> int:
        if item.path in wheelhouse:
            return 0
        if item.path.suffix == ".ipynb":
            return 1
        return 2 if item.path in long_files else 3

    return rank


@pytest.fixture(scope="session")
def components(pytestconfig: pytest.Config) -> Components:
    """The implementation under test: the engine's own classes, or those given."""
    return Components(pytestconfig.getoption("components"))
