"""The landmark / multi-CLS / Mean@k pooling flags shared by `export`, `eval` and `bench`.

`--pooling` (of the calibration flags) takes lmk, multi-cls and mean-every besides the model's own poolings;
`--lmk-every G` (tokens, or `sentence`), `--lmk-token TOKEN` and `--mean-every K` set them.  `eval` and `bench`
sweep: there `--pooling`, `--lmk-every` and `--mean-every` take comma-separated lists."""

from __future__ import annotations

import argparse

from ..pooling import DEFAULT_EVERY, DEFAULT_MEAN_EVERY, PAPER_EVERY, ROW_SET_KINDS, Pooling

POOLING_HELP = ("cls | last | mean | auto = the model's sentence-transformers Pooling (default) | lmk (landmark "
                "tokens, the model's SEP, after every --lmk-every tokens) | multi-cls (CLS tokens before every "
                "--lmk-every tokens) | mean-every (the mean of every --mean-every-th token)")


def add_pooling_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """The landmark flags (`add_calibration_args(landmarks=True)` adds them, with lmk / multi-cls / mean-every on
    its `--pooling`)."""
    lists = " (comma-separated to sweep)" if sweep else ""
    g = p.add_argument_group("landmark (LMK), multi-CLS and Mean@k pooling")
    g.add_argument("--lmk-every", default=str(DEFAULT_EVERY), metavar="G",
                   help=f"a landmark every G tokens, or after every sentence with 'sentence' (default "
                        f"%(default)s; the LMK paper uses {', '.join(map(str, PAPER_EVERY))}){lists}")
    g.add_argument("--lmk-token", default=None, metavar="TOKEN",
                   help="the landmark token (default: the model's SEP for lmk, its CLS for multi-cls; EOS / BOS "
                        "where it has none)")
    g.add_argument("--mean-every", default=str(DEFAULT_MEAN_EVERY), metavar="K",
                   help=f"mean-every pools the K-th, 2K-th, ... token (default %(default)s){lists}")


def _items(text: str, flag: str, sweep: bool) -> list[str]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{flag} is empty")
    if len(items) > 1 and not sweep:
        raise ValueError(f"{flag} takes one value here, got {text!r}")
    return items


def pooling_choices(args: argparse.Namespace, sweep: bool = False) -> list[Pooling]:
    """The `Pooling` of each pooling asked for (`--pooling` with its flags); a landmark kind's token is resolved
    against the model later (`Pooling.resolve`)."""
    out: list[Pooling] = []
    for name in _items(args.pooling, "--pooling", sweep):
        if name not in ROW_SET_KINDS:
            out.append(Pooling.parse(name))
            continue
        flag = "--mean-every" if name == "mean-every" else "--lmk-every"
        values = _items(args.mean_every if name == "mean-every" else args.lmk_every, flag, sweep)
        out += [Pooling.parse(name, every, args.lmk_token) for every in values]
    return out
