"""Write the generated parts of the documentation from the code and the committed results.

    python docs/generate.py           # rewrite every generated block in place
    python docs/generate.py --check   # exit 1 and name the stale blocks; change nothing

A generated block sits between two HTML comments in a Markdown page,

    <!-- generated: NAME by docs/generate.py -->
    ...
    <!-- end generated: NAME -->

and everything between them is what `BLOCKS[NAME]` renders. The rest of the page is written by hand.
tests/test_generated_docs.py fails when a committed block differs from what this script writes, so a new
option, a changed help text or a rerun evaluation shows up as a stale page, not as a wrong one.

The blocks:

* `docs/cli.md`: the subcommands (`cli-commands`), every option of every subcommand (`cli-options`), read
  from `attncal.cli.build_parser()`, and the option combinations `attncal export` refuses (`export-conflicts`),
  read from `attncal.exporting.plan.CONFLICTS`.
* `README.md`: the "which file to load" table (`readme-which-file`), copied from docs/which-file.md.
* `docs/evaluation.md`: the two example result tables (`eval-pyref`, `eval-synthetic`), rendered from the
  committed `docs/eval/*/results.json` by the function that writes `attncal eval`'s own results.md.
* `docs/quantization.md`: int8 per CPU class (`bench-int8`), from `docs/bench/int8/results.json` that
  benchmarks/int8_cpu_classes.py wrote.
* `docs/performance.md`: the long-context and all-MiniLM-L6-v2 cost tables (`bench-long`, `bench-long-sweep`,
  `bench-minilm`, `bench-plain-long`, `bench-relative-position`, `bench-cpu-paths`: the calibration's cost
  per CPU path of the native library; `bench-openblas`: the native graph under OpenBLAS's AVX2 and AVX-512
  kernels), and the peer tables (`bench-peers`: OpenVINO, sentence-transformers
  and the uncalibrated ORT graph against the calibrated default, with one generated statement per shape and
  measure that tests/test_docs.py holds prose claims about the peers to),
  rendered from the committed `docs/bench/*/results.json` that `attncal bench --out` wrote, each with the
  command, commit, machine and date its JSON records.
* `docs/long-documents.md`: retrieval of chunked long documents (`bench-long-documents`), from
  `docs/bench/long-documents/results.json` that benchmarks/long_documents.py wrote, and their cost
  (`bench-long-documents-cost`), from `docs/bench/long-documents-cost/results.json` that
  `attncal bench --long-documents` wrote.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Callable

from attncal.bench.engines import TWIN
from attncal.bench.timing import median_ratio, sessions_median_ratio
from attncal.calibration.config import CalibrationConfig
from attncal.cli import build_parser
from attncal.eval.report import markdown_table
from attncal.exporting.plan import CONFLICTS, ExportOptions

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
CALIBRATION_GROUP = "calibration"
# The subcommand whose calibration options are the shared table; the others list only where theirs differ.
CALIBRATION_REFERENCE = "export"


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    render: Callable[[], str]


def _begin(name: str) -> str:
    return f"<!-- generated: {name} by docs/generate.py -->"


def _end(name: str) -> str:
    return f"<!-- end generated: {name} -->"


# -- the command line ------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    """Text for a Markdown table cell: pipes escaped, one line, this machine's home directory as `~` (a default
    such as `attncal eval --cache` expands it)."""
    return " ".join(text.replace(str(Path.home()), "~").split()).replace("|", "\\|")


def _subcommands() -> tuple[argparse._SubParsersAction, dict[str, argparse.ArgumentParser]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub, dict(sub.choices)


def _long(action: argparse.Action) -> str:
    """An option's long name (`--out` of `-o`, `--out`)."""
    return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])


def _names(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(f"`{o}`" for o in action.option_strings)
    name = action.metavar or action.dest.upper()
    return f"`{name}`" + (" (optional)" if action.nargs == "?" else "")


def _meaning(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The option's help as `--help` prints it, plus its choices and default where the help does not say them."""
    if isinstance(action, argparse.BooleanOptionalAction) and action.help:
        # Python 3.10 appends this to every such option's help; 3.11 and later do not.
        action = copy.copy(action)
        action.help = action.help.removesuffix(" (default: %(default)s)")
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    extra = []
    if action.choices is not None and "one of" not in text:
        extra.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    takes_value = action.nargs != 0 and not isinstance(action, argparse.BooleanOptionalAction)
    if takes_value and action.default not in (None, "", argparse.SUPPRESS) and "default" not in text:
        extra.append(f"default `{action.default}`")
    return _cell("; ".join([t for t in (text, *extra) if t]))


def _rows(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> list[str]:
    return [f"| {_names(a)} | {_meaning(parser, a)} |" for a in actions if not isinstance(a, argparse._HelpAction)]


def _table(rows: list[str]) -> str:
    return "\n".join(["| option | meaning |", "|---|---|", *rows]) + "\n"


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    return [(g.title, [a for a in g._group_actions if not isinstance(a, argparse._HelpAction)])
            for g in parser._action_groups]


def _synopsis(name: str, parser: argparse.ArgumentParser) -> str:
    """`attncal NAME` with its positionals and required options, then `[options]`."""
    parts = [f"attncal {name}"]
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        metavar = a.metavar or a.dest.upper()
        if not a.option_strings:
            parts.append(f"[{metavar}]" if a.nargs == "?" else metavar)
        elif a.required:
            parts.append(f"{_long(a)} {metavar}")
    return " ".join(parts + ["[options]"])


def render_cli_commands() -> str:
    sub, _ = _subcommands()
    lines = ["| command | what it does |", "|---|---|"]
    for choice in sub._choices_actions:
        lines.append(f"| [`attncal {choice.dest}`](#attncal-{choice.dest}) | {_cell(choice.help)} |")
    return "\n".join(lines) + "\n"


def _tables(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """The parser's arguments as tables: positionals and plain options together, then each named group."""
    plain = ("positional arguments", "options")
    groups = _groups(parser)
    return [("", [a for title, actions in groups if title in plain for a in actions])] + \
        [(title, actions) for title, actions in groups if title not in plain and actions]


def render_cli_options() -> str:
    _, parsers = _subcommands()
    shared = {a.dest: row for title, actions in _groups(parsers[CALIBRATION_REFERENCE]) if title == CALIBRATION_GROUP
              for a, row in zip(actions, _rows(parsers[CALIBRATION_REFERENCE], actions))}
    calibrating = []
    out = []
    for name, parser in parsers.items():
        out.append(f"### `attncal {name}`\n\n{_cell(parser.description or '')}\n\n"
                   f"```text\n{_synopsis(name, parser)}\n```\n")
        for title, actions in _tables(parser):
            rows = _rows(parser, actions)
            if title == CALIBRATION_GROUP:
                calibrating.append(name)
                own = [row for a, row in zip(actions, rows) if shared.get(a.dest) != row]
                out.append("The [calibration options](#calibration-options)"
                           + (" but these:\n\n" + _table(own) if own else ".\n"))
            elif rows:
                out.append((f"{title[0].upper()}{title[1:]}:\n\n" if title else "") + _table(rows))
        if parser.epilog:
            out.append(_epilog(parser.epilog))
    out.append("### Calibration options\n\n"
               + ", ".join(f"`attncal {n}`" for n in calibrating) + " take them; they mirror "
               "[`CalibrationConfig`](calibration.md#parameters), whose defaults they show.\n\n"
               + _table(list(shared.values())))
    return "\n".join(out)


def _epilog(text: str) -> str:
    """A subcommand's epilog: a paragraph, or, where it is laid out in lines (examples), a text block."""
    if "\n" not in text.strip():
        return _cell(text) + "\n"
    return "```text\n" + textwrap.dedent(text).strip("\n") + "\n```\n"


def _short(value: object) -> str:
    """A value as Python source, a dataclass with only the fields that differ from their defaults."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = []
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            default = (f.default if f.default is not dataclasses.MISSING
                       else f.default_factory() if f.default_factory is not dataclasses.MISSING else object())
            if v != default:
                parts.append(f"{f.name}={_short(v)}")
        return f"{type(value).__name__}({', '.join(parts)})"
    return repr(value)


def _flags(example: dict, parser: argparse.ArgumentParser) -> str | None:
    """An `ExportOptions` example as the `attncal export` options that give it; None where a field has no
    option of its own (then only the Python API can ask for it)."""
    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    settings = []
    for field, value in example.items():
        if dataclasses.is_dataclass(value) and field == "config":  # the calibration options
            default = type(value)()
            settings += [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)
                         if getattr(value, f.name) != getattr(default, f.name)]
        else:
            settings.append((field, value))
    out = []
    for dest, value in settings:
        action = by_dest.get(dest)
        if action is None or dataclasses.is_dataclass(value):
            return None
        flag = _long(action)
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if value == action.default:
                return None
            out.append(flag)
        else:
            out.append(f"{flag} {value}")
    return " ".join(out)


def render_export_conflicts() -> str:
    _, parsers = _subcommands()
    lines = ["| options | error |", "|---|---|"]
    for conflict in CONFLICTS:
        opts = ExportOptions(**conflict.example)
        flags = _flags(conflict.example, parsers["export"])
        given = (f"`attncal export {flags}`" if flags is not None else
                 "`ExportOptions(" + ", ".join(f"{k}={_short(v)}" for k, v in conflict.example.items()) + ")`")
        lines.append(f"| {given} | {_cell(conflict.message(opts))} |")
    return "\n".join(lines) + "\n"


# -- the README's copy of a docs table ---------------------------------------------------------------------

def _docs_table(page: str, heading: str) -> Callable[[], str]:
    """The first table under `heading` of docs/`page`, its links made relative to the repository root (the
    README's folder), so that the README and the docs page cannot disagree."""
    def render() -> str:
        text = (DOCS / page).read_text(encoding="utf-8")
        marker = f"\n{heading}\n"
        if marker not in text:
            raise ValueError(f"docs/{page}: no heading '{heading}'")
        lines = text.split(marker, 1)[1].splitlines()
        first = next(i for i, line in enumerate(lines) if line.startswith("|"))
        table = [line for line in itertools.takewhile(lambda line: line.startswith("|"), lines[first:])]
        table = [re.sub(r"\]\(#", f"](docs/{page}#", line) for line in table]
        return "\n".join(re.sub(r"\]\((?!https?:|docs/|#)([^)]+)\)", r"](docs/\1)", line) for line in table) + "\n"
    return render


# -- evaluation results ------------------------------------------------------------------------------------

def _eval_table(folder: str) -> Callable[[], str]:
    def render() -> str:
        results = json.loads((DOCS / "eval" / folder / "results.json").read_text(encoding="utf-8"))
        return markdown_table(results["rows"], tuple(results["groups"]))
    return render


# -- benchmark figures --------------------------------------------------------------------------------------

def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _bench_run(folder: str) -> dict:
    return json.loads((DOCS / "bench" / folder / "results.json").read_text(encoding="utf-8"))


def _run_bullet(run: dict) -> str:
    """What an `attncal bench` run measured: its command, the commit, the CPU and its class, the date."""
    meta, machine = run["meta"], run["meta"]["machine"]
    return (f"* `{meta['command']}`: commit `{meta['commit']}`, {meta['date']}, {machine['cpu']} "
            f"(`{machine['cpu_class']}`), {machine['threads']} threads, {meta['repeats']} rounds, peak "
            f"memory the median of {meta['memory_probes']} processes; peer `{meta['peer']}`")


def _bench_table(*folders: str) -> Callable[[], str]:
    """`attncal bench` runs, committed as `docs/bench/FOLDER/results.json`: what each run measured (its command,
    the commit, the CPU and its class, the date), then every engine's time and peak memory against the run's peer,
    one row per engine and shape."""
    def render() -> str:
        runs = [_bench_run(f) for f in folders]
        lines = [_run_bullet(run) for run in runs]
        lines += ["", "| model | batch × tokens | engine | p50 | time / peer | peak memory | memory / peer |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for run in runs:
            model = run["meta"]["model"].replace("--synthetic ", "synthetic ")
            for r in sorted(run["rows"], key=lambda r: (r["batch"], r["seq"])):
                peak = "–" if r["peak_mib"] is None else f"{r['peak_mib']:,.1f} MiB"
                lines.append(f"| {model} | {r['batch']} × {r['seq']:,} | `{r['engine']}` | {r['p50_ms']:,.1f} ms | "
                             f"{_ratio(r['latency_vs_peer'])} | {peak} | {_ratio(r['memory_vs_peer'])} |")
        return "\n".join(lines)
    return render


def _int8_table() -> str:
    """benchmarks/int8_cpu_classes.py's run, committed as docs/bench/int8/results.json: each int8 target's time
    against the fp32 uncalibrated export and its cosine to the fp32 calibrated one, per CPU class."""
    run = json.loads((DOCS / "bench" / "int8" / "results.json").read_text(encoding="utf-8"))
    meta, machine = run["meta"], run["meta"]["machine"]
    lines = [f"* `{meta['command']}`: commit `{meta['commit']}`, {meta['date']}, {machine['cpu']} "
             f"(`{machine['cpu_class']}`), {machine['threads']} threads, {meta['rounds']} rounds, {meta['passages']} "
             f"passages; AVX2: {meta['avx2']}",
             "", "| CPU kernels | `--int8-target` | weights | MatMuls kept in fp32 | time / fp32 uncalibrated | "
             "cosine p1 | cosine min |", "|---|---|---|---:|---:|---:|---:|"]
    for r in run["rows"]:
        if "weights" not in r:
            lines.append(f"| {r['cpu']} | {r['target']} | fp32 | – | {_ratio(r['time_vs_fp32_uncalibrated'])} | – | – |")
            continue
        lo, hi = r["weight_range"]
        bits = "7-bit" if max(abs(lo), abs(hi)) <= 64 and lo < 0 else "8-bit"
        cos = r["cosine_to_fp32_calibrated"]
        lines.append(f"| {r['cpu']} | `{r['target']}` | {r['weights']}, {bits} | {len(r['fp32_nodes'])} of "
                     f"{r['weight_nodes']} | {_ratio(r['time_vs_fp32_uncalibrated'])} | {cos['p1']:.4f} | "
                     f"{cos['min']:.4f} |")
    return "\n".join(lines)


def _timing_tail(meta: dict, machine: dict) -> str:
    """The end of a timing run's bullet: "N thread(s), R rounds, C clock", and ", OpenBLAS CORE" (and whether
    $OPENBLAS_CORETYPE forced it) where the run recorded the kernels under the native library's GEMMs
    (`attncal.runtime.oplib.blas_record`); runs before that recorded nothing."""
    tail = (f"{machine['threads']} thread{'s' if machine['threads'] != 1 else ''}, {meta['repeats']} rounds, "
            f"{meta.get('clock', 'wall')} clock")
    if not machine.get("blas_core"):
        return tail
    forced = " (forced by `OPENBLAS_CORETYPE`)" if machine.get("blas_core_forced") else ""
    return f"{tail}, OpenBLAS `{machine['blas_core']}`{forced}"


def _openblas_table() -> str:
    """`attncal bench` runs of all-MiniLM-L6-v2, committed as docs/bench/openblas/RUN/results.json, alternately with
    $OPENBLAS_CORETYPE forcing OpenBLAS's AVX2 kernels and with OpenBLAS's own pick: the native graphs' time over
    the uncalibrated ORT-optimized graph's (ORT's own GEMMs, which OpenBLAS does not touch), per shape, with a 95 %
    bootstrap interval over the rounds."""
    files = sorted((DOCS / "bench" / "openblas").glob("*/results.json"))
    runs = [json.loads(f.read_text(encoding="utf-8")) for f in files]
    shapes = sorted({(r["batch"], r["seq"]) for run in runs for r in run["rows"]})
    lines = []
    for run in runs:
        meta, machine = run["meta"], run["meta"]["machine"]
        env = f"OPENBLAS_CORETYPE={machine['blas_core']} " if machine["blas_core_forced"] else ""
        lines.append(f"* `{env}{meta['command']}`: commit `{meta['commit']}`, {meta['date']}, {machine['cpu']} "
                     f"(`{machine['cpu_class']}`), {_timing_tail(meta, machine)}")
    lines += ["", "| run | OpenBLAS kernels | over `ort-opt` | " + " | ".join(f"{b} × {s}" for b, s in shapes) + " |",
              "|---|---|---|" + "---:|" * len(shapes)]
    for f, run in zip(files, runs):
        machine = run["meta"]["machine"]
        by = {(r["engine"], r["batch"], r["seq"]): r["times_ms"] for r in run["rows"]}
        core = f"`{machine['blas_core']}`" + (", forced" if machine["blas_core_forced"] else ", OpenBLAS's pick")
        for engine in ("ort-native", "ort-opt-cal"):
            cells = [median_ratio(by[(engine, b, s)], by[("ort-opt", b, s)]) for b, s in shapes]
            figures = " | ".join(f"{r:.3f} [{lo:.3f}, {hi:.3f}]" for r, lo, hi in cells)
            lines.append(f"| `{f.parent.name}` | {core} | `{engine}` | {figures} |")
    return "\n".join(lines)


def _cpu_path_overhead_table() -> str:
    """`attncal bench` runs of all-MiniLM-L6-v2 per CPU path of the native library and pooling, committed as
    docs/bench/cal-overhead/PATH-POOLING/results.json: the calibrated native graph's time over the uncalibrated
    one's (`ort-opt-native` / `ort-native`), per shape, with a 95 % bootstrap interval over the rounds where the run
    recorded them, and where the run has it the A/A control (`ort-native@2`, a second uncalibrated session) the same
    way; 100 tokens is the shape where no row is calibrated (every text shorter than one basket)."""
    root = DOCS / "bench" / "cal-overhead"
    runs = [json.loads(f.read_text(encoding="utf-8")) for f in sorted(root.glob("*/results.json"))]
    order = {p: i for i, p in enumerate(("avx512", "avx2", "default"))}
    def pooling(run: dict) -> str:  # the run's config as it was written (the pooling a word, or its object)
        return CalibrationConfig.from_dict(run["meta"]["config"]).pooling.describe()

    runs.sort(key=lambda r: (order.get(r["meta"]["machine"]["cpu_path"], 9), pooling(r)))
    shapes = sorted({(r["batch"], r["seq"]) for run in runs for r in run["rows"]})
    lines = []
    for run in runs:
        meta, machine = run["meta"], run["meta"]["machine"]
        forced = "forced by `ATTNCAL_CPU_PATH`" if machine["cpu_path_forced"] else "this CPU's widest"
        env = f"ATTNCAL_CPU_PATH={machine['cpu_path']} " if machine["cpu_path_forced"] else ""
        lines.append(f"* `{env}{meta['command']}`: commit `{meta['commit']}`, "
                     f"{meta['date']}, {machine['cpu']} (`{machine['cpu_class']}`, path `{machine['cpu_path']}` "
                     f"{forced}), {_timing_tail(meta, machine)}")
    lines += ["", "| CPU path | pooling | over the uncalibrated graph | " + " | ".join(f"{b} × {s}" for b, s in shapes)
              + " |", "|---|---|---|" + "---:|" * len(shapes)]
    cal, uncal = "ort-opt-native", "ort-native"

    def times(by: dict, engines: tuple[str, ...], b: int, s: int) -> list[list[float]] | None:
        """The round times of each session of `engines` (one graph's), or None where a row or its rounds lack."""
        rows = [by.get((e, b, s)) for e in engines]
        if any(r is None or not r.get("times_ms") for r in rows):
            return None
        return [r["times_ms"] for r in rows]

    def cell(by: dict, over: tuple[str, ...], base: tuple[str, ...], b: int, s: int) -> str:
        a, u = times(by, over, b, s), times(by, base, b, s)
        if a is None or u is None:
            rows = by.get((over[0], b, s)), by.get((base[0], b, s))
            return "–" if None in rows else _ratio(rows[0]["p50_ms"] / rows[1]["p50_ms"])
        ratio, lo, hi = sessions_median_ratio(a, u)
        return f"{ratio:.3f} [{lo:.3f}, {hi:.3f}]"

    for run in runs:
        by = {(r["engine"], r["batch"], r["seq"]): r for r in run["rows"]}
        engines = {e for e, _, _ in by}
        path = run["meta"]["machine"]["cpu_path"]
        # With a second session of both graphs, the cell is the geometric mean over the four pairs of sessions: a
        # session's speed is set for the whole run (the A/A rows), which the rounds' interval does not cover.
        twinned = {cal + TWIN, uncal + TWIN} <= engines
        pair = ((cal, cal + TWIN), (uncal, uncal + TWIN)) if twinned else ((cal,), (uncal,))
        rows = [(*pair, "calibrated, two sessions each" if twinned else "calibrated"),
                ((uncal + TWIN,), (uncal,), "A/A: uncalibrated again")]
        if twinned:
            rows.append(((cal + TWIN,), (cal,), "A/A: calibrated again"))
        for over, base, what in rows:
            if over[0] in engines:
                lines.append(f"| `{path}` | {pooling(run)} | {what} | "
                             + " | ".join(cell(by, over, base, b, s) for b, s in shapes) + " |")
    return "\n".join(lines)


def _long_documents_table() -> str:
    """benchmarks/long_documents.py's run, committed as docs/bench/long-documents/results.json: MRR@10 of each way
    of indexing long documents, at document and at chunk level, with paired-bootstrap intervals, and the cost of
    each chunking side by side."""
    run = json.loads((DOCS / "bench" / "long-documents" / "results.json").read_text(encoding="utf-8"))
    s = run["set"]
    lines = [f"* `{run['command']}`: commit `{run['commit']}`, {run['date']}, {run['machine']['cpu_class']}; "
             f"{run['model']}, max length {run['max_length']}; {s['passages']} passages of "
             f"{s['passage_tokens']['min']}-{s['passage_tokens']['max']} tokens ({s['source']}), {s['queries']} "
             f"queries; chunks of {run['chunking']['size']} tokens, naive overlap {run['chunking']['naive_overlap']}, "
             f"landmarks every {run['chunking']['landmark_every']}",
             "", "| vectors | doc MRR@10 | Δ vs whole, uncalibrated [95 % CI] | beginning / middle / end | "
             "chunk MRR@10 | Δ vs naive, uncalibrated [95 % CI] |", "|---|---:|---|---|---:|---|"]

    def delta(d: dict) -> str:
        return f"{d['delta']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"

    for label, r in run["retrieval"].items():
        thirds = " / ".join(f"{v:.3f}" for v in r["doc_mrr10_by_third"].values())
        chunk = (f"{r['chunk_mrr10']:.3f} | {delta(r['chunk_delta_vs_naive_plain'])}" if "chunk_mrr10" in r
                 else "– | –")
        lines.append(f"| {label} | {r['doc_mrr10']:.3f} | {delta(r['doc_delta_vs_whole_plain'])} | {thirds} | {chunk} |")
    return "\n".join(lines)


def _long_documents_cost_table() -> str:
    """`attncal bench --long-documents`'s run, committed as docs/bench/long-documents-cost/results.json: the time of
    each way of encoding long documents side by side, and the index bytes per document at each precision."""
    run = json.loads((DOCS / "bench" / "long-documents-cost" / "results.json").read_text(encoding="utf-8"))
    m = run["machine"]
    graph = f"{run['graph']}, chunk vectors in the graph" if run["chunk_vectors"] else run["graph"]
    lines = [f"* `{run['command']}`: commit `{run['commit']}`, {run['date']}, {m['cpu']} (`{m['cpu_class']}`), "
             f"{m['threads']} threads, {run['repeats']} rounds; model {run['model']} ({run['model_type']}, "
             f"{'calibrated' if run['calibrated'] else 'uncalibrated'}, {graph}), max length {run['max_length']}; "
             f"chunks of {run['chunk_size']} tokens",
             "", "| documents × tokens | encoding | median | time / late | vectors per document |",
             "|---|---|---:|---:|---:|"]
    for shape, cases in run["cost"].items():
        for case, c in cases.items():
            lines.append(f"| {shape} | {case} | {c['median_s']:.2f} s | {c['vs_late']:.2f} | "
                         f"{c['vectors_per_doc']:.1f} |")
    precisions = list(next(iter(next(iter(run["cost"].values())).values()))["index_bytes_per_doc"])
    lines += ["", f"Index bytes per document ({run['dimension']} dimensions):", "",
              "| documents × tokens | encoding | " + " | ".join(precisions) + " |",
              "|---|---|" + "---:|" * len(precisions)]
    for shape, cases in run["cost"].items():
        for case, c in cases.items():
            if case.startswith("late, from"):
                continue  # the same vectors as late
            lines.append(f"| {shape} | {case} | " + " | ".join(f"{c['index_bytes_per_doc'][p]:,.0f}"
                                                             for p in precisions) + " |")
    return "\n".join(lines)


# -- the peers --------------------------------------------------------------------------------------------------

# The model shapes of the peer tables: (shape, the `attncal bench` runs of it, committed as docs/bench/FOLDER/).
PEER_SHAPES = (("BERT", ("peers/bert",)), ("XLM-R", ("peers/xlmr-2048", "peers/xlmr-8192")),
               ("Qwen3", ("peers/qwen3-2048", "peers/qwen3-8192")))
# Besides each run's own peer (the uncalibrated ORT graph, attncal.bench.engines.PEERS), the runtimes a user
# would otherwise run the model in: OpenVINO and sentence-transformers on PyTorch.
OTHER_PEERS = ("openvino", "torch-sdpa")
OURS = "ort-opt-cal"  # what `Encoder` runs by default on the CPU


@dataclasses.dataclass(frozen=True)
class PeerVerdict:
    """`OURS` against the best peer at one size of one shape, in time or in memory. `verdict` is "ahead" or
    "behind" where the time ratio's 95 % bootstrap interval over the rounds lies below or above 1 (in memory:
    where every probe of ours lies below, or above, every probe of the smallest peer), "level" otherwise, and
    "not compared" where an engine did not run (`missing`)."""
    shape: str
    batch: int
    seq: int
    metric: str  # "time" | "memory"
    verdict: str
    peer: str | None = None  # the fastest / smallest peer
    ratio: float | None = None
    interval: tuple[float, float] | None = None
    missing: tuple[str, ...] = ()

    def describe(self) -> str:
        where = f"{self.batch} × {self.seq:,}"
        what = "time" if self.metric == "time" else "peak"
        if self.verdict == "not compared":
            how = "did not run" if self.metric == "time" else "has no peak memory"
            return f"not compared at {where} ({', '.join(f'`{e}`' for e in self.missing)} {how})"
        figure = f"{self.ratio:.3f}" + (f" [{self.interval[0]:.3f}, {self.interval[1]:.3f}]" if self.interval else "")
        if self.verdict == "ahead":
            return f"ahead of every peer at {where} ({figure} of `{self.peer}`'s {what})"
        if self.verdict == "level":
            return f"level with `{self.peer}` at {where} ({figure} of its {what})"
        return f"behind `{self.peer}` at {where} by {100 * (self.ratio - 1):.0f} % ({figure} of its {what})"


def _peers_of(run: dict) -> tuple[str, ...]:
    return (run["meta"]["peer"], *OTHER_PEERS)


def _peer_verdict(shape: str, run: dict, by: dict, batch: int, seq: int, metric: str) -> PeerVerdict:
    peers = _peers_of(run)
    missing = tuple(e for e in (OURS, *peers) if (e, batch, seq) not in by
                    or (metric == "memory" and not by[e, batch, seq]["peak_mib_probes"]))
    if missing:
        return PeerVerdict(shape, batch, seq, metric, "not compared", missing=missing)
    ours = by[OURS, batch, seq]
    if metric == "time":
        best = min((by[e, batch, seq] for e in peers), key=lambda r: r["p50_ms"])
        ratio, lo, hi = median_ratio(ours["times_ms"], best["times_ms"])
        verdict = "ahead" if hi < 1 else "behind" if lo > 1 else "level"
        return PeerVerdict(shape, batch, seq, metric, verdict, best["engine"], ratio, (lo, hi))
    best = min((by[e, batch, seq] for e in peers), key=lambda r: r["peak_mib"])
    mine, theirs = ours["peak_mib_probes"], best["peak_mib_probes"]
    verdict = "ahead" if max(mine) < min(theirs) else "behind" if min(mine) > max(theirs) else "level"
    return PeerVerdict(shape, batch, seq, metric, verdict, best["engine"], ours["peak_mib"] / best["peak_mib"])


def peer_verdicts() -> list[PeerVerdict]:
    """`OURS` against the fastest and the smallest peer at every size of every shape of `PEER_SHAPES`, from the
    committed runs: what the generated statements of `bench-peers` say, and what prose claims about the peers are
    checked against (tests/test_docs.py)."""
    out = []
    for shape, folders in PEER_SHAPES:
        for run in map(_bench_run, folders):
            by = {(r["engine"], r["batch"], r["seq"]): r for r in run["rows"]}
            for batch, seq in itertools.product(run["meta"]["batch"], run["meta"]["seq"]):
                out += [_peer_verdict(shape, run, by, batch, seq, m) for m in ("time", "memory")]
    return out


def _peers_table() -> str:
    """`attncal bench` runs of the peers, per model shape: each engine's time and peak memory against the fastest
    and the smallest peer at each size (the peers: OpenVINO, sentence-transformers on PyTorch and the uncalibrated
    ORT graph), and one line per shape and measure saying where `OURS` is ahead of every peer, level or behind."""
    runs = [(shape, _bench_run(f)) for shape, folders in PEER_SHAPES for f in folders]
    lines = [_run_bullet(run) for _, run in runs]
    lines += ["", "| shape | batch × tokens | engine | p50 | time / fastest peer | peak memory | "
              "memory / smallest peer |", "|---|---|---|---:|---:|---:|---:|"]
    notes = []
    for shape, run in runs:
        peers = _peers_of(run)
        by = {(r["engine"], r["batch"], r["seq"]): r for r in run["rows"]}
        for batch, seq in itertools.product(run["meta"]["batch"], run["meta"]["seq"]):
            ran = [by[e, batch, seq] for e in peers if (e, batch, seq) in by]
            fastest = min((r["p50_ms"] for r in ran), default=None)
            smallest = min((r["peak_mib"] for r in ran if r["peak_mib"] is not None), default=None)
            for e in run["meta"]["engines"]:
                name = f"`{e}` (peer)" if e in peers else f"`{e}`"
                r = by.get((e, batch, seq))
                if r is None:
                    notes.append(f"`{e}` did not run at {batch} × {seq:,} on the {shape} shape: "
                                 f"{run['notes'].get(e, 'not in the run')}")
                    lines.append(f"| {shape} | {batch} × {seq:,} | {name} | – [{len(notes)}] | – | – | – |")
                    continue
                peak = "–" if r["peak_mib"] is None else f"{r['peak_mib']:,.1f} MiB"
                lines.append(f"| {shape} | {batch} × {seq:,} | {name} | {r['p50_ms']:,.1f} ms | "
                             f"{_ratio(fastest and r['p50_ms'] / fastest)} | {peak} | "
                             f"{_ratio(smallest and r['peak_mib'] and r['peak_mib'] / smallest)} |")
    lines += [""] + [f"{i}. {n}" for i, n in enumerate(notes, 1)] + ([""] if notes else [])
    verdicts = peer_verdicts()
    for shape, folders in PEER_SHAPES:
        cpu = ", ".join(sorted({_bench_run(f)["meta"]["machine"]["cpu_class"] for f in folders}))
        for metric in ("time", "memory"):
            said = "; ".join(v.describe() for v in verdicts if v.shape == shape and v.metric == metric)
            lines.append(f"* **{shape} shape, {metric}** (`{cpu}`): `{OURS}` is {said}.")
    return "\n".join(lines)


BLOCKS: dict[str, Block] = {
    "cli-commands": Block(DOCS / "cli.md", render_cli_commands),
    "export-conflicts": Block(DOCS / "cli.md", render_export_conflicts),
    "cli-options": Block(DOCS / "cli.md", render_cli_options),
    "readme-which-file": Block(REPO / "README.md", _docs_table("which-file.md", "## By runtime")),
    "eval-pyref": Block(DOCS / "evaluation.md", _eval_table("pyref-minilm")),
    "eval-synthetic": Block(DOCS / "evaluation.md", _eval_table("synthetic-minilm")),
    "bench-long": Block(DOCS / "performance.md", _bench_table("long-2048", "long-8192")),
    "bench-long-sweep": Block(DOCS / "performance.md", _bench_table("long-sweep")),
    "bench-minilm": Block(DOCS / "performance.md", _bench_table("minilm")),
    "bench-plain-long": Block(DOCS / "performance.md", _bench_table("gemma", "qwen3", "modernbert")),
    "bench-relative-position": Block(DOCS / "performance.md", _bench_table("mpnet", "t5")),
    "bench-long-documents": Block(DOCS / "long-documents.md", _long_documents_table),
    "bench-long-documents-cost": Block(DOCS / "long-documents.md", _long_documents_cost_table),
    "bench-cpu-paths": Block(DOCS / "performance.md", _cpu_path_overhead_table),
    "bench-openblas": Block(DOCS / "performance.md", _openblas_table),
    "bench-peers": Block(DOCS / "performance.md", _peers_table),
    "bench-int8": Block(DOCS / "quantization.md", _int8_table),
}


# -- reading and writing blocks ----------------------------------------------------------------------------

def _span(text: str, name: str, page: Path) -> tuple[int, int]:
    """Where block `name`'s body starts and ends in `text` (ValueError when its markers are missing)."""
    begin, end = _begin(name), _end(name)
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"{page.relative_to(REPO)}: needs exactly one '{begin}' and one '{end}'")
    start = text.index(begin) + len(begin) + 1
    stop = text.index(end)
    if stop < start:
        raise ValueError(f"{page.relative_to(REPO)}: '{end}' comes before '{begin}'")
    return start, stop


def committed(name: str) -> str:
    """Block `name` as the page holds it."""
    block = BLOCKS[name]
    text = block.page.read_text(encoding="utf-8")
    start, stop = _span(text, name, block.page)
    return text[start:stop]


def rendered(name: str) -> str:
    """Block `name` as this script writes it (blank lines around it are the page's)."""
    return "\n" + BLOCKS[name].render().strip("\n") + "\n\n"


def stale() -> list[str]:
    """The blocks whose committed text differs from what this script writes."""
    return [name for name in BLOCKS if committed(name) != rendered(name)]


def write() -> list[str]:
    """Rewrite every stale block in place; the names of those rewritten."""
    names = stale()
    for name in names:
        page = BLOCKS[name].page
        text = page.read_text(encoding="utf-8")
        start, stop = _span(text, name, page)
        page.write_text(text[:start] + rendered(name) + text[stop:], encoding="utf-8")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write the generated parts of the documentation.")
    ap.add_argument("--check", action="store_true", help="only report stale blocks (exit 1 if any)")
    args = ap.parse_args(argv)
    try:
        names = stale() if args.check else write()
    except (ValueError, KeyError, OSError) as exc:
        print(f"docs/generate.py: error: {exc}", file=sys.stderr)
        return 2
    verb = "stale" if args.check else "rewritten"
    for name in names:
        print(f"{BLOCKS[name].page.relative_to(REPO)}: {name} {verb}")
    return 1 if args.check and names else 0


if __name__ == "__main__":
    sys.exit(main())
