"""benchmarks/gemm_shapes.sh: the attention kernel's GEMM shapes timed per backend.  Here with OpenBLAS and the
built-in loops (MKL and oneDNN need a prefix with their wheels): it builds, times every shape, and every
backend computes what OpenBLAS computes; a prefix without the libraries is refused in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gemm_shapes.sh"
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the benchmark")


def run(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("scipy_openblas32")
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})


def test_every_shape_is_timed_and_agrees_with_openblas():
    proc = run("", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [ln for ln in proc.stdout.splitlines() if " NT " in ln or " NN " in ln]
    assert len(rows) == 10
    for row in rows:
        *_, openblas, builtin, ratio, diff = row.split()
        assert float(openblas) > 0 and float(builtin) > 0 and float(ratio) > 0
        assert float(diff) <= 1e-4, row


def test_a_prefix_without_the_libraries_is_refused(tmp_path):
    proc = run(str(tmp_path), "1")
    assert proc.returncode == 2 and proc.stderr.strip() == f"gemm_shapes.sh: no libmkl_rt in {tmp_path}/lib"
