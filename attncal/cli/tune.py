"""Should I calibrate this model on my documents, and how? Sweep, decide with intervals, check general retrieval.

Examples:
  attncal tune MODEL --docs my-docs/ -o tune-out/          # a grid fitted to the model and your documents
  attncal tune MODEL --data my-posq -o tune-out/ --general example --shuffled
  attncal tune default --example -o tune-out/              # the real-prose set the demo builds
  attncal tune MODEL --docs my-docs/ --grid grid.yaml --max-begin-loss 0.01 --export -o tune-out/
  attncal tune MODEL --docs other-docs/ --grid tune-out/candidate.yaml --confirm-only -o held-out/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..calibration.config import CalibrationConfig
from ..eval.posq_builder import PosqOptions
from ..eval.realtext import python_reference_documents
from ..eval.tune import PRESETS, ExportStep, TuneOptions, grid_label, tune
from ..eval.tune_report import delta_table, encode_command
from ..exporting.plan import ExportOptions
from .common import CLIError, command_line, write_command_log
from .eval import load_grid

LOG_FILE = "attncal-tune.log"
LOG_FILE_HELP = f"they are written to OUT/{LOG_FILE}"


def export_step(exporter: str = "dynamo", max_length: int | None = None) -> ExportStep:
    """How `--export` exports tune's recommendation: the exporter, with its parity check, quiet."""
    def step(model: str, out: Path, config: CalibrationConfig, calibrate: bool) -> dict:
        from ..exporting.exporter import export  # lazy: onnx_ir and sympy, not loaded at start-up

        return export(model, out, ExportOptions(config=config, calibrate=calibrate, exporter=exporter,
                                                max_length=max_length), quiet=True)
    return step


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Defaults are None here: `run` takes TuneOptions' own for every option not given.
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (__doc__ or "").split("\n", 1)[1]
    p.add_argument("model", help="model directory or 'default' (not an export: tune sweeps configurations)")
    src = p.add_argument_group("the position-labelled set (one of)")
    src.add_argument("--docs", help="your documents (a directory of .txt/.md/.rst files or a JSONL file): the set is "
                     "built from them with the --make-posq builder and kept in OUT/set")
    src.add_argument("--data", help="an existing set: attncal eval --make-posq output, FineWeb-PosQ or PosIR/BEIR "
                     "layout with positions")
    src.add_argument("--example", action="store_true",
                     help="the real-prose set the demo builds (the Python Language Reference shipped with Python)")
    src.add_argument("--text-field", default="text", help="JSONL field holding the document text (default text)")
    src.add_argument("--split", default="test", help="qrels split of a BEIR-layout --data or --general (default test)")
    p.add_argument("-o", "--out", required=True, help="output directory: report.md, results.json, plots, the set "
                   "and (with --export) the exports")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is not empty")
    p.add_argument("--grid", default=None,
                   help="a preset (fitted, the default: baskets 1/8, 1/4, 1/2 of the typical passage, λ 0.25-1, "
                   "the last layer and the last two, the variants that differ for the model's pooling; paper: the "
                   "paper's "
                   "24; default: the published default alone; strengths: the default at four strengths) or a YAML "
                   "file of configurations (the format of attncal eval --configs)")
    p.add_argument("--baselines", default="", help="comma-separated baselines: sea (Segment Embed Average)")
    rule = p.add_argument_group("the recommendation rule")
    rule.add_argument("--max-begin-loss", type=float, default=None,
                      help="largest loss of the beginning group's nDCG@10 a recommendation may cost (default 0.02)")
    rule.add_argument("--tie-margin", type=float, default=None,
                      help="configurations whose ΔHM is within this of the best tie; the lowest PSI wins (default "
                      "0.001)")
    rule.add_argument("--accept-general-loss", type=float, default=None, metavar="D",
                      help="with --general: a significant general-retrieval loss of at most D nDCG@10 (point "
                      "estimate) does not block the recommendation; the decision names the trade (default 0)")
    rule.add_argument("--min-queries", type=int, default=None, metavar="N",
                      help="queries per position group each part needs before tune decides (default 60: a "
                      "held-out ΔHM interval of about ±0.02); fewer is refused with how many more documents would do")
    rule.add_argument("--confirm-only", action="store_true",
                      help="the grid was chosen elsewhere (e.g. another run's OUT/candidate.yaml): score it on all "
                      "the documents, every one held out, with no selection")
    rule.add_argument("--bootstrap", type=int, default=None, metavar="N",
                      help="paired bootstrap resamples of the queries (default 1000)")
    rule.add_argument("--seed", type=int, default=0, help="seed of the split by document, the bootstrap, the "
                      "set's queries and the shuffled sentences (default 0)")
    gen = p.add_argument_group("do no harm on general retrieval")
    gen.add_argument("--general", metavar="DATA",
                     help="a BEIR-layout set (corpus.jsonl, queries.jsonl, qrels/) to score the recommendation and "
                     "the uncalibrated model on; 'example' is the small set shipped with attncal")
    gen.add_argument("--shuffled", action="store_true",
                     help="also score them on the --general set with every document's sentences shuffled")
    ex = p.add_argument_group("exporting the recommendation")
    ex.add_argument("--export", action="store_true", help="export the recommended configuration and its "
                    "uncalibrated twin into OUT (parity-checked) and print the attncal encode command")
    ex.add_argument("--exporter", choices=("dynamo", "torchscript"), default="dynamo")
    run = p.add_argument_group("running")
    run.add_argument("--cache", default=str(Path.home() / ".cache" / "attncal" / "eval"),
                     help="embedding cache, and hidden states under hidden/ (default %(default)s)")
    run.add_argument("--no-cache", action="store_true",
                     help="read and write no cache (hidden states then go to a temporary directory, removed after)")
    run.add_argument("--cache-budget", type=float, default=None, metavar="GIB",
                     help="refuse to start when the hidden states to store exceed this many GiB (default 8)")
    run.add_argument("--top-k", type=int, default=100, help="exact search depth (default %(default)s)")
    run.add_argument("--batch-size", type=int, default=32, help="texts per model call (default %(default)s)")
    run.add_argument("--max-length", type=int, default=None, help="override the model's max sequence length")
    run.add_argument("--max-passages", type=int, default=None, help="with --docs/--example: keep a seeded sample "
                     "of at most N passages")
    run.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def _grid(spec: str):
    if spec in PRESETS:
        return [], None, spec
    path = Path(spec)
    if not path.exists():
        raise CLIError(f"--grid {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    configs, names = load_grid(path)
    return configs, [n or grid_label(c) for n, c in zip(names, configs)], path.name


def run(args: argparse.Namespace) -> int:
    sources = [f for f, v in (("--docs", args.docs), ("--data", args.data), ("--example", args.example)) if v]
    if len(sources) != 1:
        raise CLIError("give the set as one of --docs DOCS, --data DIR or --example"
                       + (f" (got {' and '.join(sources)})" if sources else ""))
    if args.max_passages is not None and args.data:
        raise CLIError("--max-passages applies to a set built here (--docs, --example); --data is used as it is")
    d = TuneOptions()
    configs, labels, grid = _grid(args.grid or d.grid)
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]

    def given(name: str, default):
        value = getattr(args, name)
        return default if value is None else value

    opts = TuneOptions(configs=configs, labels=labels, grid=grid, baselines=baselines,
                       max_begin_loss=given("max_begin_loss", d.max_begin_loss),
                       tie_margin=given("tie_margin", d.tie_margin), n_resamples=given("bootstrap", d.n_resamples),
                       accept_general_loss=given("accept_general_loss", d.accept_general_loss),
                       min_queries=given("min_queries", d.min_queries), confirm_only=args.confirm_only,
                       seed=args.seed, top_k=args.top_k, batch_size=args.batch_size, max_length=args.max_length,
                       cache_dir=None if args.no_cache else args.cache,
                       cache_budget_gib=given("cache_budget", d.cache_budget_gib), general=args.general,
                       general_split=args.split, shuffled=args.shuffled, export=args.export, exporter=args.exporter,
                       plots=not args.no_plots,
                       command=command_line("tune"))
    posq_options = PosqOptions(max_passages=args.max_passages, seed=args.seed)
    if args.example:
        results = _tune_example(args, opts, posq_options)
    else:
        results = tune(args.model, args.data, opts, args.out, docs=args.docs, posq_options=posq_options,
                       text_field=args.text_field, split=args.split, overwrite=args.overwrite,
                       export_step=export_step(opts.exporter, opts.max_length))
    _print(results, Path(args.out))
    write_command_log(args, Path(args.out) / LOG_FILE)
    return 0


def _tune_example(args: argparse.Namespace, opts, posq_options) -> dict:
    """--example: the demo's real-prose documents, taken as --docs takes a user's."""
    return tune(args.model, None, opts, args.out, docs=python_reference_documents(), posq_options=posq_options,
                overwrite=args.overwrite, export_step=export_step(opts.exporter, opts.max_length))


def _print(results: dict, out: Path) -> None:
    rec = results["recommendation"]
    b = results["bootstrap"]
    print(f"selection part, family-wise {100 * b['selection_level']:.4g} % intervals "
          f"({results['grid']['distinct']} distinct of {results['grid']['configurations']} grid rows):")
    sys.stdout.write(delta_table(results["rows"], tuple(results["groups"]), rec["recommended"]))
    print()
    e = results.get("expected_effect")
    if e and e["held_out"] is not None:
        d = e["held_out"]
        ci = d["ci"] or [float("nan")] * 2
        print(f"expected effect of {e['label']} (held out): ΔHM {d['delta']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]")
    print(rec["bias"]["text"])
    if rec["recommended"]:
        print(f"recommendation: calibrate with {rec['recommended']}: {rec['reason']}")
    else:
        print(f"recommendation: do not calibrate: {rec['reason']}")
    g = results.get("general")
    if g is not None:
        print(f"general retrieval: {'FLAGGED: ' if g['flagged'] else ''}{g['verdict']}")
        if g.get("shuffled"):
            print(f"sentences shuffled: {'FLAGGED: ' if g['shuffled']['flagged'] else ''}{g['shuffled']['verdict']}")
    t = results["sweep"]
    if t["factor"] is not None:
        print(f"encoding: {t['encode_s']:.1f} s = {t['factor']:.2f}x one uncalibrated encode "
              f"({t['uncalibrated_pass_s']:.1f} s); CPU time {t['factor_cpu']:.2f}x")
    for n in results["notes"]:
        print(f"note: {n}")
    if results.get("export"):
        print(f"re-index with: {encode_command(results['export'], out)}")
    print(f"wrote {out} (report.md, results.json{', plots' if results['plots'] else ''}) in {results['seconds']} s")
