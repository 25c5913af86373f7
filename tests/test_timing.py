"""minivllm.bench.timing: interleaved rounds, median and middle half, verdicts from numbers.

A fake clock makes every timing here exact, so these tests check the arithmetic and the
words, never the speed of this machine."""

import pytest

from minivllm.bench.timing import Timing, compare, measure, rotated, table


class FakeClock:
    """Each variant advances the clock by the cost it is given; the clock reads it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def work(self, name: str, costs: list[float]):
        it = iter(costs)

        def run() -> None:
            self.calls.append(name)
            self.now += next(it)
        return run


def test_measure_interleaves_rotates_and_drops_warmup():
    clock = FakeClock()
    variants = {"a": clock.work("a", [9.0, 1, 2, 3]), "b": clock.work("b", [9.0, 4, 5, 6])}
    got = measure(variants, rounds=3, warmup=1, clock=clock)
    # round 0: a b, round 1: b a, round 2: a b, round 3: b a
    assert clock.calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert got["a"].samples == (1, 2, 3) and got["b"].samples == (4, 5, 6)  # the 9 s warm-up is gone
    assert got["a"].median == 2 and got["b"].median == 5


def test_median_and_middle_half():
    t = Timing("x", (1.0, 2.0, 3.0, 4.0, 100.0))
    assert t.median == 3.0 and (t.low, t.high) == (2.0, 4.0)  # one disturbed round moves neither
    assert str(t) == "3 s (2-4)"
    assert t.scaled(1e3, "ms").median == 3000.0


def test_verdict_names_a_winner_only_when_spreads_do_not_overlap():
    fast, slow = Timing("batched", (1.0, 1.1, 1.2)), Timing("loop", (3.0, 3.1, 3.3))
    c = compare(fast, slow)
    assert c.clear and c.winner is fast and c.ratio == pytest.approx(1.1 / 3.1)
    assert c.verdict.startswith("batched is 2.82x faster than loop")

    a, b = Timing("a", (1.0, 2.0, 3.0)), Timing("b", (1.5, 2.5, 3.5))
    assert compare(a, b).winner is None
    assert compare(a, b).verdict.startswith("no clear difference on this machine")


def test_rates_are_better_when_higher():
    # 10 tokens in 1 s is 10 tok/s; in 2 s it is 5 tok/s: the first is faster
    quick = Timing("quick", (1.0, 1.0, 1.0)).rate(10, "tok/s")
    slow = Timing("slow", (2.0, 2.0, 2.0)).rate(10, "tok/s")
    assert quick.higher_is_better and compare(slow, quick).winner is quick
    with pytest.raises(ValueError, match="cannot compare"):
        compare(quick, Timing("s", (1.0,)))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least one sample"):
        Timing("empty", ())
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        measure({"a": lambda: None}, rounds=0)


def test_table_lists_every_timing_with_its_ratio():
    text = table([Timing("base", (2.0, 2.0)), Timing("half", (1.0, 1.0))], baseline="base")
    lines = text.splitlines()
    assert len(lines) == 3 and "vs base" in lines[0]
    assert lines[1].rstrip().endswith("1.00x") and lines[2].rstrip().endswith("0.50x")


def test_rotated_starts_each_round_one_further():
    assert [rotated("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
