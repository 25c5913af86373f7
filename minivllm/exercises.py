"""Exercises that answer back: the self-check every notebook exercise calls, and the
learner copies of the notebooks.

Each exercise in a notebook is a few cells, told apart by their tags:

* ``exercise`` (markdown): the question, headed ``### Exercise N: ...``;
* ``answer`` (code): where the learner writes a prediction, ``...`` until then;
* ``solution`` (markdown or code): the worked answer, in the instructor copy only;
* ``self-check`` (code): runs the experiment and calls :func:`check` on the prediction.

An exercise whose answer is an explanation, not a value, is tagged ``open-ended`` and has
a solution but no self-check. The notebooks in ``notebooks/`` are the instructor copies,
the one source of truth; :func:`make_learner_copies` (``make learner``) writes the copies
for a room, with the solution cells removed and no outputs, and :func:`make_check_copies`
the copies ``make test`` runs (each instructor notebook with the learner's exercise cells
run again at its end).

A self-check prints, and never raises: a learner who runs the whole notebook before
answering gets "fill in your prediction" at each exercise, not a traceback that stops
the run at the first one. In the instructor copy the check cells are tagged
``nbval-check-output``, so ``make test`` fails if a solution stops being right.
"""

from __future__ import annotations

import argparse
import ast
import math
from pathlib import Path
from typing import Any

SOLUTION_TAG = "solution"
CHECK_TAG = "self-check"


def _equal(answer: Any, expected: Any, rel_tol: float | None) -> bool:
    """Equality that reads a learner's answer kindly: a tuple equals a list with the same
    items, and numbers may be compared with a relative tolerance."""
    if isinstance(answer, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(answer) == len(expected) and all(
            _equal(a, e, rel_tol) for a, e in zip(answer, expected))
    if isinstance(answer, dict) and isinstance(expected, dict):
        return answer.keys() == expected.keys() and all(
            _equal(answer[k], expected[k], rel_tol) for k in answer)
    if isinstance(answer, str) and isinstance(expected, str):
        return answer.strip().lower() == expected.strip().lower()
    if rel_tol is not None and _is_number(answer) and _is_number(expected):
        return math.isclose(answer, expected, rel_tol=rel_tol)
    return answer == expected


def check(exercise: str, answer: Any, expected: Any, hint: str, *,
          rel_tol: float | None = None) -> bool | None:
    """Compare a learner's ``answer`` with the ``expected`` value the self-check cell
    computed, and say so in one line: "correct", or a hint that points at the idea.

    Returns True or False, or None while the answer is still the blank ``...`` (or holds
    one, e.g. ``(..., ...)``). The expected value is never printed: the hint is the help.
    """
    if _is_blank(answer):
        print(f"Exercise {exercise}: fill in your prediction in the cell above "
              "(replace the ...), then run this cell again.")
        return None
    if _equal(answer, expected, rel_tol):
        print(f"✓ Exercise {exercise}: correct.")
        return True
    print(f"✗ Exercise {exercise}: not yet. Hint: {hint}")
    return False


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_blank(answer: Any) -> bool:
    if answer is ...:
        return True
    if isinstance(answer, (list, tuple)):
        return any(_is_blank(a) for a in answer)
    if isinstance(answer, dict):
        return any(_is_blank(a) for a in answer.values())
    return False


EXERCISE_TAGS = {"exercise", "answer", SOLUTION_TAG, CHECK_TAG, "open-ended"}


def learner_copy(nb):
    """The learner copy of one instructor notebook (an nbformat node, not changed): the
    cells tagged ``solution`` removed (nbconvert's TagRemovePreprocessor), every output
    cleared, and the self-checks no longer compared by nbval (a learner's check prints
    "fill in"). Refused with a ValueError if a kept cell reads a name that only a removed
    solution defines: in the room that cell would stop with a NameError."""
    import copy

    from nbconvert.preprocessors import ClearOutputPreprocessor, TagRemovePreprocessor

    missing = names_only_solutions_define(nb)
    if missing:
        raise ValueError("the learner copy would fail: " + "; ".join(
            f"cell {i} reads {', '.join(sorted(names))}, which only a solution cell defines"
            for i, names in missing.items()))
    nb = copy.deepcopy(nb)
    nb, _ = TagRemovePreprocessor(remove_cell_tags={SOLUTION_TAG}, enabled=True).preprocess(nb, {})
    nb, _ = ClearOutputPreprocessor(enabled=True).preprocess(nb, {})
    for cell in nb.cells:
        tags = cell.get("metadata", {}).get("tags")
        if tags and CHECK_TAG in tags and "nbval-check-output" in tags:
            tags.remove("nbval-check-output")
    nb.metadata.pop("widgets", None)  # widget state belongs to outputs just cleared
    return nb


def make_learner_copies(source: Path, dest: Path) -> list[Path]:
    """Write :func:`learner_copy` of every numbered notebook in ``source`` to ``dest``."""
    return _write_copies(source, dest, learner_copy)


def _write_copies(source: Path, dest: Path, transform) -> list[Path]:
    import nbformat

    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(source.glob("[0-9][0-9]_*.ipynb")):
        try:
            nb = transform(nbformat.read(path, as_version=4))
        except ValueError as err:
            raise ValueError(f"{path.name}: {err}") from err
        nbformat.write(nb, dest / path.name)
        written.append(dest / path.name)
    return written


def check_copy(nb):
    """The notebook ``make test`` runs under nbval: the instructor copy, then the learner
    copy's exercise cells again (its answers still ``...``, so its self-checks print
    "fill in").

    Every notebook keeps its exercises at the end, so the learner copy is the instructor
    copy cell for cell up to the first exercise, and what differs is only that tail.
    Running the learner's tail in the same kernel tests what running the whole learner copy
    tested (no exercise cell raises before it is answered) at the cost of the exercises
    alone, not of the notebook a second time. The one thing it cannot see, a later cell
    reading a name only a solution defined, :func:`learner_copy` refuses by reading the
    code. The instructor cells come first and unchanged, so nbval compares their stored
    outputs exactly as it would in the instructor copy itself."""
    import copy

    learner = learner_copy(nb)
    start = next((i for i, c in enumerate(nb.cells)
                  if EXERCISE_TAGS & set(c.get("metadata", {}).get("tags", []))), None)
    if start is None:
        raise ValueError("the notebook has no exercise cells")
    later = [i for i, c in enumerate(nb.cells[start:], start)
             if c.cell_type == "code" and not EXERCISE_TAGS & set(c.get("metadata", {}).get("tags", []))
             and not _in_exercise(nb.cells, i)]
    if later:
        raise ValueError(f"code cell {later[0]} comes after the exercises: they must be the "
                         "notebook's last section")
    assert [c.source for c in learner.cells[:start]] == [c.source for c in nb.cells[:start]]
    merged = copy.deepcopy(nb)
    for cell in learner.cells[start:]:
        if "id" in cell:
            cell.id = f"learner-{cell.id}"[:64]  # a notebook's cell ids are unique
        merged.cells.append(cell)
    return merged


def _in_exercise(cells, index: int) -> bool:
    """Whether an untagged cell sits inside an exercise (after one, before the next
    ``#``/``##`` heading): an experiment the exercise asks the learner to run."""
    for cell in reversed(cells[:index]):
        tags = set(cell.get("metadata", {}).get("tags", []))
        if "exercise" in tags:
            return True
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith(("# ", "## ")):
            return False
    return False


def make_check_copies(source: Path, dest: Path) -> list[Path]:
    """Write :func:`check_copy` of every numbered notebook in ``source`` to ``dest``."""
    return _write_copies(source, dest, check_copy)


def names_only_solutions_define(nb) -> dict[int, set[str]]:
    """The names each kept code cell reads that no kept cell before it (nor the cell itself)
    binds and some solution cell does: {cell index in ``nb``: names}. Read from the code
    with :mod:`ast`, not run; IPython's ``%``/``!`` lines are skipped."""
    solution_names: set[str] = set()
    for cell in nb.cells:
        if cell.cell_type == "code" and SOLUTION_TAG in cell.get("metadata", {}).get("tags", []):
            solution_names |= _bound(_parse(cell.source))
    found: dict[int, set[str]] = {}
    defined: set[str] = set()
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or SOLUTION_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        tree = _parse(cell.source)
        bound = _bound(tree)
        read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        missing = (read - bound - defined) & solution_names
        if missing:
            found[i] = missing
        defined |= bound
    return found


def _parse(source: str) -> ast.AST:
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    return ast.parse("\n".join(lines))


def _bound(tree: ast.AST) -> set[str]:
    """Every name the code binds anywhere: assignments, imports, defs and their
    parameters, loop, ``with`` and ``except`` targets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m minivllm.exercises",
        description="Write the learner copies of the notebooks (solutions removed, no outputs), "
                    "or with --check the copies `make test` runs under nbval.")
    parser.add_argument("source", type=Path, help="folder of the instructor notebooks")
    parser.add_argument("dest", type=Path, help="folder to write the copies to")
    parser.add_argument("--check", action="store_true",
                        help="write check copies: the instructor notebook, then the learner's "
                             "exercise cells (see check_copy)")
    args = parser.parse_args(argv)
    make = make_check_copies if args.check else make_learner_copies
    try:
        written = make(args.source, args.dest)
    except ValueError as err:
        parser.error(str(err))
    if not written:
        parser.error(f"no numbered notebook (NN_name.ipynb) in {args.source}")
    kind = "check" if args.check else "learner"
    print(f"Wrote {len(written)} {kind} notebooks to {args.dest}")


if __name__ == "__main__":
    main()
