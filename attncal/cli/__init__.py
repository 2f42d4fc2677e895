"""The `attncal` command line (also `python -m attncal`).

Each subcommand lives in its own module and registers itself in `main`.
User errors (bad paths, bad calibration values, unsupported models) print one
line and exit with status 2; they never show a traceback.

The commands that run torch, transformers, ONNX Runtime or Ray (`CAPTURED_COMMANDS`)
print only attncal's own lines: those libraries' warnings and messages are captured
(attncal.console), shown with -v/--verbose, and kept in a log file where the command
writes a directory (export: OUT/attncal-export.log).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Callable, Sequence

from .. import __version__, console
from ..artifact import ArtifactError
from ..modelinfo import ModelNotFoundError, UnsupportedModelError
from ..versions import without_torch_advice
from . import bench, check, demo, doctor, encode, eval, export, inspect, serve, triton_repo, tune
from .common import (  # noqa: F401  (CLIError and the shared flags: public here, as before)
    EXIT_USAGE,
    CLIError,
    add_calibration_args,
    config_from_args,
    write_command_log,
)

# Commands whose third-party chatter is captured; each gets -v/--verbose.
CAPTURED_COMMANDS = ("export", "check", "bench", "eval", "encode", "demo", "tune")
VERBOSE_HELP = ("show the warnings and messages of torch, transformers and ONNX Runtime as they come "
                "(by default they are kept off the console){where}")
# ValueError covers calibration.attention_functions' UnsupportedArchitectureError, which is not imported here: that
# module needs torch, and commands that do not (--help, inspect) start without it.
USER_ERRORS = (ArtifactError, ValueError, FileNotFoundError, FileExistsError, ModelNotFoundError,
               UnsupportedModelError)
# What a command may import that the runtime install (`pip install attncal`) lacks, by top-level import name,
# and the extra of pyproject.toml that installs it: a missing one is named in one line with the extra.
EXTRA_OF_MODULE = {"torch": "export", "sentence_transformers": "export", "onnx_ir": "export",
                   "onnxscript": "export", "matplotlib": "eval", "ir_measures": "eval", "yaml": "eval",
                   "chonkie": "eval", "ray": "ray", "tritonclient": "serving"}


def _commands() -> list[tuple[str, str, Callable]]:
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
    without_torch_advice()
    parser = build_parser()
    args = parser.parse_args(argv)
    captured = args.command in CAPTURED_COMMANDS
    with console.capture(verbose=args.verbose) if captured else contextlib.nullcontext() as capture:
        args.capture = capture
        code = _run(args)
        if code not in (0, 130) and capture is not None and not capture.verbose and capture.third_party_lines:
            n = capture.third_party_lines
            print(f"attncal {args.command}: {n} line{'s' if n != 1 else ''} of third-party warnings and messages "
                  f"{'were' if n != 1 else 'was'} kept off the console; --verbose shows them", file=sys.stderr)
        return code


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
