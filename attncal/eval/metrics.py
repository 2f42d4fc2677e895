"""Position-bias metrics on top of ir-measures (pytrec_eval underneath).

Per-query nDCG@10 and Recall@10 come from ir-measures; this module only
groups them: the mean per position group, the harmonic mean across groups
(high only when every group is served well) and the position sensitivity
index PSI = 1 - min/max of the group nDCG@10 (0 = no position bias).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Mapping


def require_ir_measures() -> None:
    """Import ir-measures now.  It comes with the `eval` extra and is imported where it scores (`per_query`), so
    that `attncal.eval` imports without it (the CLI's parser imports it, also on the runtime install); the entry
    points call this first, so an install without it is refused before anything is built or encoded."""
    import ir_measures  # noqa: F401


@dataclass
class GroupScores:
    """nDCG@10 per group, their harmonic mean and PSI, and the aggregate nDCG@10 / Recall@10."""

    groups: dict[str, float]
    counts: dict[str, int]
    hm: float
    psi: float
    ndcg10: float
    recall10: float

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def per_query(
    qrels: Mapping[str, Mapping[str, int]], run: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, float]]:
    """{query id: {"ndcg10": .., "recall10": ..}} for every judged query (unretrieved ones score 0)."""
    import ir_measures  # the eval extra; see require_ir_measures

    ndcg10, r10 = ir_measures.nDCG @ 10, ir_measures.R @ 10
    out = {q: {"ndcg10": 0.0, "recall10": 0.0} for q in qrels}
    names = {str(ndcg10): "ndcg10", str(r10): "recall10"}
    binary = {q: {d: int(r > 0) for d, r in docs.items()} for q, docs in qrels.items()}
    for m in ir_measures.iter_calc([ndcg10, r10], binary, {q: dict(d) for q, d in run.items()}):
        if m.query_id in out:
            out[m.query_id][names[str(m.measure)]] = float(m.value)
    return out


def harmonic_mean(values: list[float]) -> float:
    """Harmonic mean; 0 when any value is 0 (a group that fails entirely sinks the score)."""
    if not values:
        return math.nan
    return statistics.harmonic_mean(values)


def psi(values: list[float]) -> float:
    """1 - min/max; NaN when every group scores 0 (no bias can be measured)."""
    if not values or max(values) <= 0:
        return math.nan
    return 1.0 - min(values) / max(values)


def group_scores(
    qrels: Mapping[str, Mapping[str, int]],
    run: Mapping[str, Mapping[str, float]],
    group: Mapping[str, str],
    groups: tuple[str, ...],
) -> GroupScores:
    return scores_from_per_query(per_query(qrels, run), group, groups)


def scores_from_per_query(
    pq: Mapping[str, Mapping[str, float]], group: Mapping[str, str], groups: tuple[str, ...]
) -> GroupScores:
    """Group the per-query scores of `per_query`; separate so that a caller that also needs the
    per-query values (the paired bootstrap of `attncal eval --compare`) scores each run once."""
    by_group: dict[str, list[float]] = {g: [] for g in groups}
    for q, scores in pq.items():
        if q in group:
            by_group[group[q]].append(scores["ndcg10"])
    present = [g for g in groups if by_group[g]]
    means = {g: statistics.fmean(by_group[g]) for g in present}
    vals = list(means.values())
    return GroupScores(
        groups=means,
        counts={g: len(by_group[g]) for g in present},
        hm=harmonic_mean(vals),
        psi=psi(vals),
        ndcg10=statistics.fmean(s["ndcg10"] for s in pq.values()),
        recall10=statistics.fmean(s["recall10"] for s in pq.values()),
    )


def score_delta(scores: dict, base: dict) -> dict[str, float | None]:
    """`scores` minus `base` (two `GroupScores.to_dict()`s): group_<name>, hm, psi, ndcg10, recall10;
    None where either side is undefined (to_dict writes NaN as None)."""
    def d(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    out = {f"group_{g}": d(scores["groups"].get(g), base["groups"].get(g)) for g in base["groups"]}
    for k in ("hm", "psi", "ndcg10", "recall10"):
        out[k] = d(scores[k], base[k])
    return out
