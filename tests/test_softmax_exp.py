"""The softmax's exp of the native CPU kernels (plugins/kernels/calibration_cpu.h) on its own, in vector steps
and in the scalar tail, against exp in double, special values included (tests/cpp/exp_row_test.cpp).  Built with
the versions picked at load time (AVX-512 / AVX2 / baseline, whichever this CPU runs) and without them
(the baseline 8-lane form)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++)")
@pytest.mark.parametrize("defines", [[], ["-DATTNCAL_NO_CLONES"]], ids=["dispatched", "no-clones"])
def test_exp_row_matches_double_exp_in_lanes_and_tail(tmp_path, defines):
    exe = tmp_path / "exp_row_test"
    # The library's flags (CMake: -O3, gnu++17).
    subprocess.run(["g++", "-std=gnu++17", "-O3", "-Wall", "-Wextra", "-Werror", *defines,
                    "-I", str(REPO / "plugins" / "kernels"),
                    "-o", str(exe), str(REPO / "tests" / "cpp" / "exp_row_test.cpp")], check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "40034 values checked" in res.stdout and " 0 failure(s)" in res.stdout, res.stdout
