"""The CPU attention kernel's shared store of packed key tiles (plugins/kernels/cpu/calibrated_attention.h,
`AttentionPlan::share_tiles`) on its own: the same bits as units that pack their own tiles, whichever unit packs
a tile first, and a store only for shapes whose tiles serve several units (tests/cpp/attention_tile_store_test.cpp).
Through ONNX Runtime, where the kernel takes its store from the session's arena, the oracle and thread-count
tests of test_calibrated_attention_kernel.py cover it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from support.cpu import run_on_each_path

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++)")
def test_shared_tiles_give_the_bits_of_unshared_ones_in_any_order(tmp_path):
    exe = tmp_path / "attention_tile_store_test"
    # The library's flags (CMake: -O3, gnu++17), with the built-in GEMM: the tiles run on the packed kernel.
    subprocess.run(["g++", "-std=gnu++17", "-O3", "-Wall", "-Wextra", "-Werror", "-pthread",
                    "-I", str(REPO / "plugins" / "kernels"), "-I", str(REPO / "benchmarks"),
                    "-o", str(exe), str(REPO / "tests" / "cpp" / "attention_tile_store_test.cpp")], check=True)
    for path, res in run_on_each_path([str(exe)]):  # each path's panels: 32 keys wide, or 16
        assert res.returncode == 0, (path, res.stdout + res.stderr)
        lines = res.stdout.splitlines()
        assert lines[-1] == "0 failure(s)", (path, res.stdout)
        stores = [int(line.split()[2]) for line in lines[:-1]]  # each case's store, checked there against its shape
        assert len(stores) == 6 and min(stores) == 0 < max(stores), (path, res.stdout)
