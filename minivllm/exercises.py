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
for a room, with the solution cells removed and no outputs.

A self-check prints, and never raises: a learner who runs the whole notebook before
answering gets "fill in your prediction" at each exercise, not a traceback that stops
the run at the first one. In the instructor copy the check cells are tagged
``nbval-check-output``, so ``make test`` fails if a solution stops being right.
"""

from __future__ import annotations

import argparse
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


def make_learner_copies(source: Path, dest: Path) -> list[Path]:
    """Write a learner copy of every numbered notebook in ``source`` to ``dest``: the cells
    tagged ``solution`` removed (nbconvert's TagRemovePreprocessor), every output cleared,
    and the self-checks no longer compared by nbval (a learner's check prints "fill in")."""
    import nbformat
    from nbconvert.preprocessors import ClearOutputPreprocessor, TagRemovePreprocessor

    remove = TagRemovePreprocessor(remove_cell_tags={SOLUTION_TAG}, enabled=True)
    clear = ClearOutputPreprocessor(enabled=True)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(source.glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nb, _ = remove.preprocess(nb, {})
        nb, _ = clear.preprocess(nb, {})
        for cell in nb.cells:
            tags = cell.get("metadata", {}).get("tags")
            if tags and CHECK_TAG in tags and "nbval-check-output" in tags:
                tags.remove("nbval-check-output")
        nb.metadata.pop("widgets", None)  # widget state belongs to outputs just cleared
        out = dest / path.name
        nbformat.write(nb, out)
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m minivllm.exercises",
        description="Write the learner copies of the notebooks (solutions removed, no outputs).")
    parser.add_argument("source", type=Path, help="folder of the instructor notebooks")
    parser.add_argument("dest", type=Path, help="folder to write the learner copies to")
    args = parser.parse_args(argv)
    written = make_learner_copies(args.source, args.dest)
    if not written:
        parser.error(f"no numbered notebook (NN_name.ipynb) in {args.source}")
    print(f"Wrote {len(written)} learner notebooks to {args.dest}")


if __name__ == "__main__":
    main()
