"""Cost of calibration in PyTorch on a long-context encoder (CPU).

Compares, on one synthetic XLM-R-shaped encoder (random weights) at batch 8 x
2048 tokens:

  (i)   the uncalibrated eager forward,
  (ii)  the efficient calibration (`attncal.calibration.apply`) on the last-half layers,
  (iii) a naive full-tensor calibration in the style of the original research code,

and, on SDPA attention (`--engines sdpa,split-loop,split-batched --pooling mean`), the split
calibration (`attncal_sdpa`) in its two forms: one SDPA call per basket (loop) or one call over all
baskets with the queries repeated (batched), against uncalibrated SDPA.

Time: the engines are interleaved (i, ii, iii, i, ii, iii, ...) in one process
and the ratio of medians is reported.  Memory: each engine runs one forward in
a fresh subprocess; the peak resident set size during that forward (VmHWM,
reset through /proc/self/clear_refs just before it) minus the RSS before it is
the forward's working memory.  Extra memory = engine minus (i).

    python benchmarks/calibration_overhead.py [--batch 8] [--seq 2048] [--rounds 5] [--json out.json]
    python benchmarks/calibration_overhead.py --engines sdpa,split-loop,split-batched,efficient --pooling mean
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from functools import partial

ENGINES = ("uncalibrated", "efficient", "naive", "sdpa", "split-loop", "split-batched")
DEFAULT_ENGINES = ("uncalibrated", "efficient", "naive")


def build_model(seq: int):
    import torch
    from transformers import AutoModel

    from attncal.synthetic import make_config

    torch.manual_seed(0)
    cfg = make_config("xlm-roberta", layers=4, hidden=256, heads=4, intermediate=1024, max_positions=seq)
    return AutoModel.from_config(cfg, attn_implementation="eager").eval()


def make_batch(batch: int, seq: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 100, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask}


def run_engine(model, batch, engine: str, pooling: str = "cls"):
    import torch

    from attncal.calibration import CalibrationConfig, calibrate

    cfg = CalibrationConfig(pooling=pooling)  # published defaults: basket 128, λ 0.5, last half
    sdpa = engine in ("sdpa", "split-loop", "split-batched")
    model.config._attn_implementation = "sdpa" if sdpa else "eager"
    with torch.no_grad():
        if engine in ("uncalibrated", "sdpa"):
            return model(**batch).last_hidden_state
        if sdpa:
            with calibrate(model, cfg, implementation="split", split_mode=engine.split("-")[1]):
                return model(**batch).last_hidden_state
        impl = "efficient" if engine == "efficient" else "naive"
        with calibrate(model, cfg, implementation=impl):
            return model(**batch).last_hidden_state


def memory_child(engine: str, batch: int, seq: int, threads: int, pooling: str) -> None:
    """Subprocess body: one warm-up forward, then one measured forward."""
    import torch

    from attncal.bench.harness import _status_kib

    torch.set_num_threads(threads)
    model = build_model(seq)
    inputs = make_batch(batch, seq)
    run_engine(model, inputs, engine, pooling)  # warm-up: lazy inits, allocator pools
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak RSS to the current RSS
    out = run_engine(model, inputs, engine, pooling)
    peak = _status_kib("VmHWM")
    del out
    print(json.dumps({"engine": engine, "peak_extra_kib": peak - before}))


def measure_memory(engine: str, args) -> float:
    cmd = [sys.executable, __file__, "--child", engine, "--batch", str(args.batch), "--seq", str(args.seq),
           "--threads", str(args.threads), "--pooling", args.pooling]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_extra_kib"] / 1024.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES), help=f"subset of {', '.join(ENGINES)}; the "
                    "first is the baseline of the ratios")
    ap.add_argument("--pooling", choices=("cls", "mean"), default="cls", help="calibrated rows (default cls)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        memory_child(args.child, args.batch, args.seq, args.threads, args.pooling)
        return
    engines = [e for e in args.engines.split(",") if e]
    if not engines or any(e not in ENGINES for e in engines):
        ap.error(f"--engines must be a comma-separated subset of {', '.join(ENGINES)}")

    import torch
    from tqdm import tqdm

    from attncal.bench.timing import interleaved_times, medians

    torch.set_num_threads(args.threads)
    model = build_model(args.seq)
    inputs = make_batch(args.batch, args.seq)
    with tqdm(total=len(engines) * (args.rounds + 1), desc="timing runs", file=sys.stderr) as bar:
        times = interleaved_times({e: partial(run_engine, model, inputs, e, args.pooling) for e in engines},
                                  args.rounds, on_run=bar.update)
    mem = {e: measure_memory(e, args) for e in tqdm(engines, desc="memory (fresh processes)", file=sys.stderr)}
    med = medians(times)
    base = engines[0]
    rows = []
    for e in engines:
        rows.append({
            "engine": e,
            "median_s": med[e],
            "time_ratio": med[e] / med[base],
            "peak_forward_mib": mem[e],
            "extra_mib": mem[e] - mem[base],
        })
    meta = {
        "model": "synthetic XLM-R: 4 layers, hidden 256, 4 heads, 2050 positions (random weights)",
        "batch": args.batch, "seq": args.seq, "rounds": args.rounds, "threads": args.threads,
        "config": f"cls-soft, λ=0.5, basket 128, last-half layers (2 of 4), {args.pooling} pooling",
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
    }
    print(f"# {meta['model']}; batch {args.batch} x {args.seq} tokens; {args.threads} threads; "
          f"median of {args.rounds} interleaved rounds; torch {torch.__version__}")
    print(f"# config: {meta['config']}")
    print("| engine | median time (s) | time vs (i) | peak forward memory (MiB) | extra vs (i) (MiB) |")
    print("|---|---:|---:|---:|---:|")
    for i, r in zip(("(i)", "(ii)", "(iii)", "(iv)", "(v)", "(vi)"), rows):
        print(f"| {i} {r['engine']} | {r['median_s']:.3f} | {r['time_ratio']:.3f} | "
              f"{r['peak_forward_mib']:.1f} | {r['extra_mib']:+.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
