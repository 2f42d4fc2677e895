"""benchmarks/op_profile.py: ONNX Runtime's profile of a graph, by operator type."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import op_profile  # noqa: E402

from attncal import ExportOptions, export  # noqa: E402
from attncal.synthetic import save_synthetic_model  # noqa: E402
from test_native_kernel import library  # noqa: E402,F401  (the built-library fixture)


def test_profile_splits_the_native_graph_by_operator(tmp_path, library, capsys):  # noqa: F811
    src = save_synthetic_model("qwen3", tmp_path / "src", seed=3, max_positions=128)
    out = tmp_path / "plain"
    export(src, out, ExportOptions(check=False, calibrate=False), quiet=True)
    total, by_op = op_profile.profile(out / "onnx" / "model_optimized_native.onnx", 2, 64, threads=1, rounds=2,
                                      library=library)
    assert by_op["PooledRowCalibratedAttention"] > 0 and "Softmax" not in by_op  # the op ran, in every layer
    assert abs(sum(by_op.values()) - total) < 1e-6 and by_op["MatMul"] > 0
    plain, _ = op_profile.profile(out / "onnx" / "model.onnx", 2, 64, threads=1)
    assert plain > 0
    assert op_profile.main([str(out / "onnx" / "model.onnx"), "--batch", "1", "--seq", "16", "--threads", "1",
                            "--top", "2"]) == 0
    assert "1 x 16" in capsys.readouterr().out
    assert op_profile.main([str(tmp_path / "missing.onnx")]) == 2
