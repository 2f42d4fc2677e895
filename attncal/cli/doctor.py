"""Report this machine's attncal setup (and an export's), to paste into a bug report.

Like `transformers env`: versions (and whether the libraries attncal is tested with are in the ranges it
declares), the CPU's feature class (what an int8 graph's figures cover), ONNX Runtime providers, the native library (where, what it
registers, whether it loads), CUDA / TensorRT availability, thread settings and, for an export
directory, its format, graphs, placements, precision and parity, and the graph `Encoder` would run.
Nothing is downloaded and nothing is written.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from .. import cpuinfo
from ..artifact import open_export
from ..calibration.config import CalibrationConfig
from ..exporting.quantize import graph_record
from ..graphs.ops.contract import ALL_OP_TYPES, attention_op_spec, op_spec, with_softmax
from ..runtime import oplib
from ..runtime.encoder import default_providers, select_graph
from ..serving.env import ServingEnvError, check_env
from ..versions import declared_ranges, in_range, installed, library_versions

_PACKAGES = ("attncal", "torch", "transformers", "onnx", "onnx-ir", "onnxruntime", "onnxruntime-gpu", "numpy",
             "sentence-transformers", "optimum", "optimum-onnx", "scipy-openblas32", "ray", "tritonclient")
_TESTED = ("onnxruntime", "onnx", "transformers", "torch", "numpy", "packaging")  # checked against attncal's declared ranges


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("export", nargs="?", help="an attncal export directory to describe as well")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _versions() -> dict[str, str | None]:
    return {"python": platform.python_version(), "platform": platform.platform(), **library_versions(_PACKAGES)}


def _tested() -> dict[str, dict[str, Any]]:
    """Each library of _TESTED: its installed version, the range attncal declares for it (the installed
    package metadata: pyproject.toml's ranges, which are the tested ones) and whether the version is in it
    (None: not installed, or not declared)."""
    ranges = declared_ranges()
    out = {}
    for pkg in _TESTED:
        spec = ranges.get(pkg)
        out[pkg] = {"installed": installed(pkg), "tested": "any" if spec == "" else spec,
                    "in_range": in_range(installed(pkg), spec)}
    return out


def _cpu() -> dict[str, str]:
    return {"machine": platform.machine(), "class": cpuinfo.cpu_class()}


def _registered_ops(library: Path) -> dict[str, bool]:
    """Each `ai.attncal` op type: does an ONNX Runtime session with only this library (no function body)
    load a one-node model of it?"""
    import onnxruntime as ort

    from ..graphs.ops.single_op import single_op_model  # lazy: onnx, ~30 ms of every attncal start-up otherwise

    specs = {}
    for pooling in ("cls", "mean"):
        base = op_spec(CalibrationConfig(pooling=pooling).resolve(), 0)
        specs[base.op_type] = base
        fused = op_spec(CalibrationConfig(pooling=pooling).resolve(), 0, fused_softmax=True)
        specs[with_softmax(base.op_type)] = fused
        for projected in (False, True):
            att = attention_op_spec(CalibrationConfig(pooling=pooling).resolve(), 0, num_heads=2, projected=projected)
            specs[att.op_type] = att
    out = {}
    for op_type in ALL_OP_TYPES:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        so.register_custom_ops_library(str(library))
        try:
            ort.InferenceSession(single_op_model(specs[op_type], with_function=False).SerializeToString(), so,
                                 providers=["CPUExecutionProvider"])
            out[op_type] = True
        except Exception:  # noqa: BLE001 - "not registered" is the answer, whatever ORT raised
            out[op_type] = False
    return out


def _native() -> dict[str, Any]:
    info: dict[str, Any] = {"disabled_by_env": oplib.native_disabled_by_env(), "build": oplib.build_info()}
    lib = oplib.default_library_path()
    info["library"] = str(lib) if lib is not None else None
    if lib is None:
        info["loads"] = False
        info["note"] = ("not installed: install a platform wheel (`pip install .` builds one), or run `make plugins` "
                        "in a source checkout (portable graphs then run their ONNX function bodies)")
        return info
    info["packaged"] = lib.parent == oplib.PACKAGE_LIB_DIR
    try:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.register_custom_ops_library(str(lib))
        info["loads"] = True
        info.update(oplib.blas_record())  # OpenBLAS's kernels under the library's GEMMs
        info["ops"] = _registered_ops(lib)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: this is a diagnostic
        info["loads"] = False
        info["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    cuda = lib.with_name(oplib.CUDA_LIBRARY)
    trt = lib.with_name(oplib.TRT_LIBRARY)
    info["cuda_library"] = str(cuda) if cuda.exists() else None
    info["tensorrt_plugin"] = str(trt) if trt.exists() else None
    return info


def _accelerators() -> dict[str, Any]:
    import onnxruntime as ort

    torch = _torch()
    cuda = torch is not None and torch.cuda.is_available()
    out: dict[str, Any] = {"ort_providers": ort.get_available_providers(),
                           "torch_cuda": cuda,
                           "torch_cuda_version": torch.version.cuda if torch is not None else None,
                           "nvcc": None, "tensorrt_library": ctypes.util.find_library("nvinfer")}
    if cuda:
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    out["nvcc"] = oplib.find_nvcc()
    headers = oplib.tensorrt_headers()
    out["tensorrt_headers"] = str(headers) if headers is not None else None
    return out


def _torch():
    """torch where it is installed; the runtime install (`pip install attncal`) has none, and doctor still runs."""
    try:
        import torch
    except ModuleNotFoundError:
        return None
    return torch


def _threads() -> dict[str, Any]:
    torch = _torch()
    return {"cpu_count": os.cpu_count(), "sched_affinity": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else None,
            "torch_threads": torch.get_num_threads() if torch is not None else None,
            **{k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                              "ATTNCAL_NATIVE", "HF_HUB_OFFLINE")}}


def _triton() -> dict[str, Any]:
    try:
        env = check_env()
    except ServingEnvError as exc:
        return {"available": False, "why": str(exc)}
    return {"available": True, "env": str(env.root), **{k: str(v) for k, v in vars(env).items() if k != "root"}}


def _export(path: Path) -> dict[str, Any]:
    exp = open_export(path, graphs=None)
    meta = exp.meta
    providers = default_providers()
    lib = oplib.resolve_library(None, notice=False)
    graphs = {}
    for g, info in (meta.get("graphs") or {}).items():
        par = info.get("parity") or {}
        graphs[g] = {"placement": info.get("placement"), "fused_attention": info.get("fused_attention"),
                     "quantized_nodes": info.get("quantized_nodes"),
                     "int8_cpu": cpuinfo.coverage_line(graph_record(path / g)) if info.get("quantized_nodes") else None,
                     "parity": {k: par.get(k) for k in ("precision", "max_abs", "min_cos", "p1_cos", "ok")} or None}
    return {
        "path": str(path), "format": meta.get("format"), "model_type": meta.get("model_type"),
        "architecture": meta.get("architecture"), "tested": meta.get("tested"), "calibrated": meta.get("calibrated"),
        "calibrated_layers": meta.get("calibrated_layers"), "pooling": meta.get("pooling"),
        "placement": meta.get("placement"),
        "precision": (meta.get("quantization") or {}).get("precision") or ("fp16" if meta.get("fp16") else "fp32"),
        "optimizer": meta.get("optimizer"), "graphs": graphs,
        "encoder_runs": select_graph(path, meta, "auto", providers, lib), "exported_with": meta.get("versions"),
    }


def collect(export: str | None = None) -> dict[str, Any]:
    """The whole report as a dict (what `--json` prints)."""
    report = {"versions": _versions(), "tested_versions": _tested(), "cpu": _cpu(), "native": _native(),
              "accelerators": _accelerators(), "threads": _threads(), "triton": _triton()}
    if export is not None:
        report["export"] = _export(Path(export))
    return report


def _text(report: dict[str, Any]) -> str:
    lines = ["## attncal doctor", ""]
    for section, body in report.items():
        lines.append(f"- {section}:")
        for k, v in body.items():
            if isinstance(v, dict):
                lines.append(f"    - {k}:")
                lines += [f"        - {kk}: {vv}" for kk, vv in v.items()]
            else:
                lines.append(f"    - {k}: {v}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    report = collect(args.export)
    sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n" if args.json else _text(report))
    return 0
