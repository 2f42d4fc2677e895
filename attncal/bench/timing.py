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
    return sessions_median_ratio([times], [base], level=level, resamples=resamples, seed=seed)


def sessions_median_ratio(sessions: Sequence[Sequence[float]], base: Sequence[Sequence[float]], *,
                          level: float = 0.95, resamples: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """`median_ratio` of one graph's sessions over another's: the geometric mean of median(s) / median(t) over every
    pair of a session s of `sessions` and t of `base` (a session's speed is set when it is made, so two sessions a
    side weigh that luck down), and its `level` bootstrap interval, the rounds resampled together on every session."""
    a = np.asarray(sessions, dtype=float)
    b = np.asarray(base, dtype=float)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or a.shape[1] == 0:
        raise ValueError(f"need the same number of rounds on both sides, got {a.shape[-1]} and {b.shape[-1]}")
    idx = np.random.default_rng(seed).integers(0, a.shape[1], size=(resamples, a.shape[1]))

    def ratio(ma: np.ndarray, mb: np.ndarray) -> np.ndarray:  # the geometric mean over every pair of sessions
        return np.exp(np.log(ma).mean(axis=0) - np.log(mb).mean(axis=0))

    boot = ratio(np.median(a[:, idx], axis=-1), np.median(b[:, idx], axis=-1))
    tail = (1 - level) / 2
    point = ratio(np.median(a, axis=-1), np.median(b, axis=-1))
    return float(point), float(np.quantile(boot, tail)), float(np.quantile(boot, 1 - tail))
