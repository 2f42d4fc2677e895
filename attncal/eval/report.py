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
            if f.name == "pooling" and v.row_set:  # its parameters in words: `lmk [SEP] every 64 tokens`
                parts.append(v.describe())
                continue
            parts.append(f"{v}" if f.name == "variant" else f"{_SHORT[f.name]}={v}")
    return " ".join(parts)


def fmt(v: Any, signed: bool = False) -> str:
    """A table cell: three decimals (signed for deltas), `n/a` for an undefined value."""
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
        cells = [row["label"], *(fmt(s["groups"].get(g)) for g in groups), fmt(s["hm"]), fmt(s["psi"]),
                 fmt(s["ndcg10"]), fmt(s["recall10"]), fmt(delta, signed=True)]
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


def truncation_section(t: dict, rows: list[dict], groups: tuple[str, ...]) -> str:
    """The 'Length and truncation' part of results.md, kept apart from the position-bias table.

    A passage longer than the model's max length loses its end before the
    encoder sees it; an end-group query on it fails for that reason alone.
    When any passage is truncated, the scores without those queries follow.
    """
    lt = t.get("passage_tokens") or {}
    lines = ["\n## Length and truncation\n\n",
             f"Passage length in tokens (special tokens included): min {lt.get('min')}, median {lt.get('median')}, "
             f"mean {lt.get('mean')}, max {lt.get('max')}; model max length "
             f"{t['max_length'] if t['max_length'] is not None else 'unbounded'}.\n"]
    n = t["passages_truncated"]
    if not n:
        lines.append("No passage is truncated: the table above measures position, not truncation.\n")
        return "".join(lines)
    per = ", ".join(f"{HEADERS.get(g, g)} {c}" for g, c in t["queries_on_truncated_passages"].items())
    lines.append(f"**{n} of {t['passages']} passages are truncated** to {t['max_length']} tokens; the encoder never "
                 f"sees their ends. Queries whose relevant passage is truncated: {per}. A lost end is not position "
                 "bias, so the table below leaves those queries out.\n\n")
    if any(r.get("untruncated") for r in rows):
        lines.append(markdown_table(rows, groups, key="untruncated"))
    else:
        lines.append("Every query's relevant passage is truncated; no untruncated scores.\n")
    return "".join(lines)


def plot_hm_psi_vs_strength(rows: list[dict], path) -> None:
    """HM and PSI against λ (one line per non-λ setting); uncalibrated dotted, SEA baseline dashed, as references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    cal = [r for r in rows if r["kind"] == "calibrated" and r["scores"]]
    series: dict[str, list[dict]] = {}
    for r in cal:
        series.setdefault(r["label"].split(" ", 1)[1] if " " in r["label"] else "", []).append(r)
    base = next((r for r in rows if r["kind"] == "uncalibrated" and r["scores"]), None)
    refs = [r for r in rows if r["kind"] == "baseline" and r["scores"]]
    styles = ["-", "--", "-.", ":"]
    for ax, key, name in ((axes[0], "hm", "HM (harmonic mean of group nDCG@10)"),
                          (axes[1], "psi", "PSI = 1 - min/max (0 = no position bias)")):
        for si, (rest, rs) in enumerate(series.items()):
            rs = sorted(rs, key=lambda r: r["config"]["strength"])
            ys = [math.nan if r["scores"][key] is None else r["scores"][key] for r in rs]
            ax.plot([r["config"]["strength"] for r in rs], ys, styles[si % len(styles)], marker="o", color="C0",
                    label=f"calibrated{' ' + rest if rest else ''}")
        if base is not None and base["scores"][key] is not None:
            ax.axhline(base["scores"][key], color="black", ls=":", lw=1, label="uncalibrated")
        for i, r in enumerate(refs):
            if r["scores"][key] is not None:
                ax.axhline(r["scores"][key], color=f"C{3 + i}", ls="--", lw=1.2, label=r["label"])
        ax.set_xlabel("calibration strength λ")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
