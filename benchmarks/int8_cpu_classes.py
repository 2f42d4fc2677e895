"""int8 weight formats on two CPU classes: cosine to the fp32 calibrated export, and time against fp32.

all-MiniLM-L6-v2, calibrated with default options.  Each int8 candidate is `attncal export --quantize int8`
with the quantizer's weight format set (equal to onnxruntime's quantize_dynamic with the same options):

* `int8-u8u8`: uint8 weights per channel, asymmetric (QUInt8, U8U8 kernels; the default);
* `int8-7bit`: int8 weights per channel in the 7-bit range (QInt8 with reduce_range);
* `int8-8bit`: int8 weights per channel in the 8-bit range (QInt8; the default before).

`encode` embeds the last 48 of the 79 Python Language Reference documents (truncated at the export's 256
tokens) with each export's `Encoder` and saves them with what the process saw: numpy's CPU features (CPUID,
not /proc) and MatMulInteger probes of 255 x 127 (U8S8) and 255 x 255 (U8U8) products, whose U8S8 sum ONNX
Runtime's AVX2 kernel saturates and its VNNI kernel does not.  Run it natively, and under user-mode emulation
of an AVX2-only CPU (QEMU's `-cpu Haswell`, no AVX-512) for what such a CPU computes; times under emulation mean
nothing, so `encode` times nothing.  `time` times the Encoders natively, interleaved; `report` gives the cosine
of each run's int8 embeddings to the first run's fp32 calibrated ones.

    python benchmarks/int8_cpu_classes.py prepare --workdir W
    python benchmarks/int8_cpu_classes.py encode --workdir W --out W/native.npz [--graph optimized]
    qemu-x86_64-static -cpu Haswell .venv/bin/python benchmarks/int8_cpu_classes.py encode --workdir W --out W/haswell.npz
    python benchmarks/int8_cpu_classes.py time --workdir W --threads 2 --rounds 9
    python benchmarks/int8_cpu_classes.py report W/native.npz W/haswell.npz
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from unittest import mock

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from attncal.bench.engines import interleaved_session_options
from attncal.bench.timing import interleaved_times, medians
from attncal.eval.realtext import python_reference_documents
from attncal.export.exporter import ExportOptions, export
from attncal.export import quantize
from attncal.modelinfo import default_model_path
from attncal.runtime import Encoder

try:
    from numpy._core._multiarray_umath import __cpu_features__ as CPU_FEATURES
except ImportError:  # numpy 1.x
    from numpy.core._multiarray_umath import __cpu_features__ as CPU_FEATURES

FP32 = ("uncalibrated", "calibrated")
VARIANTS = {"int8-u8u8": ("uint8", False), "int8-7bit": ("int8", True), "int8-8bit": ("int8", False)}
PASSAGES = 48


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("prepare", "encode", "time", "report"))
    ap.add_argument("runs", nargs="*", type=Path, help="report: the .npz files of `encode`")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--out", type=Path, help="encode: the .npz to write")
    ap.add_argument("--graph", default="auto", help="encode, time: the Encoder's graph (auto, optimized, native)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_intermixed_args()
    if args.step == "prepare":
        prepare(args.workdir)
    elif args.step == "encode":
        encode(args.workdir, args.out, args.graph)
    elif args.step == "time":
        print(json.dumps(timing(args.workdir, args.threads, args.rounds, args.graph), indent=2))
    else:
        print(json.dumps(report(args.runs), indent=2))


def prepare(work: Path) -> None:
    for name in FP32:
        if not (work / name / "attncal.json").exists():
            export(default_model_path(), work / name, ExportOptions(calibrate=name == "calibrated", overwrite=True),
                   quiet=True)
    for name, (weights, reduce_range) in VARIANTS.items():
        if not (work / name / "attncal.json").exists():
            # The exporter calls the quantizer with its defaults: this variant's weight format instead.
            fmt = partial(quantize.quantize_graph, weights=weights, reduce_range=reduce_range)
            with mock.patch.object(quantize, "quantize_graph", fmt):
                export(default_model_path(), work / name, ExportOptions(quantize="int8", overwrite=True), quiet=True)


def passages() -> list[str]:
    docs, _ = python_reference_documents()
    return [d.text for d in docs][-PASSAGES:]


def cpu_seen() -> dict:
    """What this process's CPU is, as CPUID (numpy's dispatch) and ONNX Runtime's integer kernels show it."""
    return {"cpuid": {f: bool(CPU_FEATURES.get(f)) for f in ("AVX2", "AVX512F", "AVX512BW", "AVX512VNNI", "AVXVNNI")},
            "u8s8_probe": _probe(np.int8, 127), "u8u8_probe": _probe(np.uint8, 255)}


def _probe(weight_dtype, weight: int, k: int = 64) -> dict:
    """MatMulInteger of 255s times `weight`s over `k`: whether ONNX Runtime's kernel adds the products exactly."""
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "probe",
                              [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, k]),
                               helper.make_tensor_value_info("b", helper.np_dtype_to_tensor_dtype(
                                   np.dtype(weight_dtype)), [k, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 16])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"a": np.full((1, k), 255, np.uint8), "b": np.full((k, 16), weight, weight_dtype)}
    got, exact = int(session.run(None, feeds)[0][0, 0]), 255 * weight * k
    return {"exact": exact, "onnxruntime": got, "kernel": "exact" if got == exact else "saturating int16 pair sums"}


def encode(work: Path, out: Path, graph: str) -> None:
    texts = passages()
    encs = {n: Encoder(work / n, graph=graph) for n in ("calibrated", *VARIANTS)}
    emb = {n: e.encode(texts) for n, e in encs.items()}
    np.savez(out, seen=json.dumps({**cpu_seen(), "graphs": {n: e.graph_file for n, e in encs.items()}}), **emb)


def timing(work: Path, threads: int, rounds: int, graph: str) -> dict:
    """Median seconds of each Encoder over the passages, interleaved rounds in a rotating order, and each one's
    ratio to the fp32 uncalibrated Encoder's."""
    texts = passages()
    names = (*FP32, *VARIANTS)
    encs = {n: Encoder(work / n, graph=graph, intra_op_threads=threads,
                       session_options=interleaved_session_options(work / n)) for n in names}
    med = medians(interleaved_times({n: partial(e.encode, texts) for n, e in encs.items()}, rounds, rotate=True))
    return {"texts": len(texts), "rounds": rounds, "threads": threads, "cpu": cpu_seen(),
            "graphs": {n: e.graph_file for n, e in encs.items()}, "median_s": med,
            "ratio_to_fp32_uncalibrated": {n: med[n] / med["uncalibrated"] for n in names}}


def report(runs: list[Path]) -> dict:
    """Cosine of each run's embeddings to the first run's fp32 calibrated ones (p1, p50, min)."""
    ref = np.load(runs[0])["calibrated"]
    out = {}
    for run in runs:
        data = np.load(run)
        cos = {}
        for name in ("calibrated", *VARIANTS):
            a = data[name]
            c = (a * ref).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(ref, axis=1))
            cos[name] = {"p1": float(np.percentile(c, 1)), "p50": float(np.median(c)), "min": float(c.min())}
        out[run.name] = {"cpu": json.loads(str(data["seen"])), "cosine_to_first_fp32_calibrated": cos}
    return out


if __name__ == "__main__":
    sys.exit(main())
