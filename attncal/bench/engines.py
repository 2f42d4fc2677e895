"""The engines `attncal bench` compares, each behind one small interface.

An engine is prepared once (models loaded, sessions created) and then runs
one batch of token ids per call.  Everything model-related is shared through
`Workspace`, which holds the source model and the exports the engines need,
built once per bench run.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..calibration.config import CalibrationConfig

ENGINES = ("torch", "torch-cal", "torch-naive", "torch-sdpa", "torch-cal-sdpa", "ort", "ort-cal", "ort-opt",
           "ort-opt-cal", "ort-cal-lib")
DEFAULT_ENGINES = ("torch", "torch-cal", "torch-naive", "ort", "ort-cal", "ort-opt", "ort-opt-cal", "ort-cal-lib")


class EngineUnavailable(RuntimeError):
    """The engine cannot run here (e.g. the native op library is not built); the bench notes and skips it."""


@dataclass
class Workspace:
    """The source model, the calibration config and the export directories of one bench run."""

    model: Path
    config: CalibrationConfig
    exports: Path
    threads: int

    def export_dir(self, name: str) -> Path:
        return self.exports / name

    def to_json(self) -> str:
        return json.dumps({"model": str(self.model), "config": self.config.to_dict(), "exports": str(self.exports),
                           "threads": self.threads})

    @classmethod
    def from_json(cls, text: str) -> "Workspace":
        d = json.loads(text)
        return cls(Path(d["model"]), CalibrationConfig.from_dict(d["config"]), Path(d["exports"]), d["threads"])


def build_exports(ws: Workspace, engines: list[str], quiet: bool = True) -> dict[str, str]:
    """Create the exports the selected engines need (once; reused when present). Returns notes."""
    from ..export.exporter import ExportOptions, export

    notes: dict[str, str] = {}
    need = {
        "uncal": any(e in engines for e in ("ort", "ort-opt", "ort-opt-cal")),
        "cal": any(e in engines for e in ("ort-cal", "ort-cal-lib")),
    }
    for name, cal in (("uncal", False), ("cal", True)):
        if need[name] and not (ws.export_dir(name) / "attncal.json").exists():
            # TorchScript export: ONNX Runtime's transformer optimizer fuses its attention pattern.
            export(ws.model, ws.export_dir(name),
                   ExportOptions(config=ws.config, calibrate=cal, exporter="torchscript", check=False, overwrite=True),
                   quiet=quiet)
    if ("ort-opt" in engines or "ort-opt-cal" in engines) and not (ws.export_dir("opt") / "attncal.json").exists():
        optimize_export(ws.export_dir("uncal"), ws.export_dir("opt"))
    if "ort-opt-cal" in engines and not (ws.export_dir("opt-cal") / "attncal.json").exists():
        from ..graphs.row_placement import RowPlacementError, calibrate_optimized

        try:
            calibrate_optimized(ws.export_dir("opt"), ws.export_dir("opt-cal"), ws.config)
        except RowPlacementError as exc:
            notes["ort-opt-cal"] = str(exc)
    return notes


def optimize_export(src: Path, dest: Path) -> None:
    """ONNX Runtime's transformer optimizer (attention and layer-norm fusions) on an uncalibrated export."""
    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    meta = json.loads((src / "attncal.json").read_text())
    cfg = json.loads((src / "config.json").read_text())
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    opt = optimize_model(str(src / "onnx" / "model.onnx"), model_type="bert",
                         num_heads=int(cfg["num_attention_heads"]), hidden_size=int(cfg["hidden_size"]))
    onnx.save(opt.model, str(tmp / "onnx" / "model.onnx"))
    meta["optimized"] = "onnxruntime.transformers.optimizer (model_type=bert)"
    (tmp / "attncal.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


def make_engine(name: str, ws: Workspace) -> Callable[[dict[str, np.ndarray]], object]:
    """A callable running one batch (numpy int64 feeds) on engine `name`."""
    if name.startswith("torch"):
        import torch

        from ..calibration.encode import TorchEncoder

        torch.set_num_threads(ws.threads)
        sdpa = name.endswith("sdpa")  # torch-sdpa / torch-cal-sdpa: SDPA attention, split calibration
        enc = TorchEncoder(ws.model, attn_implementation="sdpa" if sdpa else "eager")
        config = None if name in ("torch", "torch-sdpa") else ws.config
        impl = {"torch-naive": "naive", "torch-cal-sdpa": "split"}.get(name, "efficient")
        names = set(enc.tokenizer.model_input_names)

        def run_torch(feeds: dict[str, np.ndarray]):
            batch = {k: torch.from_numpy(v) for k, v in feeds.items() if k in names}
            return enc.forward(batch, config, implementation=impl)

        return run_torch
    from ..runtime.encoder import Encoder

    lib = None
    if name == "ort-cal-lib":
        try:
            from ..runtime import oplib  # type: ignore[attr-defined]
        except ImportError:
            raise EngineUnavailable("the native op library support is not installed") from None
        lib = oplib.default_library_path()
        if lib is None:
            raise EngineUnavailable("the native op library is not built (make plugins)")
    export_name = {"ort": "uncal", "ort-cal": "cal", "ort-cal-lib": "cal", "ort-opt": "opt", "ort-opt-cal": "opt-cal"}[name]
    path = ws.export_dir(export_name)
    if not (path / "attncal.json").exists():
        raise EngineUnavailable(f"no export for {name} at {path}")
    enc = Encoder(path, providers=["CPUExecutionProvider"], custom_op_library=lib, intra_op_threads=ws.threads)

    def run_ort(feeds: dict[str, np.ndarray]):
        return enc.run({k: v for k, v in feeds.items() if k in enc.input_names})

    return run_ort


def make_feeds(batch: int, seq: int, vocab: int = 100, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids of exactly `seq` valid tokens per item (special ids avoided), as numpy int64."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, max(11, vocab), size=(batch, seq), dtype=np.int64)
    return {
        "input_ids": ids,
        "attention_mask": np.ones((batch, seq), dtype=np.int64),
        "token_type_ids": np.zeros((batch, seq), dtype=np.int64),
    }
