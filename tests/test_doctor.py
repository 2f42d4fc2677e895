"""`attncal doctor`: the report a user pastes into a bug report."""

from __future__ import annotations

import json

from attncal import CalibrationConfig, cpuinfo
from attncal.cli import doctor, main
from attncal.exporting.exporter import ExportOptions, export
from attncal.graphs.ops.contract import ALL_OP_TYPES
from attncal.runtime import oplib
from attncal.synthetic import save_synthetic_model
from attncal.versions import declared_ranges


def test_doctor_reports_setup_and_export(tmp_path, capsys):
    src = save_synthetic_model("bert", tmp_path / "m", seed=1, pooling="mean")
    out = tmp_path / "out"
    export(src, out, ExportOptions(config=CalibrationConfig(basket_size=16), exporter="torchscript"), quiet=True)
    assert main(["doctor", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    import onnxruntime as ort
    import torch

    assert report["versions"]["onnxruntime"] == ort.__version__ and report["versions"]["torch"] == torch.__version__
    assert report["accelerators"]["ort_providers"] == ort.get_available_providers()
    assert report["threads"]["torch_threads"] == torch.get_num_threads()
    assert report["cpu"]["class"] == cpuinfo.cpu_class() in cpuinfo.CLASSES
    tested = report["tested_versions"]
    assert set(tested) == {"onnxruntime", "onnx", "transformers", "torch", "numpy", "packaging"}
    assert tested["onnxruntime"] == {"installed": ort.__version__, "tested": declared_ranges()["onnxruntime"],
                                     "in_range": True}
    assert tested["torch"]["installed"] == torch.__version__ and tested["torch"]["in_range"] is True
    lib = oplib.default_library_path()
    native = report["native"]
    if lib is None:
        assert native["library"] is None and native["loads"] is False and "make plugins" in native["note"]
    else:  # every op of the contract is registered by the built library (checked without function bodies)
        assert native["library"] == str(lib) and native["loads"] is True
        assert native["ops"] == {op: True for op in ALL_OP_TYPES}
    exp = report["export"]
    assert exp["calibrated"] is True and exp["precision"] == "fp32" and exp["tested"] is True
    assert set(exp["graphs"]) == {"onnx/model.onnx", "onnx/model_optimized.onnx", "onnx/model_optimized_native.onnx"}
    assert all(g["parity"]["ok"] for g in exp["graphs"].values())
    assert exp["encoder_runs"] == ("onnx/model_optimized_native.onnx" if lib is not None else "onnx/model_optimized.onnx")
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("## attncal doctor") and "- native:" in text and "- export:" not in text


def test_doctor_says_when_a_library_is_outside_the_tested_range(monkeypatch):
    real = doctor.installed
    monkeypatch.setattr(doctor, "installed", lambda pkg: "1.0.0" if pkg == "onnxruntime" else real(pkg))
    monkeypatch.setattr(doctor, "declared_ranges", lambda: {"onnxruntime": ">=1.29", "numpy": ""})
    tested = doctor.collect()["tested_versions"]
    assert tested["onnxruntime"] == {"installed": "1.0.0", "tested": ">=1.29", "in_range": False}
    assert tested["numpy"]["tested"] == "any" and tested["numpy"]["in_range"] is True
    assert tested["torch"]["tested"] is None and tested["torch"]["in_range"] is None  # not declared: unknown


def test_doctor_refuses_a_path_that_is_not_an_export(tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert len([ln for ln in err.splitlines() if ": error: " in ln]) == 1 and "Traceback" not in err
