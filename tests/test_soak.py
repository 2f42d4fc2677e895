"""Serving soak: the real tritonserver under 8 concurrent clients for 4,000 requests (bounded, loopback).

Mixed text lengths (one character to beyond the max length, 1-3 texts per request), the calibrated
and the uncalibrated model, and 1 % malformed requests.  Checks: every answer equals the local
Encoder's (<= 1e-5), every malformed request is rejected, and the server's peak resident memory
(tritonserver plus its Python-backend stubs, i.e. its process group) over the last 3,600 requests is
within 10 % of its peak over the first 400.  Prints the request rate and p99 latency.

Uses the server fixtures of tests/test_serving.py (skipped like them without the serving env).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from test_serving import TOL, encoders, exports, repo, server  # noqa: F401  (fixtures, reused)

tritonclient = pytest.importorskip("tritonclient")
import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

CLIENTS = 8
REQUESTS = 4000
BASELINE_AT = 400
MALFORMED_SHARE = 0.01
TIME_LIMIT_S = 110


def _group(pgid: int) -> list[Path]:
    """/proc/PID of every process in group `pgid` (the server and its Python stubs)."""
    procs = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:  # field 5: the process group
                procs.append(d)
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
    return procs


def reset_group_peak(pgid: int) -> None:
    """Start a new high-water mark for every process in group `pgid`: VmHWM := VmRSS (Linux >= 4.0)."""
    for d in _group(pgid):
        (d / "clear_refs").write_text("5")


def group_peak_kib(pgid: int) -> int:
    """The peak resident memory (VmHWM) since `reset_group_peak`, summed over the processes of group `pgid`, KiB."""
    total = 0
    for d in _group(pgid):
        try:
            status = (d / "status").read_text()
        except OSError:
            continue
        total += next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM:")), 0)
    return total


def _malformed(kind: int):
    """(input array, datatype) of a request the server must reject."""
    return [
        (np.array([[b""]], dtype=object), "BYTES"),                 # empty text
        (np.array([[b"ok"], [b"\xff\xfe\x80"]], dtype=object), "BYTES"),  # not UTF-8
        (np.array([[1], [2]], dtype=np.int32), "INT32"),            # wrong dtype
        (np.array([[b"a", b"b"]], dtype=object), "BYTES"),          # wrong shape
    ][kind % 4]


def test_serving_soak(server, encoders):  # noqa: F811
    from attncal.synthetic import synthetic_text

    rng = np.random.default_rng(13)
    pool = [synthetic_text(int(n), seed=i) for i, n in enumerate(rng.integers(1, 700, size=60))] + ["x" * 2000]
    expected = {m: encoders[m].encode(pool) for m in ("cal", "raw")}
    assert np.abs(expected["cal"] - expected["raw"]).max() > 2 * TOL  # a swapped model would be a wrong answer
    n_bad = int(REQUESTS * MALFORMED_SHARE)
    bad_at = set(rng.choice(REQUESTS, size=n_bad, replace=False).tolist())
    plan = []
    for i in range(REQUESTS):
        model = "cal" if rng.random() < 0.5 else "raw"
        if i in bad_at:
            plan.append((model, None, int(rng.integers(0, 4))))
        else:
            plan.append((model, rng.integers(0, len(pool), size=int(rng.integers(1, 4))).tolist(), 0))

    wrong: list[str] = []
    accepted_bad: list[int] = []
    rejected_good: list[str] = []
    rejected_bad = [0]
    latencies: list[float] = []
    lock = threading.Lock()

    def run_range(start: int, stop: int) -> None:
        cursor = [start]

        def worker() -> None:
            c = grpcclient.InferenceServerClient(server.grpc_url)
            try:
                while True:
                    with lock:
                        i = cursor[0]
                        cursor[0] += 1
                    if i >= stop:
                        return
                    model, idx, kind = plan[i]
                    if idx is None:
                        arr, dtype = _malformed(kind)
                    else:
                        arr, dtype = np.array([[pool[j].encode()] for j in idx], dtype=object), "BYTES"
                    inp = grpcclient.InferInput("text", list(arr.shape), dtype)
                    inp.set_data_from_numpy(arr)
                    t0 = time.perf_counter()
                    try:
                        emb = c.infer(model, [inp], client_timeout=30).as_numpy("sentence_embedding")
                    except InferenceServerException as exc:
                        with lock:
                            if idx is None:
                                rejected_bad[0] += 1
                            else:
                                rejected_good.append(f"request {i}: {exc}")
                        continue
                    dt = time.perf_counter() - t0
                    with lock:
                        if idx is None:
                            accepted_bad.append(i)
                            continue
                        latencies.append(dt)
                        err = float(np.abs(emb - expected[model][idx]).max()) if emb.shape == (len(idx), 32) else 1e9
                        if err > TOL:
                            wrong.append(f"request {i} ({model}, texts {idx}): max diff {err:.3g}")
            finally:
                c.close()

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=TIME_LIMIT_S)
        assert not any(t.is_alive() for t in threads), "soak clients did not finish in time"

    # The server's peak memory over the first BASELINE_AT requests (the warm-up: arenas grow to the shapes
    # they meet) against its peak over the rest, the same mix: what a leak keeps raises the later peak.  Peaks
    # are high-water marks, reset at each phase's start: none is missed, and none depends on when it is read.
    t_start = time.perf_counter()
    reset_group_peak(server.pid)
    run_range(0, BASELINE_AT)
    peak_baseline = group_peak_kib(server.pid)
    reset_group_peak(server.pid)
    run_range(BASELINE_AT, REQUESTS)
    elapsed = time.perf_counter() - t_start
    peak_end = group_peak_kib(server.pid)

    rate = REQUESTS / elapsed
    p50, p99 = (1e3 * float(np.percentile(latencies, q)) for q in (50, 99))
    growth = peak_end / peak_baseline - 1
    print(f"\nsoak: {REQUESTS} requests ({n_bad} malformed) from {CLIENTS} clients in {elapsed:.1f} s = {rate:.1f} "
          f"req/s; latency p50 {p50:.1f} ms, p99 {p99:.1f} ms; server peak RSS {peak_baseline / 1024:.1f} MiB over "
          f"the first {BASELINE_AT} requests, {peak_end / 1024:.1f} MiB over the other {REQUESTS - BASELINE_AT} "
          f"({100 * growth:+.1f} %)")
    assert wrong == [], wrong[:5]
    assert rejected_good == [], rejected_good[:5]
    assert accepted_bad == [] and rejected_bad[0] == n_bad
    assert len(latencies) == REQUESTS - n_bad
    assert peak_baseline > 0 and abs(growth) <= 0.10, (peak_baseline, peak_end)
    assert server.running()
    if os.environ.get("ATTNCAL_SOAK_REPORT"):
        Path(os.environ["ATTNCAL_SOAK_REPORT"]).write_text(
            f"{rate:.1f} req/s, p50 {p50:.1f} ms, p99 {p99:.1f} ms, peak RSS {peak_baseline / 1024:.1f} -> "
            f"{peak_end / 1024:.1f} MiB ({100 * growth:+.1f} %), {elapsed:.1f} s\n")
