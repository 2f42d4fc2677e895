"""`attncal demo` (the README's main job) end to end on a tiny random model: two exports, parity, the latency
line, and refusals of bad arguments."""

from __future__ import annotations

import re

import pytest

from attncal.cli import main

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options


def test_demo_on_a_tiny_model(tiny_models, tmp_path, capsys):
    out = tmp_path / "demo-out"
    code = main(["demo", "--model", str(tiny_models["bert"]), "--out", str(out), "--repeats", "2",
                 "--basket-size", "8"])
    assert code == 0
    text = capsys.readouterr().out
    assert len(re.findall(r"max \|Δ\| \S+ +min cosine \S+ +OK", text)) == 2, text
    ratio = re.search(r"uncalibrated ([\d.]+) ms, calibrated ([\d.]+) ms \(ratio ([\d.]+)\)", text)
    assert ratio and float(ratio.group(3)) == pytest.approx(float(ratio.group(2)) / float(ratio.group(1)), abs=2e-3)
    assert re.search(r"calibrated graph: onnx/\S+, \S+ placement", text)
    for name in ("uncalibrated", "calibrated"):
        assert (out / name / "attncal.json").is_file()


def test_demo_rejects_bad_repeats(tiny_models, tmp_path, capsys):
    code = main(["demo", "--model", str(tiny_models["bert"]), "--out", str(tmp_path / "d"), "--repeats", "0"])
    assert code == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
