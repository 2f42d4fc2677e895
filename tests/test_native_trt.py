"""The TensorRT plugin (plugins/tensorrt/) compiled against both public TensorRT header
sets (10.5.0, the version in Triton 24.10, and 11.1) named by $ATTNCAL_TENSORRT_HEADERS (the one
setting the CMake build reads too; see attncal.runtime.oplib.tensorrt_headers),
linked with the CUDA launchers (the checkout build's libattncal_cuda.so, nvcc compiling them once for the
suite) or, without nvcc, a test-only launcher stub, and its
host test (tests/cpp/trt_plugin_host_test.cpp) run for the four op types (PooledRowCalibration,
AllRowsCalibration, SoftmaxPooledRowCalibration, SoftmaxAllRowsCalibration): creators (8: 4 ops x
namespaces "" and "ai.attncal"), field parsing (with the refusals of the shared attribute parser:
a missing field with a stray or duplicated one in its place, misspelt, ill-typed and foreign fields,
each report naming the field), output types and shapes, format combinations, the
IPluginV3OneBuildV2 build interface with output 0 aliased to input 0, serialisation round trip,
clone, a clean enqueue error without a GPU and the launcher each op type dispatches to.  The
calibrated attention plugin (plugins/tensorrt/attncal_trt_attention_plugin.cpp, ops
PooledRowCalibratedAttention and AllRowsCalibratedAttention) is built as CMake builds the library,
with the calibration plugin and ATTNCAL_TRT_WITH_ATTENTION (one getCreators, 12 creators), and host
tested by tests/cpp/trt_attention_host_test.cpp: creators and field names, attribute parsing and
refusals (num_heads, scale), the attribute round trip, output types (float, half, bfloat16) and
shapes, format combinations, run-time shape refusals, workspace size, a clean enqueue error; and the
relative position bias (relative_max_distance and the fifth input, the bias table): accepted, refused,
serialised, and the table's type, shape, format and workspace checks.  No
libnvinfer: the test binaries provide getPluginRegistry.  The headers are read in place, never
copied into the repository; without the setting the tests skip and say how to provide them.

Also here, needing only g++: the host test of the CUDA launchers' shared-memory choices
(plugins/kernels/cuda/launch_config.h; tests/cpp/launch_config_test.cpp), which both plugins' launchers
make before every launch; and, with nvcc, the calibrated attention launcher's argument checks for the
geometry (grouped key/value heads, windows, the relative position bias), which run before anything
touches a device."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from attncal.runtime import oplib

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("10.5.0", "11.1")
CPP = ROOT / "tests" / "cpp"
KERNELS = ROOT / "plugins" / "kernels"


def _cuda_home(nvcc: str) -> Path | None:
    """The toolkit root holding include/cuda_runtime_api.h (nvcc may be a wrapper script)."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), Path(nvcc).resolve().parents[1],
             "/usr/local/cuda"]
    try:  # a wrapper: ask nvcc itself where it lives
        out = subprocess.run([nvcc, "--dryrun", "--version"], capture_output=True, text=True, timeout=30).stderr
        cands += [line.split("=", 1)[1].strip().rstrip("/").rsplit("/bin", 1)[0]
                  for line in out.splitlines() if "_NVVM_BRANCH_=" not in line and "TOP=" in line]
    except (OSError, subprocess.SubprocessError):
        pass
    for c in cands:
        if c and (Path(c) / "include" / "cuda_runtime_api.h").is_file():
            return Path(c)
    return None


@pytest.fixture(scope="module")
def launcher() -> tuple[list[str], list[str]]:
    """(objects/sources/libraries, extra compile+link flags) providing the attncal_cuda_* launchers: the
    calibration ops' and the calibrated attention ops' (both plugins link them).  With nvcc, the checkout's
    build's libattncal_cuda.so (oplib.build_library: nvcc compiles the launchers once for the suite); without,
    the test stubs."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler (g++)")
    nvcc = oplib.find_nvcc()
    if nvcc is None:
        return ([str(CPP / "no_cuda" / "launcher_stub.cpp"), str(CPP / "no_cuda" / "attention_launcher_stub.cpp")],
                ["-I", str(CPP / "no_cuda")])
    cuda = _cuda_home(nvcc)
    if cuda is None:
        pytest.fail(f"nvcc at {nvcc} but no cuda_runtime_api.h found (set CUDA_HOME)")
    cuda_lib = oplib.build_library().parent / oplib.CUDA_LIBRARY
    assert cuda_lib.is_file(), f"nvcc is installed but the build made no {cuda_lib}"
    lib_dirs = [d for d in (cuda / "lib64", cuda / "lib", cuda / "targets/x86_64-linux/lib") if d.is_dir()]
    return [str(cuda_lib)], [f"-Wl,-rpath,{cuda_lib.parent}", "-I", str(cuda / "include"),
                             *[f"-L{d}" for d in lib_dirs], "-lcudart_static", "-ldl", "-lrt", "-lpthread"]


def _build_and_run(cmd: list[str], exe: Path) -> str:
    """Compile `cmd` (which writes `exe`), run it, return its stdout; fail with the compiler's or the
    binary's output."""
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"compile failed:\n{' '.join(cmd)}\n{build.stderr[-4000:]}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.parametrize("version", VERSIONS)
def test_trt_plugin_host(version, request, tmp_path):
    headers = oplib.tensorrt_headers(version)  # a set that is named but missing fails, never skips
    if headers is None:
        pytest.skip(f"TensorRT headers not given: {oplib.TENSORRT_HEADERS_HELP}")
    objs, flags = request.getfixturevalue("launcher")  # only now: nvcc is slow, and pointless for a skip
    exe = tmp_path / f"trt_host_{version}"
    cmd = ["g++", "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-deprecated-declarations", "-I", str(headers),
           "-I", str(KERNELS), str(CPP / "trt_plugin_host_test.cpp"), str(ROOT / "plugins/tensorrt/attncal_trt_plugin.cpp"),
           *objs, "-o", str(exe), *flags]
    out = _build_and_run(cmd, exe)
    assert f"TensorRT headers {version.split('.')[0]}." in out
    assert "OK:" in out and "clean error" in out
    assert "= 8, version 1" in out  # 4 op types x 2 namespaces
    for op in ("PooledRowCalibration", "AllRowsCalibration", "SoftmaxPooledRowCalibration",
               "SoftmaxAllRowsCalibration"):
        assert f"{op}: build interface PLUGIN_V3ONE_BUILD 2.0, getAliasedInput(0) = 0" in out
    assert "Softmax* ops -> softmax launcher" in out
    assert "malformed fields (4 ops)" in out
    assert "missing attribute 'strength'; attribute this op does not take: 'pool_last'" in out


@pytest.mark.parametrize("version", VERSIONS)
def test_trt_attention_plugin_host(version, request, tmp_path):
    """The calibrated attention plugin, built as CMake builds libattncal_trt_plugin.so (both plugin
    files, ATTNCAL_TRT_WITH_ATTENTION), host-tested against each header set."""
    headers = oplib.tensorrt_headers(version)
    if headers is None:
        pytest.skip(f"TensorRT headers not given: {oplib.TENSORRT_HEADERS_HELP}")
    objs, flags = request.getfixturevalue("launcher")
    exe = tmp_path / f"trt_attention_{version}"
    cmd = ["g++", "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-deprecated-declarations",
           "-DATTNCAL_TRT_WITH_ATTENTION", "-I", str(headers), "-I", str(KERNELS),
           str(CPP / "trt_attention_host_test.cpp"), str(ROOT / "plugins/tensorrt/attncal_trt_plugin.cpp"),
           str(ROOT / "plugins/tensorrt/attncal_trt_attention_plugin.cpp"), *objs, "-o", str(exe), *flags]
    out = _build_and_run(cmd, exe)
    assert f"TensorRT headers {version.split('.')[0]}." in out
    assert "OK:" in out
    assert "attention creators: 12 listed" in out
    assert "refused" in out and "round trip" in out
    assert "GQA, windows and relative_max_distance accepted, an invalid geometry refused" in out
    assert "the geometry included (relative_max_distance too)" in out
    assert "attention malformed fields (2 ops)" in out and "missing attribute 'strength'" in out
    for op in ("PooledRowCalibratedAttention", "AllRowsCalibratedAttention"):
        assert f"{op}: output types (float, half, bf16 -> same), shape [q0, q1, v2], 3 of 8 format combinations" in out
        assert any(line.startswith(f"{op}: output types") and line.endswith("GQA and window shapes ok")
                   for line in out.splitlines()), out
        for strength in ("0.5", "0.0"):
            assert f"{op} (strength {strength}): enqueue without a GPU: returned" in out
        assert f"{op} (relative bias): enqueue without a GPU: returned" in out
        assert (f"{op} relative_bias: the fifth input exactly with relative_max_distance, of query's type (float, "
                "half, bf16), shape [num_buckets, N], workspace") in out
    assert out.count("clean error") == 6


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++)")
def test_cuda_launch_config_host(tmp_path):
    """The tiled attention kernel's configuration for the shared-memory opt-in limits of sm_80, sm_86,
    sm_89 and sm_90, head sizes 32..256 and every dtype: it fits, it is the largest that fits, sm_80 and
    sm_90 keep the kernel's designed configuration and sm_86 / sm_89 never fall back to the per-row
    kernel for a head the tiled kernel serves; the per-row and calibration kernels fit any shape."""
    exe = tmp_path / "launch_config_test"
    cmd = ["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I", str(KERNELS),
           str(CPP / "launch_config_test.cpp"), "-o", str(exe)]
    out = _build_and_run(cmd, exe)
    m = re.search(r"^(\d+) choices checked, 0 failure\(s\)$", out, re.M)
    assert m, out
    assert int(m.group(1)) > 4 * 3 * 225 * 2, out  # every device, dtype, head size and block class at least


# Calls the calibrated attention launchers with an empty batch (B = 0: checked, then nothing to launch, so no
# device is touched) for each geometry; prints one line per call: its name, the status and the error message.
# The relative position bias: `md` is relative_max_distance, `buckets` the table's rows (0 = no table; the
# table pointer is NULL, which an empty batch never reads).
GEOMETRY_CHECKS_CPP = r"""
#include <cstdio>
#include "cuda/calibrated_attention_cuda.h"

static void call(const char* what, int kv, int left, int right, long long S_q, int all_rows, int md = 0,
                 long long buckets = 0) {
  AttncalParams p{};
  p.all_rows = all_rows;
  p.basket_size = 2;
  p.strength = 0.5f;
  p.num_heads = 4;
  p.num_kv_heads = kv;
  p.window_left = left;
  p.window_right = right;
  p.relative_max_distance = md;
  for (int reference = 0; reference < 2; ++reference) {
    const int rc =
        reference ? attncal_cuda_calibrated_attention_reference(0, nullptr, nullptr, nullptr, nullptr, nullptr, 0, S_q,
                                                                8, 4, 16, 16, 0.f, nullptr, buckets, &p, nullptr)
                  : attncal_cuda_calibrated_attention(0, nullptr, nullptr, nullptr, nullptr, nullptr, 0, S_q, 8, 4, 16,
                                                      16, 0.f, nullptr, buckets, &p, nullptr, nullptr);
    std::printf("%s%s: %d %s\n", what, reference ? " (reference)" : "", rc, attncal_cuda_last_error());
  }
}

int main() {
  call("default", 0, -1, -1, 8, 1);
  call("gqa 2 causal", 2, -1, 0, 8, 1);
  call("mqa sliding", 1, 3, 2, 8, 0);
  call("kv == heads one-sided", 4, 5, -1, 8, 0);
  call("kv 3", 3, -1, -1, 8, 1);
  call("kv -1", -1, -1, -1, 8, 1);
  call("window left -2", 0, -2, -1, 8, 1);
  call("window on one query", 0, -1, 0, 1, 0);
  call("relative 32 buckets", 0, -1, -1, 8, 1, 20, 32);
  call("relative pooled gqa causal", 2, -1, 0, 8, 0, 2, 4);
  call("relative 2 buckets", 0, -1, -1, 8, 1, 20, 2);
  call("relative distance 8 of 32 buckets", 0, -1, -1, 8, 1, 8, 32);
  call("relative on one query", 0, -1, -1, 1, 0, 20, 32);
  call("table without attribute", 0, -1, -1, 8, 1, 0, 32);
  call("attribute without table", 0, -1, -1, 8, 1, 20, 0);
  call("relative distance -1", 0, -1, -1, 8, 1, -1, 0);
  return 0;
}
"""


def test_cuda_launcher_geometry_checks_host(launcher, tmp_path):
    """The calibrated attention launchers (compiled with nvcc, run without a device) accept grouped key/value
    heads, windows and a relative position bias, and refuse an invalid geometry with a one-line message naming
    it, as the CPU side does: num_kv_heads not dividing num_heads, a window bound below -1, a window with
    S_q != S_k; a bias table with too few buckets or a max distance not above num_buckets / 4, with S_q != S_k,
    without relative_max_distance, or relative_max_distance without a table or below 0."""
    objs, flags = launcher
    if not any(o.endswith(".so") for o in objs):
        pytest.skip("nvcc not found: the launchers are a test stub here")
    src = tmp_path / "geometry_checks.cpp"
    src.write_text(GEOMETRY_CHECKS_CPP)
    exe = tmp_path / "geometry_checks"
    cmd = ["g++", "-std=c++17", "-O1", "-Wall", "-Werror", "-I", str(KERNELS), str(src), *objs, "-o", str(exe), *flags]
    out = _build_and_run(cmd, exe)
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    for what in ("default", "gqa 2 causal", "mqa sliding", "kv == heads one-sided", "relative 32 buckets",
                 "relative pooled gqa causal"):
        for name in (what, f"{what} (reference)"):
            assert lines[name].strip() == "0", (name, lines[name])
    refused = {
        "kv 3": "1 num_kv_heads must divide num_heads=4 (0 = num_heads), got 3",
        "kv -1": "1 num_kv_heads must divide num_heads=4 (0 = num_heads), got -1",
        "window left -2": "1 window_left and window_right must be >= 0, or -1 for no limit; got -2 and -1",
        "window on one query": "1 a window (window_left, window_right) needs S_q == S_k, got S_q=1, S_k=8",
        "relative 2 buckets": "1 a relative position bias needs at least 4 buckets and relative_max_distance above "
                              "num_buckets / 4; got 2 buckets and 20",
        "relative distance 8 of 32 buckets": "1 a relative position bias needs at least 4 buckets and "
                                             "relative_max_distance above num_buckets / 4; got 32 buckets and 8",
        "relative on one query": "1 a relative position bias needs S_q == S_k (self-attention); got S_q=1, S_k=8",
        "table without attribute": "1 the relative_bias input needs relative_max_distance > 0",
        "attribute without table": "1 relative_max_distance=20 needs the relative_bias input (the bias table)",
        "relative distance -1": "1 relative_max_distance must be >= 1, or 0 for no relative position bias; got -1",
    }
    for what, expect in refused.items():
        for name in (what, f"{what} (reference)"):
            assert lines[name] == expect, (name, lines[name])
