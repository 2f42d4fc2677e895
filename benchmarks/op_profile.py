"""Where a graph's time goes, by operator type: ONNX Runtime's own profile of each graph on one batch.

Why: a whole-model ratio against a peer graph mixes the attention (what attncal changes) with the model's
own MatMuls and element-wise work (what both graphs share).  The profile splits them, so a time target can
be checked against what the attention alone could give: with the shared part S and the peer's total P, no
attention kernel brings the ratio below S / P.

    python benchmarks/op_profile.py EXPORT/onnx/model.onnx EXPORT/onnx/model_optimized_native.onnx \\
        --batch 4 --seq 2048 --threads 2

Each graph runs in its own session (the native library registered where it is found), once to warm up, then
`--rounds` profiled runs; per operator type the kernel time per run, and its share of the graph's total.
Profiling adds a little per node, so the totals run above untimed runs (`attncal bench` gives those)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path


CONTROL_FLOW = frozenset({"Scan", "Loop", "If"})


def profile(graph: Path, batch: int, seq: int, threads: int = 2, rounds: int = 1,
            library: Path | None = None) -> tuple[float, Counter]:
    """(kernel milliseconds per run, Counter of milliseconds per run by operator type) of `graph` on a batch of
    `batch` x `seq` tokens."""
    import onnxruntime as ort

    from attncal.bench.engines import make_feeds

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if library is not None:
        so.register_custom_ops_library(str(library))
    with tempfile.TemporaryDirectory() as tmp:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "profile")
        sess = ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
        names = {i.name for i in sess.get_inputs()}
        feeds = {k: v for k, v in make_feeds(batch, seq).items() if k in names}
        sess.run(None, feeds)  # warm-up (profiled too; left out below)
        for _ in range(rounds):
            sess.run(None, feeds)
        events = json.loads(Path(sess.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    first = min(e["ts"] for e in runs)
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
             and e["ts"] > first + runs[0]["dur"]]
    by_op: Counter = Counter()
    for e in nodes:
        by_op[e["args"]["op_name"]] += e["dur"] / 1000 / rounds
    # A control-flow node's time holds its body's nodes, which the profile lists too (within its interval):
    # only the rest is its own (the chunked feed-forward's Scan: its bookkeeping; its MatMuls count as MatMuls).
    for c in (e for e in nodes if e["args"]["op_name"] in CONTROL_FLOW):
        inner = sum(e["dur"] for e in nodes if e is not c and c["ts"] <= e["ts"] and
                    e["ts"] + e["dur"] <= c["ts"] + c["dur"])
        by_op[c["args"]["op_name"]] -= inner / 1000 / rounds
    return sum(by_op.values()), by_op


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("graphs", type=Path, nargs="+", help="ONNX graphs (an export's onnx/*.onnx)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--top", type=int, default=8, help="operator types listed per graph (default 8)")
    args = ap.parse_args(argv)
    from attncal.runtime import oplib

    library = oplib.resolve_library(notice=False)  # None where the library is not built or turned off
    for graph in args.graphs:
        if not graph.is_file():
            print(f"op_profile: no graph at {graph}", file=sys.stderr)
            return 2
        total, by_op = profile(graph, args.batch, args.seq, args.threads, args.rounds, library)
        print(f"{graph}: {args.batch} x {args.seq}, {total:.1f} ms of kernels per run")
        for op, ms in by_op.most_common(args.top):
            print(f"  {op:<36} {ms:10.1f} ms  {ms / total:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
