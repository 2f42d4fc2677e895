"""Throughput and latency of served models, calibrated against uncalibrated, under concurrency.

For each concurrency level every model is measured in the same run, in
alternating rounds (A B A B ...), so a ratio compares like with like even when
the machine's speed drifts.  Each client thread owns one gRPC client and sends
requests of `batch` texts back to back; throughput is sequences per second of
wall time over the whole round, latency is per request.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..synthetic import synthetic_text
from .repository import discover
from .server import TritonServer, free_port


def _texts(n: int, seed: int, min_chars: int, max_chars: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [synthetic_text(int(rng.integers(min_chars, max_chars + 1)), seed=seed + i) for i in range(n)]


def _round(url: str, model: str, concurrency: int, requests_per_client: int, batch: int, texts: list[str],
           timeout_s: float) -> tuple[float, list[float], int]:
    """One timed round: (wall seconds, per-request latencies, errors)."""
    import tritonclient.grpc as grpcclient

    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    start = threading.Barrier(concurrency + 1)

    def client(k: int) -> None:
        c = grpcclient.InferenceServerClient(url)
        try:
            reqs = []
            for r in range(requests_per_client):
                chunk = [texts[((k * requests_per_client + r) * batch + j) % len(texts)] for j in range(batch)]
                arr = np.array([[t.encode()] for t in chunk], dtype=object)
                inp = grpcclient.InferInput("text", arr.shape, "BYTES")
                inp.set_data_from_numpy(arr)
                reqs.append(inp)
            start.wait(timeout=60)
            for inp in reqs:
                t0 = time.perf_counter()
                try:
                    c.infer(model, [inp], client_timeout=timeout_s)
                except Exception:
                    errors[k] += 1
                latencies[k].append(time.perf_counter() - t0)
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    start.wait(timeout=60)
    t0 = time.perf_counter()
    for t in threads:
        t.join(timeout=timeout_s * requests_per_client + 60)
    wall = time.perf_counter() - t0
    return wall, [x for lat in latencies for x in lat], sum(errors)


def bench_triton(
    target: str | os.PathLike,
    names: Sequence[str] | None = None,
    *,
    baseline: str | None = None,
    concurrency: Sequence[int] = (1, 4, 16),
    requests_per_client: int = 20,
    rounds: int = 2,
    requests_per_level: int | None = None,
    batch: int = 1,
    min_chars: int = 20,
    max_chars: int = 200,
    timeout_s: float = 30.0,
    warmup: int = 5,
    seed: int = 0,
    show_progress: bool = True,
) -> dict:
    """Measure `names` on a running server (`target` = "host:grpc_port") or on a repository
    directory (`target` = path; a server is started on free loopback ports and stopped after).

    `names` default to every attncal model in the repository; `baseline` (default: the
    uncalibrated one when exactly one is) is the denominator of the ratios.  `requests_per_level`,
    when given, is the number of requests per model, level and round, shared by the level's clients
    (each sends ceil(requests_per_level / concurrency)), so every level gets as many requests;
    otherwise each client sends `requests_per_client`.
    Returns {"rows": [{model, concurrency, seq_per_s, p50_ms, p95_ms, errors}], "ratios": [...]}.
    """
    from tqdm.auto import tqdm

    server = None
    is_repo = Path(target).is_dir()
    calibrated: dict[str, bool] = discover(target) if is_repo else {}
    names = list(names or calibrated)
    if not names:
        raise ValueError("no model names given and no attncal model found in the repository")
    if baseline is None:
        raw = [n for n in names if calibrated.get(n) is False]
        baseline = raw[0] if len(raw) == 1 else names[0]
    if baseline not in names:
        raise ValueError(f"baseline {baseline!r} is not among {names}")
    if is_repo:
        server = TritonServer(target, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
        server.start().wait_ready()
        url = server.grpc_url
    else:
        url = str(target)
    try:
        def per_client(c: int) -> int:
            return requests_per_client if requests_per_level is None else -(-requests_per_level // c)

        texts = _texts(max(256, max(c * per_client(c) for c in concurrency) * batch), seed, min_chars, max_chars)
        for n in names:  # warm up: first calls load sessions' lazy state
            _round(url, n, 1, warmup, batch, texts, timeout_s)
        per: dict[tuple[str, int], dict] = {}
        steps = [(c, r, n) for c in concurrency for r in range(rounds) for n in (names if r % 2 == 0 else names[::-1])]
        for c, _, n in tqdm(steps, desc="bench triton", unit="round", disable=not show_progress):
            wall, lat, err = _round(url, n, c, per_client(c), batch, texts, timeout_s)
            acc = per.setdefault((n, c), {"wall": 0.0, "lat": [], "errors": 0, "seqs": 0})
            acc["wall"] += wall
            acc["lat"] += lat
            acc["errors"] += err
            acc["seqs"] += c * per_client(c) * batch
        rows = []
        for (n, c), a in per.items():
            lat_ms = np.array(a["lat"]) * 1e3
            rows.append({"model": n, "calibrated": calibrated.get(n), "concurrency": c,
                         "seq_per_s": a["seqs"] / a["wall"], "p50_ms": float(np.percentile(lat_ms, 50)),
                         "p95_ms": float(np.percentile(lat_ms, 95)), "errors": a["errors"]})
        ratios = []
        for c in concurrency:
            base = per[(baseline, c)]
            for n in names:
                if n == baseline:
                    continue
                a = per[(n, c)]
                ratios.append({"model": n, "baseline": baseline, "concurrency": c,
                               "throughput_ratio": (a["seqs"] / a["wall"]) / (base["seqs"] / base["wall"]),
                               "p50_ratio": float(np.percentile(a["lat"], 50) / np.percentile(base["lat"], 50))})
        return {"url": url, "batch": batch, "requests_per_client": {c: per_client(c) for c in concurrency},
                "rounds": rounds,
                "rows": rows, "ratios": ratios}
    finally:
        if server is not None:
            server.stop()


def format_table(result: dict) -> str:
    """Markdown table of `bench_triton`'s result."""
    lines = ["| model | concurrency | seq/s | p50 ms | p95 ms | errors |", "|---|---:|---:|---:|---:|---:|"]
    for r in sorted(result["rows"], key=lambda r: (r["concurrency"], r["model"])):
        lines.append(f"| {r['model']} | {r['concurrency']} | {r['seq_per_s']:.1f} | {r['p50_ms']:.2f} | "
                     f"{r['p95_ms']:.2f} | {r['errors']} |")
    for q in result["ratios"]:
        lines.append(f"\n{q['model']} / {q['baseline']} at concurrency {q['concurrency']}: "
                     f"throughput x{q['throughput_ratio']:.3f}, p50 latency x{q['p50_ratio']:.3f}")
    return "\n".join(lines)
