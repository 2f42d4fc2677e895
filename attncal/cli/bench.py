"""Benchmark latency, throughput and peak memory of calibrated vs uncalibrated engines, side by side."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

from ..artifact import METADATA_FILE, ArtifactError, looks_like_export, open_export, write_text_atomic
from ..bench import engines as bench_engines
from ..bench import chunking as chunk_bench
from ..bench import harness
from ..bench.engines import (DEFAULT_ENGINES, ENGINES, MEM_PATTERN, TWIN, Workspace, build_exports, is_engine,
                              peer_engine)
from ..bench.report import write_results
from ..bench.timing import CLOCKS
from ..graphs.placements.placement_names import CHOICES as PLACEMENTS
from ..exporting.plan import ExportOptions
from ..modelinfo import load_model_info, position_limit, resolve_model_path
from ..pooling import Pooling
from ..runtime.encoder import Encoder
from ..serving.bench import bench_triton, format_table
from ..synthetic import SYNTHETIC_SHAPES, save_synthetic_model
from .common import CLIError, add_calibration_args, command_line, config_from_args, write_command_log
from .pooling import pooling_choices

LOG_FILE = "attncal-bench.log"
LOG_FILE_HELP = f"they are written to OUT/{LOG_FILE}"


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CLIError(f"{name} must be a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise CLIError(f"{name} must list integers >= 1, got {text!r}")
    return values


def _position_limit(info) -> int | None:
    """How many tokens the model can take (its position table; the ST max length may be lower)."""
    from transformers import AutoConfig

    return position_limit(AutoConfig.from_pretrained(str(info.path)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model directory, an attncal export (its source model is used) or 'default'")
    p.add_argument("--triton", default=None, metavar="REPO_OR_URL",
                   help="bench served models instead: a model repository (a server is started on loopback ports) "
                        "or a running server's host:grpc_port")
    p.add_argument("--names", default=None, help="with --triton: comma-separated model names (default: all attncal models)")
    p.add_argument("--concurrency", default="1,4,16", help="with --triton: client concurrency levels (default %(default)s)")
    p.add_argument("--requests", type=int, default=240,
                   help="with --triton: requests per model, level and round, shared by the clients (default "
                        "%(default)s: enough that one level's ratio is not a few seconds of noise)")
    p.add_argument("--rounds", type=int, default=4,
                   help="with --triton: rounds per level, models alternating order (default %(default)s)")
    p.add_argument("--long-documents", action="store_true",
                   help="bench the cost of indexing long documents instead (attncal.bench.chunking): one vector per "
                        "document, naive chunks (overlap 0 and 32) and late chunks (window overlap 0 and 32; from "
                        "the graph's chunk vectors and from its token states where the export has them) of 8 "
                        "documents of 512 and 2,048 tokens, and the index bytes per document at each precision; "
                        "MODEL is an attncal export, or 'default' (exported calibrated, with --chunk-vectors, into "
                        "--workdir); writes OUT/long-documents.json")
    p.add_argument("--synthetic", choices=tuple(SYNTHETIC_SHAPES), default=None,
                   help="bench a random-weight model of a deployed long-context shape instead of MODEL: "
                        + "; ".join(f"{k}: {v.description}" for k, v in SYNTHETIC_SHAPES.items()))
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help=f"comma-separated subset of {', '.join(ENGINES)}; an ORT engine followed by "
                   f"{' or '.join(MEM_PATTERN)} runs with ONNX Runtime's memory pattern on (as ORT's default session "
                   f"options have it) or off, whatever the Encoder chooses for the export; and followed by {TWIN}, a "
                   "second session of it (an A/A control: what two identical sessions differ by)")
    p.add_argument("--seq", default="128,512,2048", help="sequence lengths (default %(default)s)")
    p.add_argument("--batch", default="1,8,32", help="batch sizes (default %(default)s)")
    p.add_argument("--repeats", type=int, default=10, help="timed rounds per shape (default %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads (default: all cores)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="what a run is timed in: wall time, or this process's CPU time (with --threads 1 and "
                        "in-process engines: a figure that other load on the machine moves far less) "
                        "(default %(default)s)")
    p.add_argument("--no-memory", action="store_true", help="skip the per-process peak memory probes")
    p.add_argument("--memory-probes", type=int, default=3,
                   help="fresh processes per engine and shape for peak memory; the median is reported (default "
                        "%(default)s: one process can peak a few MiB off, where its allocators placed their blocks)")
    p.add_argument("--out", default="results", help="output directory (default %(default)s)")
    p.add_argument("--placement", choices=PLACEMENTS, default="auto",
                   help="placement of the ort-opt-cal engine's optimized graph (default %(default)s)")
    p.add_argument("--workdir", default=None, help="where exports are built and cached, per model, config and attncal code (default: OUT/../.bench-cache)")
    add_calibration_args(p, landmarks=True,
                         pooling_note="; lmk, multi-cls and mean-every apply to the engines ort-pooled and "
                                      "ort-opt-pooled, which run --seq content tokens with their landmarks, the "
                                      "others keep the model's pooling")


def run_triton(args: argparse.Namespace) -> int:
    conc = _int_list(args.concurrency, "--concurrency")
    names = [n.strip() for n in args.names.split(",") if n.strip()] if args.names else None
    if args.requests < 1 or args.rounds < 1:
        raise ValueError(f"--requests and --rounds must be >= 1, got {args.requests} and {args.rounds}")
    result = bench_triton(args.triton, names, concurrency=conc, requests_per_level=args.requests, rounds=args.rounds)
    table = format_table(result)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} exists and is a file")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "triton.json", json.dumps(result, indent=2))
    write_text_atomic(out / "triton.md", table + "\n")
    write_command_log(args, out / LOG_FILE)
    print(table)
    return 0


def run_long_documents(args: argparse.Namespace) -> int:
    if args.model is None or args.synthetic:
        raise CLIError("--long-documents takes an attncal export, or 'default', as MODEL")
    if args.repeats < 1:
        raise CLIError(f"--repeats must be >= 1, got {args.repeats}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} exists and is a file")
    if args.model == "default" and not looks_like_export(args.model):
        export_dir = (Path(args.workdir) if args.workdir else out.parent / ".bench-cache") / "long-documents-default"
        if not (export_dir / METADATA_FILE).is_file():
            from ..exporting.exporter import export as run_export  # lazy: onnx_ir and sympy, not loaded at start-up

            run_export("default", export_dir, ExportOptions(chunk_vectors=True, overwrite=True), quiet=True)
    else:
        export_dir = Path(args.model)
    enc = Encoder(open_export(export_dir).path, providers=["CPUExecutionProvider"], intra_op_threads=args.threads)
    result = {"command": command_line("bench"), "commit": harness.source_commit(),
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": harness.machine_info(args.threads),
              "model": args.model, "model_type": enc.meta.get("model_type"),
              "calibrated": bool(enc.meta.get("calibrated")), "graph": enc.graph_file,
              "chunk_vectors": enc.has_chunk_vectors, "max_length": enc.max_length, "dimension": enc.dimension,
              "chunk_size": chunk_bench.CHUNK_SIZE, "overlap": chunk_bench.OVERLAP, "repeats": args.repeats,
              "cost": chunk_bench.measure(enc, args.repeats)}
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "long-documents.json", json.dumps(result, indent=2) + "\n")
    write_command_log(args, out / LOG_FILE)
    for shape, rows in result["cost"].items():
        for case, r in rows.items():
            print(f"{shape:>10}  {case:<28} {r['median_s']:8.2f} s  x{r['vs_late']:.2f} of late  "
                  f"{r['vectors_per_doc']:6.1f} vectors/doc")
    print(f"wrote {out}/long-documents.json")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.triton:
        return run_triton(args)
    if args.long_documents:
        return run_long_documents(args)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if not is_engine(e)]
    if bad or not engines:
        raise CLIError(f"unknown engine(s) {', '.join(bad) or '(none)'}; choose from {', '.join(ENGINES)} "
                       f"(an ORT engine may take {' or '.join(MEM_PATTERN)}, and {TWIN})")
    seqs, batches = _int_list(args.seq, "--seq"), _int_list(args.batch, "--batch")
    if args.repeats < 1:
        raise CLIError(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads < 1:
        raise CLIError(f"--threads must be >= 1, got {args.threads}")
    if args.memory_probes < 1:
        raise CLIError(f"--memory-probes must be >= 1, got {args.memory_probes} (--no-memory skips the probes)")
    problem = harness.clock_problem(args.clock, args.threads, engines)
    if problem:
        raise CLIError(f"--clock {args.clock}: {problem}")
    if (args.model is None) == (args.synthetic is None):
        raise CLIError(f"give either MODEL or --synthetic {{{','.join(SYNTHETIC_SHAPES)}}}")
    out = Path(args.out)
    work = Path(args.workdir) if args.workdir else out.parent / ".bench-cache"
    pooling, = pooling_choices(args)
    # lmk / multi-cls / mean-every: the ort-pooled engines' pooling; the other engines pool as the model does
    pooled = pooling if pooling.row_set else None
    config = config_from_args(args, Pooling() if pooled else pooling)
    if args.synthetic:
        shape = SYNTHETIC_SHAPES[args.synthetic]
        model = work / f"synthetic-{args.synthetic}"
        if not (model / "config.json").exists():
            save_synthetic_model(shape.arch, model, **shape.kwargs)
        name = f"synthetic {args.synthetic} ({shape.description}, random weights)"
    else:
        if Path(args.model).is_file():
            raise ArtifactError(args.model, "is a file; expected a model directory, an attncal export or 'default'")
        if looks_like_export(args.model):
            # An export is benched through its source model; validate it whole before any work.
            exp = open_export(args.model)
            source = exp.meta.get("source_model")
            if not source or not Path(source).is_dir():
                raise ArtifactError(exp.path / "attncal.json", f"its source model {source!r} is not on disk; "
                                                               "bench the model directory instead")
            model = Path(source)
        else:
            model = resolve_model_path(args.model)
        name = args.model  # as given ("default", a hub id, a directory): results.json names no one's machine
    info = load_model_info(model)
    limit = _position_limit(info)
    if limit is not None and max(seqs) > limit:
        raise CLIError(f"--seq {max(seqs)} exceeds the model's {limit} positions")
    config = config.bind(info.pooling)
    config.layer_indices(info.num_layers)
    pooled_json = pooled.to_json() if pooled is not None else None
    key = f"{info.model_type}-" + hashlib.sha256(
        f"{model}|{config.to_json()}|{args.placement}|{pooled_json}|{bench_engines.export_code_fingerprint()}".encode()
    ).hexdigest()[:12]
    ws = Workspace(model=model, config=config, exports=work / key, threads=args.threads, placement=args.placement,
                   pooled=pooled)
    notes = build_exports(ws, engines)
    rows, skipped = harness.run_bench(ws, [e for e in engines if e not in notes], seqs, batches, args.repeats,
                                      memory=not args.no_memory, memory_probes=args.memory_probes,
                                      clock=args.clock)
    notes.update(skipped)
    meta = {"model": args.model or f"--synthetic {args.synthetic}", "model_name": name, "config": config.to_dict(), "pooled": pooled_json,
            "engines": engines,
            "peer": peer_engine([r.engine for r in rows]),
            "seq": seqs, "batch": batches, "repeats": args.repeats, "clock": args.clock,
            "memory_probes": None if args.no_memory else args.memory_probes,
            "machine": harness.machine_info(args.threads),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "command": command_line("bench"),
            "commit": harness.source_commit()}
    write_results(out, rows, meta, notes)
    write_command_log(args, out / LOG_FILE)
    print((out / "results.md").read_text())
    print(f"wrote {out}/results.json, results.md, latency.png" + (", memory.png" if not args.no_memory else "")
          + f", {LOG_FILE}")
    return 0
