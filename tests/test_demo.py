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
    assert ratio
    # The ratio is of the unrounded medians: it must lie where the two times printed to 0.01 ms, and itself
    # printed to 0.001, allow (at a few ms, the printed times alone move their ratio by up to 0.0025).
    uncal, cal, printed = (float(ratio.group(i)) for i in (1, 2, 3))
    assert (cal - 5e-3) / (uncal + 5e-3) - 5e-4 <= printed <= (cal + 5e-3) / (uncal - 5e-3) + 5e-4, text
    assert re.search(r"calibrated graph: onnx/\S+, \S+ placement", text)
    # The position-bias table comes before parity and cost: one row per third of the passage, from real prose.
    rows = re.findall(r"^  (the beginning|the middle|the end) +(\d+) +([\d.]+) +([\d.]+)  ([+-][\d.]+) "
                      r"\[([+-][\d.]+), ([+-][\d.]+)\]$", text, re.M)
    assert [r[0] for r in rows] == ["the beginning", "the middle", "the end"], text
    for _, n, base, cal, delta, lo, hi in rows:
        assert int(n) > 0 and abs(float(cal) - float(base) - float(delta)) <= 1.5e-3 and float(lo) <= float(hi)
    assert re.search(r"^On this set .+\.$", text, re.M) and text.index("position bias") < text.index("parity of")
    for name in ("uncalibrated", "calibrated"):
        assert (out / name / "attncal.json").is_file()


def test_demo_rejects_bad_repeats(tiny_models, tmp_path, capsys):
    code = main(["demo", "--model", str(tiny_models["bert"]), "--out", str(tmp_path / "d"), "--repeats", "0"])
    assert code == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_the_verdict_says_only_what_the_intervals_show():
    from attncal.cli.demo_position import _verdict

    delta = {"group_begin": {"delta": -0.03, "ci": [-0.04, -0.01]}, "group_middle": {"delta": 0.01, "ci": [-0.002, 0.02]},
             "group_end": {"delta": 0.04, "ci": [0.02, 0.06]}}
    assert _verdict(["begin", "middle", "end"], delta) == (
        "On this set calibration found more passages whose answer is at the end (+0.040); fewer whose answer is at "
        "the beginning (-0.030); no change its interval tells from zero at the middle.")
    flat = {k: {"delta": 0.0, "ci": [-0.01, 0.01]} for k in delta}
    assert _verdict(["begin", "middle", "end"], flat) == (
        "On this set no change its interval tells from zero at the beginning, the middle and the end.")
