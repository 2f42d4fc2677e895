"""GPU timing of the CUDA calibration kernels and of the calibrated attention kernel (one command).

For a machine with an NVIDIA GPU, a CUDA build of torch and nvcc; onnxruntime-gpu is used by the last
section only, where it is installed.  Correctness is not checked here: that is the GPU test suite,
tests/gpu (`pytest -m gpu`), which `make gpu-check` runs first, then this script.  It:

  1. compiles the CUDA launchers with nvcc for this GPU (tests/support/cuda.py, through
     attncal.runtime.oplib.compile_cuda_kernel; no CMake or ORT headers needed);
  2. measures the calibration kernel's effective bandwidth on B=32, H=16, K=8192 pooled rows
     (bytes read + written / time, in place on a [B,H,1,K] tensor) against the GPU's copy bandwidth
     (torch copy_ of the same bytes);
  3. times the fused op at B=8, H=16, Q=K=2048 fp16 (AllRows) against torch.softmax alone on the same
     tensor, against the copy bandwidth, and against torch.softmax + the separate calibration; and the
     separate calibration out of place vs in place (AllRows and pooled);
  4. times the calibrated attention kernel and its peak memory against torch's flash SDPA at B=8,
     S=8192, 12 heads x 64, float16 (targets <= 1.15x, <= 1.05x);
  5. times the torch efficient calibration vs uncalibrated at batch 8 x 2048, and split placement
     (SDPA) vs uncalibrated SDPA at 8 x 8192 with peak memory, on the synthetic long model (XLM-R,
     4 layers, hidden 256, 4 heads);
  6. times the `attncal export --fp16` exports of all-MiniLM-L6-v2 on ONNX Runtime's CUDA provider
     (benchmarks/fp16_exports.py: the default Encoder, calibrated vs uncalibrated, with the parity it
     reports); skipped, saying so, where onnxruntime-gpu is not installed.

Neither this script nor the GPU test suite has run on a GPU yet (no GPU was lent when they were
written): the targets are design expectations, not measurements.

    python benchmarks/gpu_check.py [--json out.json] [--skip-attention] [--skip-model] [--skip-exports]
    python benchmarks/gpu_check.py --compile-only     # step 1 only (works without a GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # support: the launchers, shared with the GPU tests
sys.path.insert(0, str(ROOT / "benchmarks"))  # fp16_exports (section 6)

from attncal.runtime import oplib  # noqa: E402
from support.cuda import (attention_launch, attention_workspace_bytes, compile_launchers, launch, load,  # noqa: E402
                          params_of)

MIN_ARCH = 50
"""The lowest SM architecture --arch takes (nvcc's oldest targets are above it)."""


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
            ws = torch.empty(attention_workspace_bytes(lib, B, S, N), dtype=torch.uint8, device="cuda")
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
    is the case split placement exists for.  Its parity against eager calibration on CUDA is
    tests/gpu/test_torch_cuda.py's."""
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
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="only compile the kernels (no GPU needed)")
    ap.add_argument("--arch", type=int, action="append", default=None,
                    help="SM architecture(s) to compile for, e.g. 90 (default: the GPU's, or 80 and 90)")
    ap.add_argument("--skip-attention", action="store_true", help="skip the calibrated attention timing")
    ap.add_argument("--skip-model", action="store_true", help="skip the torch model timing")
    ap.add_argument("--skip-exports", action="store_true",
                    help="skip section 6 (fp16 exports on ONNX Runtime's CUDA provider)")
    ap.add_argument("--out-dir", default=None,
                    help="where to keep the compiled library and section 6's exports (default: a temp dir, "
                         "removed on exit)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.arch and min(args.arch) < MIN_ARCH:
        ap.error(f"--arch takes SM architectures such as 80 or 90 (>= {MIN_ARCH}), got {min(args.arch)}")
    archs = args.arch
    if not archs:
        archs = [80, 90]
        if not args.compile_only:
            from support.cuda import device_archs, torch_cuda_unavailable

            reason = torch_cuda_unavailable()
            if reason:
                print(f"error: {reason} (use --compile-only to only compile)", file=sys.stderr)
                return 2
            archs = device_archs()
    # Without --out-dir the library and section 6's exports (~430 MB) go to a temp dir removed on exit.
    with contextlib.ExitStack() as stack:
        out_dir = Path(args.out_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="attncal-gpu-")))
        results = _timings(args, archs, out_dir)
    if "calibrated_attention" in results:
        bench = results["calibrated_attention"]
        print("summary:", json.dumps({"calibrated_attention": {
            key: bench[key] for key in ("latency_ratio_vs_flash", "memory_ratio_vs_flash", "meets_targets")}}))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2))
        tmp.replace(args.json)
    return 0


def _timings(args: argparse.Namespace, archs: list[int], out_dir: Path) -> dict:
    """Compile the CUDA launchers into `out_dir`, then run the timings `args` selects (on a GPU)."""
    t0 = time.perf_counter()
    lib_path = compile_launchers(out_dir / oplib.CUDA_LIBRARY, archs)
    results: dict = {"compiled": str(lib_path), "archs": archs, "compile_s": round(time.perf_counter() - t0, 1)}
    print(f"compiled {lib_path} for sm_{', sm_'.join(map(str, archs))} in {results['compile_s']} s")
    if args.compile_only:
        return results
    import torch

    lib = load(lib_path)
    results["device"] = torch.cuda.get_device_name()
    results["bandwidth"] = bandwidth(lib)
    print("bandwidth:", json.dumps(results["bandwidth"], indent=1))
    results["fused"] = fused_bench(lib)
    print("fused softmax + calibration, 8 x 16 x 2048 x 2048 fp16:", json.dumps(results["fused"], indent=1))
    if not args.skip_attention:
        results["calibrated_attention"] = attention_bench(lib)
        print("calibrated attention vs flash SDPA, 8 x 8192, 12 x 64, fp16:",
              json.dumps(results["calibrated_attention"], indent=1))
    if not args.skip_model:
        results["torch_overhead"] = torch_overhead()
        print("torch efficient vs uncalibrated:", json.dumps(results["torch_overhead"]))
        results["split_long_context"] = split_long_context()
        print("split placement on CUDA (SDPA), 8 x 8192, mean pooling:", json.dumps(results["split_long_context"]))
    if not args.skip_exports:
        import fp16_exports
        from attncal.modelinfo import default_model_path

        results["fp16_exports"] = fp16_exports.run(default_model_path(), out_dir / "exports")
        print("fp16 exports on ONNX Runtime CUDA:", json.dumps(results["fp16_exports"], indent=1))
    return results


if __name__ == "__main__":
    sys.exit(main())
