"""The report of `attncal eval --compare`: export labels, the two markdown tables and drift.png.

Kept apart from `report.py` (the λ-sweep report of one model): a comparison
has no λ axis, and its second table is made of deltas with intervals.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..calibration.config import CalibrationConfig
from ..pooling import Pooling
from .report import HEADERS, config_label, fmt


def precision_of(meta: dict) -> str:
    """The weights' precision as attncal.json records it: the quantization's, fp16, else fp32."""
    quant = meta.get("quantization")
    if isinstance(quant, dict) and quant.get("precision"):
        return str(quant["precision"])
    return "fp16" if meta.get("fp16") else "fp32"


def calibration_of(meta: dict) -> str:
    """`uncalibrated`, or `calibrated` with λ and every non-default field of the stored config.

    The pooling (and a landmark pooling's token or every-k) is left out: it belongs to the export and applies
    to the uncalibrated export too, so it says nothing about the calibration."""
    if not meta.get("calibrated"):
        return "uncalibrated"
    cfg = replace(CalibrationConfig.from_dict(meta["config"]), pooling=Pooling())
    return f"calibrated {config_label(cfg)}"


def export_labels(names: list[str], paths: list[str], metas: list[dict]) -> list[str]:
    """`NAME (calibration, precision)` per export; the path as given when directory names collide,
    and `#k` when the same export is listed twice, so that every row of the report is distinct."""
    heads = [n if names.count(n) == 1 else p for n, p in zip(names, paths)]
    labels = [f"{h} ({calibration_of(m)}, {precision_of(m)})" for h, m in zip(heads, metas)]
    out = []
    for i, lab in enumerate(labels):
        k = labels[:i].count(lab)
        out.append(lab if k == 0 else f"{lab} #{k + 1}")
    return out


def truncation_note(label: str, t: dict) -> str:
    """One line per export that truncates passages: the encoder never sees their ends, so an end-group
    query on one fails whatever the export's position bias; the count keeps that apart from drift."""
    per = ", ".join(f"{HEADERS.get(g, g)} {c}" for g, c in t["queries_on_truncated_passages"].items())
    return (f"{label}: {t['passages_truncated']} of {t['passages']} passages are longer than its max length "
            f"({t['max_length']} tokens) and are truncated; queries on them: {per} (a lost end is not position bias)")


def scores_table(rows: list[dict], groups: tuple[str, ...]) -> str:
    """One line per export: nDCG@10 per group, HM, PSI, aggregate nDCG@10 and R@10."""
    head = ["export", *(HEADERS.get(g, g) for g in groups), "HM", "PSI", "nDCG@10", "R@10"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        s = row["scores"]
        cells = [row["label"], *(fmt(s["groups"].get(g)) for g in groups), fmt(s["hm"]), fmt(s["psi"]),
                 fmt(s["ndcg10"]), fmt(s["recall10"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def with_ci(entry: dict | None) -> str:
    """A paired delta as a signed figure with its interval ("+0.012 [-0.003, +0.027]"); "n/a" without one."""
    if not entry or entry.get("delta") is None:
        return "n/a"
    ci = entry.get("ci")
    interval = "" if ci is None else f" [{fmt(ci[0], signed=True)}, {fmt(ci[1], signed=True)}]"
    return fmt(entry["delta"], signed=True) + interval


def delta_table(rows: list[dict], groups: tuple[str, ...], level: float) -> str:
    """One line per non-baseline export: Δ per group, ΔHM and ΔPSI against the baseline, each with its
    paired bootstrap interval."""
    head = ["export − baseline", *(f"Δ{HEADERS.get(g, g)}" for g in groups), "ΔHM", "ΔPSI"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows[1:]:
        d = row["delta"]
        cells = [row["label"], *(with_ci(d.get(f"group_{g}")) for g in groups), with_ci(d.get("hm")),
                 with_ci(d.get("psi"))]
        lines.append("| " + " | ".join(cells) + " |")
    return f"Deltas with paired bootstrap {100 * level:g} % intervals:\n\n" + "\n".join(lines) + "\n"


def _value(v: Any) -> float:
    return math.nan if v is None else float(v)


def plot_drift(rows: list[dict], groups: tuple[str, ...], level: float, path: Path) -> None:
    """Left: nDCG@10 per position group, one line per export.  Right: each export's deltas against the
    baseline (groups, HM, PSI) with their interval as error bars, so drift and its noise show together."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = np.arange(len(groups))
    for i, row in enumerate(rows):
        left.plot(xs, [_value(row["scores"]["groups"].get(g)) for g in groups], marker="o", color=f"C{i}",
                  ls="-" if i else "--", label=row["label"] + (" (baseline)" if i == 0 else ""))
    left.set_xticks(xs, [HEADERS.get(g, g) for g in groups])
    left.set_xlabel("position group of the answer")
    left.set_ylabel("nDCG@10")
    left.set_title("nDCG@10 per position group", fontsize=9)
    left.legend(fontsize=7)
    keys = [f"group_{g}" for g in groups] + ["hm", "psi"]
    names = [f"Δ{HEADERS.get(g, g)}" for g in groups] + ["ΔHM", "ΔPSI"]
    others = rows[1:]
    width = 0.8 / max(len(others), 1)
    for i, row in enumerate(others):
        d = [row["delta"].get(k) or {} for k in keys]
        ys = np.array([_value(e.get("delta")) for e in d])
        lo = np.array([ys[j] - e["ci"][0] if e.get("ci") else 0.0 for j, e in enumerate(d)])
        hi = np.array([e["ci"][1] - ys[j] if e.get("ci") else 0.0 for j, e in enumerate(d)])
        right.bar(np.arange(len(keys)) + (i - (len(others) - 1) / 2) * width, ys, width, color=f"C{i + 1}",
                  yerr=np.vstack([np.maximum(lo, 0), np.maximum(hi, 0)]), capsize=3, label=row["label"])
    right.axhline(0.0, color="black", lw=0.8)
    right.set_xticks(np.arange(len(keys)), names)
    right.set_ylabel("export − baseline")
    right.set_title(f"difference from the baseline, paired bootstrap {100 * level:g} % interval", fontsize=9)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
