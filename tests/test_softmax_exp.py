"""The softmax's exp of the native CPU kernels (plugins/kernels/cpu/exp.h) on its own, in vector steps
and in the scalar tail, against exp in double, special values included (tests/cpp/exp_row_test.cpp).  Built with
the instruction-set paths (plugins/kernels/cpu/isa.h), run under every path this CPU runs, and without them (the
baseline 8-lane form)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from support.cpu import run_on_each_path

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++)")
@pytest.mark.parametrize("defines", [[], ["-DATTNCAL_NO_CLONES"]], ids=["dispatched", "no-clones"])
def test_exp_row_matches_double_exp_in_lanes_and_tail(tmp_path, defines):
    exe = tmp_path / "exp_row_test"
    # The library's flags (CMake: -O3, gnu++17).
    subprocess.run(["g++", "-std=gnu++17", "-O3", "-Wall", "-Wextra", "-Werror", *defines,
                    "-I", str(REPO / "plugins" / "kernels"),
                    "-o", str(exe), str(REPO / "tests" / "cpp" / "exp_row_test.cpp")], check=True)
    for path, res in run_on_each_path([str(exe)], every=not defines):
        assert res.returncode == 0, (path, res.stdout + res.stderr)
        assert "40034 values checked" in res.stdout and " 0 failure(s)" in res.stdout, (path, res.stdout)


_NEEDS_OBJDUMP = pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("objdump") is None or platform.machine() != "x86_64",
    reason="needs g++ and objdump on x86-64")


def _compile(tmp_path: Path, source: str) -> Path:
    """An object of `source` built with the library's flags (CMake: -O3, gnu++17)."""
    src = tmp_path / "probe.cpp"
    src.write_text(source)
    obj = tmp_path / "probe.o"
    subprocess.run(["g++", "-std=gnu++17", "-O3", "-c", "-I", str(REPO / "plugins" / "kernels"),
                    "-o", str(obj), str(src)], check=True)
    return obj


def _disassemble(obj: Path, symbol: str) -> str:
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--disassemble={symbol}", str(obj)],
                         capture_output=True, text=True, check=True).stdout
    assert f"<{symbol}>:" in asm, f"no {symbol} in the object"
    return asm


@_NEEDS_OBJDUMP
def test_avx2_exp_is_vectorised_with_fma(tmp_path):
    """GCC 12 compiled the scalar exp loop one float at a time for AVX2 (it if-converts its selects only with
    AVX-512's masks): on an AVX2-only Zen 3 that made the native graph 1.10-1.32x `ort-opt` instead of
    0.99-1.07x.  The AVX2 version of the row's exp must use 256-bit registers, and fused multiply-adds: a
    `target("avx2")` version has no FMA (AVX2 does not imply it), and its polynomial ran ~30 % slower there."""
    obj = _compile(tmp_path, "#include \"cpu/exp.h\"\n"
                             "void use(const float* x, float* y, int64_t n, float m) { attncal::exp_shifted_row(x, y, n, m); }\n")
    asm = _disassemble(obj, "_ZN7attncalL20exp_shifted_row_avx2EPKfPflf")
    assert asm.count("%ymm") >= 8, asm
    assert asm.count("vfmadd") >= 6, asm  # the degree-6 polynomial at least


@_NEEDS_OBJDUMP
@pytest.mark.parametrize("function", ["softmax_calibrate_row_f32", "calibrate_row_f32"])
def test_row_routines_have_an_avx2_version(tmp_path, function):
    """The per-row softmax + calibration and the calibration alone sum their baskets in 8-float vectors.  As
    plain inline functions they were compiled for baseline x86-64 only, where GCC lowers a 32-byte vector
    to two SSE halves kept on the stack: the row sums ran at 0.55 ns a key instead of 0.11, and the
    calibrated attention op spent 1.8 ns a key on a row instead of 1.0-1.4 (Zen 3, K = 512).  Each must have
    an AVX2 version (the AVX2 path's) that works in 256-bit registers."""
    obj = _compile(tmp_path, "#include \"cpu/row_calibration.h\"\n"
                             "void use(const float* x, float* y, int64_t K, int64_t q, const attncal::ItemPlan& it,\n"
                             "         const float* keep, const AttncalParams& p, attncal::Scratch& sc) {\n"
                             "  attncal::softmax_calibrate_row(x, y, K, q, it, keep, p, sc);\n"
                             "  attncal::calibrate_row(x, y, K, q, it, keep, p, sc);\n"
                             "}\n")
    name = f"{function}_avx2"  # (x, y, K, q, item plan, keep, params, scratch): q is the row, for marked rows
    asm = _disassemble(obj, f"_ZN7attncalL{len(name)}{name}EPKfPfllRKNS_8ItemPlanES1_RK13AttncalParamsRNS_7ScratchE")
    assert asm.count("%ymm") >= 8, asm
