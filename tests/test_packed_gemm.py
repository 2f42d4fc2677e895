"""The packed-weight projection GEMM (plugins/kernels/cpu/packed_gemm.h) on its own: the micro-kernels
(AVX-512, AVX2 and the default path's, under every instruction-set path this CPU runs) against a float64 reference on shapes that cut every
block short, and identical results whichever row and panel tiles compute them; the accumulating form without a
bias (the attention kernel's context over key tiles), a row alone equal to the same row among others
(tests/cpp/packed_gemm_test.cpp).  The ONNX Runtime ops that use it are tested in test_projected_attention.py and
test_calibrated_attention_kernel.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from support.cpu import run_on_each_path

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++)")
def test_packed_gemm_kernels_match_reference_and_tiling(tmp_path):
    exe = tmp_path / "packed_gemm_test"
    # The library's flags (CMake: -O3, gnu++17, so that GCC contracts the multiply-adds into FMAs as there).
    subprocess.run(["g++", "-std=gnu++17", "-O3", "-Wall", "-Wextra", "-Werror",
                    "-I", str(REPO / "plugins" / "kernels"),
                    "-o", str(exe), str(REPO / "tests" / "cpp" / "packed_gemm_test.cpp")], check=True)
    for path, res in run_on_each_path([str(exe)]):
        assert res.returncode == 0, (path, res.stdout + res.stderr)
        kernels = 2 if path == "avx512" else 1  # AVX-512 runs panels of 32 and of 16; the others of 16
        assert f"{kernels} kernel(s) tested, 0 failure(s)" in res.stdout, (path, res.stdout)
