"""Interleaved timing: the one loop behind `attncal bench`, `attncal demo` and the benchmark scripts.

These machines are noisy (a 2-core VM's single-thread timings move by ±30 % between runs), so a ratio is
only worth reading when both sides were measured side by side: every round runs each candidate once, in
turn, and the figures are medians over rounds.  `rotate` shifts the order by one each round, for A/B runs
where the session that runs second tends to run slower whichever it is (benchmarks/library_ab.py); the
others keep a fixed order, their figures being recorded with it.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping


def interleaved_times(runs: Mapping[str, Callable[[], object]], repeats: int, *, warmup: int = 1,
                      rotate: bool = False, on_run: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Seconds of each of `repeats` timed calls per name, the names taking turns within each round.

    Each callable first runs `warmup` times (untimed, also in turns); `on_run` is called after every call,
    warm-up included (a progress bar's update)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    names = list(runs)
    for _ in range(warmup):
        for name in names:
            runs[name]()
            if on_run is not None:
                on_run()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names) if rotate and names else 0
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
            if on_run is not None:
                on_run()
    return times


def medians(times: Mapping[str, list[float]], scale: float = 1.0) -> dict[str, float]:
    """The median of each name's times, times `scale` (1e3 for milliseconds)."""
    return {name: scale * statistics.median(v) for name, v in times.items()}
