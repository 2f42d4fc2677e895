"""ONNX Runtime's transformer optimizer, run in a child process on a graph whose weights stay on disk.

`onnxruntime.transformers.optimizer.optimize_model` loads every weight into the ModelProto it fuses,
and its fusions copy that proto again and again (symbolic and ONNX shape inference each take a full
copy), so on a large-vocabulary model the optimizer alone held many times the weights.  Here the same
two stages run as `optimize_model` runs them for `model_type="bert"` (ONNX Runtime's basic graph
optimizations at level 1 without ConstantSharing, then the Python fusions), but the proto handed to the
fusions is loaded without its external data: a copy of it is the graph's structure only, and a fusion
that reads a weight (the Q/K/V merge of attention) reads just that tensor from disk, relative to the
working directory, which is therefore the data file's folder.

A child process, because ONNX Runtime's session and the fusions' protobuf arenas keep their memory until
the process ends, and because an out-of-memory kill then names this step (`run` reports the signal)
instead of ending the export without a word.

The stages are those of one ONNX Runtime release's optimize_model, `MIRRORS_ORT`; with another installed,
optimizing says so once (in the parent process, so the export log has it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from ..artifact import stage_onnx
from ..versions import warn_if_not_mirrored
from .child import run_child

MIRRORS_ORT = "1.32"  # the onnxruntime release whose optimize_model stages `_optimize` rebuilds
_DISABLED = ["ConstantSharing"]  # what optimize_model disables at level 1 (its ConstantSharing note)


class OptimizerError(RuntimeError):
    """The optimizer's child process failed or was killed; the message says how, in one line."""


def _basic_optimizations(src: Path, basic: Path) -> None:
    """ONNX Runtime's level-1 graph optimizations on the CPU provider, saved with external data: the session
    `optimize_by_onnxruntime(use_gpu=False, opt_level=1, save_as_external_data=True)` builds, with its
    options.  Built here because that function imports torch (for `torch.version.hip`, read only on its GPU
    path), and importing torch would be most of this child's start-up."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.optimized_model_filepath = str(basic)
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", basic.name + ".data")
    opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(src), opts, providers=["CPUExecutionProvider"], disabled_optimizers=list(_DISABLED))


def _optimize(src: Path, dst: Path, num_heads: int, hidden_size: int) -> None:
    import onnx
    from onnxruntime.transformers.optimizer import optimize_by_fusion

    basic = dst.with_name(dst.stem + ".level1.onnx")
    _basic_optimizations(src, basic)
    model = onnx.load(str(basic), load_external_data=False)
    os.chdir(basic.parent)  # the fusions read external tensors relative to the working directory
    fused = optimize_by_fusion(model, "bert", num_heads, hidden_size).model
    import onnx_ir as ir

    out = ir.from_proto(fused)
    ir.external_data.set_base_dir(out.graph, basic.parent)
    stage_onnx(out, dst)
    del out, fused, model
    for leftover in (basic, basic.with_name(basic.name + ".data")):
        leftover.unlink(missing_ok=True)


def run(src: Path, dst: Path, num_heads: int, hidden_size: int) -> tuple[Path, str]:
    """Optimize `src` into `dst` (+ `<name>_data`) in a child process; returns `dst` and what the child wrote
    to stderr (passed on to this process's stderr as the child wrote it), or OptimizerError."""
    warn_if_not_mirrored("onnxruntime", MIRRORS_ORT, "attncal's optimizer runs the stages of optimize_model")
    dst.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "attncal.exporting.ort_optimize", str(src), str(dst), "--num-heads", str(num_heads),
           "--hidden-size", str(hidden_size)]
    stderr = run_child(cmd, "ONNX Runtime's transformer optimizer", OptimizerError, stdout=subprocess.PIPE)
    return dst, stderr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attncal.exporting.ort_optimize", description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--num-heads", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    a = p.parse_args(argv)
    _optimize(a.src.resolve(), a.dst.resolve(), a.num_heads, a.hidden_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
