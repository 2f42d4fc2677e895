"""The rule `attncal tune` decides by: select on some documents, confirm on others, and weigh the harm.

The rule reads only tables of per-query nDCG@10 (one column per configuration and one for the
uncalibrated model, a position group and a document per query), so it is tested on hand-made and
seeded random tables as well as run on a model's.

1. **Split by document.**  `split_documents` deals the documents, in a seeded random order, to a
   *selection* and a *confirmation* part, each next document to the part with fewer queries so far.  A
   document's passages and queries are all in one part, so nothing the choice was made on is seen again.
2. **Select, accounting for the number compared.**  On the selection part every configuration gets paired
   bootstrap intervals against the uncalibrated model at the family-wise level 1 − α/m (Bonferroni), m
   being the number of *distinct* configurations (columns that are equal are one; a column equal to the
   uncalibrated one changes nothing and is not counted).  A configuration qualifies when its ΔHM interval
   lies above 0 and its beginning group loses at most `max_begin_loss` (point estimate); of those, the
   largest ΔHM wins (ties within `tie_margin`: the lowest PSI, then grid order).  That is the candidate.
3. **Confirm on the held-out documents.**  The candidate alone is scored on the confirmation part, one
   comparison, at level 1 − α.  Its held-out ΔHM is *the* expected effect: it must lie above 0, and the
   held-out beginning loss must stay within `max_begin_loss`.
4. **The direction of the bias.**  The uncalibrated model's last group minus its first, with its interval,
   on all queries.  Calibration moves weight toward later content; unless that difference lies below 0 (the
   model under-serves later content) the decision is not to calibrate, whatever the sweep finds.
5. **Harm.**  A significant loss on a general retrieval set (its ΔnDCG@10 interval below 0) blocks the
   recommendation unless the loss is within `accept_general_loss`, which the user sets; either way the
   decision names the trade-off.

Under no true effect, "calibrate" needs the candidate's held-out interval to lie above 0, an event of
probability at most α/2 on documents independent of the choice, so the family-wise error of the decision
is at most α whatever the grid (tests/test_tune.py measures it on seeded null tables).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .bootstrap import LEVEL, draw_resamples, paired_deltas
from .metrics import harmonic_mean, psi

DECIDE = "calibrate"
DO_NOT = "do not calibrate"
REFUSE = "too little data"
SELECTION, CONFIRMATION = "selection", "confirmation"
TAIL_RESAMPLES = 10  # resamples beyond each end of a percentile interval, at least: sets the resamples needed


@dataclass(frozen=True)
class Rule:
    max_begin_loss: float = 0.02
    tie_margin: float = 0.001
    level: float = LEVEL
    accept_general_loss: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_begin_loss:
            raise ValueError(f"--max-begin-loss must be >= 0, got {self.max_begin_loss}")
        if not 0.0 <= self.tie_margin:
            raise ValueError(f"--tie-margin must be >= 0, got {self.tie_margin}")
        if not 0.0 <= self.accept_general_loss:
            raise ValueError(f"--accept-general-loss must be >= 0, got {self.accept_general_loss}")
        if not 0.5 <= self.level < 1.0:
            raise ValueError(f"the interval level must be in [0.5, 1), got {self.level}")

    def family_level(self, m: int) -> float:
        """The level of each of m intervals that together hold at `level` (Bonferroni)."""
        return 1.0 - (1.0 - self.level) / max(m, 1)

    def text(self, begin: str, m: int) -> str:
        return (f"select on one part of the documents: among the {m} distinct configuration{'s' if m != 1 else ''}, "
                f"the largest ΔHM whose family-wise {100 * self.family_level(m):.3g} % interval (Bonferroni over "
                f"{m}) lies above 0 and whose {begin} group loses at most {self.max_begin_loss:g} nDCG@10 (ties "
                f"within {self.tie_margin:g}: lowest PSI, then grid order); confirm it on the other documents: its "
                f"held-out {100 * self.level:g} % ΔHM interval above 0 and its held-out {begin} loss at most "
                f"{self.max_begin_loss:g}; calibrate only when the uncalibrated model under-serves later content and "
                f"general retrieval loses no more than {self.accept_general_loss:g} where it loses significantly")


def resamples_for(level: float, n_resamples: int) -> int:
    """At least `n_resamples`, and enough that each tail of a `level` percentile interval holds
    TAIL_RESAMPLES resamples."""
    return max(n_resamples, math.ceil(2 * TAIL_RESAMPLES / (1.0 - level)))


# --------------------------------------------------------------------------- the split
def split_documents(queries_per_document: Mapping[str, int], seed: int) -> dict[str, str]:
    """{document: SELECTION | CONFIRMATION}: the documents in a seeded random order (of their sorted ids), each
    to the part with fewer queries so far (the selection part on a tie)."""
    docs = sorted(queries_per_document)
    order = np.random.default_rng([seed, 62]).permutation(len(docs))
    load = {SELECTION: 0, CONFIRMATION: 0}
    out = {}
    for i in order:
        d = docs[int(i)]
        part = SELECTION if load[SELECTION] <= load[CONFIRMATION] else CONFIRMATION
        out[d] = part
        load[part] += queries_per_document[d]
    return out


# --------------------------------------------------------------------------- intervals on a table
def point_stats(values: np.ndarray, query_groups: Sequence[str], groups: Sequence[str]) -> dict[str, float | None]:
    """Group means (group_<name>), HM and PSI of per-query values on the full table."""
    labels = np.asarray(list(query_groups))
    means = [float(values[labels == g].mean()) for g in groups if np.any(labels == g)]
    out: dict[str, float | None] = {f"group_{g}": m for g, m in zip([g for g in groups if np.any(labels == g)], means)}
    out["hm"] = harmonic_mean(means)
    p = psi(means)
    out["psi"] = None if math.isnan(p) else p
    return out


def table_deltas(values: Mapping[str, np.ndarray], base: np.ndarray, query_groups: Sequence[str],
                 groups: Sequence[str], *, level: float, n_resamples: int, seed: int) -> dict[str, dict]:
    """{label: paired_deltas against `base`} for every column, on one set of stratified resamples."""
    resamples = draw_resamples(query_groups, groups, n_resamples, seed)
    b = point_stats(base, query_groups, groups)
    out = {}
    for lab, v in values.items():
        s = point_stats(v, query_groups, groups)
        point = {k: (None if s.get(k) is None or b.get(k) is None else s[k] - b[k]) for k in s}
        out[lab] = paired_deltas(v, base, point, resamples, level)
    return out


def distinct(values: Mapping[str, np.ndarray], base: np.ndarray) -> tuple[dict[str, str], list[str]]:
    """(same_as, no_ops): a column equal to an earlier one is that one; a column equal to `base` changes
    nothing.  Comparing the per-query scores is weaker than comparing embeddings; the caller passes the
    embeddings' identities where it has them."""
    same: dict[str, str] = {}
    no_op: list[str] = []
    first: dict[bytes, str] = {}
    base_key = np.ascontiguousarray(base).tobytes()
    for lab, v in values.items():
        key = np.ascontiguousarray(v).tobytes()
        if key == base_key:
            no_op.append(lab)
        elif key in first:
            same[lab] = first[key]
        else:
            first[key] = lab
    return same, no_op


def _d(row: dict, key: str) -> dict:
    return (row.get("delta") or {}).get(key) or {}


def _fmt_ci(entry: dict) -> str:
    ci = entry.get("ci")
    return f"{entry['delta']:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "")


def verdict(row: dict, begin: str, rule: Rule) -> str:
    """Why a configuration qualifies as the candidate or not, in a few words ("qualifies" when it does)."""
    hm = _d(row, "hm")
    ci = hm.get("ci")
    if hm.get("delta") is None or ci is None:
        return "ΔHM undefined"
    if ci[1] < 0:
        return "lowers HM"
    if ci[0] <= 0:
        return "ΔHM interval includes 0"
    b = _d(row, f"group_{begin}").get("delta")
    if b is not None and b < -rule.max_begin_loss:
        return f"{begin} loses {-b:.3f} > {rule.max_begin_loss:g}"
    return "qualifies"


# --------------------------------------------------------------------------- the stages
def select(rows: list[dict], groups: Sequence[str], rule: Rule, where: str = "the selection part") -> dict:
    """The candidate among the distinct `rows` of `where` (label, scores.psi, delta at the family level)."""
    begin = groups[0]
    verdicts = {r["label"]: verdict(r, begin, rule) for r in rows}
    ok = [r for r in rows if verdicts[r["label"]] == "qualifies"]
    out = {"verdicts": verdicts, "ties": []}
    if not ok:
        gains = [r for r in rows if (_d(r, "hm").get("ci") or [0.0])[0] > 0]
        defined = [r for r in rows if _d(r, "hm").get("delta") is not None]
        if gains:
            best = max(gains, key=lambda r: _d(r, "hm")["delta"])
            loss = -_d(best, f"group_{begin}")["delta"]
            reason = (f"calibrating with {best['label']} gains {_end(best, groups)} on the {groups[-1]} group and "
                      f"loses {loss:.3f} on the {begin} group ({where}; ΔHM {_fmt_ci(_d(best, 'hm'))}), more "
                      f"than --max-begin-loss {rule.max_begin_loss:g}: not recommended; --max-begin-loss "
                      f"{math.ceil(loss * 1000) / 1000:g} accepts that trade")
            return dict(out, candidate=None, closest=best["label"], reason=reason, trade_off="beginning")
        if defined:
            best = max(defined, key=lambda r: _d(r, "hm")["delta"])
            reason = (f"no configuration raises HM significantly on {where} once the number compared is "
                      f"accounted for; the largest ΔHM, {best['label']}'s, is {_fmt_ci(_d(best, 'hm'))}")
            return dict(out, candidate=None, closest=best["label"], reason=reason, trade_off=None)
        return dict(out, candidate=None, closest=None, reason="no configuration has a defined ΔHM", trade_off=None)
    top = max(_d(r, "hm")["delta"] for r in ok)
    tied = [r for r in ok if _d(r, "hm")["delta"] >= top - rule.tie_margin]

    def psi_of(r: dict) -> float:
        v = r["scores"]["psi"]
        return float("inf") if v is None else v

    pick = min(tied, key=psi_of)  # min keeps the first of equal PSIs: grid order
    others = [r["label"] for r in tied if r is not pick]
    reason = (f"{pick['label']}: ΔHM {_fmt_ci(_d(pick, 'hm'))}, {begin} {_d(pick, f'group_{begin}')['delta']:+.3f} "
              f"on {where}")
    if others:
        reason += (f"; it ties (ΔHM within {rule.tie_margin:g}) with {', '.join(others)}, and the lowest PSI, "
                   "then the grid order, chose it")
    return dict(out, candidate=pick["label"], closest=pick["label"], reason=reason, ties=others, trade_off=None)


def _end(row: dict, groups: Sequence[str]) -> str:
    e = _d(row, f"group_{groups[-1]}").get("delta")
    return "?" if e is None else f"{e:+.3f}"


def confirm(row: dict, groups: Sequence[str], rule: Rule) -> tuple[bool, str, str | None]:
    """(confirmed, why, trade_off) for the candidate's row on the held-out documents (delta at `rule.level`)."""
    begin = groups[0]
    hm = _d(row, "hm")
    if hm.get("delta") is None or hm.get("ci") is None:
        return False, f"{row['label']}: ΔHM undefined on the held-out documents", None
    if hm["ci"][0] <= 0:
        return False, (f"{row['label']}, chosen on the selection part, does not carry over to the held-out documents: "
                       f"ΔHM there {_fmt_ci(hm)}"), None
    b = _d(row, f"group_{begin}").get("delta")
    if b is not None and b < -rule.max_begin_loss:
        return False, (f"calibrating with {row['label']} gains {_end(row, groups)} on the {groups[-1]} group and "
                       f"loses {-b:.3f} on the {begin} group on the held-out documents, more than --max-begin-loss "
                       f"{rule.max_begin_loss:g}: not recommended; --max-begin-loss "
                       f"{math.ceil(-b * 1000) / 1000:g} accepts that trade"), "beginning"
    return True, f"{row['label']} holds on the held-out documents: ΔHM {_fmt_ci(hm)}", None


def bias_direction(values: np.ndarray, query_groups: Sequence[str], groups: Sequence[str], *, level: float,
                   n_resamples: int, seed: int) -> dict:
    """The uncalibrated model's last group minus its first (nDCG@10), with a stratified bootstrap interval:
    which position it favours."""
    first, last = groups[0], groups[-1]
    labels = np.asarray(list(query_groups))
    a, b = values[labels == first], values[labels == last]
    if not len(a) or not len(b):
        return {"first": first, "last": last, "delta": None, "ci": None, "under_serves_later": False,
                "text": f"the {first} or the {last} group has no query: the bias's direction is unknown"}
    rng = np.random.default_rng([seed, 5])
    diffs = (b[rng.integers(0, len(b), (n_resamples, len(b)))].mean(axis=1)
             - a[rng.integers(0, len(a), (n_resamples, len(a)))].mean(axis=1))
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = (float(x) for x in np.percentile(diffs, [tail, 100.0 - tail]))
    delta = float(b.mean() - a.mean())
    where = f"{last} − {first} nDCG@10 of the uncalibrated model {delta:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    if hi < 0:
        text = f"the uncalibrated model under-serves later content: {where}"
    elif lo > 0:
        text = f"the uncalibrated model favours later content (biased toward the {last}): {where}"
    else:
        text = f"the uncalibrated model does not measurably under-serve later content: {where}"
    return {"first": first, "last": last, "delta": delta, "ci": [lo, hi], "under_serves_later": hi < 0,
            "text": text}


def general_harm(general: dict | None, rule: Rule) -> tuple[bool, str | None]:
    """(blocks, trade-off text) from a general-retrieval check of the candidate."""
    if general is None or not general.get("flagged"):
        return False, None
    row = general["rows"][-1]
    loss = -row["delta"]["ndcg10"]["delta"]
    return loss > rule.accept_general_loss, f"{loss:.3f} nDCG@10 on general retrieval ({general['dataset']['name']})"


def decide(selection: dict, held_out: dict | None, bias: dict, general: dict | None, groups: Sequence[str],
           rule: Rule, m: int) -> dict:
    """The decision from the stages' outcomes.  `held_out` is the candidate's confirmation row (None without a
    candidate); `general` the general-retrieval check of the candidate (None when not run)."""
    out = {"rule": rule.text(groups[0], m), "max_begin_loss": rule.max_begin_loss, "tie_margin": rule.tie_margin,
           "accept_general_loss": rule.accept_general_loss, "distinct_configurations": m,
           "selection_level": rule.family_level(m), "level": rule.level, "verdicts": selection["verdicts"],
           "ties": selection["ties"], "candidate": selection["candidate"], "closest": selection["closest"],
           "selection_reason": selection["reason"], "bias": bias, "trade_off": selection.get("trade_off"),
           "held_out": None, "confirmed": None, "general_blocks": False}

    def no(reason: str, trade: str | None = None) -> dict:
        if trade is not None:
            out["trade_off"] = trade
        return dict(out, decision=DO_NOT, recommended=None, reason=reason)

    if selection["candidate"] is None:
        reason = selection["reason"]
        return no(reason if bias["under_serves_later"] else f"{bias['text']}; and {reason}")
    confirmed, why, trade = confirm(held_out, groups, rule)
    out["held_out"], out["confirmed"] = why, confirmed
    if not bias["under_serves_later"]:
        return no(f"{bias['text']}, so there is no end-of-passage deficit to correct, whatever the sweep finds "
                  f"({why})")
    if not confirmed:
        return no(why, trade)
    blocks, harm = general_harm(general, rule)
    gain = f"calibrating with {held_out['label']} gains {_end(held_out, groups)} on the {groups[-1]} group (held out)"
    if blocks:
        out["general_blocks"] = True
        loss = -general["rows"][-1]["delta"]["ndcg10"]["delta"]
        return no(f"{gain} and loses {harm}: not recommended; --accept-general-loss "
                  f"{math.ceil(loss * 1000) / 1000:g} accepts that trade", "general")
    reason = f"{why}; {bias['text']}"
    if harm is not None:
        out["trade_off"] = "general"
        reason += f"; {gain} and loses {harm}, within --accept-general-loss {rule.accept_general_loss:g}: accepted"
    return dict(out, decision=DECIDE, recommended=held_out["label"], reason=reason)


# --------------------------------------------------------------------------- the whole rule on a table
@dataclass
class ScoreTable:
    """Per-query nDCG@10: `values[label]` for every configuration, `base` for the uncalibrated model, each
    query's position group and document."""

    values: dict[str, np.ndarray]
    base: np.ndarray
    query_groups: list[str]
    query_documents: list[str]
    groups: tuple[str, ...]
    psi: dict[str, float] | None = None


def decide_table(table: ScoreTable, rule: Rule, *, n_resamples: int = 1000, seed: int = 0) -> dict:
    """Split, select, confirm and decide on a complete table (every column on every query); what `tune` does
    on a model's, where the confirmation column is computed after the choice."""
    counts: dict[str, int] = {}
    for d in table.query_documents:
        counts[d] = counts.get(d, 0) + 1
    part = split_documents(counts, seed)
    in_part = {p: np.array([part[d] == p for d in table.query_documents]) for p in (SELECTION, CONFIRMATION)}

    def sub(p: str, v: np.ndarray) -> np.ndarray:
        return v[in_part[p]]

    sel_groups = [g for g, k in zip(table.query_groups, in_part[SELECTION]) if k]
    same, no_op = distinct({k: sub(SELECTION, v) for k, v in table.values.items()}, sub(SELECTION, table.base))
    compared = [k for k in table.values if k not in same and k not in no_op]
    m = max(len(compared), 1)
    level = rule.family_level(m)
    deltas = table_deltas({k: sub(SELECTION, table.values[k]) for k in compared}, sub(SELECTION, table.base),
                          sel_groups, table.groups, level=level, n_resamples=resamples_for(level, n_resamples),
                          seed=seed)
    rows = [{"label": k, "scores": {"psi": (table.psi or {}).get(k)}, "delta": deltas[k]} for k in compared]
    sel = select(rows, table.groups, rule)
    held = None
    if sel["candidate"] is not None:
        conf_groups = [g for g, k in zip(table.query_groups, in_part[CONFIRMATION]) if k]
        c = sel["candidate"]
        held = {"label": c, "delta": table_deltas({c: sub(CONFIRMATION, table.values[c])},
                                                  sub(CONFIRMATION, table.base), conf_groups, table.groups,
                                                  level=rule.level, n_resamples=n_resamples, seed=seed)[c]}
    bias = bias_direction(table.base, table.query_groups, table.groups, level=rule.level, n_resamples=n_resamples,
                          seed=seed)
    return decide(sel, held, bias, None, table.groups, rule, m)
