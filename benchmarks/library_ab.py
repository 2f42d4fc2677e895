"""A/B of builds of the native library: the same native graph run with each build, interleaved in one process.

Why: a kernel change moves the model by a few per cent, and a shared VM drifts by as much between two
`attncal bench` runs.  Here each build's session runs the same inputs in turn (the order rotating every
round, so no build always runs first or right after another), medians are taken per build, and an optional
uncalibrated graph (`--baseline`, run without any library) gives the ratio users see.  The builds must give
the same embeddings (max |Δ| is printed; a kernel change that moves them is not a speed change).
`--export-of NAME=DIR` runs build NAME on another export's graph: two exports of one model (an older
commit's and the current one) under one build, when the graph, not the kernel, changed.

    # the current build against one made from an older commit (oplib.build_library('old-build'))
    python benchmarks/library_ab.py minilm-cal --lib old=old-build/libattncal_ort.so \\
        --lib new=build/plugins/libattncal_ort.so --baseline minilm-raw/onnx/model_optimized.onnx \\
        --seq 128,256,512 --batch 8 --repeats 10 --threads 2
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Callable
from pathlib import Path

import numpy as np


def _session(graph: Path, threads: int, library: Path | None):
    import onnxruntime as ort

    from attncal.bench.engines import interleaved_session_options

    so = interleaved_session_options(graph.parents[1])  # the export of EXPORT/onnx/GRAPH
    so.intra_op_num_threads = threads
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])


def padded_feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    """A batch of mixed lengths, as a server's dynamic batching forms it: item i holds seq * (i + 1) // batch
    valid tokens, the rest right padding."""
    from attncal.bench.engines import make_feeds

    feeds = make_feeds(batch, seq)
    for i in range(batch):
        n = max(1, seq * (i + 1) // batch)
        feeds["attention_mask"][i, n:] = 0
        feeds["input_ids"][i, n:] = 0
    return feeds


def run(export: Path, libraries: dict[str, Path], *, baseline: Path | None = None, seqs=(256,), batch: int = 8,
        repeats: int = 10, threads: int = 2, graph: str = "onnx/model_optimized_native.onnx",
        padded: bool = False, exports: dict[str, Path] | None = None) -> list[dict]:
    """One row per sequence length: median ms per build (and baseline), ratios, max |Δ| between builds.
    `padded`: batches of mixed lengths (`padded_feeds`) instead of `seq` valid tokens in every item.
    `exports`: the export whose graph a build runs, where it is not `export`."""
    from attncal.bench.engines import make_feeds
    from attncal.bench.timing import interleaved_times, medians

    exports = exports or {}
    sessions = {name: _session(exports.get(name, export) / graph, threads, lib) for name, lib in libraries.items()}
    if baseline is not None:
        sessions["baseline"] = _session(baseline, threads, None)
    names, first = list(sessions), next(iter(libraries))
    rows = []
    for seq in seqs:
        feeds = padded_feeds(batch, seq) if padded else make_feeds(batch, seq)
        per = {k: {i.name: feeds[i.name] for i in s.get_inputs()} for k, s in sessions.items()}
        outs = {}
        for k, s in sessions.items():  # two warm-up runs each
            outs[k] = s.run(None, per[k])[-1]
            s.run(None, per[k])
        runs = {k: partial(sessions[k].run, None, per[k]) for k in names}
        med = medians(interleaved_times(runs, repeats, warmup=0, rotate=True), scale=1e3)
        row = {"seq": seq, "batch": batch, "median_ms": med,
               "vs_first": {k: med[k] / med[first] for k in libraries},
               "max_abs_diff": max(float(np.abs(outs[k] - outs[first]).max()) for k in libraries)}
        if baseline is not None:
            row["vs_baseline"] = {k: med[k] / med["baseline"] for k in libraries}
        rows.append(row)
    return rows


def _named_path(option: str, what: str, exists: Callable[[Path], bool]) -> Callable[[str], tuple[str, Path]]:
    def parse(spec: str) -> tuple[str, Path]:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"{option} takes NAME=PATH, got {spec!r}")
        if not exists(Path(path)):
            raise argparse.ArgumentTypeError(f"{option} {name}: no {what} at {path}")
        return name, Path(path)
    return parse


_library = _named_path("--lib", "library", Path.is_file)
_export_of = _named_path("--export-of", "directory", Path.is_dir)


def _seqs(text: str) -> list[int]:
    try:
        seqs = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seq takes comma-separated integers, got {text!r}") from None
    if not seqs or min(seqs) < 1:
        raise argparse.ArgumentTypeError(f"--seq lengths must be >= 1, got {text!r}")
    return seqs


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export", type=Path, help="a calibrated attncal export with a native graph")
    ap.add_argument("--lib", type=_library, action="append", required=True, metavar="NAME=PATH",
                    help="a build of libattncal_ort.so (give two or more)")
    ap.add_argument("--baseline", type=Path, help="an uncalibrated graph to compare with (run without a library)")
    ap.add_argument("--seq", type=_seqs, default=[256])
    ap.add_argument("--batch", type=_positive, default=8)
    ap.add_argument("--repeats", type=_positive, default=10)
    ap.add_argument("--threads", type=_positive, default=2)
    ap.add_argument("--graph", default="onnx/model_optimized_native.onnx", help="graph of the export to run")
    ap.add_argument("--padded", action="store_true",
                    help="batches of mixed lengths: item i holds SEQ * (i + 1) / BATCH tokens, the rest padding")
    ap.add_argument("--export-of", type=_export_of, action="append", default=[], metavar="NAME=DIR",
                    help="run build NAME on this export's graph instead of EXPORT's")
    args = ap.parse_args(argv)
    libraries, exports = dict(args.lib), dict(args.export_of)
    if len(libraries) < 2:
        ap.error("give at least two --lib NAME=PATH with different names")
    if set(exports) - set(libraries):
        ap.error(f"--export-of names a build that no --lib gives: {', '.join(sorted(set(exports) - set(libraries)))}")
    for name in libraries:
        path = exports.get(name, args.export) / args.graph
        if not path.is_file():
            ap.error(f"{path} does not exist (a float32 export of the BERT family has it)")
    if args.baseline is not None and not args.baseline.is_file():
        ap.error(f"--baseline {args.baseline} does not exist")
    first = args.lib[0][0]
    for row in run(args.export, libraries, baseline=args.baseline, seqs=args.seq, batch=args.batch,
                   repeats=args.repeats, threads=args.threads, graph=args.graph, padded=args.padded,
                   exports=exports):
        parts = [f"{k} {ms:.1f} ms" for k, ms in row["median_ms"].items()]
        ratios = [f"{k}/{first} {v:.3f}" for k, v in row["vs_first"].items() if k != first]
        ratios += [f"{k}/baseline {v:.3f}" for k, v in row.get("vs_baseline", {}).items()]
        print(f"{row['batch']} x {row['seq']}: " + ", ".join(parts) + " | " + ", ".join(ratios)
              + f" | max |d| {row['max_abs_diff']:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
