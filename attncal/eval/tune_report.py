"""The report of `attncal tune`: report.md, results.json and two plots.

report.md leads with the decision, the expected effect (the candidate's ΔHM on the documents it was not
chosen on, the in-sample one beside it) and the rule; then the split, the bias's direction, the grid
(how many distinct configurations were compared, which rows change nothing or coincide), the selection
part's table at the family-wise level, the held-out table, the general retrieval check, what the sweeps
cost, and the commands that reproduce the run and take the manual path.
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
    held = [r for r in (results.get("held_out") or []) if r.get("run") and r["kind"] != "uncalibrated"]
    lines = ["\n## What the sweep cost\n\n"]
    if t["factor"] is not None:
        lines.append(f"Encoding the passages for all {len(rows) - 1} grid rows on the selection part, the candidate "
                     f"on the confirmation part and the uncalibrated model on both took {t['encode_s']:.1f} s, "
                     f"**{t['factor']:.2f}x** one uncalibrated encode of all passages ({t['uncalibrated_pass_s']:.1f} "
                     f"s, measured in the same run); in CPU time {t['encode_cpu_s']:.1f} s, {t['factor_cpu']:.2f}x "
                     f"({t['uncalibrated_pass_cpu_s']:.1f} s). The whole run took {results['seconds']:.1f} s.\n\n")
    else:
        lines.append(f"Encoding took {t['encode_s']:.1f} s; part of it came from the caches, so it is not compared "
                     "with an uncalibrated encode.\n\n")
    how = "from the stored hidden states" if t["resumed"] else "(all layers run: this architecture cannot resume)"
    lines.append(f"The model has {t['layers']} layers; configurations start at layer"
                 f"{'s' if len(t['start_layers']) != 1 else ''} {', '.join(map(str, t['start_layers'])) or '-'} "
                 f"{how}.\n\n"
                 "| part | configuration | passages calibrated | layers run | seconds | CPU seconds | how |\n"
                 "|---|---|---|---|---|---|---|\n")
    first = "selection" if results.get("held_out") is not None else "all"
    for part, rs in ((first, rows), ("confirmation", held)):
        for r in rs:
            run = r["run"]
            lines.append(f"| {part} | {r['label']} | {run['passages_calibrated']} | {run['layers_run']} | "
                         f"{fmt(run['seconds'])} | {fmt(run['cpu_seconds'])} | {run['source']} |\n")
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


def _split_section(results: dict) -> str:
    sp = results["split"]
    ds = results["dataset"]
    parts = sp["parts"]
    out = ["\n## Documents: selection and confirmation\n\n"]
    if sp["confirm_only"]:
        out.append(f"`--confirm-only`: the grid was chosen elsewhere, so all {ds['documents']} documents are held "
                   "out and nothing is selected here; each configuration's interval is family-wise over the "
                   "configurations scored.\n\n")
    else:
        out.append(f"The {ds['documents']} documents were split by document (seed {sp['seed']}; a document's passages "
                   "and queries are all in one part): the configurations are compared and the candidate chosen on "
                   "the selection part, and the candidate alone is scored on the confirmation part.\n\n")
    counts = sp["minimum"]["queries_per_group"]
    out.append("| part | documents | passages | "
               + " | ".join(f"{HEADERS.get(g, g)} queries" for g in results["groups"])
               + " |\n|" + "---|" * (3 + len(results["groups"])) + "\n")
    for name, p in parts.items():
        out.append(f"| {name} | {len(p['documents'])} | {p['passages']} | "
                   + " | ".join(str(counts[name][g]) for g in results["groups"]) + " |\n")
    out.append(f"\nA decision needs at least {sp['minimum']['min_queries_per_group']} queries per position group in "
               f"each part: {sp['minimum']['why']}.\n")
    return "".join(out)


def _grid_section(results: dict) -> str:
    g = results["grid"]
    b = results["bootstrap"]
    out = [f"\n## The grid: {g['configurations']} rows, {g['distinct']} distinct configurations compared\n\n"]
    if g.get("typical_content_tokens"):
        out.append(f"The typical passage holds {g['typical_content_tokens']} tokens of content; the baskets are 1/8, "
                   "1/4 and 1/2 of it.\n\n")
    if g["no_op"]:
        out.append(f"No-op rows (they change no passage of the selection part, so they are the uncalibrated model): "
                   f"{', '.join(f'`{x}`' for x in g['no_op'])}.\n\n")
    if g["same_as"]:
        out.append("Rows that give the same embeddings as an earlier one (counted once): "
                   + ", ".join(f"`{k}` = `{v}`" for k, v in g["same_as"].items()) + ".\n\n")
    out.append(f"The selection part's intervals are family-wise: {b['family_wise']}, each at "
               f"{100 * b['selection_level']:.4g} % ({b['selection_resamples']} resamples).\n")
    return "".join(out)


def _held_out_section(results: dict) -> str:
    rows = results.get("held_out")
    if not rows or len(rows) < 2:
        return ""
    groups = tuple(results["groups"])
    return (f"\n## Held out: the candidate on the confirmation part ({100 * results['bootstrap']['level']:g} %)\n\n"
            + delta_table(rows, groups, results["recommendation"]["recommended"]) + "\n"
            + scores_table(rows, groups))


def _expected_line(results: dict) -> str:
    e = results.get("expected_effect")
    if not e:
        return ""
    b = results["bootstrap"]
    if e["held_out"] is None:
        return (f"\nThe closest candidate, `{e['label']}`, was not run on the held-out documents; in sample "
                f"(selection part, family-wise {100 * b['selection_level']:.4g} %) its ΔHM is "
                f"{with_ci(e['in_sample'])}.\n")
    where = "on all documents (held out: chosen elsewhere)" if e["in_sample"] is None else \
        "on the documents it was not chosen on"
    line = f"\n**Expected effect** of `{e['label']}` {where}: ΔHM {with_ci(e['held_out'])} ({100 * b['level']:g} %)"
    if e["in_sample"] is not None:
        line += (f"; in sample, on the selection part: {with_ci(e['in_sample'])} (family-wise "
                 f"{100 * b['selection_level']:.4g} %)")
    return line + ".\n"


def markdown(results: dict, out_name: str, set_dir: Path | None) -> str:
    groups = tuple(results["groups"])
    rec = results["recommendation"]
    ds = results["dataset"]
    b = results["bootstrap"]
    head = (f"# attncal tune: {results['model']} on {ds['name']}\n\n"
            f"{ds['documents']} documents, {ds['passages']} passages, {ds['queries']} queries ("
            + ", ".join(f"{HEADERS.get(g, g)} {n}" for g, n in ds["queries_per_group"].items())
            + f"); {results['grid']['configurations']} grid rows"
            + (f" ({results['grid']['description']})" if results["grid"]["description"] else "")
            + f", {results['grid']['distinct']} distinct, and the uncalibrated model. Exact top-{results['top_k']} "
            "search within each part, nDCG@10 per position group (binary relevance), HM = harmonic mean of the "
            "groups, PSI = 1 − min/max. Intervals: paired bootstrap, resamples of the queries within their group, "
            f"seed {b['seed']}.\n\n")
    if rec["decision"] == DECIDE:
        verdict = f"## Recommendation: calibrate with `{rec['recommended']}`\n\n{rec['reason']}.\n"
    else:
        verdict = f"## Recommendation: do not calibrate\n\n{rec['reason']}.\n"
    text = [head, verdict, _expected_line(results), f"\n{rec['bias']['text'][0].upper()}{rec['bias']['text'][1:]}.\n",
            f"\nThe rule: {rec['rule']}.\n", _split_section(results), _grid_section(results),
            "\n## Deltas against the uncalibrated model "
            f"({'all documents' if results['split']['confirm_only'] else 'selection part'}, "
            f"family-wise {100 * b['selection_level']:.4g} %)\n\n",
            delta_table(results["rows"], groups, rec["recommended"]),
            "\n## Scores\n\n", scores_table(results["rows"], groups), _held_out_section(results),
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
    ax.set_xlabel(f"ΔHM against the uncalibrated model ({100 * level:.4g} % paired bootstrap interval)")
    ax.set_title("selection part, family-wise intervals; green: qualifies, orange: significant gain that costs the "
                 "first group too much, blue: no significant gain; "
                 f"{'star: recommended' if recommended else 'nothing recommended'}",
                 fontsize=8)
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
        b = results["bootstrap"]
        plot_delta_hm(results["rows"], rec["recommended"], b["selection_level"], tmp / PLOT_DELTA)
        results["plots"]["ΔHM per configuration"] = PLOT_DELTA
        pick = rec["recommended"] or rec["closest"]
        held = results.get("held_out") or []
        rows, level = ((held, b["level"]) if any(r["label"] == pick for r in held)
                       else (results["rows"], b["selection_level"]))
        if pick is not None:
            plot_groups(rows, tuple(results["groups"]), pick, level, tmp / PLOT_GROUPS)
            results["plots"]["nDCG@10 per position group"] = PLOT_GROUPS
    (tmp / REPORT).write_text(markdown(results, str(out), set_dir), encoding="utf-8")
    (tmp / RESULTS).write_text(json.dumps(results, indent=2, default=json_default), encoding="utf-8")
