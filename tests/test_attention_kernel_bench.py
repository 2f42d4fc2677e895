"""benchmarks/attention_kernel.py: the CPU attention kernel alone, kernel trees side by side.  Built and run on
the smallest shape with one tree under two names (the same bits, a ratio near 1), and its refusals."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("attention_kernel", REPO / "benchmarks" / "attention_kernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++)")
def test_one_tree_under_two_names_gives_the_same_bits(capsys):
    pytest.importorskip("scipy_openblas32")
    tree = REPO / "plugins" / "kernels"
    assert _module().main(["--kernels", f"a={tree}", "--kernels", f"b={tree}", "--shapes", "minilm-512",
                           "--rounds", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| shape | a ms | b ms | b / a | same bits |"
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[0] == "minilm-512" and float(cells[1]) > 0 and float(cells[2]) > 0 and cells[4] == "yes"


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++)")
def test_poolings_are_columns_side_by_side(capsys):
    """`--poolings cls,landmark`: the same build calibrated both ways, a column each, the ratio to the first (timed
    by CPU time, `--clock cpu`)."""
    pytest.importorskip("scipy_openblas32")
    args = ["--shapes", "minilm-512", "--poolings", "cls,landmark", "--rounds", "1", "--clock", "cpu"]
    assert _module().main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| shape | cls ms | landmark ms | landmark / cls | same bits per pooling |"
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[0] == "minilm-512" and float(cells[1]) > 0 and float(cells[2]) > 0 and cells[4] == "yes"
    assert float(cells[3]) == pytest.approx(float(cells[2]) / float(cells[1]), rel=0.05)


@pytest.mark.parametrize("args,message", [
    (["--poolings", "max"], "unknown pooling(s) ['max']; use off, mean, cls, landmark"),
    (["--kernels", "nope"], "is not NAME=DIR"),
    (["--kernels", f"a={REPO}"], "is not NAME=DIR"),
    (["--shapes", "bert-huge"], "unknown shape(s) ['bert-huge']"),
    (["--rounds", "0"], "--rounds must be >= 1"),
])
def test_bad_arguments_are_refused_with_the_reason(capsys, args, message):
    assert _module().main(args) == 2
    assert message in capsys.readouterr().err
