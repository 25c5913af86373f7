"""Every exercise answers back: each has a worked solution, each checkable one a
self-check that says "correct" in the instructor copy, and the learner copies keep the
question and the check but not the answer (minivllm.exercises explains the cell tags)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minivllm.exercises import (
    check,
    check_copy,
    learner_copy,
    make_check_copies,
    make_learner_copies,
)

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def tags(cell: dict) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def text(cell: dict) -> str:
    return "".join(cell["source"])


def output_text(cell: dict) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))


def exercises(nb: dict) -> list[tuple[dict, list[dict]]]:
    """(the exercise cell, the cells up to the next exercise or the next ## section)."""
    found: list[tuple[dict, list[dict]]] = []
    for cell in nb["cells"]:
        if "exercise" in tags(cell):
            found.append((cell, []))
        elif found:
            if cell["cell_type"] == "markdown" and re.match(r"#{1,2}\s", text(cell)):
                break
            found[-1][1].append(cell)
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_exercise_has_a_solution_and_a_self_check(path):
    nb = json.loads(path.read_text())
    found = exercises(nb)
    assert len(found) >= 3, f"three or more exercises (cells tagged 'exercise'), found {len(found)}"
    numbers = []
    for cell, body in found:
        heading = re.match(r"###\s+Exercise\s+(\d+):\s+\S", text(cell))
        assert heading, f"an exercise starts with '### Exercise N: title': {text(cell)[:60]!r}"
        numbers.append(int(heading.group(1)))
        name = f"exercise {heading.group(1)}"
        assert any("solution" in tags(c) for c in body), f"{name} has no cell tagged 'solution'"
        checks = [c for c in body if "self-check" in tags(c)]
        if "open-ended" in tags(cell):
            assert not checks, f"{name} is tagged open-ended but has a self-check"
            continue
        assert checks, f"{name} has no self-check (tag it 'open-ended' if nothing is checkable)"
        answers = [c for c in body if "answer" in tags(c)]
        assert answers and all("..." in text(c) for c in answers), \
            f"{name}: an 'answer' cell with the blank ... for the learner"
        first_solution = next(i for i, c in enumerate(body) if "solution" in tags(c))
        assert body.index(answers[0]) < first_solution < body.index(checks[0]), \
            f"{name}: answer cell, then solution, then self-check"
        for c in checks:
            assert "check(" in text(c), f"{name}: the self-check calls minivllm.exercises.check"
            assert "nbval-check-output" in tags(c), f"{name}: nbval compares the self-check"
            assert re.search(r"✓ Exercise \S+: correct", output_text(c)), \
                f"{name}: the stored self-check says correct, got {output_text(c)!r}"
    assert numbers == list(range(1, len(numbers) + 1)), f"exercises numbered 1..n, got {numbers}"
    for c in nb["cells"]:
        if "(Engine code)" in text(c):
            assert "exercise" in tags(c), "an engine-code exercise outside an exercise cell"


def test_learner_copies_keep_questions_and_checks_but_not_solutions(tmp_path):
    written = make_learner_copies(ROOT / "notebooks", tmp_path)
    assert [p.name for p in written] == [p.name for p in NOTEBOOKS]
    for src, dst in zip(NOTEBOOKS, written):
        instructor, learner = json.loads(src.read_text()), json.loads(dst.read_text())
        kept = [c for c in instructor["cells"] if "solution" not in tags(c)]
        assert [text(c) for c in learner["cells"]] == [text(c) for c in kept], src.name
        assert len(kept) < len(instructor["cells"]), f"{src.name}: no solution removed"
        assert not any(c.get("outputs") for c in learner["cells"] if c["cell_type"] == "code")
        assert not any("nbval-check-output" in tags(c) for c in learner["cells"]
                       if "self-check" in tags(c)), "a learner's check is not compared"


def test_check_copies_run_the_instructor_notebook_then_the_learners_exercises(tmp_path):
    """What `make test` runs: the instructor notebook unchanged (outputs compared), then the
    learner copy's cells from the first exercise on. Before that point the learner copy is
    the instructor copy cell for cell, so this covers both copies."""
    written = make_check_copies(ROOT / "notebooks", tmp_path)
    assert [p.name for p in written] == [p.name for p in NOTEBOOKS]
    for src, dst, learner_path in zip(NOTEBOOKS, written,
                                      make_learner_copies(ROOT / "notebooks", tmp_path / "learner")):
        instructor, merged = json.loads(src.read_text()), json.loads(dst.read_text())
        learner = json.loads(learner_path.read_text())
        n = len(instructor["cells"])
        assert merged["cells"][:n] == instructor["cells"], src.name
        tail = merged["cells"][n:]
        start = len(learner["cells"]) - len(tail)
        assert [text(c) for c in learner["cells"][:start]] == [
            text(c) for c in instructor["cells"][:start]], f"{src.name}: copies differ before the exercises"
        assert [text(c) for c in tail] == [text(c) for c in learner["cells"][start:]]
        assert "exercise" in tags(tail[0]) or "answer" in tags(tail[0]), src.name
        assert sum("self-check" in tags(c) for c in tail) == sum(
            "self-check" in tags(c) for c in instructor["cells"]), src.name
        assert not any("solution" in tags(c) or "nbval-check-output" in tags(c) for c in tail)


def _notebook(*cells: tuple[str, str, list[str]]):
    import nbformat
    nb = nbformat.v4.new_notebook()
    for kind, source, cell_tags in cells:
        make = nbformat.v4.new_code_cell if kind == "code" else nbformat.v4.new_markdown_cell
        nb.cells.append(make(source, metadata={"tags": cell_tags}))
    return nb


def test_a_learner_copy_whose_cell_reads_a_solutions_name_is_refused():
    """The one failure the check copies cannot see by running (the instructor's solutions
    ran before the learner's cells), found by reading the code instead."""
    ok = _notebook(("code", "import math\nn = 3", []),
                   ("markdown", "### Exercise 1: blocks", ["exercise"]),
                   ("code", "blocks = ...", ["answer"]),
                   ("code", "blocks = math.ceil(n / 2)\nhelper = [b for b in range(blocks)]", ["solution"]),
                   ("code", "%time x = 1\ncheck('1', blocks, 2, hint='h')", ["self-check"]))
    assert len(learner_copy(ok).cells) == 4
    bad = _notebook(*[(c.cell_type, c.source, c.metadata["tags"]) for c in ok.cells],
                    ("code", "def f():\n    return len(helper)\nf()", ["self-check"]))
    with pytest.raises(ValueError, match=r"cell 5 reads helper, which only a solution cell defines"):
        learner_copy(bad)
    rebound = _notebook(*[(c.cell_type, c.source, c.metadata["tags"]) for c in ok.cells],
                        ("code", "helper = []\nprint(len(helper))", []))
    learner_copy(rebound)  # bound by the learner's own cell: fine


def test_a_code_cell_after_the_exercises_is_refused():
    """The learner's exercises run after the instructor's whole notebook, so a clean-up
    cell after them (a server stopped) would have run before them."""
    nb = _notebook(("code", "x = 1", []),
                   ("markdown", "## Exercises", []),
                   ("markdown", "### Exercise 1: x", ["exercise"]),
                   ("code", "y = ...", ["answer"]),
                   ("code", "y = x", ["solution"]),
                   ("code", "check('1', y, x, hint='h')", ["self-check"]),
                   ("code", "print('an experiment inside the exercise')", []),
                   ("markdown", "## Recap", []))
    assert len(check_copy(nb).cells) == len(nb.cells) + 5  # the exercise, less its solution
    nb.cells.append(_notebook(("code", "server.stop()", [])).cells[0])
    with pytest.raises(ValueError, match="code cell 8 comes after the exercises"):
        check_copy(nb)


def test_check_says_correct_gives_a_hint_and_never_the_answer(capsys):
    assert check("1", 3, 3, hint="count the blocks") is True
    assert check("1", (1, 2), [1, 2], hint="h") is True
    assert check("1", "Rise", "rise", hint="h") is True
    assert check("1", 0.104, 0.1, hint="h", rel_tol=0.05) is True
    assert "correct" in capsys.readouterr().out
    assert check("2", 4, 31337, hint="each block holds 16 tokens") is False
    out = capsys.readouterr().out
    assert "each block holds 16 tokens" in out and "31337" not in out
    assert check("3", ..., 5, hint="h") is None
    assert check("3", (1, ...), (1, 5), hint="h") is None
    assert "fill in" in capsys.readouterr().out
    assert check("4", True, 1, hint="h") is True  # Python's own equality, no surprises
