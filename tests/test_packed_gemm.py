"""The packed-weight projection GEMM (plugins/kernels/cpu/packed_gemm.h) on its own: both micro-kernels
(AVX-512 and AVX2, each where this CPU runs it) against a float64 reference on shapes that cut every
block short, and identical results whichever row and panel tiles compute them; the accumulating form without a
bias (the attention kernel's context over key tiles), a row alone equal to the same row among others
(tests/cpp/packed_gemm_test.cpp).  The ONNX Runtime ops that use it are tested in test_projected_attention.py and
test_calibrated_attention_kernel.py."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def packed_kernels() -> int:
    """How many packed micro-kernels this machine runs (AVX-512 and AVX2+FMA on x86-64; none elsewhere)."""
    if platform.machine() != "x86_64":
        return 0
    flags = cpu_flags()
    return int("avx512f" in flags) + int({"avx2", "fma"} <= flags)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++)")
def test_packed_gemm_kernels_match_reference_and_tiling(tmp_path):
    exe = tmp_path / "packed_gemm_test"
    # The library's flags (CMake: -O3, gnu++17, so that GCC contracts the multiply-adds into FMAs as there).
    subprocess.run(["g++", "-std=gnu++17", "-O3", "-Wall", "-Wextra", "-Werror",
                    "-I", str(REPO / "plugins" / "kernels"),
                    "-o", str(exe), str(REPO / "tests" / "cpp" / "packed_gemm_test.cpp")], check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{packed_kernels()} kernel(s) tested, 0 failure(s)" in res.stdout, res.stdout
