"""Measure position bias and the retrieval effect of calibration configs (nDCG@10 per position group, HM, PSI).

Examples:
  attncal eval default --data my-data --strength 0,0.5,1 --out results/
  attncal eval my-model --data beir-dir --configs grid.yaml --baselines sea --out results/
  attncal eval --make-synthetic posq-demo            # write the small synthetic set and stop
  attncal eval --make-posq my-docs/ -o my-posq       # build a position-labelled set from your documents
  attncal eval my-model --data my-posq --out results/
  attncal eval default --make-posq-example pyref --strength 0,0.5,1 --baselines sea --out results/
                                                     # real-prose example (the Python Language Reference)
  attncal eval --compare uncal/ cal/ int8/ --data my-posq --out drift/
                                                     # retrieval drift of exports against the first one
  attncal eval default --data my-posq --strength 0 --pooling mean,lmk,multi-cls,mean-every \
      --lmk-every 32,64,128 --mean-every 64 --out pooling/
                                                     # landmark pooling zero-shot against the model's own
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..calibration.config import CalibrationConfig
from ..eval import EvalOptions, evaluate, load_dataset, write_synthetic
from ..eval.metrics import require_ir_measures
from ..eval.posq_builder import PosqOptions, make_posq
from ..eval.realtext import make_posq_example
from ..eval.report import config_label, markdown_table
from ..eval.runner import is_export
from ..modelinfo import load_model_info
from .common import (DEFAULT_STRENGTHS, CLIError, add_calibration_args, config_from_args, strength_list,
                     write_command_log)
from .eval_compare import check_compare, run_compare
from .pooling import pooling_choices

LOG_FILE = "attncal-eval.log"
LOG_FILE_HELP = f"they are written to OUT/{LOG_FILE} (with --out)"


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (__doc__ or "").split("\n", 1)[1]
    p.add_argument("model", nargs="?", help="model directory, 'default', or an attncal export directory "
                   "(an export evaluates its stored calibration only)")
    p.add_argument("--data", help="dataset directory (FineWeb-PosQ or PosIR/BEIR layout; see docs/evaluation.md)")
    p.add_argument("--configs", help="YAML file: a list of calibration config mappings (optional 'name' each)")
    p.add_argument("--baselines", default="", help="comma-separated baselines: sea (Segment Embed Average)")
    p.add_argument("-o", "--out", help="output directory for results.md, results.json and the plots "
                   "(with --make-posq: the directory the set is written to)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is not empty")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "attncal" / "eval"),
                   help="embedding cache directory (default ~/.cache/attncal/eval)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the embedding cache")
    p.add_argument("--split", default="test", help="qrels split for the BEIR layout (default %(default)s)")
    p.add_argument("--position-groups", type=int, default=3, help="equal-width position groups (default thirds)")
    p.add_argument("--length-buckets", type=_ints, default=None,
                   help="also report by relevant-document length, e.g. 128,256 (token edges)")
    p.add_argument("--top-k", type=int, default=100, help="exact search depth (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="texts per model call (default %(default)s)")
    p.add_argument("--max-length", type=int, default=None, help="override the model's max sequence length")
    p.add_argument("--sea-chunk-tokens", type=int, default=128, help="SEA chunk size in tokens (default %(default)s)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    c = p.add_argument_group("comparing exports (retrieval drift)")
    c.add_argument("--compare", nargs="+", metavar="EXPORT",
                   help="score two or more attncal export directories on the same set, side by side, with each "
                   "one's deltas against the first (the baseline); instead of MODEL")
    c.add_argument("--bootstrap", type=int, default=None, metavar="N",
                   help="paired bootstrap resamples of the queries for the delta intervals (default "
                   "1000; seeded by --seed)")
    p.add_argument("--make-synthetic", metavar="DIR",
                   help="write the small synthetic position-controlled set to DIR; with a MODEL, evaluate on it")
    p.add_argument("--synthetic-per-class", type=int, default=30, help="passages per position class (default 30)")
    p.add_argument("--synthetic-words", type=int, default=200, help="words per synthetic passage (default 200)")
    g = p.add_argument_group("building a position-labelled set from real text")
    g.add_argument("--make-posq", metavar="DOCS",
                   help="build a FineWeb-PosQ set from DOCS (a directory of .txt/.md/.rst files or a JSONL file) "
                   "and write it to -o DIR; passages are counted with MODEL's tokenizer (default: 'default')")
    g.add_argument("--make-posq-example", metavar="DIR",
                   help="build the real-prose example set (the Python Language Reference shipped with Python) "
                   "in DIR; with a MODEL, evaluate on it")
    g.add_argument("--text-field", default="text", help="JSONL field holding the document text (default text)")
    g.add_argument("--passage-tokens", type=int, default=None,
                   help="token budget per passage (default: the model's max length; larger budgets warn that "
                   "passages will be truncated)")
    g.add_argument("--min-passage-tokens", type=int, default=None, help="drop shorter passages (default: half the "
                   "budget)")
    g.add_argument("--drop-words", type=float, default=0.5,
                   help="share of a sentence's words dropped to make its query (default %(default)s)")
    g.add_argument("--max-passages", type=int, default=None, help="keep a seeded sample of at most N passages")
    g.add_argument("--seed", type=int, default=0, help="seed for query sentences and dropped words, and for "
                   "the bootstrap of --compare (default 0)")
    add_calibration_args(p, sweep=True, landmarks=True)  # eval sweeps λ and the poolings


def _defaults() -> tuple[dict, dict]:
    """(default value, flag as the user types it) of every eval option, from the parser's public API: the defaults
    are what parsing no argument gives, and an option's flag is its destination spelt as a long option where the
    help lists that flag (the commands' naming rule), else the destination in capitals (a positional)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    defaults = vars(p.parse_args([]))
    listed = set(p.format_help().replace(",", " ").split())
    flags = {d: f"--{d.replace('_', '-')}" if f"--{d.replace('_', '-')}" in listed else d.upper() for d in defaults}
    return defaults, flags


def load_grid(path: str | Path) -> tuple[list, list[str | None]]:
    """Configs and optional names from a YAML list of mappings (or a mapping with a 'configs' list)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: config grid not found")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ValueError(f"{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if isinstance(doc, dict) and "configs" in doc:
        doc = doc["configs"]
    if not isinstance(doc, list) or not doc:
        raise ValueError(f"{path}: expected a non-empty list of calibration config mappings")
    configs, names = [], []
    for i, item in enumerate(doc, 1):
        if not isinstance(item, dict):
            raise ValueError(f"{path}: item {i} is not a mapping")
        item = dict(item)
        names.append(item.pop("name", None))
        try:  # pooling: a word (cls, lmk, ...) or the object {kind: lmk, every: 64, token: "[SEP]"}
            configs.append(CalibrationConfig.from_dict(item))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: item {i}: {exc}") from None
    return configs, names


def _configs_from_args(args: argparse.Namespace) -> tuple[list, list[str] | None]:
    """The configs to sweep and their labels: every strength with every pooling asked for."""
    if args.configs:
        if args.strength is not None:
            raise CLIError("--configs and --strength are exclusive; put the strengths in the YAML file")
        configs, names = load_grid(args.configs)
    else:
        configs, names = [], []
        for s in args.strength or strength_list(DEFAULT_STRENGTHS):
            for pooling in pooling_choices(args, sweep=True):
                ns = argparse.Namespace(**vars(args))
                ns.strength = s
                configs.append(config_from_args(ns, pooling))
                names.append(None)
    if any(c.pooling.inserts for c in configs):  # the landmark token, named in the labels and the report
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(load_model_info(args.model).path))
        configs = [c.with_pooling(c.pooling.resolve(tokenizer)) for c in configs]
    return configs, [n or config_label(c) for n, c in zip(names, configs)]


def _posq_options(args: argparse.Namespace) -> PosqOptions:
    return PosqOptions(passage_tokens=args.passage_tokens, min_passage_tokens=args.min_passage_tokens,
                       drop_words=args.drop_words, max_passages=args.max_passages, seed=args.seed)


def _print_posq(posq, out) -> None:
    c = posq.manifest["counts"]
    lt = posq.manifest["passage_tokens"]
    per = ", ".join(f"{k} {v}" for k, v in c["queries_per_class"].items())
    print(f"wrote {c['passages']} passages (tokens: min {lt['min']}, median {lt['median']}, max {lt['max']}; budget "
          f"{posq.manifest['passage_budget_tokens']}) and {c['queries']} queries ({per}) to {out}")
    for w in posq.warnings:
        print(f"warning: {w}", file=sys.stderr)


def _make_posq(args: argparse.Namespace) -> int:
    if args.data is not None:
        raise CLIError("--data and --make-posq are exclusive: build the set first, then evaluate with --data")
    if not args.out:
        raise CLIError("--make-posq DOCS needs -o DIR, the directory to write the set to")
    posq = make_posq(args.make_posq, args.out, args.model or "default", _posq_options(args),
                     text_field=args.text_field, overwrite=args.overwrite, warn=lambda w: None)
    _print_posq(posq, args.out)
    print(f"evaluate it with: attncal eval {args.model or 'default'} --data {args.out} --out RESULTS")
    return 0


def _make_posq_example(args: argparse.Namespace, tokenizer_model: str | None = None) -> None:
    """Build the real-prose set into --make-posq-example DIR and point --data at it.

    Passages are counted with `tokenizer_model`'s tokenizer (with --compare: the
    baseline export's), else MODEL's, else the default model's."""
    if args.data is not None:
        raise CLIError("--data and --make-posq-example are exclusive")
    out = Path(args.make_posq_example)
    posq = make_posq_example(out, tokenizer_model or args.model or "default", _posq_options(args),
                             overwrite=args.overwrite, warn=lambda w: None)
    _print_posq(posq, out)
    args.data = str(out)


def _write_synthetic(args: argparse.Namespace) -> None:
    write_synthetic(args.make_synthetic, n_per_class=args.synthetic_per_class, words=args.synthetic_words)
    print(f"wrote the synthetic set ({3 * args.synthetic_per_class} passages) to {args.make_synthetic}")


def _compare(args: argparse.Namespace) -> int:
    """--compare: everything a user can get wrong is checked before the set is built (`check_compare`)."""
    n_resamples = check_compare(args, *_defaults())
    if args.make_posq_example:
        _make_posq_example(args, tokenizer_model=args.compare[0])
    elif args.make_synthetic:
        _write_synthetic(args)
        args.data = args.make_synthetic
    return finish(args, run_compare(args, n_resamples), "drift.png")


def run(args: argparse.Namespace) -> int:
    require_ir_measures()
    if args.compare is not None:
        return _compare(args)
    if args.bootstrap is not None:
        raise CLIError("--bootstrap applies to --compare only")
    makers = [f for f in ("make_synthetic", "make_posq", "make_posq_example") if getattr(args, f)]
    if len(makers) > 1:
        raise CLIError(" and ".join("--" + f.replace("_", "-") for f in makers) + " are exclusive")
    # The configs are checked before a set is built, so a refused config leaves nothing behind.
    swept = _configs_from_args(args) if args.model is not None and not is_export(args.model) else ([], None)
    if args.make_posq:
        return _make_posq(args)
    if args.make_posq_example:
        _make_posq_example(args)
        if args.model is None:
            return 0
    if args.make_synthetic:
        _write_synthetic(args)
        if args.model is None:
            return 0
        if args.data is not None:
            raise CLIError("--data and --make-synthetic are exclusive when a MODEL is given")
        args.data = args.make_synthetic
    if args.model is None or args.data is None:
        raise CLIError("give MODEL and --data DIR (or --make-synthetic DIR)")
    if is_export(args.model) and (args.configs or args.strength is not None):
        raise CLIError(f"{args.model} is an export: only its stored calibration can be evaluated; "
                       "drop --configs/--strength or pass the model directory")
    configs, labels = swept
    data = load_dataset(args.data, split=args.split, n_groups=args.position_groups)
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    opts = EvalOptions(configs=configs, labels=labels, baselines=baselines, top_k=args.top_k,
                       batch_size=args.batch_size, max_length=args.max_length,
                       cache_dir=None if args.no_cache else args.cache, length_buckets=args.length_buckets,
                       sea_chunk_tokens=args.sea_chunk_tokens, plots=not args.no_plots)
    results = evaluate(args.model, data, opts, out=args.out, overwrite=args.overwrite)
    sys.stdout.write(markdown_table(results["rows"], data.groups))
    return finish(args, results, "plots")


def finish(args: argparse.Namespace, results: dict, plots: str) -> int:
    """The notes, the command log beside the report, and where the report went (`plots`: their name)."""
    for n in results["notes"]:
        print(f"note: {n}")
    if args.out:
        write_command_log(args, Path(args.out) / LOG_FILE)
        print(f"wrote {args.out} (results.md, results.json{', ' + plots if not args.no_plots else ''}, {LOG_FILE}) "
              f"in {results['seconds']} s")
    return 0
