"""Check that an export's ONNX Runtime embeddings match the PyTorch reference (exit 1 if not)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..artifact import INLINED_GRAPH, NATIVE_GRAPH, OPTIMIZED_GRAPH, PORTABLE_GRAPH, open_export
from ..runtime.parity import check_parity
from .common import CLIError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="an attncal export directory")
    p.add_argument("--texts", default=None, help="a UTF-8 file with one text per line (default: built-in set)")
    p.add_argument("--reference", default=None, help="the source model (default: the path in attncal.json)")
    p.add_argument("--batch-size", type=int, default=4, help="texts per ONNX Runtime call (default %(default)s)")
    p.add_argument("--custom-op-library", default=None, help="run with this native attncal op library")
    p.add_argument("--no-native", dest="native", action="store_const", const=False, default=None,
                   help="use the ONNX function body even when the native library is built ($ATTNCAL_NATIVE=0)")
    p.add_argument("--graph", choices=("all", "portable", "optimized", "native", "inlined"), default="all",
                   help="which graph of the export to check (default: every graph it has; the native graph runs "
                        "with the native library where it is built, else with its ONNX function bodies)")


def read_texts(path: str) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"texts file {p} not found")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"texts file {p} is not UTF-8: {exc}") from None
    texts = [t for t in lines if t.strip()]
    if not texts:
        raise ValueError(f"texts file {p} has no non-empty lines")
    return texts


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    texts = read_texts(args.texts) if args.texts else None
    files = {"portable": PORTABLE_GRAPH, "optimized": OPTIMIZED_GRAPH, "native": NATIVE_GRAPH, "inlined": INLINED_GRAPH}
    # Every graph the check will run is validated first: a damaged export is one line, before any work.
    meta = open_export(args.out, graphs="all" if args.graph == "all" else files[args.graph]).meta
    present = meta.get("graphs") or {}
    graphs = ([g for g, f in files.items() if g == "portable" or f in present] if args.graph == "all"
              else [args.graph])
    ok = True
    for graph in graphs:
        report = check_parity(args.out, texts, args.reference, batch_size=args.batch_size,
                              custom_op_library=args.custom_op_library, graph=graph, native=args.native)
        print(f"{report.graph}:")
        print(report.table())
        verdict = "OK" if report.ok else "FAILED"
        print(f"{verdict} ({report.precision}): {report.summary()}")
        ok &= report.ok
    return 0 if ok else 1
