"""The simulator itself (marker `simt`): its PTX models, each alone against a naive copy or GEMM, and the errors
its runtime must report, each provoked by a small CUDA kernel (tests/simt/runtime_test.cpp, compiled with the
runtime): a divergent __syncthreads, a barrier after threads exited, a deadlock (the timeout names the site), a
shuffle reading a lane outside its mask and one called by a lane outside it, a dynamic shared memory write and a
read past the allocation, a static shared array indexed past its end; and the float16 / bfloat16 conversions against torch's (round to nearest even)."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
import torch

from . import build

pytestmark = pytest.mark.simt


@pytest.fixture(scope="module")
def runtime_test(tmp_path_factory):
    exe = tmp_path_factory.mktemp("simt") / "runtime_test"
    cmd = ["g++", *build.FLAGS, "-I", str(build.SIMT / "include"), "-I", str(build.KERNELS),
           str(build.SIMT / "runtime_test.cpp"), str(build.SIMT / "runtime.cpp"), "-o", str(exe)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]

    def run(*args, timeout_s: str = "60"):
        env = dict(os.environ, SIMT_TIMEOUT_S=timeout_s)
        r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120, env=env)
        return r.returncode, r.stdout + r.stderr

    return run


@pytest.mark.parametrize("model,expect", [
    ("ldmatrix", ["ldmatrix: 0 of 128 registers differ", "ldmatrix trans: 0 of 128 registers differ"]),
    ("mma", ["mma f16: max |D - naive GEMM| = 0", "mma bf16: max |D - naive GEMM| = 0"]),
    ("ldmatrix_mma", ["ldmatrix + mma: max |D - naive GEMM| = 0"]),
    ("cp_async", ["as the ISA says"]),
    ("shuffles", ["shuffles and atomics: 0 wrong"]),
])
def test_ptx_models_and_warp_operations(runtime_test, model, expect):
    rc, out = runtime_test(model)
    assert rc == 0, out
    for line in expect:
        assert line in out, out


@pytest.mark.parametrize("case,kernel,messages", [
    ("divergent", "divergent_kernel", ["divergent __syncthreads: this thread waits at simt/runtime_test.cpp:"]),
    # whichever comes first: a thread exits while others wait, or a thread reaches the barrier after others exited
    ("exit", "exit_kernel", ["wait at __syncthreads at simt/runtime_test.cpp:",
                             "thread(s) of the block exited (divergent barrier)"]),
    ("mask", "mask_kernel", ["__shfl_xor_sync reads lane"]),
    ("lane_not_in_mask", "lane_not_in_mask_kernel", ["which is not in its mask 0x0000ffff"]),
    ("oob_write", "oob_kernel", ["dynamic shared memory access at byte 128 of a 128-byte allocation (out of bounds)"]),
    ("oob_read", "oob_read_kernel", ["dynamic shared memory access at byte 128 of a 128-byte allocation (out of bounds)"]),
    ("static_oob", "static_oob_kernel", ["index out of the bounds of a fixed-size array (static shared memory"]),
])
def test_runtime_reports_kernel_errors(runtime_test, case, kernel, messages):
    rc, out = runtime_test(case)
    assert rc == 1 and f"launch failed: simt: {kernel} block (0,0,0) thread" in out, out
    assert any(m in out for m in messages), out


def test_deadlock_times_out_naming_kernel_and_site(runtime_test):
    rc, out = runtime_test("deadlock", timeout_s="1")
    assert rc == 1 and "deadlock_kernel" in out and "deadlock:" in out and "simt/runtime_test.cpp:" in out, out


def test_half_and_bfloat16_conversions_round_to_nearest_even(runtime_test, tmp_path):
    """A spread of float32 bit patterns (every 4099th, so every exponent, subnormals, infinities and NaNs) rounded
    to float16 and bfloat16 against torch's conversions, and back exactly."""
    path = tmp_path / "conv.bin"
    rc, out = runtime_test("conversions", str(path))
    assert rc == 0, out
    rec = np.fromfile(path, dtype=np.dtype([("x", "<u4"), ("h", "<u2"), ("b", "<u2"), ("hx", "<f4"), ("bx", "<f4")]))
    x = torch.from_numpy(rec["x"].view(np.float32).copy())
    want_h = x.half().view(torch.int16).numpy().view(np.uint16)
    want_b = x.bfloat16().view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(rec["x"].view(np.float32))
    assert np.array_equal(rec["h"][~nan], want_h[~nan]) and np.array_equal(rec["b"][~nan], want_b[~nan])
    assert np.all((rec["h"][nan] & 0x7c00) == 0x7c00) and np.all((rec["h"][nan] & 0x3ff) != 0)  # NaN stays NaN
    assert np.all(np.isnan(rec["bx"][nan]))
    fin = ~nan
    assert np.array_equal(rec["hx"][fin], x.half().float().numpy()[fin])
    assert np.array_equal(rec["bx"][fin], x.bfloat16().float().numpy()[fin])
    assert len(rec) > 1_000_000
