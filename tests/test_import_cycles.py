"""No import cycle inside minivllm.

In a cycle the order of imports decides whether a name exists yet, and a reader cannot
start from either module without the other. ``bench`` and ``simulator`` once formed one
that hid in an import inside a function, so every import counts here: at the top, inside
a function, or behind a condition; only ``if TYPE_CHECKING:`` blocks (never run) are
skipped. Importing ``a.b.c`` runs the ``__init__`` of ``a.b`` too, so that is an edge as
well, unless the importing module sits inside ``a.b`` itself (then it already ran).
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"minivllm": ROOT / "minivllm"}


def module_files(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the packages."""
    modules = {}
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


class _Imports(ast.NodeVisitor):
    """Every module an import statement names: ``import a.b`` names a.b; ``from a import
    b`` names a.b if that is a module, else it reads b from package a's ``__init__``."""

    def __init__(self, package: str, modules: dict[str, Path]) -> None:
        self.package = package  # where relative imports start
        self.modules = modules
        self.named: list[tuple[str, bool]] = []
        """(module, whether the import reads a name from it that its __init__ defines)"""

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
        for child in node.orelse if name == "TYPE_CHECKING" else [node.test, *node.body, *node.orelse]:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.named += [(alias.name, False) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parent = self.package.rsplit(".", node.level - 1)[0] if node.level > 1 else self.package
            base = f"{parent}.{base}" if base else parent
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self.named.append((sub, False) if sub in self.modules else (base, True))


def import_graph(packages: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` whose code its import statements run."""
    modules = module_files(packages)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        visitor = _Imports(package, modules)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        edges = set()
        for target, reads_init in visitor.named:
            if target not in modules:
                continue  # outside the packages
            parts = target.split(".")
            for ancestor in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
                # A package that contains this module has started its __init__ already,
                # unless the import reads a name that __init__ defines.
                inside = (name + ".").startswith(ancestor + ".")
                if ancestor in modules and (not inside or (reads_init and ancestor == target)):
                    edges.add(ancestor)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def test_minivllm_has_no_import_cycle():
    graph = import_graph(PACKAGES)
    # the walk sees the package: a few edges every reader knows are there
    assert "minivllm.core.scheduler" in graph["minivllm.engine.core"]
    assert "minivllm.kernels.reference" in graph["minivllm.worker.attention"]
    assert "minivllm.sim.replay" in graph["minivllm.sim.simulator"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(reversed(cycle))


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sim.py").write_text("def run():\n    from pkg.sub.bench import replay\n")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.bench import replay\n")
    (pkg / "sub" / "bench.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import other\n"
        "def replay():\n    pass\n"
    )
    (pkg / "other.py").write_text("from pkg import sim\n")
    graph = import_graph({"pkg": pkg})
    assert graph["pkg.sim"] == {"pkg.sub", "pkg.sub.bench"}
    assert graph["pkg.sub.bench"] == set()  # TYPE_CHECKING imports never run
    assert find_cycle(graph) is None
    # sim -> sub.bench, whose package __init__ imports sim: a cycle, as bench <-> simulator was
    (pkg / "sub" / "__init__.py").write_text("from .. import sim\n")
    cycle = find_cycle(import_graph({"pkg": pkg}))
    assert cycle is not None and set(cycle) == {"pkg.sim", "pkg.sub"}


# The scheduler's side of the engine works on counts and block ids, never on tensors
# (DESIGN: "the scheduler never touches tensors"); that holds at import level too.
TENSOR_FREE = ("minivllm.core.scheduler", "minivllm.core.kv_cache_manager",
               "minivllm.core.block_pool", "minivllm.request")


def run_python(code: str, timeout: float) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, so ``sys.modules`` shows only what it imported."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_the_scheduler_side_imports_no_torch():
    code = (
        "import sys\n"
        f"for name in {TENSOR_FREE!r}:\n"
        "    __import__(name)\n"
        "    heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "    assert not heavy, f'importing {name} imported {heavy}'\n"
        "print('ok')\n"
    )
    done = run_python(code, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_package_names_still_import_lazily():
    """``from minivllm import LLM`` (and the rest of ``__all__``) works, and the engine is
    loaded only when one of them is asked for."""
    code = (
        "import sys, minivllm\n"
        "assert 'torch' not in sys.modules\n"
        "from minivllm import LLM, LLMEngine, EngineConfig, SamplingParams, RequestOutput, "
        "CompletionOutput, viz\n"
        "assert 'torch' in sys.modules and LLM.__module__ == 'minivllm.entrypoints.llm'\n"
        "assert sorted(minivllm.__all__) == sorted(set(minivllm.__all__) & set(dir(minivllm)))\n"
        "print('ok')\n"
    )
    done = run_python(code, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
