"""GPU check of the CUDA calibration kernels (one command, <= 5 minutes of GPU time).

For a machine with an NVIDIA GPU, torch (CUDA build) and nvcc; onnxruntime-gpu is
used by section 8 only, where it is installed, and TensorRT not at all.  It:

  1. compiles plugins/kernels/calibration_cuda.cu with nvcc for this GPU
     (attncal.runtime.oplib.compile_cuda_kernel; no CMake or ORT headers needed);
  2. runs attncal_cuda_calibrate through ctypes on torch CUDA tensors against the
     float64 oracle `attncal.calibration.reference` on randomized cases with
     randomized attributes (fp32 <= 1e-6, fp16 <= 2e-3; out-of-place into a
     NaN-filled buffer, so a row left unwritten fails, and in place);
  3. the same for the fused attncal_cuda_softmax_calibrate
     (SoftmaxPooledRowCalibration / SoftmaxAllRowsCalibration) against the oracle
     applied to softmax(scores) in float64, plus deterministic corner cases for
     both launchers (a subnormal fixed weight with empty content, rows of equal
     scores, fully masked items);
  4. measures the kernel's effective bandwidth on B=32, H=16, K=8192 pooled rows
     (bytes read + written / time, in place on a [B,H,1,K] tensor) against the
     GPU's copy bandwidth (torch copy_ of the same bytes);
  5. times the fused op at B=8, H=16, Q=K=2048 fp16 (AllRows) against torch.softmax
     alone on the same tensor, against the copy bandwidth, and against
     torch.softmax + the separate calibration; and the separate calibration out of
     place vs in place (AllRows and pooled);
  6. times the torch efficient calibration vs uncalibrated at batch 8 x 2048 on
     the synthetic long model (XLM-R, 4 layers, hidden 256, 4 heads);
  7. the calibrated attention ops (PooledRowCalibratedAttention /
     AllRowsCalibratedAttention, plugins/kernels/calibrated_attention_cuda.cu):
     the tiled kernel and the per-row kernel against the float64 oracle
     `attention_reference` (float32, float16, bfloat16; both padding sides, holes,
     partial and empty baskets, Q = 1 for pooled, fully masked items, head sizes on
     every load path) and against each other; deterministic edge cases (NaN rules,
     rows the tiled kernel queues for the per-row kernel); against torch SDPA + the
     split identity (attncal.calibration.split); time and peak memory against torch's
     flash SDPA at B=8, S=8192, 12 heads x 64, float16 (targets <= 1.15x, <= 1.05x);
  8. the `attncal export --fp16` exports of all-MiniLM-L6-v2 on ONNX Runtime's CUDA provider
     (benchmarks/fp16_exports.py): parity of every graph against the fp32 PyTorch reference
     with `attncal check`'s fp16 tolerances, and the default Encoder's time, calibrated vs
     uncalibrated; skipped, saying so, where onnxruntime-gpu is not installed.

None of this has run on a GPU yet (no GPU was lent when it was written): every expected
figure in comments is a design expectation, not a measurement.

    python benchmarks/gpu_check.py [--json out.json] [--cases 400] [--fused-cases 200] [--attention-cases 150]
    python benchmarks/gpu_check.py --compile-only     # step 1 only (works without a GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # fp16_exports (section 8)

from attncal.graphs.contract import op_spec  # noqa: E402
from attncal.runtime import attributes_def, oplib  # noqa: E402


# The ctypes mirror of AttncalParams (plugins/kernels/attncal_params.h), built from the attribute table
# (plugins/kernels/attncal_attributes.def) rather than written out here, so that it follows the struct.
Params = attributes_def.params_structure()


def params_of(rc) -> ctypes.Structure:
    """The launchers' AttncalParams for resolved calibration `rc`: its node's attributes (op_spec)."""
    return attributes_def.make_params(rc.all_rows, op_spec(rc, 0).attrs)


def load(path: Path):
    lib = ctypes.CDLL(str(path))
    for fn in (lib.attncal_cuda_calibrate, lib.attncal_cuda_softmax_calibrate):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 4 + [
            ctypes.POINTER(Params), ctypes.c_void_p, ctypes.c_void_p]
    lib.attncal_cuda_last_error.restype = ctypes.c_char_p
    lib.attncal_cuda_workspace_bytes.restype = ctypes.c_size_t
    lib.attncal_cuda_workspace_bytes.argtypes = [ctypes.c_int64]
    # The calibrated attention launchers (calibrated_attention_cuda.h).
    i64 = ctypes.c_int64
    lib.attncal_cuda_calibrated_attention.restype = ctypes.c_int
    lib.attncal_cuda_calibrated_attention.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [i64] * 6 + [
        ctypes.c_float, ctypes.POINTER(Params), ctypes.c_void_p, ctypes.c_void_p]
    lib.attncal_cuda_calibrated_attention_reference.restype = ctypes.c_int
    lib.attncal_cuda_calibrated_attention_reference.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [i64] * 6 + [
        ctypes.c_float, ctypes.POINTER(Params), ctypes.c_void_p]
    lib.attncal_cuda_attention_workspace_bytes.restype = ctypes.c_size_t
    lib.attncal_cuda_attention_workspace_bytes.argtypes = [i64, i64, i64]
    return lib


def launch(lib, probs, out, mask, p: Params, workspace=None, softmax: bool = False) -> None:
    """attncal_cuda_calibrate(probs -> out), or with softmax=True attncal_cuda_softmax_calibrate(scores -> out)."""
    import torch

    B, H, Q, K = probs.shape
    dtype = 1 if probs.dtype == torch.float16 else 0
    stream = torch.cuda.current_stream().cuda_stream
    fn = lib.attncal_cuda_softmax_calibrate if softmax else lib.attncal_cuda_calibrate
    rc = fn(dtype, probs.data_ptr(), out.data_ptr(), mask.data_ptr(), B, H, Q, K, ctypes.byref(p),
            None if workspace is None else workspace.data_ptr(), stream)
    if rc != 0:
        name = "attncal_cuda_softmax_calibrate" if softmax else "attncal_cuda_calibrate"
        raise RuntimeError(f"{name} failed ({rc}): {lib.attncal_cuda_last_error().decode()}")


TOL = {"float32": 1e-6, "float16": 2e-3}


def random_case(rng: random.Random):
    """Randomized attributes and geometry: (config, resolved, B, H, Q, K, mask).  Mostly short rows (64- and
    128-thread blocks), sometimes long ones (256 threads); pooled cases sometimes have Q == 1 (row placement)."""
    import torch

    from attncal.calibration import CalibrationConfig

    S = rng.choice([1, 2, 3, 4, 8, 16, 32, 33, 64, 128])
    kw = {}
    for name in ("first_weight", "last_weight"):
        if rng.random() < 0.25:
            kw[name] = rng.choice(["equal", "original", round(rng.uniform(0, 0.45), 3)])
    for name in ("isolate_first", "isolate_last"):
        if rng.random() < 0.3:
            kw[name] = rng.random() < 0.5
    cfg = CalibrationConfig(variant=rng.choice(["uniform", "cls-soft", "cls-hard"]),
                            strength=rng.choice([0.0, 1.0, rng.random()]), basket_size=S,
                            pooling=rng.choice(["cls", "last", "mean"]), self_weight=round(rng.uniform(0, 0.5), 3),
                            skip_short=rng.random() < 0.5, **kw)
    rc = cfg.resolve()
    if rng.random() < 0.1:
        K = rng.randint(1025, 1600)
        B, H = rng.randint(1, 2), 1
    else:
        K = rng.randint(1, 64 if rc.all_rows else 600)
        B, H = rng.randint(1, 4), rng.randint(1, 3)
    Q = 1 if not rc.all_rows and rng.random() < 0.2 else K
    mask = torch.zeros(B, K, dtype=torch.long)
    for b in range(B):
        n = rng.randint(0, K)
        if rng.random() < 0.5:
            mask[b, K - n:] = 1  # left padding
        else:
            mask[b, :n] = 1  # right padding
    if rng.random() < 0.1 and K > 4:
        mask[:, rng.randrange(1, K - 1)] = 0  # holes
    return cfg, rc, B, H, Q, K, mask


def compare(name: str, out, ref, what: str) -> float:
    """Max abs error of out vs the float64 reference; raises over the tolerance or on a non-finite value."""
    import torch

    out = out.double()
    if not bool(torch.isfinite(out).all()):
        raise AssertionError(f"{what}: non-finite output ({int((~torch.isfinite(out)).sum())} values)")
    err = float((out - ref).abs().max()) if out.numel() else 0.0
    if not err <= TOL[name]:
        raise AssertionError(f"{name} {what}: err {err:.3g} > {TOL[name]}")
    return err


def run_case(lib, x, mask, rc, in_place: bool, softmax: bool):
    """Runs one launcher on the GPU (in place, or out of place into a NaN-filled buffer, checking that the
    input is untouched) and returns the output on the host."""
    import torch

    d_x, d_mask = x.cuda(), mask.cuda()
    if in_place:
        launch(lib, d_x, d_x, d_mask, params_of(rc), softmax=softmax)
        torch.cuda.synchronize()
        return d_x.cpu()
    d_out = torch.full_like(d_x, float("nan"))
    launch(lib, d_x, d_out, d_mask, params_of(rc), softmax=softmax)
    torch.cuda.synchronize()
    if not torch.equal(d_x.cpu(), x):
        raise AssertionError("the out-of-place launch modified its input")
    return d_out.cpu()


def check_correctness(lib, n_cases: int, seed: int = 0) -> dict:
    import torch
    from tqdm import tqdm

    from attncal.calibration import reference

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    worst = {"float32": 0.0, "float16": 0.0}
    counts = {"float32": 0, "float16": 0}
    for _ in tqdm(range(n_cases), desc="kernel vs reference", unit="case"):
        cfg, rc, B, H, Q, K, mask = random_case(rng)
        S = rc.basket_size
        logits = torch.randn(B, H, Q, K, generator=gen, dtype=torch.float64) * rng.choice([0.5, 2.0, 6.0])
        probs64 = torch.softmax(logits.masked_fill(mask[:, None, None, :] == 0, float("-inf")), -1).nan_to_num(0.0)
        if rng.random() < 0.2:
            probs64[..., rng.randrange(K):][..., : 2 * S] = 0  # empty baskets
        dt = rng.choice([torch.float32, torch.float16])
        name = "float16" if dt == torch.float16 else "float32"
        probs = probs64.to(dt)
        ref = reference(probs.double(), mask, rc)
        in_place = rng.random() < 0.5
        out = run_case(lib, probs, mask, rc, in_place, softmax=False)
        err = compare(name, out, ref, f"case ({cfg}, B={B}, H={H}, Q={Q}, K={K}, in_place={in_place})")
        worst[name] = max(worst[name], err)
        counts[name] += 1
    return {"cases": counts, "max_abs_err": worst}


def check_fused_correctness(lib, n_cases: int, seed: int = 1) -> dict:
    """attncal_cuda_softmax_calibrate(scores) vs reference(softmax(scores) in float64).  The scores are
    logits with finfo.min on masked keys (a fully masked item has rows of equal scores: softmax 1/K)."""
    import torch
    from tqdm import tqdm

    from attncal.calibration import reference

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    worst = {"float32": 0.0, "float16": 0.0}
    counts = {"float32": 0, "float16": 0}
    for _ in tqdm(range(n_cases), desc="fused softmax kernel vs reference", unit="case"):
        cfg, rc, B, H, Q, K, mask = random_case(rng)
        dt = rng.choice([torch.float32, torch.float16])
        name = "float16" if dt == torch.float16 else "float32"
        # logit ranges that keep valid keys' float32 probabilities normal (as tests/test_fused_softmax.py)
        logits = torch.randn(B, H, Q, K, generator=gen, dtype=torch.float64) * rng.choice([0.5, 2.0, 6.0])
        if rng.random() < 0.2:
            logits = logits + rng.uniform(-30.0, 30.0)  # an offset: the max subtraction matters
        scores = logits.to(dt).masked_fill(mask[:, None, None, :] == 0, torch.finfo(dt).min)
        ref = reference(torch.softmax(scores.double(), -1), mask, rc)
        in_place = rng.random() < 0.5
        out = run_case(lib, scores, mask, rc, in_place, softmax=True)
        err = compare(name, out, ref, f"fused case ({cfg}, B={B}, H={H}, Q={Q}, K={K}, in_place={in_place})")
        worst[name] = max(worst[name], err)
        counts[name] += 1
    return {"cases": counts, "max_abs_err": worst}


def check_edge_cases(lib) -> dict:
    """Deterministic corner cases for both launchers, both dtypes, in place and out of place, pooled and all
    rows: a fixed weight of 1e-40 (subnormal in float32) on an isolated first key whose row has no content
    mass, so `total` is subnormal and the kernel must divide by it (1/total overflows float32); an item
    with no valid key (scores all finfo.min: softmax 1/K, not calibrated); an odd K (out-of-place rows not
    16-byte aligned)."""
    import torch

    from attncal.calibration import ResolvedCalibration, reference
    from attncal.calibration.config import MODE_EQUAL, MODE_FIXED

    B, H, K = 3, 2, 7
    mask = torch.ones(B, K, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2] = 0
    gen = torch.Generator().manual_seed(2)
    n = 0
    worst = {"float32": 0.0, "float16": 0.0}
    for pooling in ("cls", "mean"):
        rc = ResolvedCalibration(pooling=pooling, strength=0.5, basket_size=2, isolate_first=True,
                                 isolate_last=False, first_mode=MODE_FIXED, first_weight=1e-40,
                                 last_mode=MODE_EQUAL, last_weight=0.0, skip_short=False)
        for dt in (torch.float32, torch.float16):
            name = "float16" if dt == torch.float16 else "float32"
            fmin = torch.finfo(dt).min
            logits = torch.randn(B, H, K, K, generator=gen, dtype=torch.float64)
            logits[:, :, :, 1:] = fmin  # every row: all mass on the first key, so the content mass is 0
            logits[:, 1, 3:, :] = torch.randn(B, K - 3, K, generator=gen, dtype=torch.float64)  # some normal rows
            scores = logits.to(dt).masked_fill(mask[:, None, None, :] == 0, fmin)
            probs64 = torch.softmax(scores.double(), -1)
            probs = probs64.to(dt)
            for softmax, x, ref in ((False, probs, reference(probs.double(), mask, rc)),
                                    (True, scores, reference(probs64, mask, rc))):
                for in_place in (False, True):
                    out = run_case(lib, x, mask, rc, in_place, softmax=softmax)
                    what = f"edge case ({pooling}, softmax={softmax}, in_place={in_place})"
                    worst[name] = max(worst[name], compare(name, out, ref, what))
                    n += 1
    return {"cases": n, "max_abs_err": worst}


def time_cuda(fn, iters: int) -> float:
    """Median milliseconds per call (CUDA events, after a warm-up)."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bandwidth(lib, B: int = 32, H: int = 16, K: int = 8192) -> dict:
    import torch

    from attncal.calibration import CalibrationConfig

    res = {}
    for dt in (torch.float32, torch.float16):
        probs = torch.softmax(torch.randn(B, H, 1, K, device="cuda"), -1).to(dt)
        mask = torch.ones(B, K, dtype=torch.long, device="cuda")
        ws = torch.empty(lib.attncal_cuda_workspace_bytes(B), dtype=torch.uint8, device="cuda")
        p = params_of(CalibrationConfig(pooling="cls").resolve())  # published defaults: basket 128
        ms = time_cuda(lambda: launch(lib, probs, probs, mask, p, ws), 50)
        moved = 2 * probs.numel() * probs.element_size() + mask.numel() * 8  # read + write rows, read mask
        dst = torch.empty_like(probs)
        copy_ms = time_cuda(lambda: dst.copy_(probs), 50)
        copy_moved = 2 * probs.numel() * probs.element_size()
        name = str(dt).replace("torch.", "")
        res[name] = {"kernel_ms": ms, "kernel_GBps": moved / ms / 1e6, "copy_ms": copy_ms,
                     "copy_GBps": copy_moved / copy_ms / 1e6,
                     "fraction_of_copy": (moved / ms) / (copy_moved / copy_ms)}
    return res


def fused_bench(lib, B: int = 8, H: int = 16, K: int = 2048, iters: int = 20) -> dict:
    """The fused op on [B,H,K,K] fp16 scores (AllRows, published defaults otherwise; half the batch padded by
    a quarter) vs torch.softmax alone, vs the copy bandwidth and vs torch.softmax + the separate calibration;
    and the separate calibration out of place vs in place (AllRows and pooled)."""
    import torch

    from attncal.calibration import CalibrationConfig

    torch.manual_seed(0)
    dt = torch.float16
    mask = torch.ones(B, K, dtype=torch.long, device="cuda")
    mask[B // 2:, K * 3 // 4:] = 0
    scores = (torch.randn(B, H, K, K, device="cuda", dtype=dt) * 2).masked_fill(mask[:, None, None, :] == 0,
                                                                                torch.finfo(dt).min)
    ws = torch.empty(lib.attncal_cuda_workspace_bytes(B), dtype=torch.uint8, device="cuda")
    p_all = params_of(CalibrationConfig(pooling="mean").resolve())
    p_cls = params_of(CalibrationConfig(pooling="cls").resolve())
    out = torch.empty_like(scores)
    work = scores.clone()
    probs = torch.softmax(scores, -1)
    probs_work = probs.clone()
    n_bytes = scores.numel() * scores.element_size()
    moved = 2 * n_bytes + mask.numel() * 8  # read + write the tensor, read the mask

    ms = {
        "copy": time_cuda(lambda: out.copy_(scores), iters),
        "torch_softmax": time_cuda(lambda: torch.softmax(scores, -1), iters),
        "fused_out_of_place": time_cuda(lambda: launch(lib, scores, out, mask, p_all, ws, softmax=True), iters),
        "fused_in_place": time_cuda(lambda: launch(lib, work, work, mask, p_all, ws, softmax=True), iters),
    }
    p0 = params_of(CalibrationConfig(pooling="mean", strength=0.0).resolve())
    ms["fused_strength0_out_of_place"] = time_cuda(lambda: launch(lib, scores, out, mask, p0, ws, softmax=True),
                                                   iters)

    def unfused():
        x = torch.softmax(scores, -1)
        launch(lib, x, x, mask, p_all, ws)

    ms["torch_softmax_plus_calibrate_in_place"] = time_cuda(unfused, iters)
    ms["calibrate_all_rows_in_place"] = time_cuda(lambda: launch(lib, probs_work, probs_work, mask, p_all, ws), iters)
    ms["calibrate_all_rows_out_of_place"] = time_cuda(lambda: launch(lib, probs, out, mask, p_all, ws), iters)
    ms["calibrate_pooled_in_place"] = time_cuda(lambda: launch(lib, probs_work, probs_work, mask, p_cls, ws), iters)
    ms["calibrate_pooled_out_of_place"] = time_cuda(lambda: launch(lib, probs, out, mask, p_cls, ws), iters)
    # Whole-tensor bytes (read + write, + the mask) per second; not meaningful for the pooled op in place,
    # which touches B*H rows only.
    gbps = {k: moved / v / 1e6 for k, v in ms.items() if k != "calibrate_pooled_in_place"}
    gbps["copy"] = 2 * n_bytes / ms["copy"] / 1e6
    # Sanity: fused (softmax in fp32, one rounding) vs torch.softmax in fp16 + the separate calibration.
    launch(lib, scores, out, mask, p_all, ws, softmax=True)
    ref = torch.softmax(scores, -1)
    launch(lib, ref, ref, mask, p_all, ws)
    torch.cuda.synchronize()
    diff = float((out.float() - ref.float()).abs().max())
    return {
        "shape": [B, H, K, K], "dtype": "float16", "calibration": "AllRows (mean pooling), basket 128",
        "median_ms": ms, "GBps": gbps,
        "fused_fraction_of_copy": gbps["fused_out_of_place"] / gbps["copy"],
        "fused_vs_torch_softmax": ms["fused_out_of_place"] / ms["torch_softmax"],
        "fused_vs_softmax_plus_calibrate": ms["fused_out_of_place"] / ms["torch_softmax_plus_calibrate_in_place"],
        "calibrate_all_rows_out_of_place_vs_in_place":
            ms["calibrate_all_rows_out_of_place"] / ms["calibrate_all_rows_in_place"],
        "calibrate_pooled_out_of_place_vs_copy": ms["calibrate_pooled_out_of_place"] / ms["copy"],
        "max_abs_diff_fused_vs_unfused": diff,
    }


def torch_overhead(batch: int = 8, seq: int = 2048, rounds: int = 10) -> dict:
    import torch
    from transformers import AutoModel

    from attncal.calibration import CalibrationConfig, calibrate
    from attncal.synthetic import make_config

    torch.manual_seed(0)
    cfg = make_config("xlm-roberta", layers=4, hidden=256, heads=4, intermediate=1024, max_positions=seq)
    model = AutoModel.from_config(cfg, attn_implementation="eager").eval().cuda()
    ids = torch.randint(10, 100, (batch, seq), device="cuda")
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    cal = CalibrationConfig(pooling="cls")

    def plain():
        with torch.no_grad():
            model(**inputs)

    def calibrated():
        with torch.no_grad(), calibrate(model, cal, implementation="efficient"):
            model(**inputs)

    t = {"uncalibrated": [], "efficient": []}
    for fn in (plain, calibrated):
        time_cuda(fn, 1)
    for _ in range(rounds):  # interleaved
        t["uncalibrated"].append(time_cuda(plain, 1))
        t["efficient"].append(time_cuda(calibrated, 1))
    med = {k: statistics.median(v) for k, v in t.items()}
    return {"batch": batch, "seq": seq, "median_ms": med, "overhead_pct": 100 * (med["efficient"] / med["uncalibrated"] - 1)}


def split_long_context(batch: int = 8, seq: int = 8192, rounds: int = 3) -> dict:
    """Split placement on CUDA: torch SDPA (flash / memory-efficient kernels) calibrated vs uncalibrated,
    mean pooling (every row calibrated), on the synthetic long model at batch x seq, with peak GPU memory.
    The eager probabilities of one layer would be batch*heads*seq^2*2 bytes (8 GiB at 8 x 8192, fp16): this
    is the case split placement exists for."""
    import torch
    from transformers import AutoModel

    from attncal.calibration import CalibrationConfig, calibrate
    from attncal.synthetic import make_config

    torch.manual_seed(0)
    cfg = make_config("xlm-roberta", layers=4, hidden=256, heads=4, intermediate=1024, max_positions=seq)
    model = AutoModel.from_config(cfg, attn_implementation="sdpa").eval().cuda().half()
    ids = torch.randint(10, 100, (batch, seq), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, seq - 1000:] = 0  # one padded item, so the key-padding path is exercised
    inputs = {"input_ids": ids, "attention_mask": mask}
    cal = CalibrationConfig(pooling="mean", variant="uniform")

    def plain():
        with torch.no_grad():
            return model(**inputs).last_hidden_state

    def calibrated():
        with torch.no_grad(), calibrate(model, cal, implementation="split"):
            return model(**inputs).last_hidden_state

    out: dict = {"batch": batch, "seq": seq, "dtype": "float16", "pooling": "mean"}
    for name, fn in (("uncalibrated_sdpa", plain), ("split_sdpa", calibrated)):
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        out[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    t = {"uncalibrated_sdpa": [], "split_sdpa": []}
    for _ in range(rounds):  # interleaved
        t["uncalibrated_sdpa"].append(time_cuda(plain, 1))
        t["split_sdpa"].append(time_cuda(calibrated, 1))
    med = {k: statistics.median(v) for k, v in t.items()}
    out["median_ms"] = med
    out["latency_ratio"] = med["split_sdpa"] / med["uncalibrated_sdpa"]
    out["memory_ratio"] = out["split_sdpa_peak_mib"] / max(out["uncalibrated_sdpa_peak_mib"], 1e-9)
    # Parity of the split path against eager calibration on a short slice (eager at 8192 would need GiBs).
    short = {k: v[:2, :1024] for k, v in inputs.items()}
    eager = AutoModel.from_config(cfg, attn_implementation="eager").eval().cuda()
    eager.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    model32 = AutoModel.from_config(cfg, attn_implementation="sdpa").eval().cuda()
    model32.load_state_dict(eager.state_dict())
    with torch.no_grad():
        with calibrate(eager, cal, implementation="efficient"):
            ref = eager(**short).last_hidden_state
        with calibrate(model32, cal, implementation="split"):
            got = model32(**short).last_hidden_state
    valid = short["attention_mask"].bool()[..., None]
    out["parity_fp32_max_abs"] = float(torch.where(valid, got - ref, 0.0).abs().max())
    return out


# ------------------------------------------------------------------ calibrated attention
# Tolerances against the float64 oracle, beyond the float32 rounding of the scores themselves (added per
# case, `score_bound`): float32 is computed in float32 throughout (1e-6, as every float32 op here).  The
# 16-bit tiled kernel multiplies P rounded to the input type by V on the tensor cores, as FlashAttention
# does: each weight moves by a relative 2^-11 (float16) / 2^-8 (bfloat16), the context (|v| <= 2) by at
# most 2 * 2^-11 * 2 = 2e-3 / 1.6e-2 in the worst case, on top of the output's own rounding (half an ulp
# below 2: 4.9e-4 / 3.9e-3).  Hence 3e-3 (float16) and 2e-2 (bfloat16).
ATTN_TOL = {"float32": 1e-6, "float16": 3e-3, "bfloat16": 2e-2}
ATTN_DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}


def attention_launch(lib, q, k, v, mask, out, rc, num_heads: int, scale: float, workspace=None,
                     reference: bool = False) -> None:
    """attncal_cuda_calibrated_attention (or the per-row reference launcher) on torch CUDA tensors:
    q [B,S_q,N*D], k [B,S_k,N*D], v [B,S_k,N*D_v], mask int64 [B,S_k] -> out [B,S_q,N*D_v]."""
    import torch

    B, S_q, hidden = q.shape
    S_k = k.shape[1]
    dtype = ATTN_DTYPE_CODE[str(q.dtype).replace("torch.", "")]
    stream = torch.cuda.current_stream().cuda_stream
    p = params_of(rc)
    args = (dtype, q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), out.data_ptr(), B, S_q, S_k,
            num_heads, hidden // num_heads, v.shape[2] // num_heads, float(scale), ctypes.byref(p))
    if reference:
        rc_ = lib.attncal_cuda_calibrated_attention_reference(*args, stream)
    else:
        rc_ = lib.attncal_cuda_calibrated_attention(*args, None if workspace is None else workspace.data_ptr(), stream)
    if rc_ != 0:
        name = "attncal_cuda_calibrated_attention" + ("_reference" if reference else "")
        raise RuntimeError(f"{name} failed ({rc_}): {lib.attncal_cuda_last_error().decode()}")


def attention_qkv(gen, B: int, S_q: int, S_k: int, N: int, D: int, D_v: int, dtype, temp: float,
                  dead: tuple[int, int] | None = None, exact: bool = False):
    """Q (times `temp`), K standard normal, V uniform in [-2, 2] (float64, then cast to `dtype`).  `dead`:
    keys [lo, hi) whose scores are exactly -3e4*scale in every head (the last column of q is 1, of k
    -3e4 there and 0 elsewhere): their baskets have mass 0 in float32 and float64 alike.  `exact`: q and k
    on a 1/8 grid (small), so that with a power-of-two scale the float32 scores are exact."""
    import torch

    q = torch.randn(B, S_q, N, D, generator=gen, dtype=torch.float64) * temp
    k = torch.randn(B, S_k, N, D, generator=gen, dtype=torch.float64)
    v = torch.rand(B, S_k, N * D_v, generator=gen, dtype=torch.float64) * 4 - 2
    if exact:
        q, k = (q * 8).round().clamp(-64, 64) / 8, (k * 8).round().clamp(-32, 32) / 8
    if dead is not None and D >= 2:
        q[..., -1] = 1.0
        k[..., -1] = 0.0
        k[:, dead[0]:dead[1]] = 0.0
        k[:, dead[0]:dead[1], :, -1] = -3e4
    return q.reshape(B, S_q, N * D).to(dtype), k.reshape(B, S_k, N * D).to(dtype), v.to(dtype)


def score_bound(q, k, mask, N: int, scale: float):
    """[B]: a first-order bound on the float32 rounding of the valid scores, 2^-24 * ((D+1) * sum|q_i s||k_i|
    + |s|) (the same bound as tests/test_calibrated_attention.py); the context moves by at most about
    12 * that * max|v| (every weight is a ratio of exponentials of the scores)."""
    import numpy as np

    B, S_q, _ = q.shape
    qh = q.double().reshape(B, S_q, N, -1).transpose(1, 2)
    kh = k.double().reshape(B, k.shape[1], N, -1).transpose(1, 2)
    D = qh.shape[-1]
    qh = qh * (scale if scale != 0 else 1.0 / np.sqrt(max(D, 1)))
    bound = (D + 1) * (qh.abs() @ kh.abs().transpose(-1, -2)) + (qh @ kh.transpose(-1, -2)).abs()
    bound = bound.masked_fill(mask[:, None, None, :] == 0, 0.0)
    return bound.amax(dim=(1, 2, 3)) * 2.0 ** -24


def attention_mask(rng: random.Random, B: int, K: int, holes: float):
    """Each item its own length (0 included: no valid key) and padding side; with probability `holes`
    masked keys inside the span."""
    import torch

    mask = torch.zeros(B, K, dtype=torch.long)
    for b in range(B):
        n = 0 if rng.random() < 0.1 else rng.randint(0, K)
        if rng.random() < 0.5:
            mask[b, K - n:] = 1
        else:
            mask[b, :n] = 1
        if n > 4 and rng.random() < holes:
            idx = mask[b].nonzero().flatten()
            for _ in range(rng.randint(1, 3)):
                mask[b, int(idx[rng.randrange(1, n - 1)])] = 0
    return mask


def random_attention_case(rng: random.Random):
    """Attributes and geometry of one random case: (rc, B, N, S_q, S_k, D, D_v, scale, exact, dead, mask).
    Head sizes cover both tiled-kernel widths (<= 64, <= 128), the 16-byte and element-wise load paths and
    the per-row kernel (> 128); basket sizes below, at and above the 64-key tile, divisors and not."""
    from attncal.calibration import CalibrationConfig

    S = rng.choice([1, 2, 3, 5, 8, 16, 33, 64, 100, 128])
    kw = {}
    for name in ("first_weight", "last_weight"):
        if rng.random() < 0.3:
            kw[name] = rng.choice(["equal", "original", round(rng.uniform(0, 0.45), 3)])
    for name in ("isolate_first", "isolate_last"):
        if rng.random() < 0.3:
            kw[name] = rng.random() < 0.5
    cfg = CalibrationConfig(variant=rng.choice(["uniform", "cls-soft", "cls-hard"]),
                            strength=rng.choice([0.0, 1.0, rng.random(), rng.random()]), basket_size=S,
                            pooling=rng.choice(["cls", "last", "mean"]), self_weight=round(rng.uniform(0, 0.5), 3),
                            skip_short=rng.random() < 0.4, **kw)
    rc = cfg.resolve()
    D = rng.choice([4, 8, 12, 16, 32, 40, 64, 72, 96, 128] + ([160] if rng.random() < 0.05 else []))
    D_v = D if rng.random() < 0.7 else rng.choice([8, 16, 24, 64])
    N = rng.randint(1, 3)
    S_k = rng.randint(1, 160 if rc.all_rows else 400)
    B = rng.randint(1, 3)
    S_q = 1 if (not rc.all_rows and rng.random() < 0.25) else S_k
    exact = rng.random() < 0.4
    scale = rng.choice([0.125, 0.25, 0.5]) if exact else rng.choice([0.0, 0.0, 0.1, 0.3])
    lo = rng.randrange(S_k)
    dead = (lo, lo + rng.choice([1, 2]) * S) if rng.random() < 0.2 and D >= 2 else None
    mask = attention_mask(rng, B, S_k, holes=0.2)
    return rc, B, N, S_q, S_k, D, D_v, scale, exact, dead, mask


def check_attention_correctness(lib, n_cases: int, seed: int = 20, device: str = "cuda",
                                launch=attention_launch) -> dict:
    """Random cases: the tiled launcher and the per-row launcher against the float64 oracle (every context
    row, calibrated or not) and against each other.  Outputs go into NaN-filled buffers, so an unwritten row
    fails.  `device` / `launch` exist so the harness itself can be dry-run on the CPU with a stand-in."""
    import torch
    from tqdm import tqdm

    from attncal.calibration.oracle import attention_reference

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    worst = {n: 0.0 for n in dtypes}
    worst_vs_ref = {n: 0.0 for n in dtypes}
    counts = {n: 0 for n in dtypes}
    seen = {k: 0 for k in ("cls", "last", "mean", "q1", "empty_item", "holes", "dead", "exact", "per_row_path",
                           "scalar_loads", "hd128")}
    for _ in tqdm(range(n_cases), desc="calibrated attention vs oracle", unit="case"):
        rc, B, N, S_q, S_k, D, D_v, scale, exact, dead, mask = random_attention_case(rng)
        name = rng.choice(list(dtypes))
        dt = dtypes[name]
        q, k, v = attention_qkv(gen, B, S_q, S_k, N, D, D_v, dt, temp=rng.choice([0.5, 1.0, 3.0]), dead=dead,
                                exact=exact)
        ref = attention_reference(q, k, v, mask, rc, N, scale)
        dq, dk, dv, dm = (x.to(device) for x in (q, k, v, mask))
        outs = []
        for reference in (False, True):
            out = torch.full((B, S_q, N * D_v), float("nan"), dtype=dt, device=device)
            launch(lib, dq, dk, dv, dm, out, rc, N, scale, reference=reference)
            if device == "cuda":
                torch.cuda.synchronize()
            outs.append(out.cpu().double())
        bound = torch.full((B,), ATTN_TOL[name], dtype=torch.float64)
        if not exact:
            bound = bound + 12 * score_bound(q, k, mask, N, scale) * float(v.abs().max())
        what = (f"{name} case ({rc}, B={B}, N={N}, S_q={S_q}, S_k={S_k}, D={D}, D_v={D_v}, scale={scale}, "
                f"dead={dead}, mask={mask.tolist()})")
        for i, out in enumerate(outs):
            if not bool(torch.isfinite(out).all()):
                raise AssertionError(f"{'per-row' if i else 'tiled'} {what}: non-finite output "
                                     f"({int((~torch.isfinite(out)).sum())} values)")
            err = (out - ref).abs().amax(dim=(1, 2))
            if bool((err > bound).any()):
                b = int(torch.argmax(err - bound))
                raise AssertionError(f"{'per-row' if i else 'tiled'} {what}: item {b} err {float(err[b]):.3g} > "
                                     f"{float(bound[b]):.3g}")
            if i == 0:
                worst[name] = max(worst[name], float(err.max()))
        worst_vs_ref[name] = max(worst_vs_ref[name], float((outs[0] - outs[1]).abs().max()))
        counts[name] += 1
        seen["mean" if rc.all_rows else "last" if rc.pool_last else "cls"] += 1
        seen["q1"] += S_q == 1 and S_k > 1
        seen["empty_item"] += int((mask.sum(1) == 0).any())
        lengths = mask.sum(1)
        span = [(int(m.nonzero()[-1]) - int(m.nonzero()[0]) + 1) if m.any() else 0 for m in mask]
        seen["holes"] += int(any(int(n) != s for n, s in zip(lengths, span)))
        seen["dead"] += dead is not None
        seen["exact"] += exact
        seen["per_row_path"] += max(D, D_v) > 128
        esize = 4 if name == "float32" else 2
        seen["scalar_loads"] += (D * esize) % 16 != 0 or (D_v * esize) % 16 != 0
        seen["hd128"] += 64 < max(D, D_v) <= 128
    return {"cases": counts, "max_abs_err": worst, "max_abs_diff_tiled_vs_per_row": worst_vs_ref,
            "tolerance": ATTN_TOL, "coverage": seen}


def check_attention_edge_cases(lib, device: str = "cuda", launch=attention_launch) -> dict:
    """Deterministic cases, every dtype, tiled and per-row launchers:
    * an item with no valid key: every row is the mean of V over all keys (uniform softmax), never 0 or NaN;
    * padding query rows: plain attention over the valid keys (float64 here);
    * dead baskets (mass exactly 0) placed BEFORE the live keys, so that the tiled kernel counts them when
      they close and must hand the rows to the per-row kernel (the queue), and a basket made of holes;
    * a NaN in one head of one query row: that row and head only; a NaN in a masked key: every row of that
      item and head (NaN + lowest = NaN), as the contract says;
    * S_k = 0 (an empty key set: context 0) and D = 0 (every score 0)."""
    import numpy as np
    import torch

    from attncal.calibration import CalibrationConfig
    from attncal.calibration.oracle import attention_reference

    res: dict = {"cases": 0, "max_abs_err": {}}
    gen = torch.Generator().manual_seed(21)
    mask = torch.tensor([[1] * 7 + [0] * 3, [0] * 2 + [1] * 8, [0] * 10, [1] * 3 + [0, 0] + [1] * 5],
                        dtype=torch.long)  # right padded, left padded, empty, holes
    B, K, N, D, D_v = 4, 10, 2, 16, 8

    def run(q, k, v, m, rc, scale, reference):
        out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype, device=device)
        launch(lib, q.to(device), k.to(device), v.to(device), m.to(device), out, rc, N, scale, reference=reference)
        if device == "cuda":
            torch.cuda.synchronize()
        return out.cpu().double()

    for name, dt in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        worst = 0.0
        for pooling in ("cls", "last", "mean"):
            rc = CalibrationConfig(pooling=pooling, basket_size=2, strength=0.8, skip_short=False).resolve()
            q, k, v = attention_qkv(gen, B, K, K, N, D, D_v, dt, temp=2.0)
            ref = attention_reference(q, k, v, mask, rc, N)
            mean_v = v[2].double().mean(0)
            qh = q.double().reshape(B, K, N, D).transpose(1, 2)
            kh = k.double().reshape(B, K, N, D).transpose(1, 2)
            vh = v.double().reshape(B, K, N, D_v).transpose(1, 2)
            s = (qh @ kh.transpose(-1, -2)) / np.sqrt(D)
            plain = torch.softmax(s.masked_fill(mask[:, None, None, :] == 0, float("-inf")), -1) @ vh
            plain = plain.transpose(1, 2).reshape(B, K, N * D_v)
            for reference in (False, True):
                out = run(q, k, v, mask, rc, 0.0, reference)
                tag = f"{name} {pooling} {'per-row' if reference else 'tiled'}"
                assert bool(torch.isfinite(out).all()), f"{tag}: non-finite output"
                err = float((out - ref).abs().max())
                assert err <= ATTN_TOL[name] + 1e-5, f"{tag}: err {err:.3g} vs the oracle"
                assert float((out[2] - mean_v[None, :]).abs().max()) <= ATTN_TOL[name] + 1e-5, \
                    f"{tag}: fully masked item is not the mean of V"
                for b, rows in ((0, [7, 8, 9]), (1, [0, 1])):  # padding query rows: plain attention
                    assert float((out[b, rows] - plain[b, rows]).abs().max()) <= ATTN_TOL[name] + 1e-5, \
                        f"{tag}: padding rows of item {b} are not plain attention"
                worst = max(worst, err)
                res["cases"] += 1
            # NaN rules: row 2 of item 1 (left padded, its first valid token: calibrated by mean and cls pooling).
            row = 2
            qn = q.clone()
            qn[1, row, 1] = float("nan")  # head 0 of that row
            for reference in (False, True):
                out = run(qn, k, v, mask, rc, 0.0, reference)
                nan = torch.zeros(out.shape, dtype=torch.bool)
                nan[1, row, :D_v] = True
                assert bool(torch.isnan(out[nan]).all()), f"{name} {pooling}: NaN query row is not NaN"
                assert bool(torch.isfinite(out[~nan]).all()), f"{name} {pooling}: NaN leaked to other rows"
                kn = k.clone()
                kn[0, 8, D + 1] = float("nan")  # a masked key of item 0, head 1
                out = run(q, kn, v, mask, rc, 0.0, reference)
                nan = torch.zeros(out.shape, dtype=torch.bool)
                nan[0, :, D_v:] = True
                assert bool(torch.isnan(out[nan]).all()), f"{name} {pooling}: masked NaN key did not reach every row"
                assert bool(torch.isfinite(out[~nan]).all()), f"{name} {pooling}: masked NaN key leaked"
                res["cases"] += 2
        # Dead baskets before the live keys (the queue), and a basket made only of holes.
        for pooling, S in (("mean", 4), ("cls", 4), ("mean", 64), ("last", 100)):
            Kd = 400
            rc = CalibrationConfig(pooling=pooling, basket_size=S, strength=0.9, skip_short=False).resolve()
            md = torch.ones(2, Kd, dtype=torch.long)
            hs = int(rc.isolate_first) + S * ((150 + S - 1) // S)  # a basket boundary of item 1 (start 0)
            md[1, hs:hs + S] = 0  # one whole basket of holes: not counted as non-empty
            md[1, hs + S + 1] = 0  # and a single hole in the next one
            q, k, v = attention_qkv(gen, 2, Kd, Kd, N, D, D_v, dt, temp=1.0, dead=(0, 2 * S + 3), exact=True)
            ref = attention_reference(q, k, v, md, rc, N, 0.25)
            for reference in (False, True):
                out = run(q, k, v, md, rc, 0.25, reference)
                tag = f"{name} dead baskets ({pooling}, basket {S}, {'per-row' if reference else 'tiled'})"
                assert bool(torch.isfinite(out).all()), f"{tag}: non-finite output"
                err = float((out - ref).abs().max())
                assert err <= ATTN_TOL[name], f"{tag}: err {err:.3g}"
                worst = max(worst, err)
                res["cases"] += 1
        res["max_abs_err"][name] = worst
    # An empty key set and a zero head size.
    rc = CalibrationConfig(pooling="cls", strength=0.5).resolve()
    for shape in ((2, 1, 0, 8, 8), (2, 5, 5, 0, 8)):
        b_, sq, sk, d, dv = shape
        q = torch.randn(b_, sq, N * d)
        k = torch.randn(b_, sk, N * d)
        v = torch.rand(b_, sk, N * dv)
        m = torch.ones(b_, sk, dtype=torch.long)
        if sk == 0:  # no keys: an empty softmax times an empty V
            ref = torch.zeros(b_, sq, N * dv, dtype=torch.float64)
        else:  # D = 0: every score is 0, as with zero queries and keys of head size 1
            ref = attention_reference(torch.zeros(b_, sq, N), torch.zeros(b_, sk, N), v, m, rc, N, 1.0)
        out = torch.full((b_, sq, N * dv), float("nan"), device=device)
        launch(lib, q.to(device), k.to(device), v.to(device), m.to(device), out, rc, N, 0.0)
        if device == "cuda":
            torch.cuda.synchronize()
        err = float((out.cpu().double() - ref).abs().max())
        assert err <= 1e-6, f"shape {shape}: err {err:.3g}"
        res["cases"] += 1
    return res


def check_attention_vs_split(lib, n_cases: int = 12, seed: int = 22, device: str = "cuda",
                             launch=attention_launch) -> dict:
    """The kernel against torch SDPA + the split identity (attncal.calibration.split: plain attention of the
    valid keys plus one SDPA call per basket), float32 and float16, on items with at least one valid key and no
    holes (the split path's geometry refuses holes).  Baskets of mass exactly 0 are not generated: the split
    path does not treat them as empty (its module says so)."""
    import torch
    import torch.nn.functional as F

    from attncal.calibration import CalibrationConfig, compute_geometry
    from attncal.calibration.split import split_calibrated_attention

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    worst = {"float32": 0.0, "float16": 0.0}
    for i in range(n_cases):
        name, dt = (("float32", torch.float32), ("float16", torch.float16))[i % 2]
        pooling = ("cls", "last", "mean")[i % 3]
        S = rng.choice([8, 32, 64, 128])
        cfg = CalibrationConfig(pooling=pooling, basket_size=S, strength=rng.choice([0.5, 1.0]),
                                variant=rng.choice(["uniform", "cls-soft", "cls-hard"]), skip_short=False)
        rc = cfg.resolve()
        B, N, D, K = 3, rng.choice([2, 4]), rng.choice([32, 64]), rng.randint(100, 700)
        mask = torch.zeros(B, K, dtype=torch.long)
        for b in range(B):
            n = rng.randint(1, K)
            if rng.random() < 0.5:
                mask[b, K - n:] = 1
            else:
                mask[b, :n] = 1
        q, k, v = attention_qkv(gen, B, K, K, N, D, D, dt, temp=1.0)
        scale = 1.0 / D ** 0.5
        dq, dk, dv, dm = (x.to(device) for x in (q, k, v, mask))
        out = torch.empty(B, K, N * D, dtype=dt, device=device)
        launch(lib, dq, dk, dv, dm, out, rc, N, 0.0)
        heads = lambda x: x.view(B, K, N, D).transpose(1, 2)  # noqa: E731
        allowed = dm.bool()[:, None, None, :]
        full = F.scaled_dot_product_attention(heads(dq), heads(dk), heads(dv), attn_mask=allowed, scale=scale)
        full = full.contiguous()
        geom = compute_geometry(dm, rc)
        # allowed=None: the key padding is the geometry's token mask (baskets hold content keys only; the
        # original shares' LSE masks by it); the plain term above took the padding mask itself.
        split = split_calibrated_attention(heads(dq), heads(dk), heads(dv), full, None, rc, geom, scale)
        split = split.transpose(1, 2).reshape(B, K, N * D)
        if device == "cuda":
            torch.cuda.synchronize()
        err = float((out.double() - split.double()).abs().max())
        # Two float32 computations with different summation orders (and SDPA's own backend choice); in
        # float16 both round P (FlashAttention-style) and the context.
        tol = 1e-4 if name == "float32" else 2 * ATTN_TOL[name]
        if not err <= tol:
            raise AssertionError(f"split identity {name} ({rc}, K={K}): err {err:.3g} > {tol}")
        worst[name] = max(worst[name], err)
    return {"cases": n_cases, "max_abs_diff": worst}


def attention_bench(lib, B: int = 8, S: int = 8192, N: int = 12, D: int = 64, iters: int = 10) -> dict:
    """Latency and peak memory of the calibrated attention kernel against torch's flash SDPA (the flash backend
    forced; no mask, as flash takes none) on the same [B,S,N*D] float16 buffers: plain (strength 0),
    AllRows (mean pooling defaults: basket 128, every row calibrated) and PooledRow (cls defaults: the first
    token isolated with its original share, one calibrated row per item and head), all keys valid; and, for
    information, AllRows with half the batch padded by a quarter.  Peak memory is what each call allocates
    (torch.cuda.max_memory_allocated over the call, minus what was allocated before it), the kernel's output
    and workspace allocated by torch inside the call.  Targets (docs/native-kernels.md): latency <= 1.15x, memory <= 1.05x."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attncal.calibration import CalibrationConfig

    torch.manual_seed(0)
    dt = torch.float16
    q = torch.randn(B, S, N * D, device="cuda", dtype=dt)
    k = torch.randn(B, S, N * D, device="cuda", dtype=dt)
    v = torch.randn(B, S, N * D, device="cuda", dtype=dt)
    ones = torch.ones(B, S, dtype=torch.long, device="cuda")
    padded = ones.clone()
    padded[B // 2:, S * 3 // 4:] = 0
    heads = lambda x: x.view(B, S, N, D).transpose(1, 2)  # noqa: E731
    configs = {"plain": CalibrationConfig(pooling="mean", strength=0.0).resolve(),
               "all_rows": CalibrationConfig(pooling="mean").resolve(),
               "pooled_cls": CalibrationConfig(pooling="cls").resolve()}

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(heads(q), heads(k), heads(v))

    def ours(rc, mask):
        def call():
            out = torch.empty(B, S, N * D, dtype=dt, device="cuda")
            ws = torch.empty(lib.attncal_cuda_attention_workspace_bytes(B, S, N), dtype=torch.uint8, device="cuda")
            attention_launch(lib, q, k, v, mask, out, rc, N, 0.0, workspace=ws)
            return out
        return call

    def peak_mib(fn) -> float:
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        keep = fn()  # noqa: F841  (the output stays alive, as a caller's would)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    fns = {"flash_sdpa": flash, **{name: ours(rc, ones) for name, rc in configs.items()},
           "all_rows_padded": ours(configs["all_rows"], padded)}
    ms = {name: time_cuda(fn, iters) for name, fn in fns.items()}
    mib = {name: peak_mib(fn) for name, fn in fns.items()}
    # Sanity: plain (strength 0, all keys valid) is ordinary attention: compare with flash's output.
    ref = flash().transpose(1, 2).reshape(B, S, N * D)
    diff = float((fns["plain"]().float() - ref.float()).abs().max())
    flops = 4 * B * N * S * S * D  # Q K^T and P V
    out: dict = {"shape": {"B": B, "S": S, "N": N, "D": D}, "dtype": "float16", "median_ms": ms, "peak_mib": mib,
                 "tflops": {name: flops / t / 1e9 for name, t in ms.items()},
                 "max_abs_diff_plain_vs_flash": diff}
    out["latency_ratio_vs_flash"] = {name: ms[name] / ms["flash_sdpa"] for name in fns if name != "flash_sdpa"}
    out["memory_ratio_vs_flash"] = {name: mib[name] / max(mib["flash_sdpa"], 1e-9) for name in fns
                                    if name != "flash_sdpa"}
    out["targets"] = {"latency_ratio": 1.15, "memory_ratio": 1.05}
    out["meets_targets"] = {name: out["latency_ratio_vs_flash"][name] <= 1.15
                            and out["memory_ratio_vs_flash"][name] <= 1.05 for name in configs}
    return out


def run_attention_checks(lib, n_cases: int, bench: bool = True) -> dict:
    """Section 7: correctness (random, edge, split identity), then the benchmark; each printed as it ends."""
    res: dict = {}
    res["correctness"] = check_attention_correctness(lib, n_cases)
    print("calibrated attention correctness:", json.dumps(res["correctness"]))
    res["edge_cases"] = check_attention_edge_cases(lib)
    print("calibrated attention edge cases:", json.dumps(res["edge_cases"]))
    res["split_identity"] = check_attention_vs_split(lib)
    print("calibrated attention vs SDPA + split identity:", json.dumps(res["split_identity"]))
    if bench:
        res["bench"] = attention_bench(lib)
        print("calibrated attention vs flash SDPA, 8 x 8192, 12 x 64, fp16:", json.dumps(res["bench"], indent=1))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="only compile the kernel (no GPU needed)")
    ap.add_argument("--arch", type=int, action="append", default=None,
                    help="SM architecture(s) to compile for, e.g. 90 (default: the GPU's, or 80 and 90)")
    ap.add_argument("--cases", type=int, default=400, help="randomized correctness cases (default 400)")
    ap.add_argument("--fused-cases", type=int, default=200,
                    help="randomized correctness cases of the fused softmax op (default 200)")
    ap.add_argument("--attention-cases", type=int, default=150,
                    help="randomized correctness cases of the calibrated attention kernels (default 150)")
    ap.add_argument("--skip-attention", action="store_true", help="skip the calibrated attention section")
    ap.add_argument("--skip-model", action="store_true", help="skip the torch model timing")
    ap.add_argument("--skip-exports", action="store_true",
                    help="skip section 8 (fp16 exports on ONNX Runtime's CUDA provider)")
    ap.add_argument("--out-dir", default=None,
                    help="where to keep the compiled library and section 8's exports (default: a temp dir, "
                         "removed on exit)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.cases < 1:
        ap.error("--cases must be >= 1")
    if args.fused_cases < 1:
        ap.error("--fused-cases must be >= 1")
    if args.attention_cases < 1:
        ap.error("--attention-cases must be >= 1")
    archs = args.arch
    if not archs:
        archs = [80, 90]
        if not args.compile_only:
            import torch

            if not torch.cuda.is_available():
                print("error: no CUDA GPU visible to torch (use --compile-only to only compile)", file=sys.stderr)
                return 2
            major, minor = torch.cuda.get_device_capability()
            archs = [major * 10 + minor]
    # Without --out-dir the library and section 8's exports (~430 MB) go to a temp dir removed on exit.
    with contextlib.ExitStack() as stack:
        out_dir = Path(args.out_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="attncal-gpu-")))
        results = _checks(args, archs, out_dir)
    if "calibrated_attention" in results:
        ca = results["calibrated_attention"]
        summary = {"calibrated_attention": {
            "max_abs_err_vs_oracle": ca["correctness"]["max_abs_err"],
            "max_abs_diff_tiled_vs_per_row": ca["correctness"]["max_abs_diff_tiled_vs_per_row"],
            "split_identity_max_abs_diff": ca["split_identity"]["max_abs_diff"],
            **({"latency_ratio_vs_flash": ca["bench"]["latency_ratio_vs_flash"],
                "memory_ratio_vs_flash": ca["bench"]["memory_ratio_vs_flash"],
                "meets_targets": ca["bench"]["meets_targets"]} if "bench" in ca else {})}}
        print("summary:", json.dumps(summary))
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2))
        tmp.replace(args.json)
    return 0


def _checks(args: argparse.Namespace, archs: list[int], out_dir: Path) -> dict:
    """Compile the CUDA library into `out_dir`, then run the sections `args` selects (on a GPU)."""
    t0 = time.perf_counter()
    # Both launcher files: the calibration ops and the calibrated attention ops (section 7).
    lib_path = oplib.compile_cuda_kernel(out_dir / oplib.CUDA_LIBRARY, archs=archs,
                                         sources=("calibration_cuda.cu", "calibrated_attention_cuda.cu"))
    results: dict = {"compiled": str(lib_path), "archs": archs, "compile_s": round(time.perf_counter() - t0, 1)}
    print(f"compiled {lib_path} for sm_{', sm_'.join(map(str, archs))} in {results['compile_s']} s")
    if not args.compile_only:
        import torch

        lib = load(lib_path)
        results["device"] = torch.cuda.get_device_name()
        results["correctness"] = check_correctness(lib, args.cases)
        print("correctness:", json.dumps(results["correctness"]))
        results["fused_correctness"] = check_fused_correctness(lib, args.fused_cases)
        print("fused correctness:", json.dumps(results["fused_correctness"]))
        results["edge_cases"] = check_edge_cases(lib)
        print("edge cases:", json.dumps(results["edge_cases"]))
        results["bandwidth"] = bandwidth(lib)
        print("bandwidth:", json.dumps(results["bandwidth"], indent=1))
        results["fused"] = fused_bench(lib)
        print("fused softmax + calibration, 8 x 16 x 2048 x 2048 fp16:", json.dumps(results["fused"], indent=1))
        if not args.skip_attention:
            results["calibrated_attention"] = run_attention_checks(lib, args.attention_cases)
        if not args.skip_model:
            results["torch_overhead"] = torch_overhead()
            print("torch efficient vs uncalibrated:", json.dumps(results["torch_overhead"]))
            results["split_long_context"] = split_long_context()
            print("split placement on CUDA (SDPA), 8 x 8192, mean pooling:",
                  json.dumps(results["split_long_context"]))
        if not args.skip_exports:
            import fp16_exports
            from attncal.modelinfo import default_model_path

            results["fp16_exports"] = fp16_exports.run(default_model_path(), out_dir / "exports")
            print("fp16 exports on ONNX Runtime CUDA:", json.dumps(results["fp16_exports"], indent=1))
    return results


if __name__ == "__main__":
    sys.exit(main())
