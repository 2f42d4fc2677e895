"""Throughput and peak memory of `attncal encode` against a bare `Encoder.encode` loop.

    attncal export default -o minilm
    python benchmarks/encode_throughput.py minilm --n 20000 --small 2000 --window 1024 [--engines bare,local,ray]
                                            [--triton-repo repo] [--rounds 1] [--json out.json]

Every measurement runs in a fresh subprocess (so its peak RSS, read from
getrusage of the process and its children, is its own), end to end: the bare
loop = load the texts into a list + Encoder() + Encoder.encode(texts, 32);
an engine = encode_corpus(...) including the scan, the writes and, for Ray,
starting the local instance.  Modes are interleaved round by round (bare,
local, ray, bare, ...) so a ratio compares runs made under the same load.
The corpus is synthetic pseudo-text of mixed length (20 to 1200 characters,
uniform), written once as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import json, resource, sys, time
mode, export, corpus, out, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
t0 = time.perf_counter()
if mode == "bare":
    from attncal.runtime.encoder import Encoder
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    emb = Encoder(export).encode(texts, batch_size=32)
    rows = len(texts)
else:
    from attncal.corpus import encode_corpus
    res = encode_corpus(export, corpus, out, engine=mode, batch_size=32, show_progress=False, **extra)
    rows = res.rows
wall = time.perf_counter() - t0
rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({"mode": mode, "rows": rows, "seconds": wall, "peak_rss_mib": rss / 1024}))
"""


def make_corpus(path: Path, n: int, seed: int = 0) -> None:
    from attncal.synthetic import synthetic_text

    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "text": synthetic_text(int(rng.integers(20, 1201)), seed=i)}) + "\n")


def run_child(mode: str, export: str, corpus: Path, work: Path, extra: dict) -> dict:
    out = Path(tempfile.mkdtemp(dir=work, prefix=f"{mode}-"))
    out.rmdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, export, str(corpus), str(out), json.dumps(extra)],
                          capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", help="an attncal export (e.g. of `default`)")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--small", type=int, default=2000, help="corpus size for the memory comparison (0: skip)")
    ap.add_argument("--engines", default="bare,local,ray")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--window", type=int, default=4096, help="rows sorted together (memory bound); use < --small")
    ap.add_argument("--triton-url", default=None, help="also run --engine triton against this gRPC address")
    ap.add_argument("--triton-model", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="encode-bench-"))
    try:
        return _bench(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _bench(args: argparse.Namespace, work: Path) -> int:
    big = work / "big.jsonl"
    make_corpus(big, args.n)
    modes = args.engines.split(",")
    extra = {"local": {"workers": args.workers, "window": args.window},
             "ray": {"workers": args.workers, "window": args.window}, "bare": {},
             "triton": {"workers": 4, "url": args.triton_url, "model_name": args.triton_model}}
    if args.triton_url:
        modes.append("triton")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            res = run_child(m, args.export, big, work, extra[m])
            results[m].append(res)
            print(f"round {r} {m:7s} {res['rows'] / res['seconds']:8.1f} rows/s  {res['seconds']:7.1f} s  "
                  f"peak RSS {res['peak_rss_mib']:7.0f} MiB", file=sys.stderr, flush=True)
    memory = None
    if args.small and "local" in modes:
        small = work / "small.jsonl"
        make_corpus(small, args.small)
        s = run_child("local", args.export, small, work, extra["local"])
        memory = {"small_rows": args.small, "small_rss_mib": s["peak_rss_mib"],
                  "big_rows": args.n, "big_rss_mib": max(x["peak_rss_mib"] for x in results["local"])}

    def rate(m: str) -> float:
        return sum(x["rows"] for x in results[m]) / sum(x["seconds"] for x in results[m])

    lines = ["| run | rows | rows/s | ratio | peak RSS MiB |", "|---|---:|---:|---:|---:|"]
    base = {"local": "bare", "ray": "local", "triton": "local"}
    for m in modes:
        ratio = f"{rate(m) / rate(base[m]):.3f} vs {base[m]}" if m in base and base[m] in results else "-"
        lines.append(f"| {m} | {args.n} | {rate(m):.1f} | {ratio} | "
                     f"{max(x['peak_rss_mib'] for x in results[m]):.0f} |")
    if memory:
        lines.append(f"\npeak RSS of local: {memory['small_rss_mib']:.0f} MiB at {memory['small_rows']} rows, "
                     f"{memory['big_rss_mib']:.0f} MiB at {memory['big_rows']} rows "
                     f"(x{memory['big_rss_mib'] / memory['small_rss_mib']:.3f})")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "memory": memory, "n": args.n}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
