"""The rule `attncal tune` recommends by, applied to a table of configurations and their paired intervals.

A configuration qualifies when its ΔHM interval (paired bootstrap, against the uncalibrated model) lies
above 0 and its beginning group loses at most `max_begin_loss` (point estimate).  Of the qualifying ones,
the one with the largest ΔHM is recommended; configurations within `tie_margin` of that ΔHM tie with it,
and the lowest PSI among them wins (then the first in grid order).  When none qualifies the recommendation
is not to calibrate, with the reason.  The rule reads only the table, so it is tested on hand-made ones.
"""

from __future__ import annotations

from dataclasses import dataclass

DECIDE = "calibrate"
DO_NOT = "do not calibrate"


@dataclass(frozen=True)
class Rule:
    max_begin_loss: float = 0.02
    tie_margin: float = 0.001
    level: float = 0.95

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_begin_loss:
            raise ValueError(f"--max-begin-loss must be >= 0, got {self.max_begin_loss}")
        if not 0.0 <= self.tie_margin:
            raise ValueError(f"--tie-margin must be >= 0, got {self.tie_margin}")

    def text(self, begin: str) -> str:
        return (f"the configuration with the largest ΔHM whose paired bootstrap {100 * self.level:g} % interval lies "
                f"above 0 and whose {begin} group loses at most {self.max_begin_loss:g} nDCG@10 (point estimate); "
                f"configurations within {self.tie_margin:g} of that ΔHM tie, and the lowest PSI among them is chosen "
                "(then the first in grid order); when none qualifies: do not calibrate")


def _d(row: dict, key: str) -> dict:
    return (row.get("delta") or {}).get(key) or {}


def verdict(row: dict, begin: str, rule: Rule) -> str:
    """Why a configuration qualifies or not, in a few words ("qualifies" when it does)."""
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


def _fmt_ci(entry: dict) -> str:
    ci = entry.get("ci")
    return f"{entry['delta']:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "")


def recommend(rows: list[dict], groups: list[str] | tuple[str, ...], rule: Rule) -> dict:
    """The decision for the calibrated `rows` (each with label, scores.psi and delta = paired intervals)."""
    begin = groups[0]
    verdicts = {r["label"]: verdict(r, begin, rule) for r in rows}
    ok = [r for r in rows if verdicts[r["label"]] == "qualifies"]
    out = {"rule": rule.text(begin), "max_begin_loss": rule.max_begin_loss, "tie_margin": rule.tie_margin,
           "verdicts": verdicts, "ties": []}
    if not ok:
        gains = [r for r in rows if (_d(r, "hm").get("ci") or [0.0])[0] > 0]
        defined = [r for r in rows if _d(r, "hm").get("delta") is not None]
        if gains:
            best = max(gains, key=lambda r: _d(r, "hm")["delta"])
            reason = (f"{len(gains)} configuration{'s' if len(gains) > 1 else ''} raise HM significantly, but each "
                      f"costs the {begin} group more than {rule.max_begin_loss:g}; the best, {best['label']}, has "
                      f"ΔHM {_fmt_ci(_d(best, 'hm'))} and {begin} {_d(best, f'group_{begin}')['delta']:+.3f}")
        elif defined:
            best = max(defined, key=lambda r: _d(r, "hm")["delta"])
            reason = (f"no configuration raises HM significantly; the largest ΔHM, {best['label']}'s, is "
                      f"{_fmt_ci(_d(best, 'hm'))}")
        else:
            best, reason = None, "no configuration has a defined ΔHM"
        return dict(out, decision=DO_NOT, recommended=None, closest=None if best is None else best["label"],
                    reason=reason)
    top = max(_d(r, "hm")["delta"] for r in ok)
    tied = [r for r in ok if _d(r, "hm")["delta"] >= top - rule.tie_margin]

    def psi_of(r: dict) -> float:
        v = r["scores"]["psi"]
        return float("inf") if v is None else v

    pick = min(tied, key=psi_of)  # min keeps the first of equal PSIs: grid order
    others = [r["label"] for r in tied if r is not pick]
    reason = (f"{pick['label']}: ΔHM {_fmt_ci(_d(pick, 'hm'))}, {begin} {_d(pick, f'group_{begin}')['delta']:+.3f}, "
              f"ΔPSI {_fmt_ci(_d(pick, 'psi'))}")
    if others:
        reason += (f"; it ties (ΔHM within {rule.tie_margin:g}) with {', '.join(others)}, and the lowest PSI, "
                   "then the grid order, chose it")
    return dict(out, decision=DECIDE, recommended=pick["label"], closest=pick["label"], reason=reason, ties=others)
