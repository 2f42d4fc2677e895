"""The demo's point: does calibration find the passage when the answer sits late in it?

The set is fixed before anything runs: the real-prose position-labelled set `attncal eval
--make-posq-example` builds from the Python Language Reference that every Python ships
(`attncal.eval.realtext`), each question made from one sentence of its passage and labelled by the third
of the passage that sentence sits in.  Both exports are scored on it by `attncal eval --compare`'s code
(exact search, nDCG@10 per third, paired bootstrap intervals), and the sentence printed under the table
is derived from those intervals alone: a change is called a gain or a loss only when its interval
excludes zero.
"""

from __future__ import annotations

from pathlib import Path

from ..eval import load_dataset
from ..eval.compare import CompareOptions, compare_exports
from ..eval.metrics import require_ir_measures
from ..eval.realtext import make_posq_example

RESAMPLES = 1000
SEED = 0
_WHERE = {"begin": "the beginning", "mid": "the middle", "middle": "the middle", "end": "the end"}


def build_set(out: Path, tokenizer_model: str | Path):
    """(the real-prose set, written to `out` (replaced) and loaded, its source in words); passages are counted
    with `tokenizer_model`'s tokenizer."""
    require_ir_measures()  # the comparison scores with it: refused before the set is built
    posq = make_posq_example(out, str(tokenizer_model), overwrite=True, warn=lambda w: None)
    source = posq.manifest["source"]
    return load_dataset(str(out)), f"{source['name']}, Python {source['python']}"


def compare(uncalibrated: Path, calibrated: Path, data) -> dict:
    """`attncal eval --compare` of the two exports on `data` (no cache, no report files)."""
    return compare_exports([uncalibrated, calibrated], data,
                           CompareOptions(n_resamples=RESAMPLES, seed=SEED, cache_dir=None, plots=False))


def _verdict(groups: list[str], delta: dict) -> str:
    gains, losses, flat = [], [], []
    for g in groups:
        d = delta[f"group_{g}"]
        lo, hi = d["ci"] or (None, None)
        where = _WHERE.get(g, g)
        if lo is not None and lo > 0:
            gains.append(f"{where} ({d['delta']:+.3f})")
        elif hi is not None and hi < 0:
            losses.append(f"{where} ({d['delta']:+.3f})")
        else:
            flat.append(where)
    parts = []
    if gains:
        parts.append("calibration found more passages whose answer is at " + _and(gains))
    if losses:
        parts.append("fewer whose answer is at " + _and(losses))
    if flat:
        parts.append("no change its interval tells from zero at " + _and(flat))
    return "On this set " + "; ".join(parts) + "."


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def report(results: dict, data_name: str) -> str:
    """The table and the sentence the demo prints."""
    groups = list(results["groups"])
    base, cal = results["rows"]
    ds = results["dataset"]
    lines = [f"position bias on real prose: {data_name}, {ds['passages']} passages, {ds['queries']} questions, each",
             "made from one sentence of its passage (queries are never calibrated); nDCG@10 of finding that passage:",
             f"  {'answer in the passage at':<26} {'questions':>9} {'uncalibrated':>13} {'calibrated':>11}  "
             f"Δ nDCG@10 [{int(results['bootstrap']['level'] * 100)} % interval]"]
    for g in groups:
        d = cal["delta"][f"group_{g}"]
        ci = f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]" if d["ci"] else "[-]"
        lines.append(f"  {_WHERE.get(g, g):<26} {ds['queries_per_group'][g]:>9} {base['scores']['groups'][g]:>13.3f} "
                     f"{cal['scores']['groups'][g]:>11.3f}  {d['delta']:+.3f} {ci}")
    hm = cal["delta"]["hm"]
    lines.append(f"  {'harmonic mean of the three':<26} {'':>9} {base['scores']['hm']:>13.3f} "
                 f"{cal['scores']['hm']:>11.3f}  {hm['delta']:+.3f}"
                 + (f" [{hm['ci'][0]:+.3f}, {hm['ci'][1]:+.3f}]" if hm["ci"] else ""))
    truncated = [r["label"] for r in results["rows"] if r["truncation"]["passages_truncated"]]
    if truncated:
        lines.append(f"  (passages longer than the max length of {', '.join(truncated)}: their ends were not "
                     "seen, whatever the calibration)")
    lines.append(_verdict(groups, cal["delta"]))
    return "\n".join(lines)
