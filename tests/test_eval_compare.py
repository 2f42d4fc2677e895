"""attncal eval --compare: the retrieval-drift report of several exports on one position-labelled set.

Tiny random-weight BERT exports (char-level tokenizer, torchscript, no parity
check) keep this fast; the numbers mean nothing, the relations between them
are what is checked: an export against itself drifts by exactly 0, calibration
moves the scores, every interval holds its point estimate, a seed reproduces.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from attncal.calibration.config import CalibrationConfig
from attncal.cli import main
from attncal.eval.bootstrap import draw_resamples, paired_deltas
from attncal.eval.compare_report import export_labels, precision_of
from attncal.eval.synthetic_set import write_synthetic

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options

GROUPS = ("begin", "middle", "end")


def _export(model: Path, out: Path, config: CalibrationConfig | None) -> Path:
    from attncal.exporting.exporter import ExportOptions, export

    opts = ExportOptions(config=config or CalibrationConfig(), calibrate=config is not None, exporter="torchscript",
                         check=False)
    export(model, out, opts, quiet=True)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tiny model, its uncalibrated and calibrated (λ=1) exports and a small synthetic set."""
    from attncal.synthetic import save_synthetic_model

    root = tmp_path_factory.mktemp("compare")
    model = save_synthetic_model("bert", root / "bert", seed=1, max_positions=256)
    return {
        "model": model,
        "uncal": _export(model, root / "uncal", None),
        "cal": _export(model, root / "cal", CalibrationConfig(strength=1.0)),
        "data": write_synthetic(root / "data", n_per_class=4, words=30),
    }


def _compare(setup: dict, out: Path, *names: str, extra: tuple[str, ...] = ()) -> dict:
    argv = ["eval", "--compare", *(str(setup[n]) for n in names), "--data", str(setup["data"]), "--out", str(out),
            "--no-cache", *extra]
    assert main(argv) == 0
    return json.loads((out / "results.json").read_text())


def _entries(row: dict) -> dict:
    return {k: v for k, v in row["delta"].items() if k.startswith("group_") or k in ("hm", "psi")}


# --------------------------------------------------------------------------- the report
def test_compare_report_tables_json_and_plot(setup, tmp_path, capsys):
    out = tmp_path / "out"
    res = _compare(setup, out, "uncal", "cal", "uncal")
    printed = capsys.readouterr().out
    assert "| export | begin | mid | end | HM | PSI | nDCG@10 | R@10 |" in printed
    assert "| export − baseline | Δbegin | Δmid | Δend | ΔHM | ΔPSI |" in printed
    assert {p.name for p in out.iterdir()} == {"results.md", "results.json", "drift.png", "attncal-eval.log"}
    assert (out / "drift.png").read_bytes()[:4] == b"\x89PNG"
    assert "| export − baseline |" in (out / "results.md").read_text()
    base, cal, again = res["rows"]
    assert "(uncalibrated, fp32)" in base["label"] and "(calibrated λ=1, fp32)" in cal["label"]
    assert again["label"].endswith("#2") and res["baseline"] == base["label"]
    assert base["delta"] is None and res["bootstrap"]["resamples"] == 1000
    # an export against itself: exactly 0, with a zero-width interval
    for entry in _entries(again).values():
        assert entry["delta"] == 0.0 and entry["ci"] == [0.0, 0.0]
    # calibration moves the scores; each delta is the difference of the reported scores
    d = _entries(cal)
    assert any(e["delta"] != 0.0 for e in d.values())
    assert d["hm"]["delta"] == pytest.approx(cal["scores"]["hm"] - base["scores"]["hm"])
    for g in GROUPS:
        assert d[f"group_{g}"]["delta"] == pytest.approx(cal["scores"]["groups"][g] - base["scores"]["groups"][g])
    for row in (cal, again):  # every interval holds its point estimate
        for e in _entries(row).values():
            lo, hi = e["ci"]
            assert lo - 1e-12 <= e["delta"] <= hi + 1e-12
    # the scores are those of the single-export eval (same data loading, encoder and metrics)
    single = tmp_path / "single"
    assert main(["eval", str(setup["uncal"]), "--data", str(setup["data"]), "--out", str(single), "--no-cache",
                 "--no-plots"]) == 0
    uncal_row = json.loads((single / "results.json").read_text())["rows"][0]
    assert uncal_row["label"] == "uncalibrated" and uncal_row["scores"] == base["scores"]


def test_same_seed_reproduces_and_another_seed_differs(setup, tmp_path):
    runs = [_compare(setup, tmp_path / f"o{i}", "uncal", "cal", extra=("--seed", s, "--bootstrap", "300",
                                                                       "--no-plots"))
            for i, s in enumerate(("7", "7", "8"))]
    first, same, other = (r["rows"][1]["delta"] for r in runs)
    assert first == same
    assert any(first[k]["ci"] != other[k]["ci"] for k in first if "ci" in (first[k] or {}))
    assert runs[0]["bootstrap"]["seed"] == 7 and runs[0]["bootstrap"]["resamples"] == 300


def test_compare_on_the_real_prose_example_set(setup, tmp_path):
    """--make-posq-example builds the set with the baseline export's tokenizer, then compares on it."""
    ex, out = tmp_path / "ex", tmp_path / "out"
    assert main(["eval", "--compare", str(setup["uncal"]), str(setup["cal"]), "--make-posq-example", str(ex),
                 "--max-passages", "12", "--bootstrap", "100", "--no-plots", "--no-cache", "--out", str(out)]) == 0
    manifest = json.loads((ex / "posq.json").read_text())
    res = json.loads((out / "results.json").read_text())
    assert manifest["tokenizer"]["model"] == str(setup["uncal"])
    assert res["dataset"]["passages"] == manifest["counts"]["passages"] == 12
    assert res["dataset"]["queries"] == manifest["counts"]["queries"]


def test_paired_bootstrap_keeps_groups_and_pairs_resamples():
    rng = np.random.default_rng(0)
    labels = ["begin"] * 5 + ["middle"] * 3 + ["end"] * 4
    res = draw_resamples(labels, GROUPS, 50, seed=1)
    assert [idx.shape for idx in res.indices] == [(50, 5), (50, 3), (50, 4)]
    for g, idx in zip(res.groups, res.indices):
        assert {labels[i] for i in idx.ravel()} == {g}  # resampled within the group
    values = rng.random(len(labels))
    zero = paired_deltas(values, values, {"hm": 0.0}, res)
    assert all(e["ci"] == [0.0, 0.0] and e["undefined"] == 0 for e in zero.values())
    shifted = paired_deltas(values + 0.1, values, {}, res)  # a constant shift: every group mean moves by it
    for g in GROUPS:
        assert shifted[f"group_{g}"]["ci"] == pytest.approx([0.1, 0.1])
    with pytest.raises(ValueError, match="--bootstrap must be >= 1"):
        draw_resamples(labels, GROUPS, 0, seed=1)


def test_labels_say_calibration_and_precision():
    plain = {"calibrated": False}
    assert precision_of(plain) == "fp32"
    assert precision_of({"fp16": True}) == "fp16"
    assert precision_of({"quantization": {"precision": "int8", "method": "x"}}) == "int8"
    cal = {"calibrated": True, "config": CalibrationConfig(strength=0.5, basket_size=64, pooling="mean").to_dict(),
           "quantization": {"precision": "int8"}}
    labels = export_labels(["a", "a", "b"], ["x/a", "y/a", "b"], [plain, plain, cal])
    assert labels == ["x/a (uncalibrated, fp32)", "y/a (uncalibrated, fp32)", "b (calibrated λ=0.5 basket=64, int8)"]
    assert export_labels(["a", "a"], ["a", "a"], [plain, plain])[1].endswith("#2")


def test_queries_are_borrowed_when_calibration_would_reach_them(setup, tmp_path, capsys):
    """A basket shorter than the queries: the calibrated export would calibrate them, so they come from the
    uncalibrated export of the same source model; without one, or with one of another dimension, a clear error."""
    from attncal.synthetic import save_synthetic_model

    short = _export(setup["model"], tmp_path / "cal16", CalibrationConfig(strength=1.0, basket_size=16))
    setup = dict(setup, short=short)
    res = _compare(setup, tmp_path / "out", "short", "uncal", extra=("--no-plots", "--bootstrap", "50"))
    assert res["rows"][0]["queries_encoded_by"] == res["rows"][1]["label"]
    assert any("queries are encoded by" in n for n in res["notes"])
    err = _error(["--compare", str(short), str(setup["cal"]), "--data", str(setup["data"])], capsys)
    assert "would change the queries" in err and "no uncalibrated export" in err
    # the model directory changed between the exports: same source path, another embedding dimension
    model = save_synthetic_model("bert", tmp_path / "m", seed=2, max_positions=256)
    small = _export(model, tmp_path / "small", None)
    save_synthetic_model("bert", model, seed=2, max_positions=256, hidden=48)
    wide = _export(model, tmp_path / "wide", CalibrationConfig(strength=1.0, basket_size=16))
    err = _error(["--compare", str(small), str(wide), "--data", str(setup["data"])], capsys)
    assert re.search(r"differ in embedding dimension \(48 vs 32\)", err)


# --------------------------------------------------------------------------- errors
def _error(argv: list[str], capsys) -> str:
    """The one stderr line of a failing `attncal eval` (exit status 2)."""
    capsys.readouterr()
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("attncal eval: error: "), err
    return err


@pytest.mark.parametrize("argv, message", [
    (["--compare", "{uncal}"], r"--compare needs at least 2 exports"),
    (["--compare", "{uncal}", "{model}"], r"attncal\.json: missing: this is not an attncal export"),
    (["--compare", "{uncal}", "{tmp}/nowhere"], r"nowhere: export directory not found"),
    (["--compare", "{uncal}", "{cal}", "--configs", "{tmp}/g.yaml"], r"does not take --configs"),
    (["--compare", "{uncal}", "{cal}", "--strength", "0.5"], r"does not take --strength"),
    (["--compare", "{uncal}", "{cal}", "--baselines", "sea"], r"does not take --baselines"),
    (["default", "--compare", "{uncal}", "{cal}"], r"does not take MODEL"),
    (["--compare", "{uncal}", "{cal}", "--bootstrap", "0"], r"--bootstrap must be >= 1"),
    (["--compare", "{uncal}", "{model}", "--make-posq-example", "{tmp}/ex"], r"not an attncal export"),
])
def test_errors_are_one_line_and_leave_nothing_behind(setup, tmp_path, capsys, argv, message):
    fill = {k: str(v) for k, v in setup.items()} | {"tmp": str(tmp_path)}
    argv = [a.format(**fill) for a in argv]
    if "--make-posq-example" not in argv:
        argv += ["--data", str(setup["data"])]
    (tmp_path / "g.yaml").write_text("- strength: 0.5\n")
    rc = main(["eval", *argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and err.startswith("attncal eval: error: "), err
    assert re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.yaml"]  # no OUT, no set, no temporary directory


def test_non_empty_out_is_refused_and_kept(setup, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("kept")
    rc = main(["eval", "--compare", str(setup["uncal"]), str(setup["cal"]), "--data", str(setup["data"]),
               "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "pass --overwrite" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
