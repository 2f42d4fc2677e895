"""int8 targets on two CPU classes: cosine to the fp32 calibrated embeddings, and time against fp32 uncalibrated.

all-MiniLM-L6-v2 (the default model), calibrated with default options, exported once per `--int8-target`:

* `portable`: uint8 weights per channel (U8U8 kernels, exact on every x86-64 class);
* `avx2`: 7-bit int8 weights per channel (U8S8, exact on every class), the most sensitive MatMuls in fp32
  (attncal.exporting.quantize.sensitivity, measured at export on the first Python Language Reference topics);
* `vnni`: 8-bit int8 weights per channel (U8S8: exact on VNNI, saturating int16 pair sums on AVX2).

`measure` embeds the last 48 of the 79 Python Language Reference documents (unseen by the sensitivity
measurement; truncated at the export's 256 tokens) with each export's `Encoder`, the cosine of each int8 export's
embeddings to the fp32 calibrated ones, and times the Encoders over them, interleaved in a rotating order (medians
of `--rounds`), against the fp32 uncalibrated one, all in one process.

AVX2 on an AVX-512 machine: ONNX Runtime's MLAS (and numpy, OpenBLAS, attncal's kernels) pick their kernels from
CPUID.  `run` measures twice: natively, and in a process whose CPUID reports no AVX-512, no AVX-VNNI (the
`cpuid_avx2.c` preload: Linux's CPUID faulting, `arch_prctl(ARCH_SET_CPUID, 0)`, traps every CPUID instruction
and the handler answers with those feature bits cleared), with `ATTNCAL_CPU_PATH=avx2`.  Everything else runs
natively, so the times are those of the AVX2 kernels on this CPU's cores.  Each process records what it saw:
numpy's CPU features and a MatMulInteger probe of 255 x 127 products, whose U8S8 sum the AVX2 kernel saturates
(1048544 for 2072640) and the VNNI kernel does not; `run` refuses a masked process whose probe is exact.

    python benchmarks/int8_cpu_classes.py run --workdir W --threads 2 --rounds 7 --out docs/bench/int8

writes `results.json` (rendered into docs/quantization.md by docs/generate.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from attncal.bench.engines import interleaved_session_options
from attncal.bench.harness import machine_info, source_commit
from attncal.bench.timing import interleaved_times, medians
from attncal.eval.realtext import python_reference_documents
from attncal.exporting.exporter import ExportOptions, export
from attncal.modelinfo import default_model_path
from attncal.runtime import Encoder

try:
    from numpy._core._multiarray_umath import __cpu_features__ as CPU_FEATURES
except ImportError:  # numpy 1.x
    from numpy.core._multiarray_umath import __cpu_features__ as CPU_FEATURES

FP32 = ("uncalibrated", "calibrated")
TARGETS = ("portable", "avx2", "vnni")
PASSAGES = 48
SHIM = Path(__file__).with_name("cpuid_avx2.c")
CPUS = {"native": {}, "avx2": {"ATTNCAL_CPU_PATH": "avx2"}}  # the masked run also gets the preload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("prepare", "measure", "run"))
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--out", type=Path, help="measure: its JSON; run: the folder of results.json")
    ap.add_argument("--graph", default="auto", help="the Encoders' graph (auto, optimized, native)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if args.step == "prepare":
        prepare(args.workdir)
    elif args.step == "measure":
        args.out.write_text(json.dumps(measure(args.workdir, args.graph, args.threads, args.rounds), indent=1))
    else:
        run(args)


def prepare(work: Path) -> None:
    for name in FP32:
        if not (work / name / "attncal.json").exists():
            export(default_model_path(), work / name, ExportOptions(calibrate=name == "calibrated", overwrite=True),
                   quiet=True)
    for target in TARGETS:
        if not (work / f"int8-{target}" / "attncal.json").exists():
            export(default_model_path(), work / f"int8-{target}",
                   ExportOptions(quantize="int8", int8_target=target, overwrite=True), quiet=True)


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


def _cosine(a: np.ndarray, b: np.ndarray) -> dict:
    c = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"p1": float(np.percentile(c, 1)), "p50": float(np.median(c)), "min": float(c.min())}


def measure(work: Path, graph: str, threads: int, rounds: int) -> dict:
    """In this process: cosines of each int8 export's embeddings to the fp32 calibrated ones, and the median time
    of each Encoder over the passages (interleaved, rotating order) with its ratio to fp32 uncalibrated."""
    texts = passages()
    names = (*FP32, *(f"int8-{t}" for t in TARGETS))
    encs = {n: Encoder(work / n, graph=graph, intra_op_threads=threads,
                       session_options=interleaved_session_options(work / n)) for n in names}
    emb = {n: e.encode(texts) for n, e in encs.items()}
    med = medians(interleaved_times({n: partial(e.encode, texts) for n, e in encs.items()}, rounds, rotate=True))
    return {"cpu": cpu_seen(), "graphs": {n: e.graph_file for n, e in encs.items()}, "median_s": med,
            "ratio_to_fp32_uncalibrated": {n: med[n] / med["uncalibrated"] for n in names},
            "cosine_to_fp32_calibrated": {n: _cosine(emb[n], emb["calibrated"]) for n in names}}


def _build_shim(work: Path) -> Path:
    lib = work / "libcpuid_avx2.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("a C compiler (cc) is needed to build the CPUID preload")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(SHIM)], check=True)
    return lib


def run(args) -> None:
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    prepare(work)
    shim = _build_shim(work)
    seen = {}
    for cpu, env in CPUS.items():
        env = {**os.environ, **env}
        if cpu == "avx2":
            env["LD_PRELOAD"] = str(shim)
        out = work / f"{cpu}.json"
        subprocess.run([sys.executable, __file__, "measure", "--workdir", str(work), "--out", str(out), "--graph",
                        args.graph, "--threads", str(args.threads), "--rounds", str(args.rounds)], env=env, check=True)
        seen[cpu] = json.loads(out.read_text())
    masked = seen["avx2"]["cpu"]
    if masked["u8s8_probe"]["kernel"] == "exact" or masked["cpuid"]["AVX512F"]:
        raise SystemExit(f"the CPUID mask did not take (this kernel or VM has no CPUID faulting?): {masked}")
    rows = []
    for cpu, result in seen.items():
        label = "avx2 (AVX-512 masked)" if cpu == "avx2" else machine_info(args.threads)["cpu_class"]
        for target in TARGETS:
            name = f"int8-{target}"
            meta = json.loads((work / name / "attncal.json").read_text())
            entry = meta["graphs"][result["graphs"][name]]
            sens = entry.get("int8_sensitivity") or {}
            rows.append({"cpu": label, "u8s8_kernel": result["cpu"]["u8s8_probe"]["kernel"], "target": target,
                         "weights": meta["quantization"]["weights"], "weight_range": meta["quantization"]["weight_range"],
                         "graph": result["graphs"][name], "fp32_nodes": sens.get("fp32_nodes", []),
                         "weight_nodes": sens.get("candidates", entry.get("quantized_nodes")),
                         "time_vs_fp32_uncalibrated": result["ratio_to_fp32_uncalibrated"][name],
                         "cosine_to_fp32_calibrated": result["cosine_to_fp32_calibrated"][name]})
        rows.append({"cpu": label, "u8s8_kernel": result["cpu"]["u8s8_probe"]["kernel"], "target": "fp32 calibrated",
                     "time_vs_fp32_uncalibrated": result["ratio_to_fp32_uncalibrated"]["calibrated"]})
    command = ("python benchmarks/int8_cpu_classes.py run --workdir W --threads "
               f"{args.threads} --rounds {args.rounds}" + (f" --graph {args.graph}" if args.graph != "auto" else ""))
    results = {"meta": {"command": command, "commit": source_commit(), "date": datetime.date.today().isoformat(),
                        "machine": machine_info(args.threads), "passages": PASSAGES, "rounds": args.rounds,
                        "avx2": "CPUID masked (benchmarks/cpuid_avx2.c), ATTNCAL_CPU_PATH=avx2; kernels run natively",
                        "seen": {cpu: r["cpu"] for cpu, r in seen.items()},
                        "median_s": {cpu: r["median_s"] for cpu, r in seen.items()}},
               "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
