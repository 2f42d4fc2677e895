"""The graph digest of every export the test suite builds, to show that a change of the exporter's structure
leaves its output unchanged.

Each case is one tiny random-weight model (`attncal.synthetic`, fixed seeds) exported with one placement
and one precision, without the parity check (it does not change the graphs).  The digest is the
`attncal.digest` each graph file carries (`attncal.artifact.graph_digest`: every byte the graph holds but
its doc strings), so two runs agree exactly when the graphs do.  Run it before and after a change, with
the same library versions, and compare:

    python benchmarks/export_digests.py --json before.json
    python benchmarks/export_digests.py --json after.json --compare before.json

A case the exporter refuses (an option conflict, a placement the model cannot take) records the refusal's
first line, so a refusal that appears or disappears is a difference too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRECISIONS = ("fp32", "fp16", "int8")
# fp16 and int8 are exported on one architecture whose ORT-optimized graph exists (BERT) and one that has
# none (Qwen3), which covers every precision step; fp32 on every architecture.  Every architecture is
# exported at its default pooling; BERT also at the other one (cls and mean choose different placements).
REDUCED_PRECISION_ARCHS = ("bert", "qwen3")
BOTH_POOLINGS = ("bert",)


def cases(archs: tuple[str, ...]) -> list[tuple[str, str, str, str]]:
    """(architecture, pooling, placement or 'uncalibrated', precision)."""
    from attncal.graphs.placements import CHOICES
    from attncal.synthetic import DEFAULT_POOLING

    out = []
    for arch in archs:
        other = "mean" if DEFAULT_POOLING[arch] != "mean" else "cls"
        poolings = dict.fromkeys([DEFAULT_POOLING[arch]] + ([other] if arch in BOTH_POOLINGS else []))
        for precision in PRECISIONS:
            if precision != "fp32" and arch not in REDUCED_PRECISION_ARCHS:
                continue
            out.append((arch, DEFAULT_POOLING[arch], "uncalibrated", precision))
            for pooling in poolings:
                for placement in CHOICES:
                    out.append((arch, pooling, placement, precision))
    return out


def run_case(arch: str, pooling: str, placement: str, precision: str, work: Path) -> dict:
    import onnx

    from attncal import CalibrationConfig
    from attncal.artifact import stored_digest
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.synthetic import save_synthetic_model

    src = work / f"src-{arch}-{pooling}"
    if not src.exists():
        save_synthetic_model(arch, src, seed=3, pooling=pooling, max_positions=128)
    out = work / "out"
    opts = ExportOptions(config=CalibrationConfig(basket_size=8, strength=0.7, pooling=pooling),
                         calibrate=placement != "uncalibrated",
                         placement="auto" if placement == "uncalibrated" else placement,
                         fp16=precision == "fp16", quantize="int8" if precision == "int8" else None,
                         exporter="dynamo" if arch == "gemma3_text" else "torchscript",
                         check=False, overwrite=True, memory_check=False)
    try:
        meta = export(src, out, opts, quiet=True)
    except Exception as exc:  # noqa: BLE001 - a refusal is part of the behaviour being compared
        return {"refused": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}
    return {"graphs": {g: stored_digest(onnx.load(str(out / g), load_external_data=False))
                       for g in sorted(meta["graphs"])},
            "placements": {g: meta["graphs"][g].get("placement") for g in sorted(meta["graphs"])}}


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":
        # transformers' Gemma3 iterates a set of layer types in forward, so the dynamo graph's node order follows
        # the interpreter's string hashing: fixed here, so two runs compare the exporter, not the hash seed.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    from attncal.synthetic import ARCHITECTURES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write {case: result} here")
    ap.add_argument("--compare", help="a previous run's JSON: print every case that differs, exit 1 if any")
    ap.add_argument("--archs", default=",".join(ARCHITECTURES), help="comma-separated (default: all)")
    args = ap.parse_args(argv)
    results: dict[str, dict] = {}
    todo = cases(tuple(a for a in args.archs.split(",") if a))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="attncal-digests-") as d:
        for i, case in enumerate(todo, 1):
            key = "/".join(case)
            results[key] = run_case(*case, Path(d))
            Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))  # a partial run is usable
            print(f"[{i}/{len(todo)}] {key}: {'refused' if 'refused' in results[key] else 'ok'} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    differ = [k for k in sorted(set(before) | set(results)) if before.get(k) != results.get(k)]
    for k in differ:
        print(f"differs: {k}\n  before: {before.get(k)}\n  after:  {results.get(k)}")
    exported = sum(1 for r in results.values() if "graphs" in r)
    graphs = sum(len(r["graphs"]) for r in results.values() if "graphs" in r)
    print(f"{len(results)} cases ({exported} exported, {graphs} graphs, {len(results) - exported} refused): "
          f"{len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
