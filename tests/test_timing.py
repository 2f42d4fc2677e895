"""attncal.bench.timing: the interleaved loop shared by `attncal bench`, `attncal demo` and benchmarks/."""

from __future__ import annotations

import pytest

from attncal.bench.timing import interleaved_times, median_ratio, medians, sessions_median_ratio


def _recorder():
    calls: list[str] = []
    return calls, {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}


def test_fixed_order_warmup_and_counts():
    calls, runs = _recorder()
    ticks = []
    times = interleaved_times(runs, 2, warmup=1, on_run=lambda: ticks.append(1))
    assert calls == ["a", "b", "c"] * 3  # one warm-up round, two timed rounds, always in the given order
    assert len(ticks) == 9 and {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2, "c": 2}
    assert list(times) == ["a", "b", "c"] and all(t >= 0 for v in times.values() for t in v)


def test_rotating_order_gives_each_name_each_place():
    calls, runs = _recorder()
    interleaved_times(runs, 3, warmup=0, rotate=True)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_medians_and_bad_arguments():
    assert medians({"x": [3.0, 1.0, 2.0], "y": [0.004]}, scale=1e3) == {"x": 2000.0, "y": 4.0}
    assert interleaved_times({}, 1) == {}
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        interleaved_times({"a": lambda: None}, 0)
    with pytest.raises(ValueError, match="warmup must be >= 0, got -1"):
        interleaved_times({"a": lambda: None}, 1, warmup=-1)
    with pytest.raises(ValueError, match="clock must be one of wall, cpu, got 'gpu'"):
        interleaved_times({"a": lambda: None}, 1, clock="gpu")


def test_cpu_clock_counts_this_process_work_not_its_sleep():
    """A call that sleeps takes wall time and almost no CPU time; one that computes takes both."""
    import time

    def busy():
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass

    cpu = interleaved_times({"sleep": lambda: time.sleep(0.05), "busy": busy}, 2, warmup=0, clock="cpu")
    wall = interleaved_times({"sleep": lambda: time.sleep(0.05)}, 2, warmup=0, clock="wall")
    assert max(cpu["sleep"]) < 0.02 <= min(wall["sleep"])
    assert min(cpu["busy"]) >= 0.05


def test_median_ratio_interval_pairs_the_rounds():
    """Rounds where both sides slowed together (a loaded machine) leave the paired ratio's interval narrow; a
    real 10 % difference is inside it, and a side compared with itself gets exactly 1."""
    base = [10.0, 30.0, 11.0, 29.0, 10.5, 31.0, 9.5, 30.5]
    slower = [1.1 * t for t in base]
    ratio, lo, hi = median_ratio(slower, base)
    assert abs(ratio - 1.1) < 1e-9 and lo <= 1.1 <= hi and hi - lo < 0.05
    assert median_ratio(base, base) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="same number of rounds"):
        median_ratio([1.0], [1.0, 2.0])

def test_sessions_median_ratio_weighs_each_sessions_luck_alike():
    """Two sessions a side: the geometric mean of the four pairs' median ratios, so a session that drew a slow
    start (its speed holds for the run) moves the figure by half its luck, not all of it; one session a side is
    `median_ratio` itself."""
    base = [10.0, 30.0, 11.0, 29.0, 10.5, 31.0, 9.5, 30.5]
    lucky, unlucky = [0.98 * t for t in base], [1.02 * t for t in base]
    cal = [[1.03 * t for t in base], [1.07 * t for t in base]]
    ratio, lo, hi = sessions_median_ratio(cal, [lucky, unlucky])
    assert abs(ratio - (1.03 * 1.07) ** 0.5 / (0.98 * 1.02) ** 0.5) < 1e-9 and lo <= ratio <= hi
    assert sessions_median_ratio([cal[0]], [base]) == median_ratio(cal[0], base)
    with pytest.raises(ValueError, match="same number of rounds"):
        sessions_median_ratio([[1.0, 2.0]], [[1.0]])
