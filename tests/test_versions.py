"""attncal.versions: the declared (tested) ranges read from the package metadata, and the one-line warning of
code that copies another library's internals when another release is installed."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from attncal import versions
from attncal.exporting import fp16, ort_optimize, quantize


def test_declared_ranges_come_from_the_package_metadata():
    ranges = versions.declared_ranges()
    for pkg in ("onnxruntime", "onnx", "transformers", "torch"):
        assert ranges[pkg], pkg  # every one of them has a range
    assert versions.in_range(versions.installed("onnxruntime"), ranges["onnxruntime"]) is True
    assert versions.in_range("1.0.0", ranges["onnxruntime"]) is False
    assert versions.in_range("2.13.0+cpu", ">=2.13,<2.14") is True
    assert versions.in_range(None, ">=1") is None and versions.in_range("1.0", None) is None
    assert versions.in_range("1.0", "") is True  # declared without a range
    assert versions.release("1.32.0+cpu") == (1, 32) == versions.release("1.32")


def test_mirrored_release_is_named_once_when_another_is_installed(monkeypatch):
    mirrored = quantize.MIRRORS_ORT
    monkeypatch.setattr(versions, "installed", lambda pkg: mirrored + ".7")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        versions.warn_if_not_mirrored("onnxruntime", mirrored, "x")
    assert not caught  # the same major.minor: silent
    monkeypatch.setattr(versions, "installed", lambda pkg: "1.20.0")
    with pytest.warns(versions.MirroredVersionWarning) as caught:
        versions.warn_if_not_mirrored("onnxruntime", mirrored, "x")
    (w,) = caught
    text = str(w.message)
    assert f"onnxruntime {mirrored}" in text and "onnxruntime 1.20.0 is installed" in text and "\n" not in text


def _matmul_model() -> onnx.ModelProto:
    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_each_copy_of_onnxruntime_internals_checks_the_release(tmp_path, monkeypatch):
    """The quantizer, the fp16 conversion and the optimizer's stages each name the release they copy."""
    monkeypatch.setattr(versions, "installed", lambda pkg: "1.20.0" if pkg == "onnxruntime" else None)
    path = tmp_path / "model.onnx"
    onnx.save(_matmul_model(), str(path))
    for module, call in ((quantize, lambda: quantize.quantize_graph(path)),
                         (fp16, lambda: fp16.convert_to_fp16(_matmul_model(), None)),
                         (ort_optimize, lambda: ort_optimize.run(tmp_path / "missing.onnx", tmp_path / "o.onnx", 2, 8))):
        with pytest.warns(versions.MirroredVersionWarning, match=f"onnxruntime {module.MIRRORS_ORT}; onnxruntime "
                                                                 "1.20.0 is installed"):
            try:
                call()
            except ort_optimize.OptimizerError:
                assert module is ort_optimize  # the missing graph: the warning came first
