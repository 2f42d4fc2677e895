"""benchmarks/fp16_exports.py (section 8 of the GPU check) runs here on ONNX Runtime's CPU provider, on a
tiny model: the code a GPU run executes, except the provider."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fp16_exports  # noqa: E402

from attncal.synthetic import save_synthetic_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options


def test_fp16_exports_section_on_cpu(tmp_path):
    src = save_synthetic_model("bert", tmp_path / "src", seed=5, pooling="mean", max_positions=512)
    res = fp16_exports.run(src, tmp_path / "work", provider="CPUExecutionProvider", texts=6, tokens=40, rounds=1)
    assert set(res["parity"]) == {"onnx/model.onnx", "onnx/model_optimized.onnx", "onnx/model_optimized_native.onnx"}
    for graph, p in res["parity"].items():
        assert p["ok"] and p["max_abs"] <= p["tol_max_abs"], (graph, p)
    assert res["parity_ok"]
    # The Encoder picks the native graph where the library is built, else the optimized one.
    assert res["graphs"]["calibrated"] in ("onnx/model_optimized_native.onnx", "onnx/model_optimized.onnx")
    assert res["ratio"] > 0


def test_fp16_exports_section_without_the_provider(tmp_path):
    res = fp16_exports.run(tmp_path / "unused", tmp_path / "work", provider="NoSuchExecutionProvider")
    assert set(res) == {"skipped"}
    assert "NoSuchExecutionProvider is not available" in res["skipped"]
    assert not (tmp_path / "work").exists()  # nothing exported


def test_fp16_exports_rejects_bad_arguments():
    with pytest.raises(SystemExit) as exc:
        fp16_exports.main(["--rounds", "0"])
    assert exc.value.code == 2


def test_fp16_exports_removes_its_temporary_workdir(tmp_path, monkeypatch, capsys):
    """Without --workdir the exports go to a temporary directory that is removed on exit (each run of the
    real model left ~430 MB behind before)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert fp16_exports.main(["--model", str(tmp_path), "--provider", "NoSuchExecutionProvider"]) == 0
    assert "NoSuchExecutionProvider is not available" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
