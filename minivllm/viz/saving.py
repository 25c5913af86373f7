"""Writing figures to ``figures/`` (or ``$MINIVLLM_FIGURES_DIR``), shown as the file written."""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.figure import Figure

# -- saving ---------------------------------------------------------------------------

FIGURES_ENV = "MINIVLLM_FIGURES_DIR"
"""Environment variable naming another folder for :func:`save_figure` (the test suite
points it at a temporary folder, so that running the notebooks under test does not
rewrite the committed figures)."""


def figures_dir() -> Path:
    """``$MINIVLLM_FIGURES_DIR`` when set; else the repository's ``figures/`` folder when
    running from a checkout, else ``./figures`` (created if missing)."""
    if os.environ.get(FIGURES_ENV):
        folder = Path(os.environ[FIGURES_ENV])
    else:
        repo_figures = Path(__file__).resolve().parents[2] / "figures"
        folder = repo_figures if repo_figures.is_dir() else Path.cwd() / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class SavedFigure(os.PathLike):
    """The path of a figure written by :func:`save_figure`, which Jupyter displays as
    the picture in that file: what a notebook shows is byte for byte what it saved."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        # The folder and the name, not the absolute path: notebooks store this text.
        return f"<figure saved to {self.path.parent.name}/{self.path.name}>"

    def __eq__(self, other: object) -> bool:
        return self.path == Path(other) if isinstance(other, (str, os.PathLike)) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.path)

    def _repr_png_(self) -> bytes | None:
        return self.path.read_bytes() if self.path.suffix.lower() == ".png" else None

    def _repr_svg_(self) -> str | None:
        return self.path.read_text() if self.path.suffix.lower() == ".svg" else None


def save_figure(fig: Figure, name: str, dpi: int = 120) -> SavedFigure:
    """Write ``fig`` to ``figures/<name>`` (PNG unless ``name`` ends in .svg or .pdf)
    and return its path, as a :class:`SavedFigure`: the last line of a notebook cell,
    it shows the file just written, so the committed figure and the stored notebook
    output are the same picture."""
    path = figures_dir() / name
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        path = path.with_name(path.name + ".png")
    # A fixed date stamp: the same figure gives the same bytes, run after run.
    metadata = {"Software": None} if path.suffix.lower() == ".png" else None
    fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata=metadata)
    return SavedFigure(path)
