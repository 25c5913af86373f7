"""Every notebook keeps the shape a learner relies on, and is stored executed.

(Running them is nbval's job: `make test` passes `notebooks/` to pytest with --nbval-lax.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no numbered notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_structure(path):
    nb = json.loads(path.read_text())
    markdown = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert re.search(r"^#\s+\S", markdown, re.M), "a title"
    assert re.search(r"what you will learn", markdown, re.I), "a 'What you will learn' section"
    assert re.search(r"^#+\s*Exercises", markdown, re.M | re.I), "an Exercises section"
    exercises = markdown[re.search(r"^#+\s*Exercises", markdown, re.M | re.I).end():]
    assert len(re.findall(r"^\s*(?:\d+\.|[-*])\s+\S", exercises, re.M)) >= 3, "three or more exercises"
    assert re.search(r"^#+\s*In vLLM", markdown, re.M | re.I), "an 'In vLLM' section"
    assert re.search(r"^\|.*\|\s*$", markdown.split("In vLLM", 1)[-1], re.M), "the 'In vLLM' table"
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert code, "code cells"
    assert all(c.get("execution_count") is not None for c in code), "stored executed"
    counts = [c["execution_count"] for c in code]
    assert counts == sorted(counts), "executed top to bottom, in order"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, "no error outputs"
    sources = "\n".join("".join(c["source"]) for c in code)
    assert "import minivllm" in sources or "from minivllm" in sources, "imports the package"
