"""Proof that the simulator's tests can fail (marker `simt`): each mutant is a copy of plugins/kernels with one
planted bug, built into its own simulator library (only the translation units the patch reaches recompile:
build.py caches objects by content), and a small probe of the affected kernels runs on it in a subprocess (so a
hang or a crash stays there; the barrier timeout is cut to 10 s).  The same probe passes on the unmodified
sources (test_probes_pass_on_the_real_sources), and fails on every mutant, with the failure the simulator
reports: an error over the oracle's bound, a non-finite output, or a launch error naming the kernel and site."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from . import build

pytestmark = pytest.mark.simt

BOTH = build.LAUNCHERS  # both launcher files: the C ABI the probes load is the whole library's

# name: (file under plugins/kernels/cuda, the text, its replacement, launcher files to build, probe)
MUTANTS = {
    "calibration_syncthreads_removed": (
        "calibration_kernels.cuh",
        "own != ATTNCAL_OWN_NONE ? to_f(x[q]) : 0.f, s_sc);\n  }\n  __syncthreads();",
        "own != ATTNCAL_OWN_NONE ? to_f(x[q]) : 0.f, s_sc);\n  }", BOTH, "calibration"),
    "attention_mainloop_syncthreads_removed": (
        "attention_mainloop.cuh", "      cp_async_wait<0>();\n    }\n    __syncthreads();",
        "      cp_async_wait<0>();\n    }", BOTH, "attention"),
    "ldmatrix_fragment_index": (
        "attention_mainloop.cuh",
        "ldmatrix_x4(qa[kk], Qs + (16 * warp + (m & 1) * 8 + (lane & 7)) * LD + 16 * kk + (m >> 1) * 8);",
        "ldmatrix_x4(qa[kk], Qs + (16 * warp + (m >> 1) * 8 + (lane & 7)) * LD + 16 * kk + (m & 1) * 8);",
        BOTH, "attention"),
    "cp_async_wait_removed": (
        "attention_mainloop.cuh", "      cp_async_commit();\n      cp_async_wait<1>();",
        "      cp_async_commit();", BOTH, "attention"),
    "basket_edge_off_by_one": (
        "attention_common.cuh", "seg_end = imin(c0 + (k + 1) * S, c_end);",
        "seg_end = imin(c0 + (k + 1) * S + 1, c_end);", BOTH, "attention"),
    "warp_mask": (
        "cuda_common.cuh", "for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));",
        "for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0x7fffffffu, v, o));", BOTH, "calibration"),
}


def probe(lib_path: str, kind: str) -> None:
    """The probe of one kernel family on the library at lib_path; raises on the first case out of bounds."""
    import torch

    from attncal.calibration import CalibrationConfig, reference
    from attncal.calibration.oracle import attention_reference
    from gpu.test_calibrated_attention_cuda import ATTN_TOL
    from gpu.test_calibration_cuda import compare, run_case
    from support.cuda import attention_launch
    from support.masks import mixed_mask
    from support.tensors import random_probs, random_qkv, random_scores

    lib = build.load(Path(lib_path))
    lib.simt_set_seed(7)
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    if kind == "calibration":  # both launchers, float32 and float16, kept baskets
        for i in range(8):
            rc = CalibrationConfig(pooling=("cls", "mean")[i % 2], basket_size=(4, 32)[i // 4], strength=0.7,
                                   skip_short=False).resolve()
            mask = mixed_mask(rng, 2, 90, holes=0.5, min_len=40)
            dt = (torch.float32, torch.float16)[(i // 2) % 2]
            softmax = i % 3 == 0
            Q = 90 if rc.all_rows else 1
            x = random_scores(gen, mask, 1, dt, Q=Q) if softmax else random_probs(gen, mask, 1, dt, Q=Q)
            ref = reference(torch.softmax(x.double(), -1) if softmax else x.double(), mask, rc)
            compare(run_case(x, mask, rc, i % 4 == 1, softmax, lib, device="cpu"), ref, f"probe case {i}")
    else:  # the tiled kernel: 16-bit (mma, ldmatrix, two cp.async stages) and float32, up to three 64-key tiles.
        # Rows of plain blocks too: a calibration block's row whose scores came out NaN is recomputed by the per-row
        # kernel (its queue), which would hide a corrupted tile there.
        for i, (name, pooling, S, strength, S_q, S_k) in enumerate((
                ("float16", "cls", 16, 0.8, 150, 150), ("bfloat16", "mean", 5, 0.8, 40, 40),
                ("float32", "cls", 64, 0.8, 1, 150), ("float16", "cls", 3, 0.0, 100, 100))):
            dt = getattr(torch, name)
            rc = CalibrationConfig(pooling=pooling, basket_size=S, strength=strength, skip_short=False).resolve()
            mask = mixed_mask(rng, 2, S_k, holes=0.5, min_len=S_k // 2)
            q, k, v = random_qkv(gen, 2, S_q, S_k, 1, 64, 64, dt, temp=1.0, exact=True)
            out = torch.full((2, S_q, 64), float("nan"), dtype=dt)
            attention_launch(lib, q, k, v, mask, out, rc, 1, 0.125)
            err = float((out.double() - attention_reference(q, k, v, mask, rc, 1, 0.125)).abs().max())
            assert err <= ATTN_TOL[name], f"probe case {i} ({name}): err {err:.3g} > {ATTN_TOL[name]}"
    print(f"probe {kind}: every case within its bound")


def run_probe(lib: Path, kind: str) -> subprocess.CompletedProcess:
    tests = Path(__file__).resolve().parents[1]
    code = f"import sys; sys.path.insert(0, {str(tests)!r}); from simt.test_simt_mutations import probe; " \
           f"probe({str(lib)!r}, {kind!r})"
    env = dict(os.environ, SIMT_TIMEOUT_S="10")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tests)


@pytest.mark.parametrize("kind", ["calibration", "attention"])
def test_probes_pass_on_the_real_sources(simt_lib, kind):
    r = run_probe(build.build(), kind)
    assert r.returncode == 0 and "every case within its bound" in r.stdout, r.stdout + r.stderr[-3000:]


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(name, tmp_path):
    path, old, new, launchers, kind = MUTANTS[name]
    kernels = tmp_path / "kernels"
    shutil.copytree(build.KERNELS, kernels, ignore=shutil.ignore_patterns("cpu"))
    src = kernels / "cuda" / path
    text = src.read_text()
    assert text.count(old) == 1, f"{name}: the text to mutate is not in {path} exactly once"
    src.write_text(text.replace(old, new))
    lib = build.build(kernels, launchers=launchers)
    r = run_probe(lib, kind)
    out = r.stdout + r.stderr
    print(f"{name}: {out.strip().splitlines()[-1] if out.strip() else r.returncode}")
    assert r.returncode != 0 and "every case within its bound" not in r.stdout, f"{name} was not caught:\n{out}"
    assert ("AssertionError" in out or "RuntimeError" in out), out[-3000:]
