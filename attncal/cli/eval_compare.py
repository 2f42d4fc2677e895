"""`attncal eval --compare EXPORT EXPORT [...]`: the command-line side of the retrieval-drift report.

Everything a user can get wrong is checked (`check_compare`) before the first encode and before
anything is written: the options that have no meaning for exports, the number
of exports, that every path is an intact export, and OUT.  `attncal eval` builds the data set
(--make-posq-example, --make-synthetic) only after that, so a mistyped
path leaves nothing behind, and then runs `run_compare`.
"""

from __future__ import annotations

import argparse
import sys

from ..eval import load_dataset
from ..eval.compare import DEFAULT_RESAMPLES, CompareOptions, compare_exports, summary, validate_exports
from ..eval.output import check_out_dir
from .common import CLIError

# Options that mean nothing for a comparison of exports, in groups that share the reason.
_CONFLICTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("model",), "the exports to compare are given to --compare; the first is the baseline"),
    (("configs", "strength", "variant", "basket_size", "layers", "pooling", "self_weight", "isolate_first",
      "isolate_last", "skip_short", "first_weight", "last_weight", "lmk_every", "lmk_token", "mean_every"),
     "an export evaluates its stored calibration and pooling only; pass a model directory as MODEL to sweep configs"),
    (("baselines", "sea_chunk_tokens"), "baselines need the uncalibrated PyTorch model; compare an uncalibrated "
                                        "export instead"),
    (("length_buckets", "max_length"), "not supported with --compare (an export's max length is fixed at export)"),
    (("make_posq",), "build the set first (attncal eval --make-posq DOCS -o DIR), then --compare ... --data DIR"),
)
_DATA_SOURCES = ("data", "make_posq_example", "make_synthetic")


def refuse_conflicts(args: argparse.Namespace, defaults: dict, flags: dict) -> None:
    """One CLIError line naming the options given with --compare that make no sense with it; `defaults` and
    `flags` map each eval option to its default value and to its flag as the user types it."""
    for dests, reason in _CONFLICTS:
        given = [flags[d] for d in dests if getattr(args, d, None) != defaults.get(d)]
        if given:
            raise CLIError(f"--compare does not take {', '.join(given)}: {reason}")
    sources = [flags[d] for d in _DATA_SOURCES if getattr(args, d)]
    if len(sources) > 1:
        raise CLIError(f"{' and '.join(sources)} are exclusive")
    if not sources:
        raise CLIError("--compare needs the set to score on: --data DIR, --make-posq-example DIR or "
                       "--make-synthetic DIR")


def check_compare(args: argparse.Namespace, defaults: dict, flags: dict) -> int:
    """What the user can get wrong, before the set is built: the options (`refuse_conflicts`), the exports,
    OUT and --bootstrap.  Returns the number of bootstrap resamples."""
    refuse_conflicts(args, defaults, flags)
    validate_exports(args.compare)
    check_out_dir(args.out, args.overwrite)
    n = DEFAULT_RESAMPLES if args.bootstrap is None else args.bootstrap
    if n < 1:
        raise CLIError(f"--bootstrap must be >= 1 resample, got {n}")
    return n


def run_compare(args: argparse.Namespace, n_resamples: int) -> dict:
    """Score the exports on --data (built by then) and print the summary; returns results.json's content."""
    data = load_dataset(args.data, split=args.split, n_groups=args.position_groups)
    opts = CompareOptions(n_resamples=n_resamples, seed=args.seed, top_k=args.top_k, batch_size=args.batch_size,
                          cache_dir=None if args.no_cache else args.cache, plots=not args.no_plots)
    results = compare_exports(args.compare, data, opts, out=args.out, overwrite=args.overwrite)
    sys.stdout.write(summary(results))
    return results
