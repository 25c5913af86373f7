"""Every exercise answers back: each has a worked solution, each checkable one a
self-check that says "correct" in the instructor copy, and the learner copies keep the
question and the check but not the answer (minivllm.exercises explains the cell tags)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minivllm.exercises import check, make_learner_copies

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
