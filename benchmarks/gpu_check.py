"""GPU check of the CUDA calibration kernels (one command, <= 5 minutes of GPU time).

For a machine with an NVIDIA GPU, torch (CUDA build) and nvcc, but neither
onnxruntime-gpu nor TensorRT.  It:

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
     the synthetic long model (XLM-R, 4 layers, hidden 256, 4 heads).

    python benchmarks/gpu_check.py [--json out.json] [--cases 400] [--fused-cases 200]
    python benchmarks/gpu_check.py --compile-only     # step 1 only (works without a GPU)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attncal.runtime import oplib  # noqa: E402


class Params(ctypes.Structure):
    """Mirror of AttncalParams in plugins/kernels/attncal_params.h."""

    _fields_ = [(n, ctypes.c_int32) for n in ("all_rows", "pool_last", "basket_size", "isolate_first",
                                               "isolate_last", "first_mode", "last_mode", "skip_short")] + [
        (n, ctypes.c_float) for n in ("strength", "first_weight", "last_weight")]


def params_of(rc) -> Params:
    return Params(int(rc.all_rows), int(rc.pool_last), rc.basket_size, int(rc.isolate_first), int(rc.isolate_last),
                  rc.first_mode, rc.last_mode, int(rc.skip_short), rc.strength, rc.first_weight, rc.last_weight)


def load(path: Path):
    lib = ctypes.CDLL(str(path))
    for fn in (lib.attncal_cuda_calibrate, lib.attncal_cuda_softmax_calibrate):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 4 + [
            ctypes.POINTER(Params), ctypes.c_void_p, ctypes.c_void_p]
    lib.attncal_cuda_last_error.restype = ctypes.c_char_p
    lib.attncal_cuda_workspace_bytes.restype = ctypes.c_size_t
    lib.attncal_cuda_workspace_bytes.argtypes = [ctypes.c_int64]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="only compile the kernel (no GPU needed)")
    ap.add_argument("--arch", type=int, action="append", default=None,
                    help="SM architecture(s) to compile for, e.g. 90 (default: the GPU's, or 80 and 90)")
    ap.add_argument("--cases", type=int, default=400, help="randomized correctness cases (default 400)")
    ap.add_argument("--fused-cases", type=int, default=200,
                    help="randomized correctness cases of the fused softmax op (default 200)")
    ap.add_argument("--skip-model", action="store_true", help="skip the torch model timing")
    ap.add_argument("--out-dir", default=None, help="where to put the compiled library (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.cases < 1:
        ap.error("--cases must be >= 1")
    if args.fused_cases < 1:
        ap.error("--fused-cases must be >= 1")
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
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="attncal-gpu-"))
    t0 = time.perf_counter()
    lib_path = oplib.compile_cuda_kernel(out_dir / oplib.CUDA_LIBRARY, archs=archs)
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
        if not args.skip_model:
            results["torch_overhead"] = torch_overhead()
            print("torch efficient vs uncalibrated:", json.dumps(results["torch_overhead"]))
            results["split_long_context"] = split_long_context()
            print("split placement on CUDA (SDPA), 8 x 8192, mean pooling:",
                  json.dumps(results["split_long_context"]))
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
