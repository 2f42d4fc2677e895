"""Interleaved timing: the one loop behind `attncal bench`, `attncal demo` and the benchmark scripts.

These machines are noisy (a 2-core VM's single-thread timings move by ±30 % between runs), so a ratio is
only worth reading when both sides were measured side by side: every round runs each candidate once, in
turn, and the figures are medians over rounds.  `rotate` shifts the order by one each round, so that no
candidate always runs in the same place (the session that runs second tends to run slower, whichever it is:
benchmarks/library_ab.py); `attncal bench` rotates, `attncal demo` keeps a fixed order, its figures being
recorded with it.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping, Sequence

import numpy as np

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""What a timed call is measured in: wall time, or the CPU time of this process (every thread of it).  CPU
time is what a run costs where nothing else runs: other load on the machine moves it far less than wall
time, as long as the work runs in this process and no thread of it spins while waiting (one intra-op
thread)."""


def interleaved_times(runs: Mapping[str, Callable[[], object]], repeats: int, *, warmup: int = 1,
                      rotate: bool = False, on_run: Callable[[], None] | None = None,
                      clock: str = "wall") -> dict[str, list[float]]:
    """Seconds of each of `repeats` timed calls per name, the names taking turns within each round, on
    `clock` (a key of CLOCKS).

    Each callable first runs `warmup` times (untimed, also in turns); `on_run` is called after every call,
    warm-up included (a progress bar's update)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    now = CLOCKS[clock]
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
            t0 = now()
            runs[name]()
            times[name].append(now() - t0)
            if on_run is not None:
                on_run()
    return times


def medians(times: Mapping[str, list[float]], scale: float = 1.0) -> dict[str, float]:
    """The median of each name's times, times `scale` (1e3 for milliseconds)."""
    return {name: scale * statistics.median(v) for name, v in times.items()}


def median_ratio(times: Sequence[float], base: Sequence[float], *, level: float = 0.95, resamples: int = 4000,
                 seed: int = 0) -> tuple[float, float, float]:
    """(median(times) / median(base), and its `level` bootstrap interval): the rounds are resampled with
    replacement as pairs (the i-th of each side ran in the same round, side by side), so that what moved both
    sides in a round moves the two medians together."""
    a, b = np.asarray(times, dtype=float), np.asarray(base, dtype=float)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"need the same number of rounds on both sides, got {a.size} and {b.size}")
    idx = np.random.default_rng(seed).integers(0, a.size, size=(resamples, a.size))
    boot = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    tail = (1 - level) / 2
    return float(np.median(a) / np.median(b)), float(np.quantile(boot, tail)), float(np.quantile(boot, 1 - tail))
