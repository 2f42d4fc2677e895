"""Writing the results: the markdown table (layout of the paper's Table 1), results.json and the λ plot."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from ..calibration.config import CalibrationConfig

HEADERS = {"begin": "begin", "middle": "mid", "end": "end"}
_SHORT = {"variant": "", "basket_size": "basket", "layers": "layers", "pooling": "pooling",
          "self_weight": "w", "isolate_first": "iso-first", "isolate_last": "iso-last", "skip_short": "skip-short",
          "first_weight": "first", "last_weight": "last"}


def config_label(cfg: CalibrationConfig) -> str:
    """λ plus every field that differs from the defaults, e.g. `λ=0.5 basket=64 layers=last`."""
    d = CalibrationConfig()
    parts = [f"λ={cfg.strength:g}"]
    for f in fields(CalibrationConfig):
        if f.name == "strength":
            continue
        v = getattr(cfg, f.name)
        if v != getattr(d, f.name):
            if isinstance(v, tuple):
                v = ",".join(map(str, v))
            parts.append(f"{v}" if f.name == "variant" else f"{_SHORT[f.name]}={v}")
    return " ".join(parts)


def _fmt(v: Any, signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:+.3f}" if signed else f"{v:.3f}"


def markdown_table(rows: list[dict], groups: tuple[str, ...], key: str = "scores") -> str:
    """One line per config: group nDCG@10, HM, PSI, aggregate nDCG@10 and Recall@10, ΔHM."""
    head = ["config", *(HEADERS.get(g, g) for g in groups), "HM", "PSI", "nDCG@10", "R@10", "ΔHM"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        s = row[key]
        if s is None:
            continue
        delta = (row.get("delta") or {}).get("hm") if key == "scores" else None
        cells = [row["label"], *(_fmt(s["groups"].get(g)) for g in groups), _fmt(s["hm"]), _fmt(s["psi"]),
                 _fmt(s["ndcg10"]), _fmt(s["recall10"]), _fmt(delta, signed=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_groups_vs_strength(rows: list[dict], groups: tuple[str, ...], path) -> None:
    """nDCG@10 of each group against λ (one line per group and per non-λ setting); uncalibrated dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    cal = [r for r in rows if r["kind"] == "calibrated"]
    series: dict[str, list[dict]] = {}
    for r in cal:
        series.setdefault(r["label"].split(" ", 1)[1] if " " in r["label"] else "", []).append(r)
    styles = ["-", "--", "-.", ":"]
    for si, (rest, rs) in enumerate(series.items()):
        rs = sorted(rs, key=lambda r: r["config"]["strength"])
        for gi, g in enumerate(groups):
            ax.plot([r["config"]["strength"] for r in rs], [r["scores"]["groups"].get(g, math.nan) for r in rs],
                    styles[si % len(styles)], marker="o", color=colours[gi % len(colours)],
                    label=f"{HEADERS.get(g, g)}{' ' + rest if rest else ''}")
    base = next((r for r in rows if r["kind"] == "uncalibrated" and r["scores"]), None)
    if base is not None:
        for gi, g in enumerate(groups):
            ax.axhline(base["scores"]["groups"].get(g, math.nan), color=colours[gi % len(colours)], ls=":", lw=1)
    ax.set_xlabel("calibration strength λ")
    ax.set_ylabel("nDCG@10")
    ax.set_title("nDCG@10 per position group (dotted: uncalibrated)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
