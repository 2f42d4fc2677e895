"""The softmax's exp of the native CPU kernels (plugins/kernels/calibration_cpu.h) on its own, in vector steps
and in the scalar tail, against exp in double, special values included (tests/cpp/exp_row_test.cpp).  Built with
the versions picked at load time (AVX-512 / AVX2 / baseline, whichever this CPU runs) and without them
(the baseline 8-lane form)."""

from __future__ import annotations

import platform
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


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("objdump") is None or platform.machine() != "x86_64",
                    reason="needs g++ and objdump on x86-64")
def test_avx2_exp_is_vectorised(tmp_path):
    """GCC 12 compiled the scalar exp loop one float at a time for AVX2 (it if-converts its selects only with
    AVX-512's masks): on an AVX2-only Zen 3 that made the native graph 1.10-1.32x `ort-opt` instead of
    0.99-1.07x.  The AVX2 version of the row's exp must use 256-bit registers."""
    obj = tmp_path / "exp_row_test.o"
    subprocess.run(["g++", "-std=gnu++17", "-O3", "-c", "-I", str(REPO / "plugins" / "kernels"),
                    "-o", str(obj), str(REPO / "tests" / "cpp" / "exp_row_test.cpp")], check=True)
    symbol = "_ZN7attncalL15exp_shifted_rowEPKfPflf.avx2"
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--disassemble={symbol}", str(obj)],
                         capture_output=True, text=True, check=True).stdout
    assert f"<{symbol}>:" in asm, "no AVX2 version of exp_shifted_row in the object"
    assert asm.count("%ymm") >= 8, asm
