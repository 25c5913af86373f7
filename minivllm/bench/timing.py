"""One way to time things on a shared, noisy CPU, and to say what the times show.

A laptop, a CI runner and a cloud VM all run other programs beside yours: the clock of
one run can be 1.5x the clock of the next, a minute later, with nothing changed. Two
habits make a comparison honest anyway (notebook 02 teaches them):

- **Interleave.** Time the variants in rounds, A, B, A, B, ..., never all of A and then
  all of B: a slow minute then slows both alike instead of only the one that ran in it.
  The first ``warmup`` rounds are thrown away (caches, lazy initialisation, kernels
  compiled on first use).
- **Report a spread, and let it decide the words.** Each variant's result is the median
  of its rounds with the interquartile range (the middle half of the rounds) beside it.
  :func:`compare` names a winner only when the two ranges do not overlap; when they do,
  it says "no clear difference on this machine". A sentence under a table is printed
  from :func:`compare`, never typed in advance, so it cannot contradict the numbers.

Nothing here asserts a time. Tests and notebooks assert mechanisms (tokens, steps,
blocks, bytes, FLOPs, simulated seconds) and print timings with this module.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from minivllm.metrics import percentile


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one thing (seconds, or any unit where less is better,
    unless ``higher_is_better``), warm-up rounds already removed."""

    name: str
    samples: tuple[float, ...]
    unit: str = "s"
    higher_is_better: bool = False

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError(f"{self.name}: a Timing needs at least one sample")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        """The 25th percentile (the lower edge of the middle half of the rounds)."""
        return percentile(self.samples, 25)

    @property
    def high(self) -> float:
        """The 75th percentile."""
        return percentile(self.samples, 75)

    def scaled(self, factor: float, unit: str) -> Timing:
        """The same measurement in another unit, e.g. ``t.scaled(1e3, "ms")``."""
        return Timing(self.name, tuple(x * factor for x in self.samples), unit, self.higher_is_better)

    def per(self, count: float, unit: str) -> Timing:
        """Each sample divided by ``count`` (seconds per token, say)."""
        return Timing(self.name, tuple(x / count for x in self.samples), unit, self.higher_is_better)

    def rate(self, count: float, unit: str) -> Timing:
        """``count`` per sample (tokens per second from seconds): higher is better."""
        return Timing(self.name, tuple(count / x for x in self.samples), unit, not self.higher_is_better)

    def __str__(self) -> str:
        return f"{_fmt(self.median)} {self.unit} ({_fmt(self.low)}-{_fmt(self.high)})"


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """The order of round ``round_index``: ``names`` rotated by it (A B C, then B C A, ...),
    so that no variant always runs first or right after the same neighbour."""
    k = round_index % len(names)
    return list(names[k:]) + list(names[:k])


def measure(variants: Mapping[str, Callable[[], object]], rounds: int = 5, warmup: int = 1,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, Timing]:
    """Time each variant once per round, interleaved, ``warmup`` + ``rounds`` rounds.

    Within a round the order rotates (:func:`rotated`). Returns one :class:`Timing` per variant, in
    seconds, the warm-up rounds left out.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got {rounds} and {warmup}")
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        for name in rotated(names, r):
            t0 = clock()
            variants[name]()
            elapsed = clock() - t0
            if r >= warmup:
                samples[name].append(elapsed)
    return {n: Timing(n, tuple(samples[n])) for n in names}


@dataclass(frozen=True)
class Comparison:
    """What two timings say about each other."""

    a: Timing
    b: Timing

    @property
    def ratio(self) -> float:
        """a's median over b's."""
        return self.a.median / self.b.median

    @property
    def clear(self) -> bool:
        """True when the middle halves of the two do not overlap."""
        return self.a.high < self.b.low or self.b.high < self.a.low

    @property
    def winner(self) -> Timing | None:
        """The better of the two, or None when the spreads overlap."""
        if not self.clear:
            return None
        a_less = self.a.median < self.b.median
        return self.a if a_less != self.a.higher_is_better else self.b

    @property
    def verdict(self) -> str:
        """One sentence that comes from the numbers, e.g. "batched is 3.1x faster than
        loop" or "no clear difference on this machine (spreads overlap)"."""
        if self.winner is None:
            return (f"no clear difference on this machine between {self.a.name} and {self.b.name} "
                    f"(their spreads overlap: {self.a} against {self.b})")
        w, other = (self.a, self.b) if self.winner is self.a else (self.b, self.a)
        factor = max(w.median, other.median) / min(w.median, other.median)
        return f"{w.name} is {factor:.2f}x faster than {other.name} on this machine"


def compare(a: Timing, b: Timing) -> Comparison:
    """Compare two timings of the same unit; see :class:`Comparison`."""
    if a.unit != b.unit or a.higher_is_better != b.higher_is_better:
        raise ValueError(f"cannot compare {a.name} ({a.unit}) with {b.name} ({b.unit})")
    return Comparison(a, b)


def table(timings: Sequence[Timing] | Mapping[str, Timing], baseline: str | None = None) -> str:
    """A plain-text table: median, middle half, rounds, and the ratio to ``baseline``."""
    rows = list(timings.values()) if isinstance(timings, Mapping) else list(timings)
    base = next((t for t in rows if t.name == baseline), None)
    width = max(len(t.name) for t in rows)
    head = f"{'':{width}}  {'median':>10}  {'middle half':>19}  rounds"
    if base is not None:
        head += f"  {'vs ' + base.name:>12}"
    lines = [head]
    for t in rows:
        line = (f"{t.name:{width}}  {_fmt(t.median):>7} {t.unit:<2}  "
                f"{_fmt(t.low):>8} - {_fmt(t.high):<8}  {len(t.samples):>6}")
        if base is not None:
            line += f"  {t.median / base.median:>11.2f}x"
        lines.append(line)
    return "\n".join(lines)
