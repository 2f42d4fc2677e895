"""The `attncal` command line (also `python -m attncal`).

Each subcommand lives in its own module and registers itself in `main`.
User errors (bad paths, bad calibration values, unsupported models) print one
line and exit with status 2; they never show a traceback.

The commands that run torch, transformers or ONNX Runtime (export, check, bench,
eval, encode, demo) print only attncal's own lines: those libraries' warnings and
messages are captured (attncal.library_output), shown with -v/--verbose, and kept in a
log file where the command writes a directory (export: OUT/attncal-export.log).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Callable, Sequence

from .. import library_output
from ..artifact import ArtifactError
from ..calibration.config import CalibrationConfig
from ..modelinfo import ModelNotFoundError, UnsupportedModelError

EXIT_USAGE = 2
# Commands whose third-party chatter is captured; each gets -v/--verbose.
CAPTURED_COMMANDS = ("export", "check", "bench", "eval", "encode", "demo", "tune")
VERBOSE_HELP = ("show the warnings and messages of torch, transformers and ONNX Runtime as they come "
                "(by default they are kept off the console){where}")
# ValueError covers calibration.patching's UnsupportedArchitectureError, which is not imported here: that
# module needs torch, and commands that do not (--help, inspect) start without it.
USER_ERRORS = (ArtifactError, ValueError, FileNotFoundError, FileExistsError, ModelNotFoundError,
               UnsupportedModelError)
# What a command may import that the runtime install (`pip install attncal`) lacks, by top-level import name,
# and the extra of pyproject.toml that installs it: a missing one is named in one line with the extra.
EXTRA_OF_MODULE = {"torch": "export", "sentence_transformers": "export", "onnx_ir": "export",
                   "onnxscript": "export", "matplotlib": "eval", "ir_measures": "eval", "yaml": "eval",
                   "chonkie": "eval", "ray": "ray", "tritonclient": "serving"}


class CLIError(Exception):
    """An error that is the user's to fix; printed as one line, exit status `code`."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def add_calibration_args(p: argparse.ArgumentParser) -> None:
    """Flags that mirror CalibrationConfig; defaults are the config's defaults."""
    d = CalibrationConfig()
    g = p.add_argument_group("calibration")
    g.add_argument("--variant", default=d.variant, help="uniform | cls-soft | cls-hard (default %(default)s)")
    g.add_argument("--strength", "--lambda", dest="strength", type=float, default=d.strength,
                   help="blend strength λ in [0, 1] (default %(default)s)")
    g.add_argument("--basket-size", type=int, default=d.basket_size, help="tokens per basket (default %(default)s)")
    g.add_argument("--layers", default=d.layers,
                   help="last-half | last | all | comma-separated indices, negatives allowed (default %(default)s)")
    g.add_argument("--pooling", default=d.pooling,
                   help="cls | last | mean | auto = the model's sentence-transformers Pooling (default %(default)s)")
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


def config_from_args(args: argparse.Namespace) -> CalibrationConfig:
    return CalibrationConfig(
        variant=args.variant,
        strength=args.strength,
        basket_size=args.basket_size,
        layers=args.layers,
        pooling=args.pooling,
        self_weight=args.self_weight,
        isolate_first=args.isolate_first,
        isolate_last=args.isolate_last,
        skip_short=args.skip_short,
        first_weight=args.first_weight,
        last_weight=args.last_weight,
    )


def _commands() -> list[tuple[str, str, Callable]]:
    from . import bench, check, demo, doctor, encode, eval, export, inspect, serve, triton_repo, tune

    return [
        ("export", "export an encoder to ONNX with the calibration op", export),
        ("check", "check an export's embeddings against the PyTorch reference", check),
        ("inspect", "list the calibrated layers of an export", inspect),
        ("bench", "latency, throughput and peak memory of calibrated vs uncalibrated engines", bench),
        ("eval", "measure position bias and retrieval effect of calibration configs", eval),
        ("tune", "decide whether and how to calibrate a model on your documents (sweep, intervals, rule)", tune),
        ("triton-repo", "generate a Triton model repository from an export", triton_repo),
        ("serve", "serve a model repository with Triton Inference Server", serve),
        ("encode", "re-index a corpus with an export: streaming, sharded, resumable (local, triton, ray)", encode),
        ("demo", "export the embedded default model calibrated and not, check and compare them", demo),
        ("doctor", "report versions, the native library, accelerators and an export, for bug reports", doctor),
    ]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="attncal", description="Attention calibration for text-embedding encoders.")
    parser.add_argument("--version", action="version", version=f"attncal {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, module in _commands():
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip().splitlines()[0])
        module.add_arguments(p)
        if name in CAPTURED_COMMANDS:
            where = getattr(module, "LOG_FILE_HELP", "")
            p.add_argument("-v", "--verbose", action="store_true",
                           help=VERBOSE_HELP.format(where=f"; either way {where}" if where else ""))
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    library_output.without_torch_advice()
    parser = build_parser()
    args = parser.parse_args(argv)
    captured = args.command in CAPTURED_COMMANDS
    with library_output.capture_third_party(verbose=args.verbose) if captured else contextlib.nullcontext() as capture:
        args.capture = capture
        code = _run(args)
        if code not in (0, 130) and capture is not None and not capture.verbose and capture.third_party_lines:
            print(f"attncal {args.command}: {capture.third_party_lines} lines of third-party warnings and messages "
                  "were kept off the console; --verbose shows them", file=sys.stderr)
        return code


def write_command_log(args: argparse.Namespace, path: os.PathLike | str) -> None:
    """Write the third-party warnings and messages captured so far to `path` (bench --out, eval --out)."""
    capture = getattr(args, "capture", None)
    if capture is not None:
        capture.write_log(path)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args._run(args) or 0)
    except CLIError as exc:
        print(f"attncal {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except USER_ERRORS as exc:
        print(f"attncal {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as exc:
        extra = EXTRA_OF_MODULE.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"attncal {args.command}: error: {exc.name.partition('.')[0]} is not installed; this command needs "
              f"pip install 'attncal[{extra}]'", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"attncal {args.command}: interrupted", file=sys.stderr)
        return 130
