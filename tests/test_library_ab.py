"""benchmarks/library_ab.py: two builds of the native library on one export's native graph, interleaved."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import library_ab  # noqa: E402

from attncal import ExportOptions, export  # noqa: E402
from attncal.synthetic import save_synthetic_model  # noqa: E402
from test_native_kernel import library  # noqa: E402,F401  (the built-library fixture)

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options


def test_library_ab_runs_both_builds_and_the_baseline(tmp_path, library, capsys):  # noqa: F811
    src = save_synthetic_model("bert", tmp_path / "src", seed=3, pooling="mean", max_positions=256)
    out = tmp_path / "cal"
    export(src, out, ExportOptions(check=False, exporter="torchscript"), quiet=True)
    # The same build under two names: identical embeddings, and every session timed at every length.
    rows = library_ab.run(out, {"a": library, "b": library}, baseline=out / "onnx" / "model_optimized.onnx",
                          seqs=[32, 200], batch=2, repeats=3, threads=1)
    assert [r["seq"] for r in rows] == [32, 200]
    for r in rows:
        assert set(r["median_ms"]) == {"a", "b", "baseline"} and min(r["median_ms"].values()) > 0
        assert r["vs_first"]["a"] == 1.0 and r["vs_first"]["b"] > 0 and r["vs_baseline"]["b"] > 0
        assert r["max_abs_diff"] == 0.0
    assert library_ab.main([str(out), "--lib", f"a={library}", "--lib", f"b={library}", "--seq", "16",
                            "--batch", "1", "--repeats", "1", "--threads", "1"]) == 0
    assert "1 x 16: a " in capsys.readouterr().out
    # Two exports of one model under one build: b runs the other export's graph (here uncalibrated).
    plain = tmp_path / "plain"
    export(src, plain, ExportOptions(check=False, exporter="torchscript", calibrate=False), quiet=True)
    rows = library_ab.run(out, {"a": library, "b": library}, exports={"b": plain}, seqs=[200], batch=2, repeats=2,
                          threads=1)
    assert rows[0]["max_abs_diff"] > 1e-4, "b ran the uncalibrated export's graph"


@pytest.mark.parametrize("args, message", [
    (["--lib", "a=/nonexistent.so", "--lib", "b=/nonexistent.so"], "--lib a: no library at /nonexistent.so"),
    (["--lib", "nameonly"], "--lib takes NAME=PATH, got 'nameonly'"),
    (["--lib", "a={lib}"], "give at least two --lib NAME=PATH with different names"),
    (["--lib", "a={lib}", "--lib", "b={lib}", "--seq", "12,x"], "--seq takes comma-separated integers"),
    (["--lib", "a={lib}", "--lib", "b={lib}", "--repeats", "0"], "must be >= 1, got 0"),
    (["--lib", "a={lib}", "--lib", "b={lib}"], "model_optimized_native.onnx does not exist"),
    (["--lib", "a={lib}", "--lib", "b={lib}", "--export-of", "c=/"], "--export-of names a build that no --lib gives: c"),
    (["--lib", "a={lib}", "--lib", "b={lib}", "--export-of", "b=/nonexistent"], "--export-of b: no directory at"),
])
def test_library_ab_rejects_bad_arguments(tmp_path, capsys, args, message):
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"")
    with pytest.raises(SystemExit) as exc:
        library_ab.main([str(tmp_path), *[a.format(lib=lib) for a in args]])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
