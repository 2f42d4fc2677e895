"""The CPU kernels' host tests (tests/cpp) built for arm64 with Debian's cross compiler and run under QEMU's user-mode
emulation: what an arm64 user gets is the default instruction-set path (plugins/kernels/cpu/isa.h), compiled for
the build's target (GCC's vector extensions lower to NEON), with the default path's packed micro-kernel.  The tile
store's test is built, not run here: it takes minutes under emulation (it passes there; docs/native-kernels.md)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64-static"

pytestmark = pytest.mark.skipif(shutil.which(CXX) is None or shutil.which(QEMU) is None,
                                reason=f"needs {CXX} and {QEMU} (Debian: g++-aarch64-linux-gnu, qemu-user-static)")


def build(tmp_path: Path, name: str) -> Path:
    """tests/cpp/<name>.cpp for arm64, static (QEMU then needs no arm64 libraries), with the library's flags."""
    exe = tmp_path / f"{name}.arm64"
    subprocess.run([CXX, "-std=gnu++17", "-O3", "-Wall", "-Wextra", "-Werror", "-pthread", "-static",
                    "-I", str(REPO / "plugins" / "kernels"), "-I", str(REPO / "benchmarks"),
                    "-o", str(exe), str(REPO / "tests" / "cpp" / f"{name}.cpp")], check=True)
    return exe


@pytest.mark.parametrize("name,expect", [
    ("exp_row_test", "40034 values checked"),
    ("packed_gemm_test", "1 kernel(s) tested, 0 failure(s)"),  # the default path's panels of 16
    ("landmark_rows_test", "rows checked"),
])
def test_kernel_host_tests_pass_on_arm64(tmp_path, name, expect):
    res = subprocess.run([QEMU, str(build(tmp_path, name))], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and expect in res.stdout and " 0 failure(s)" in res.stdout, res.stdout + res.stderr


def test_the_tile_store_builds_for_arm64(tmp_path):
    exe = build(tmp_path, "attention_tile_store_test")
    assert exe.read_bytes()[:4] == b"\x7fELF" and exe.read_bytes()[18] == 183  # e_machine EM_AARCH64
