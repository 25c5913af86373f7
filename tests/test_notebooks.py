"""Every notebook keeps the shape a learner relies on, and is stored executed.

(Running them is nbval's job: `make test` passes their check copies, `notebooks/checks/`
(minivllm.exercises.check_copy), to pytest with --nbval-lax.
Here: the structure of each lesson, that what the stored notebook shows is what a reader
without a kernel can see, that the figures in figures/ are the ones the notebooks show,
and that notebook 05 runs where Triton cannot be installed.)
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
NBVAL_TAGS = {"nbval-check-output", "nbval-ignore-output", "nbval-skip", "raises-exception"}
EXERCISE_TAGS = {"exercise", "answer", "solution", "self-check", "open-ended"}  # minivllm.exercises


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def source(cell: dict) -> str:
    return "".join(cell["source"])


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code" and source(c).strip()]


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no numbered notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_structure(path):
    nb = load(path)
    markdown = "\n".join(source(c) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert re.search(r"^#\s+\S", markdown, re.M), "a title"
    assert re.search(r"what you will learn", markdown, re.I), "a 'What you will learn' section"
    exercises_at = re.search(r"^#+\s*Exercises", markdown, re.M | re.I)
    assert exercises_at, "an Exercises section"
    exercises = markdown[exercises_at.end():]
    assert len(re.findall(r"^###\s+Exercise\s+\d+:", exercises, re.M)) >= 3, "three or more exercises"
    assert re.search(r"^#+\s*In vLLM", markdown, re.M | re.I), "an 'In vLLM' section"
    assert re.search(r"^\|.*\|\s*$", markdown.split("In vLLM", 1)[-1], re.M), "the 'In vLLM' table"
    code = code_cells(nb)
    assert code, "code cells"
    assert all(c.get("execution_count") is not None for c in code), "stored executed"
    counts = [c["execution_count"] for c in code]
    assert counts == sorted(counts), "executed top to bottom, in order"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, "no error outputs"
    sources = "\n".join(source(c) for c in code)
    assert "import minivllm" in sources or "from minivllm" in sources, "imports the package"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_recap_before_the_exercises(path):
    """A short recap (what was shown, three to five points) closes the lesson, before the
    exercises ask for more."""
    markdown = "\n".join(source(c) for c in load(path)["cells"] if c["cell_type"] == "markdown")
    recap = re.search(r"^#+\s*Recap\s*$", markdown, re.M | re.I)
    exercises = re.search(r"^#+\s*Exercises", markdown, re.M | re.I)
    assert recap, "a '## Recap' section"
    assert recap.start() < exercises.start(), "the recap comes before the exercises"
    body = markdown[recap.end():exercises.start()]
    points = re.findall(r"^\s*(?:\d+\.|[-*])\s+\S", body, re.M)
    assert 3 <= len(points) <= 5, f"three to five recap points, found {len(points)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_replays_store_a_widget_and_a_picture(path):
    """A replay cell must show its widget (a trailing `;` hides it, and the stored
    notebook keeps nothing), the widget's state must be saved with the notebook, and a
    static picture of the steps (viz.plot_steps) sits beside it for readers without a
    kernel."""
    nb = load(path)
    code = code_cells(nb)
    state = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for i, cell in enumerate(code):
        if "viz.replay(" not in source(cell):
            continue
        views = [o["data"][WIDGET_VIEW] for o in cell.get("outputs", [])
                 if WIDGET_VIEW in o.get("data", {})]
        assert views, f"replay cell {i} stores no widget view:\n{source(cell)}"
        assert all(v["model_id"] in state for v in views), "the widget's state is not saved"
        beside = [cell] + code[max(0, i - 1):i]
        assert any("viz.plot_steps(" in source(c) and any(
            "image/png" in o.get("data", {}) for o in c.get("outputs", [])) for c in beside), (
            f"replay cell {i} has no static picture of the steps (viz.plot_steps) beside it")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_test_markers_are_tags_not_source(path):
    """nbval reads cell tags, so learners never read test markers in the code."""
    for cell in load(path)["cells"]:
        assert "NBVAL_" not in source(cell), f"an nbval comment in the source:\n{source(cell)}"
        tags = set(cell.get("metadata", {}).get("tags", []))
        assert tags <= NBVAL_TAGS | EXERCISE_TAGS, tags


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_prose_lives_in_markdown(path):
    """Narrative is markdown; code cells print numbers and assert claims. A sentence
    assembled in an f-string would silently rewrite the lesson when a run comes out
    the other way."""
    for cell in code_cells(load(path)):
        assert "Markdown(" not in source(cell), f"prose built in a code cell:\n{source(cell)}"


def saved_names(code: str) -> list[str]:
    """The names passed to ``viz.save_figure(FIGURE, NAME)`` in a cell's code (read with
    ast, so FIGURE may be any expression, e.g. ``viz.plot_architecture()``)."""
    names = []
    for node in ast.walk(ast.parse(code)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "save_figure" and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            names.append(node.args[1].value)
    return names


def saved_figures() -> dict[str, tuple[Path, bytes | None]]:
    """figures/<name>.png -> (notebook, the PNG its saving cell stores)."""
    found = {}
    for path in NOTEBOOKS:
        for cell in code_cells(load(path)):
            for name in saved_names(source(cell)):
                name = name if name.endswith((".png", ".svg", ".pdf")) else name + ".png"
                pngs = [o["data"]["image/png"] for o in cell.get("outputs", [])
                        if "image/png" in o.get("data", {})]
                found[name] = (path, base64.b64decode(pngs[-1]) if pngs else None)
    return found


def test_figures_are_the_pictures_the_notebooks_show():
    """Every figure a notebook saves is committed, and is byte for byte the picture the
    stored notebook shows (save_figure displays the file it wrote), so no figure in
    figures/ is left over from another run. Every numbered figure has its notebook."""
    found = saved_figures()
    assert found
    for name, (notebook, shown) in found.items():
        file = ROOT / "figures" / name
        assert file.exists(), f"{notebook.name} saves figures/{name}, which is not committed"
        assert shown is not None, f"{notebook.name} does not show figures/{name} where it saves it"
        assert file.read_bytes() == shown, (
            f"figures/{name} is not the picture {notebook.name} stores: re-execute the notebook "
            "(the test suite writes its figures elsewhere, so a test run cannot cause this)")
    numbered = {p.name for p in (ROOT / "figures").glob("[0-9][0-9]_*")}
    assert numbered <= set(found), f"figures no notebook writes: {sorted(numbered - set(found))}"


# -- notebook 05 where Triton has no wheels (macOS, Windows) --------------------------------

NO_TRITON = '''\
# Loaded at interpreter start (it is first on PYTHONPATH): make `import triton` fail the
# way it does where Triton publishes no wheels, and importlib.util.find_spec("triton")
# answer None, as for a package that is not installed.
import sys

sys.modules["triton"] = None
'''


def test_notebook_05_runs_on_the_reference_path_without_triton(tmp_path):
    """Notebook 05 top to bottom in a kernel that cannot import triton: it must not fail,
    and must say that it ran the PyTorch reference instead of the kernels. Bounded: at
    most two minutes per cell, five minutes in all (it takes well under one here)."""
    blocker = tmp_path / "no_triton"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(NO_TRITON)
    spec = tmp_path / "jupyter" / "kernels" / "python3-no-triton"
    spec.mkdir(parents=True)
    pythonpath = os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (no Triton)",
        "language": "python",
        "env": {"PYTHONPATH": pythonpath, "MINIVLLM_FIGURES_DIR": str(tmp_path / "figures")},
    }))
    notebook = ROOT / "notebooks" / "05_paged_attention_triton.ipynb"
    executed = tmp_path / "05_no_triton.ipynb"
    env = {**os.environ, "JUPYTER_PATH": str(tmp_path / "jupyter")}
    run = subprocess.run(
        [sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute",
         "--ExecutePreprocessor.kernel_name=python3-no-triton",
         "--ExecutePreprocessor.timeout=120", "--output", str(executed), str(notebook)],
        env=env, cwd=ROOT / "notebooks", capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    nb = load(executed)
    text = "\n".join(
        "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
        for c in code_cells(nb) for o in c.get("outputs", []))
    assert "triton installed: False" in text, "the kernel could still import triton"
    assert "PyTorch reference" in text, "the notebook does not say it ran the reference"
    assert not [o for c in code_cells(nb) for o in c.get("outputs", [])
                if o.get("output_type") == "error"]


# -- no wall-clock assertion ------------------------------------------------------------------

WALL_CLOCK = re.compile(
    r"perf_counter|monotonic|time\.time|\.duration\b|"
    r"\b\w*(?:_s|_ms|_sec|seconds|elapsed|wall\w*|ttft\w*|itl\w*|tpot\w*|tok_s|tokens_per_s|"
    r"throughput|speed\w*|speedup\w*|latenc\w*|flop_s)\b|"
    r"[\"'][^\"']*(?:\bs\b|\bms\b|seconds|ttft|itl|tok/s|wall|speed)[^\"']*[\"']", re.I)
NOT_WALL_CLOCK = re.compile(r"sim|by definition|causal|predict|analytic", re.I)
"""Words that say why an assertion on a time holds on every machine: it reads the
simulator's clock (``sim_...``, ``# simulated clock``), an identity between clocks
(``# by definition``), an order that causality fixes (``# causal: ...``), or a model's
prediction (``predicted_...``, ``# analytic``)."""


def wall_clock_asserts(code: str) -> list[str]:
    """The assert statements in ``code`` whose condition reads a clock-like quantity
    (seconds, TTFT, tokens/s, speed-up ...) and does not say why it holds on every machine
    (:data:`NOT_WALL_CLOCK`, in a name or a comment on its lines)."""
    lines = code.splitlines()
    clean = "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in lines)
    found = []
    for node in ast.walk(ast.parse(clean)):
        if not isinstance(node, ast.Assert):
            continue
        text = ast.get_source_segment(clean, node.test) or ""
        line = " ".join(lines[node.lineno - 1:node.end_lineno])
        if WALL_CLOCK.search(text) and not NOT_WALL_CLOCK.search(line):
            found.append(line.strip())
    return found


def test_wall_clock_asserts_are_found():
    """The rule below, tried on lines it must flag and lines it must leave alone."""
    assert wall_clock_asserts("assert tight_s > 1.2 * ample_s")
    assert wall_clock_asserts('assert runs[True]["ttft"] < 0.8 * runs[False]["ttft"]')
    assert wall_clock_asserts("assert best[4].speedup > 1.2")
    assert not wall_clock_asserts("assert len(trace.steps) > 2 * len(ample.trace.steps)")
    assert not wall_clock_asserts("assert sim_ttft[1] < sim_ttft[0]")
    assert not wall_clock_asserts("assert res.ttft_p50 < 2  # simulated clock")
    assert not wall_clock_asserts("assert m.queue_time + m.prefill_time == m.ttft  # by definition")
    assert not wall_clock_asserts("assert got == reference")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_wall_clock_assertion(path):
    """A lesson asserts mechanisms (tokens, steps, blocks, bytes, FLOPs, simulated time),
    never a wall-clock time: a learner's laptop is not the machine the notebook was stored
    on. Timings are printed with their spread (minivllm.bench.timing) instead. An assertion
    on a time that holds everywhere says why (:data:`NOT_WALL_CLOCK`)."""
    found = [f"cell {i}: {line}" for i, c in enumerate(load(path)["cells"])
             if c["cell_type"] == "code" for line in wall_clock_asserts(source(c))]
    assert not found, "wall-clock assertions:\n" + "\n".join(found)


LISTING = re.compile(r"^print\(inspect\.getsource\(([\w.]+)\)\)$")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_listings_are_the_code_as_it_is(path):
    """A cell that prints the source of the package's own code (``print(inspect.getsource(
    Scheduler.schedule))``) shows a reader without a kernel its stored output: that output
    must be today's code, not the code of when the notebook was last executed."""
    import importlib
    import inspect

    nb = load(path)
    imported = {}  # name -> module, from the notebook's own `from minivllm... import ...`
    for c in code_cells(nb):
        try:
            tree = ast.parse(source(c))
        except SyntaxError:  # IPython magics
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minivllm"):
                imported.update({a.asname or a.name: node.module for a in node.names})
    for i, c in enumerate(nb["cells"]):
        m = LISTING.match(source(c).strip()) if c["cell_type"] == "code" else None
        if not m or m[1].split(".")[0] not in imported:
            continue
        head, *rest = m[1].split(".")
        obj = getattr(importlib.import_module(imported[head]), head)
        for attr in rest:
            obj = getattr(obj, attr)
        stored = "".join("".join(o.get("text", "")) for o in c["outputs"] if o["output_type"] == "stream")
        assert stored.strip() == inspect.getsource(obj).strip(), (
            f"cell {i}: the stored listing of {m[1]} is not the code as it is: execute {path.name} again")


COPIED = {"Scheduler": "minivllm.core.scheduler", "KVCacheManager": "minivllm.core.kv_cache_manager"}
"""The engine classes whose methods a solution copies, changing the lines it marks ``CHANGED``."""


def _body(code: str) -> list[str]:
    """A method's lines without its docstring, blank lines and trailing spaces (the
    ``def`` line stays: the comparison skips it, a copy may leave out annotations)."""
    lines = [line.rstrip() for line in code.splitlines() if line.strip()]
    if len(lines) > 1 and lines[1].strip().startswith(('"""', "'''")):
        quote = lines[1].strip()[:3]
        end = next(i for i in range(1, len(lines)) if lines[i].rstrip().endswith(quote)
                   and (i > 1 or lines[i].strip().count(quote) == 2))
        lines = [lines[0]] + lines[end + 1:]
    return lines


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_solution_copies_are_the_code_as_it_is(path):
    """A solution that subclasses Scheduler (or KVCacheManager) and says it copies a method
    "as it is in the file", changing the lines marked CHANGED, must copy today's method:
    every line that differs from the package's is marked CHANGED."""
    import difflib
    import importlib
    import inspect

    for c in code_cells(load(path)):
        code = source(c)
        if "CHANGED" not in code:
            continue
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            bases = [b.id for b in cls.bases if isinstance(b, ast.Name) and b.id in COPIED]
            if not bases:
                continue
            engine_cls = getattr(importlib.import_module(COPIED[bases[0]]), bases[0])
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                real = getattr(engine_cls, fn.name, None)
                if real is None:
                    continue
                lines = code.splitlines()[fn.lineno - 1:fn.end_lineno]  # whole lines: comments too
                ours = _body(inspect.cleandoc("\n" + "\n".join(lines)))
                theirs = _body(inspect.cleandoc("\n" + inspect.getsource(real)))
                matcher = difflib.SequenceMatcher(None, theirs[1:], ours[1:])
                theirs, ours = theirs[1:], ours[1:]
                for op, i1, i2, j1, j2 in matcher.get_opcodes():
                    if op != "equal":
                        assert any("CHANGED" in line for line in ours[j1:j2]), (
                            f"{path.name}: {cls.name}.{fn.name} differs from {bases[0]}.{fn.name} "
                            f"where no line says CHANGED:\n- " + "\n- ".join(theirs[i1:i2])
                            + "\n+ " + "\n+ ".join(ours[j1:j2]))
