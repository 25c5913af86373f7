"""Layout checks for a drawn figure: the guard behind the course reviews' figure findings
(keys cut off the picture, keys over the data, labels running into each other, pictures
too wide for a page).

Used two ways. tests/test_viz.py asserts them on every ``minivllm.viz`` figure. Under
``make test`` every figure a notebook cell shows or saves is checked too, including the
ones a cell builds itself with matplotlib: notebooks/conftest.py points nbval's kernels at
:func:`kernel_ipython_dir`, whose IPython start-up file calls :func:`install`, which puts :func:`assert_layout` in
front of Jupyter's picture of a ``Figure`` and of ``Figure.savefig``. A failing check
raises inside the cell, so nbval fails that cell and says what is wrong.

Each check reads what matplotlib reports about the artists it drew (their extents in
display pixels), never the picture's pixels.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.text import Text
from matplotlib.transforms import Bbox

MAX_WIDTH_PX = 2000
"""The widest picture a notebook may show, at the dpi it is drawn at: a browser shrinks a
wider one until its text is unreadable (notebook 10 once showed 3,437 px)."""

TOLERANCE_PX = 1.0
"""Overlaps smaller than this (anti-aliasing, rounded extents) are not problems."""


@dataclass
class Drawn:
    """One draw of a figure: its tight box and keys, and every text it drew (pixels)."""

    tight: Bbox
    keys: list[tuple[Legend, Bbox]]
    texts: list[tuple[str, Bbox]]


def draw(fig: Figure) -> Drawn:
    """Draw ``fig`` once with Agg and record what was drawn. Texts are recorded as
    ``Text.draw`` runs, so a tick label matplotlib keeps but does not draw (outside the
    axis' view) is not counted."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    texts: list[tuple[str, Bbox]] = []
    text_draw = Text.draw

    def recording_draw(self: Text, renderer) -> None:
        text_draw(self, renderer)
        if self.get_visible() and self.get_text().strip():
            texts.append((self.get_text(), Text.get_window_extent(self, renderer)))

    Text.draw = recording_draw
    try:
        canvas.draw()
    finally:
        Text.draw = text_draw
    renderer = canvas.get_renderer()
    keys = [(k, k.get_window_extent(renderer)) for k in fig.findobj(Legend) if k.get_visible()]
    tight = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)
    return Drawn(tight=tight, keys=keys, texts=texts)


def overflow(fig: Figure) -> tuple[float, float]:
    """How far (inches: width, height) what the figure draws reaches past its own size:
    what ``savefig(bbox_inches="tight")`` (as ``viz.save_figure`` and Jupyter's inline
    pictures do) grows the picture by, or what a fixed-size picture clips."""
    drawn = draw(fig)
    # Every key counts, also one the tight box leaves out because it is clipped to its
    # axes (an artist added with add_artist is): such a key is cut off the picture.
    box = Bbox.union([drawn.tight, *(b for _, b in drawn.keys)]).transformed(fig.dpi_scale_trans.inverted())
    w, h = fig.get_size_inches()
    return max(0.0, box.x1 - w, -box.x0), max(0.0, box.y1 - h, -box.y0)


def keys_cut_off(fig: Figure, drawn: Drawn | None = None) -> list[str]:
    """Keys (legends) that ``savefig(bbox_inches="tight")`` cuts: the tight box leaves out
    a key that is clipped to its axes, so the saved picture ends inside it."""
    drawn = drawn or draw(fig)
    t, cut = drawn.tight, []
    for key, b in drawn.keys:
        if (b.x0 < t.x0 - TOLERANCE_PX or b.x1 > t.x1 + TOLERANCE_PX
                or b.y0 < t.y0 - TOLERANCE_PX or b.y1 > t.y1 + TOLERANCE_PX):
            title = key.get_title().get_text()
            cut.append(f"the key {title!r}" if title else "a key")
    return cut


def points_under_keys(fig: Figure, drawn: Drawn | None = None) -> list[tuple[str, float, float]]:
    """Every data point (a point along a drawn line, a marker, a scatter's marker) that a
    key is drawn over:
    (the line's label, x, y). A key placed inside the axes covers data the moment a
    line runs into its corner (the reviews' notebooks 09, 12 and 14)."""
    from matplotlib.collections import PathCollection
    from matplotlib.lines import Line2D

    drawn = drawn or draw(fig)
    boxes = [b for _, b in drawn.keys]
    covered = []
    for ax in fig.axes:
        for artist in [*ax.lines, *ax.collections]:
            if not artist.get_visible():
                continue
            if isinstance(artist, Line2D):
                xy = artist.get_xydata()
            elif isinstance(artist, PathCollection):
                xy = artist.get_offsets()
            else:
                continue
            if len(xy) == 0:
                continue
            points = artist.get_transform().transform(xy)
            if isinstance(artist, Line2D) and artist.get_linestyle() not in ("None", "", " "):
                points = _along(points)  # a drawn line covers the path between its vertices too
            for x, y in points:
                if any(b.contains(x, y) for b in boxes):
                    covered.append((artist.get_label(), float(x), float(y)))
    return covered


def _along(points, step_px: float = 4.0):
    """The points of a polyline (pixels) every ``step_px`` along each segment, so a key
    drawn over the middle of a long straight line (a percentile marker) is seen."""
    import numpy as np

    out = [points[:1]]
    for a, b in zip(points[:-1], points[1:]):
        n = max(1, int(np.hypot(*(b - a)) // step_px))
        out.append(a + (b - a) * (np.arange(1, n + 1)[:, None] / n))
    return np.concatenate(out) if len(points) else points


def overlapping_texts(fig: Figure, drawn: Drawn | None = None) -> list[tuple[str, str]]:
    """Pairs of texts drawn over each other (tick labels, titles, keys' entries,
    annotations): the reviews' 40-character request ids running into each other."""
    drawn = drawn or draw(fig)
    pairs = []
    for (a, box_a), (b, box_b) in itertools.combinations(drawn.texts, 2):
        overlap_x = min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0)
        overlap_y = min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0)
        if overlap_x > TOLERANCE_PX and overlap_y > TOLERANCE_PX:
            pairs.append((a, b))
    return pairs


def layout_problems(fig: Figure) -> list[str]:
    """Every check, as sentences saying what is wrong (empty when nothing is)."""
    drawn = draw(fig)
    problems = [f"{what} is cut off the picture" for what in keys_cut_off(fig, drawn)]
    covered = points_under_keys(fig, drawn)
    if covered:
        labels = sorted({label for label, _, _ in covered})
        problems.append(f"a key covers {len(covered)} data point(s) of {labels}")
    overlaps = overlapping_texts(fig, drawn)
    problems += [f"texts overlap: {a[:40]!r} and {b[:40]!r}" for a, b in overlaps[:5]]
    if len(overlaps) > 5:
        problems.append(f"and {len(overlaps) - 5} more overlapping pairs")
    if drawn.tight.width > MAX_WIDTH_PX:
        problems.append(f"the picture is {drawn.tight.width:.0f} px wide (at most {MAX_WIDTH_PX})")
    return problems


class FigureLayoutError(AssertionError):
    """A figure fails a layout check."""


def assert_layout(fig: Figure) -> None:
    """Raise :class:`FigureLayoutError` naming the figure and its problems, if it has any."""
    problems = layout_problems(fig)
    if problems:
        titles = [fig._suptitle.get_text()] if fig._suptitle else []
        titles += [ax.get_title() for ax in fig.axes if ax.get_title()]
        raise FigureLayoutError(f"figure {titles[0] if titles else '(untitled)'!r}: " + "; ".join(problems))


def install() -> None:
    """In an IPython kernel: check every Figure before Jupyter turns it into a picture
    (a cell's last line, ``display(fig)``, pyplot's figures at the end of a cell) and
    before ``Figure.savefig`` writes it (``viz.save_figure``)."""
    import functools

    from IPython import get_ipython
    from IPython.core import pylabtools

    def checked(function):
        @functools.wraps(function)
        def wrapper(fig, *args, **kwargs):
            assert_layout(fig)
            return function(fig, *args, **kwargs)
        wrapper.layout_checked = True
        return wrapper

    # Jupyter's inline pictures: the inline backend registers partial(print_figure, ...)
    # as the Figure formatter when matplotlib starts, looking print_figure up then.
    if not getattr(pylabtools.print_figure, "layout_checked", False):
        pylabtools.print_figure = checked(pylabtools.print_figure)
    ip = get_ipython()
    for formatter in ip.display_formatter.formatters.values():  # registered before this ran
        if Figure in formatter.type_printers and not getattr(formatter.type_printers[Figure], "layout_checked", False):
            formatter.type_printers[Figure] = checked(formatter.type_printers[Figure])
    if not getattr(Figure.savefig, "layout_checked", False):
        Figure.savefig = checked(Figure.savefig)


def kernel_ipython_dir() -> str:
    """A new IPython directory whose start-up file runs :func:`install`: an IPython kernel
    started with ``IPYTHONDIR`` set to it checks every figure it shows or saves."""
    import os
    import tempfile

    ipython_dir = tempfile.mkdtemp(prefix="minivllm-ipython-")
    startup = os.path.join(ipython_dir, "profile_default", "startup")
    os.makedirs(startup)
    with open(os.path.join(startup, "00-figure-layout.py"), "w") as f:
        f.write(f"import sys\nsys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
                "import figure_layout\nfigure_layout.install()\n")
    return ipython_dir
