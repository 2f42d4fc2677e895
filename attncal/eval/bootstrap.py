"""Paired bootstrap confidence intervals for differences in position-group metrics.

Two encoders scored on the same queries are compared on the same resamples of
those queries (a paired bootstrap): the noise that comes from which queries
happen to be in the set then cancels, and an encoder compared with itself gets
a difference of exactly 0 with a zero-width interval.

Queries are resampled with replacement within their position group (a
stratified bootstrap).  Each group's nDCG@10 is a mean over that group's
queries; keeping the group sizes fixed means every resample measures every
group, which matters on small sets, where a plain resample can leave a group
empty and HM or PSI undefined.  HM and PSI are recomputed on each resample from
the resampled group means with the same functions as the point estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


LEVEL = 0.95


@dataclass(frozen=True)
class Resamples:
    """Query indices of every resample, one [n_resamples, group size] array per present group."""

    groups: tuple[str, ...]
    indices: tuple[np.ndarray, ...]

    @property
    def n(self) -> int:
        return int(self.indices[0].shape[0]) if self.indices else 0


def describe(n_resamples: int, seed: int, level: float, compared: str) -> dict:
    """What results.json records about the intervals; `compared` says what is paired with what."""
    return {"resamples": n_resamples, "seed": seed, "level": level,
            "method": f"paired: {compared} on the same resamples; queries resampled with replacement within their "
                      "position group; HM and PSI recomputed per resample; percentile interval"}


def draw_resamples(query_groups: Sequence[str], groups: Sequence[str], n_resamples: int, seed: int) -> Resamples:
    """Stratified resamples of the queries; drawn once, so every comparison uses the same ones."""
    if n_resamples < 1:
        raise ValueError(f"--bootstrap must be >= 1 resample, got {n_resamples}")
    labels = np.asarray(list(query_groups))
    rng = np.random.default_rng(seed)
    present, indices = [], []
    for g in groups:
        members = np.flatnonzero(labels == g)
        if len(members):
            present.append(g)
            indices.append(members[rng.integers(0, len(members), size=(n_resamples, len(members)))])
    return Resamples(tuple(present), tuple(indices))


def resampled_stats(values: np.ndarray, resamples: Resamples) -> np.ndarray:
    """[n_resamples, groups + 2]: each resample's group means, then its HM and PSI."""
    means = np.stack([values[idx].mean(axis=1) for idx in resamples.indices], axis=1)
    return np.column_stack([means, _harmonic_means(means), _psis(means)])


def _harmonic_means(rows: np.ndarray) -> np.ndarray:
    """`metrics.harmonic_mean` of each row, vectorised (0 where a value is 0): thousands of resamples per
    configuration at family-wise levels."""
    with np.errstate(divide="ignore"):
        inv = np.sum(1.0 / rows, axis=1)
    return np.where(np.any(rows == 0, axis=1), 0.0, rows.shape[1] / inv)


def _psis(rows: np.ndarray) -> np.ndarray:
    """`metrics.psi` of each row, vectorised (NaN where every value is 0)."""
    top = rows.max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(top > 0, 1.0 - rows.min(axis=1) / top, np.nan)


def _interval(diffs: np.ndarray, level: float) -> list[float] | None:
    """Percentile interval of the finite differences; None when no resample defines the metric."""
    finite = diffs[np.isfinite(diffs)]
    if not len(finite):
        return None
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(finite, [tail, 100.0 - tail])
    return [float(lo), float(hi)]


def paired_deltas(
    values: np.ndarray, base: np.ndarray, point: dict[str, float | None], resamples: Resamples, level: float = LEVEL
) -> dict:
    """{metric: {"delta", "ci": [lo, hi] | None}} for `values` minus `base` (per-query nDCG@10, same query order).

    `point` holds the full-set differences (group_<name>, hm, psi), computed by
    the caller from the reported scores so that table and interval agree.
    Resamples where a metric is undefined (PSI when every group scores 0) are
    left out of its interval and counted under "undefined".
    """
    diffs = resampled_stats(values, resamples) - resampled_stats(base, resamples)
    keys = [f"group_{g}" for g in resamples.groups] + ["hm", "psi"]
    out: dict = {}
    for j, key in enumerate(keys):
        col = diffs[:, j]
        out[key] = {"delta": point.get(key), "ci": _interval(col, level),
                    "undefined": int(np.count_nonzero(~np.isfinite(col)))}
    return out



def paired_mean_delta(values: np.ndarray, base: np.ndarray, resamples: Resamples, level: float = LEVEL) -> dict:
    """{"delta", "ci"} of the mean over all queries of `values` minus `base` (per-query, same order), on the
    same resamples: the aggregate nDCG@10 or Recall@10 of a set without position groups."""
    diff = np.asarray(values, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    means = diff[np.concatenate(resamples.indices, axis=1)].mean(axis=1)
    return {"delta": float(diff.mean()), "ci": _interval(means, level)}
