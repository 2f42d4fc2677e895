"""What every command module shares: the one-line user error, the calibration flags, the command's log file."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from ..artifact import write_text_atomic
from ..calibration.config import CalibrationConfig
from ..pooling import Pooling
from .pooling import POOLING_HELP, add_pooling_args

EXIT_USAGE = 2


class CLIError(Exception):
    """An error that is the user's to fix; printed as one line, exit status `code`."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


DEFAULT_STRENGTHS = "0,0.25,0.5,0.75,1"


def strength_list(text: str) -> list[float]:
    """`--strength` of a command that sweeps: a comma-separated list of λ."""
    try:
        values = [float(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values:
        raise argparse.ArgumentTypeError("the list of strengths is empty")
    return values


def add_calibration_args(p: argparse.ArgumentParser, *, sweep: bool = False, landmarks: bool = False,
                         pooling_note: str = "") -> None:
    """Flags that mirror CalibrationConfig; defaults are the config's defaults.

    sweep: `--strength` takes a comma-separated list of λ (default None: `DEFAULT_STRENGTHS`), and with
    `landmarks` so do `--pooling`, `--lmk-every` and `--mean-every`.  landmarks: `--pooling` also takes lmk,
    multi-cls and mean-every, with their flags (`attncal.cli.pooling.add_pooling_args`).  pooling_note: what
    the command adds to `--pooling`'s help."""
    d = CalibrationConfig()
    g = p.add_argument_group("calibration")
    g.add_argument("--variant", default=d.variant, help="uniform | cls-soft | cls-hard (default %(default)s)")
    if sweep:
        g.add_argument("--strength", "--lambda", dest="strength", type=strength_list, default=None,
                       help=f"comma-separated strengths λ to sweep (default {DEFAULT_STRENGTHS})")
    else:
        g.add_argument("--strength", "--lambda", dest="strength", type=float, default=d.strength,
                       help="blend strength λ in [0, 1] (default %(default)s)")
    g.add_argument("--basket-size", type=int, default=d.basket_size, help="tokens per basket (default %(default)s)")
    g.add_argument("--layers", default=d.layers,
                   help="last-half | last | all | comma-separated indices, negatives allowed (default %(default)s)")
    pooling_help = (POOLING_HELP + (" (comma-separated to sweep)" if sweep else "") if landmarks else
                    "cls | last | mean | auto = the model's sentence-transformers Pooling (default %(default)s)")
    g.add_argument("--pooling", default=d.pooling.kind, help=pooling_help + pooling_note)
    g.add_argument("--self-weight", type=float, default=d.self_weight,
                   help="fixed share w of the pooling token for cls-hard (default %(default)s)")
    g.add_argument("--isolate-first", action=argparse.BooleanOptionalAction, default=None,
                   help="give the first valid token its own share (default: by pooling)")
    g.add_argument("--isolate-last", action=argparse.BooleanOptionalAction, default=None,
                   help="give the last valid token its own share (default: by pooling)")
    g.add_argument("--skip-short", action=argparse.BooleanOptionalAction, default=d.skip_short,
                   help="leave rows with less than one basket of content unchanged (default on)")
    g.add_argument("--first-weight", default=None, help="override: equal | original | a fixed share")
    g.add_argument("--last-weight", default=None, help="override: equal | original | a fixed share")
    if landmarks:
        add_pooling_args(p, sweep=sweep)


def config_from_args(args: argparse.Namespace, pooling: Pooling | None = None) -> CalibrationConfig:
    """The config the flags give; `pooling`: the one `attncal.cli.pooling.pooling_choices` read (else `--pooling`
    as the text of a pooling, `Pooling.parse`)."""
    return CalibrationConfig(
        variant=args.variant,
        strength=args.strength,
        basket_size=args.basket_size,
        layers=args.layers,
        pooling=pooling if pooling is not None else args.pooling,
        self_weight=args.self_weight,
        isolate_first=args.isolate_first,
        isolate_last=args.isolate_last,
        skip_short=args.skip_short,
        first_weight=args.first_weight,
        last_weight=args.last_weight,
    )


def write_command_log(args: argparse.Namespace, path: os.PathLike | str) -> None:
    """Write the third-party warnings and messages captured so far to `path` (bench --out, eval --out)."""
    capture = getattr(args, "capture", None)
    if capture is not None:
        write_text_atomic(Path(path), capture.log_text())


def command_line(command: str) -> str | None:
    """`attncal COMMAND ...` as it was typed, for a result to name the command that made it; None when the
    command runs some other way (a test calling `main`, Python)."""
    return shlex.join(["attncal", command, *sys.argv[2:]]) if sys.argv[1:2] == [command] else None
