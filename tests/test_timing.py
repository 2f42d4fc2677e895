"""attncal.bench.timing: the interleaved loop shared by `attncal bench`, `attncal demo` and benchmarks/."""

from __future__ import annotations

import pytest

from attncal.bench.timing import interleaved_times, medians


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
