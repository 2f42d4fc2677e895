"""The report of `attncal tune`: report.md, results.json and two plots.

report.md leads with the decision and the rule that made it, then the table every configuration is
judged by (scores, then the deltas with their paired intervals and each one's verdict), the general
retrieval check, what the sweep cost, and the commands that reproduce the run and take the manual path.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ..calibration.config import CalibrationConfig
from .compare_report import with_ci
from .output import json_default
from .recommend import DECIDE
from .report import HEADERS, fmt, truncation_section

REPORT = "report.md"
RESULTS = "results.json"
PLOT_DELTA = "delta_hm.png"
PLOT_GROUPS = "groups.png"


def scores_table(rows: list[dict], groups: tuple[str, ...]) -> str:
    head = ["configuration", *(HEADERS.get(g, g) for g in groups), "HM", "PSI", "nDCG@10", "R@10"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s = r["scores"]
        lines.append("| " + " | ".join([r["label"], *(fmt(s["groups"].get(g)) for g in groups), fmt(s["hm"]),
                                        fmt(s["psi"]), fmt(s["ndcg10"]), fmt(s["recall10"])]) + " |")
    return "\n".join(lines) + "\n"


def delta_table(rows: list[dict], groups: tuple[str, ...], recommended: str | None) -> str:
    head = ["configuration − uncalibrated", "ΔHM", "ΔPSI", *(f"Δ{HEADERS.get(g, g)}" for g in groups), "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["delta"] is None:
            continue
        d = r["delta"]
        name = f"**{r['label']}**" if r["label"] == recommended else r["label"]
        verdict = r.get("verdict") or ("reference (not recommendable)" if r["kind"] == "baseline" else "")
        lines.append("| " + " | ".join([name, with_ci(d.get("hm")), with_ci(d.get("psi")),
                                        *(with_ci(d.get(f"group_{g}")) for g in groups), verdict]) + " |")
    return "\n".join(lines) + "\n"


def _general_section(g: dict | None, level: float) -> str:
    if g is None:
        return ""
    which = "the recommendation" if g["recommended"] else "the closest candidate; nothing is recommended"
    out = ["\n## General retrieval (do no harm)\n\n",
           f"`{g['rows'][-1]['label']}` ({which}) "
           f"against the uncalibrated model on {g['dataset']['name']} ({g['dataset']['passages']} passages, "
           f"{g['dataset']['queries']} queries), paired bootstrap {100 * level:g} % intervals:\n\n"]
    for part, res in (("as given", g), ("sentences shuffled", g.get("shuffled"))):
        if res is None:
            continue
        out.append(f"| {part} | nDCG@10 | R@10 | ΔnDCG@10 | ΔR@10 |\n|---|---|---|---|---|\n")
        for r in res["rows"]:
            d = r["delta"] or {}
            out.append(f"| {r['label']} | {fmt(r['scores']['ndcg10'])} | {fmt(r['scores']['recall10'])} | "
                       f"{with_ci(d.get('ndcg10')) if d else ''} | {with_ci(d.get('recall10')) if d else ''} |\n")
        out.append(f"\n{'**Flagged:** ' if res['flagged'] else ''}{res['verdict']}.\n\n")
    return "".join(out)


def _cost_section(results: dict) -> str:
    t = results["sweep"]
    rows = [r for r in results["rows"] if r.get("run")]
    lines = ["\n## What the sweep cost\n\n"]
    if t["factor"] is not None:
        lines.append(f"Encoding the corpus for all {len(rows) - 1} configurations and the uncalibrated model took "
                     f"{t['encode_s']:.1f} s, **{t['factor']:.2f}x** one uncalibrated encode "
                     f"({t['uncalibrated_pass_s']:.1f} s, measured in the same run); in CPU time "
                     f"{t['encode_cpu_s']:.1f} s, {t['factor_cpu']:.2f}x ({t['uncalibrated_pass_cpu_s']:.1f} s). "
                     f"The whole run took {results['seconds']:.1f} s.\n\n")
    else:
        lines.append(f"Encoding took {t['encode_s']:.1f} s; part of it came from the caches, so it is not compared "
                     "with an uncalibrated encode.\n\n")
    how = "from the stored hidden states" if t["resumed"] else "(all layers run: this architecture cannot resume)"
    lines.append(f"The model has {t['layers']} layers; configurations start at layer"
                 f"{'s' if len(t['start_layers']) != 1 else ''} {', '.join(map(str, t['start_layers'])) or '-'} "
                 f"{how}.\n\n"
                 "| configuration | passages calibrated | layers run | seconds | CPU seconds | how |\n"
                 "|---|---|---|---|---|---|\n")
    for r in rows:
        run = r["run"]
        lines.append(f"| {r['label']} | {run['passages_calibrated']} | {run['layers_run']} | {fmt(run['seconds'])} | "
                     f"{fmt(run['cpu_seconds'])} | {run['source']} |\n")
    return "".join(lines)


def cli_flags(cfg: CalibrationConfig) -> str:
    """The `attncal export` flags that reproduce `cfg` (variant, λ, basket and layers always; the rest when
    they differ from the defaults)."""
    d = CalibrationConfig()
    layers = cfg.layers if isinstance(cfg.layers, str) else ",".join(map(str, cfg.layers))
    parts = [f"--variant {cfg.variant}", f"--strength {cfg.strength:g}", f"--basket-size {cfg.basket_size}",
             f"--layers={layers}"]
    if cfg.pooling != d.pooling:
        parts.append(f"--pooling {cfg.pooling}")
    if cfg.self_weight != d.self_weight:
        parts.append(f"--self-weight {cfg.self_weight:g}")
    for name in ("isolate_first", "isolate_last", "skip_short"):
        v = getattr(cfg, name)
        if v is not None and v != getattr(d, name):
            parts.append(f"--{'' if v else 'no-'}{name.replace('_', '-')}")
    for name in ("first_weight", "last_weight"):
        if getattr(cfg, name) is not None:
            parts.append(f"--{name.replace('_', '-')} {getattr(cfg, name)}")
    return " ".join(parts)


def _reproduce(results: dict, set_dir: Path | None) -> str:
    model = results["model"]
    rec = results["recommendation"]
    data = str(set_dir) if set_dir is not None else "DATA"
    lines = ["\n## Reproduce\n\n", "This run:\n\n", f"```bash\n{results['command']}\n```\n\n"]
    pick = rec["recommended"] or rec["closest"]
    row = next((r for r in results["rows"] if r["label"] == pick), None)
    if row is not None:
        cfg = CalibrationConfig.from_dict(dict(row["config"], pooling="auto"))
        lines.append(f"The manual path for {'the recommendation' if rec['recommended'] else 'the closest candidate'} "
                     f"(`{pick}`): export it and its uncalibrated twin, measure the drift of the exported graphs, "
                     "re-index:\n\n```bash\n"
                     f"attncal export {model} -o cal {cli_flags(cfg)}\n"
                     f"attncal export {model} -o uncal --no-calibration\n"
                     f"attncal eval --compare uncal cal --data {data} --bootstrap {results['bootstrap']['resamples']} "
                     "--out drift/\n"
                     "attncal encode cal --input CORPUS.jsonl --output INDEX/\n```\n")
    return "".join(lines)


def _export_section(results: dict, out_name: str) -> str:
    ex = results.get("export")
    if not ex:
        return ""
    lines = ["\n## Exports\n\n"]
    for name, e in ex.items():
        ok = "passed" if e["parity_ok"] else "FAILED"
        lines.append(f"- `{e['dir']}` ({name}): parity against PyTorch {ok} (max |Δ| {e['max_abs']:.2e}, min cosine "
                     f"{e['min_cos']:.8f})\n")
    lines.append(f"\nRe-index with the calibrated export:\n\n```bash\n{encode_command(ex, out_name)}\n```\n")
    return "".join(lines)


def encode_command(export: dict, out: str | Path) -> str:
    """The command that re-indexes a corpus with the calibrated export of `export` (results["export"])."""
    return f"attncal encode {Path(out) / export['calibrated']['dir']} --input CORPUS.jsonl --output INDEX/"


def markdown(results: dict, out_name: str, set_dir: Path | None) -> str:
    groups = tuple(results["groups"])
    rec = results["recommendation"]
    ds = results["dataset"]
    b = results["bootstrap"]
    head = (f"# attncal tune: {results['model']} on {ds['name']}\n\n"
            f"{ds['passages']} passages, {ds['queries']} queries ("
            + ", ".join(f"{HEADERS.get(g, g)} {n}" for g, n in ds["queries_per_group"].items())
            + f"); {results['grid']['configurations']} configurations"
            + (f" ({results['grid']['description']})" if results["grid"]["description"] else "")
            + f" and the uncalibrated model. Exact top-{results['top_k']} search, nDCG@10 per position group "
            "(binary relevance), HM = harmonic mean of the groups, PSI = 1 − min/max. Intervals: paired bootstrap, "
            f"{b['resamples']} resamples of the queries within their group, seed {b['seed']}, "
            f"{100 * b['level']:g} %.\n\n")
    if rec["decision"] == DECIDE:
        verdict = f"## Recommendation: calibrate with `{rec['recommended']}`\n\n{rec['reason']}.\n"
        if rec.get("general_flag"):
            verdict += f"\n**Flagged on general retrieval:** {rec['general_flag']}.\n"
    else:
        verdict = f"## Recommendation: do not calibrate\n\n{rec['reason']}.\n"
    text = [head, verdict, f"\nThe rule: {rec['rule']}.\n",
            "\n## Deltas against the uncalibrated model\n\n", delta_table(results["rows"], groups, rec["recommended"]),
            "\n## Scores\n\n", scores_table(results["rows"], groups),
            _general_section(results.get("general"), b["level"]),
            truncation_section(results["dataset"]["truncation"], results["rows"], groups),
            _cost_section(results), _export_section(results, out_name), _reproduce(results, set_dir)]
    if results["plots"]:
        text.append("\n## Plots\n\n" + "".join(f"![{k}]({v})\n" for k, v in results["plots"].items()))
    if results["notes"]:
        text.append("\n## Notes\n\n" + "".join(f"- {n}\n" for n in results["notes"]))
    return "".join(text)


def _value(v) -> float:
    return math.nan if v is None else float(v)


def plot_delta_hm(rows: list[dict], recommended: str | None, level: float, path: Path) -> None:
    """ΔHM of every configuration with its interval, coloured by its verdict, the recommendation larger."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in rows if r["delta"] is not None]
    ys = np.arange(len(rs))[::-1]
    fig, ax = plt.subplots(figsize=(7, 1.4 + 0.28 * len(rs)))
    for y, r in zip(ys, rs):
        d = r["delta"]["hm"]
        x = _value(d["delta"])
        lo, hi = d["ci"] or (x, x)
        verdict = r.get("verdict") or ""
        colour = ("C3" if r["kind"] == "baseline" else "C2" if verdict == "qualifies"
                  else "C1" if " loses " in verdict else "C0")
        ax.errorbar(x, y, xerr=[[max(x - lo, 0)], [max(hi - x, 0)]], fmt="*" if r["label"] == recommended else "o",
                    markersize=12 if r["label"] == recommended else 6, color=colour, capsize=3)
    ax.axvline(0.0, color="black", lw=0.8)
    ax.set_yticks(ys, [r["label"] for r in rs], fontsize=7)
    ax.set_xlabel(f"ΔHM against the uncalibrated model ({100 * level:g} % paired bootstrap interval)")
    ax.set_title("green: qualifies, orange: significant gain that costs the first group too much, blue: no "
                 f"significant gain; {'star: recommended' if recommended else 'nothing recommended'}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_groups(rows: list[dict], groups: tuple[str, ...], pick: str, level: float, path: Path) -> None:
    """nDCG@10 per position group, `pick` against the uncalibrated model, each group's Δ and interval above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next(r for r in rows if r["kind"] == "uncalibrated")
    cal = next(r for r in rows if r["label"] == pick)
    xs = np.arange(len(groups))
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (r, name) in enumerate(((base, "uncalibrated"), (cal, pick))):
        ax.bar(xs + (i - 0.5) * 0.38, [_value(r["scores"]["groups"].get(g)) for g in groups], 0.38, color=f"C{i}",
               label=name)
    for x, g in zip(xs, groups):
        d = cal["delta"][f"group_{g}"]
        top = max(_value(base["scores"]["groups"].get(g)), _value(cal["scores"]["groups"].get(g)))
        ax.text(x, top + 0.01, with_ci(d), ha="center", fontsize=7)
    ax.set_xticks(xs, [HEADERS.get(g, g) for g in groups])
    ax.set_xlabel("position group of the answer")
    ax.set_ylabel("nDCG@10")
    ax.set_title(f"Δ with its {100 * level:g} % paired bootstrap interval above each group", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(tmp: Path, out: Path, results: dict, opts, set_dir: Path | None) -> None:
    """Plots, report.md and results.json into `tmp`, the temporary directory that becomes `out`."""
    rec = results["recommendation"]
    results["plots"] = {}
    if opts.plots:
        plot_delta_hm(results["rows"], rec["recommended"], results["bootstrap"]["level"], tmp / PLOT_DELTA)
        results["plots"]["ΔHM per configuration"] = PLOT_DELTA
        pick = rec["recommended"] or rec["closest"]
        if pick is not None:
            plot_groups(results["rows"], tuple(results["groups"]), pick, results["bootstrap"]["level"],
                        tmp / PLOT_GROUPS)
            results["plots"]["nDCG@10 per position group"] = PLOT_GROUPS
    (tmp / REPORT).write_text(markdown(results, str(out), set_dir), encoding="utf-8")
    (tmp / RESULTS).write_text(json.dumps(results, indent=2, default=json_default), encoding="utf-8")
