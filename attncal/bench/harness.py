"""The measurement: interleaved latency, throughput and per-process peak memory.

Method (so that every ratio comes from one run on one machine state):
* every engine is warmed up on every shape first;
* then for each shape, `repeats` rounds run the engines in turn (A B C A B C ...);
* threads are pinned (torch and ORT intra-op) and recorded;
* peak memory is measured in fresh subprocesses per (engine, shape): the peak RSS
  (VmHWM, reset through /proc/self/clear_refs once the model is loaded) over two
  batches, minus the RSS before them.  This is the working memory of inference
  (allocator arenas included), independent of how much the model weights take.
  One process is not enough: where the allocators place their blocks differs from
  process to process, and the same engine and shape then peaks in one of a few
  modes, so a single pair of probes can mislead (measured: docs/performance-log.md,
  "Peak memory: one process is not enough").  So each (engine, shape) is probed in
  `memory_probes` processes, the engines interleaved, and the median is reported
  with every probe kept in the results.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from ..cpuinfo import cpu_class
from ..runtime import oplib
from ..versions import library_versions
from .engines import OWN_PROCESS, EngineUnavailable, Workspace, make_engine, make_feeds, peer_engine
from .timing import interleaved_times


@dataclass
class Row:
    engine: str
    seq: int
    batch: int
    p50_ms: float
    p95_ms: float
    seq_per_s: float
    tok_per_s: float
    peak_mib: float | None = None  # median of peak_mib_probes
    peak_mib_probes: list[float] | None = None
    latency_vs_ort: float | None = None
    latency_vs_torch: float | None = None
    memory_vs_ort: float | None = None
    memory_vs_torch: float | None = None
    latency_vs_peer: float | None = None  # against the model's peer (engines.peer_engine)
    memory_vs_peer: float | None = None
    times_ms: list[float] | None = None  # every timed round, in round order (the engines took turns in each)


def _vocab(ws: Workspace) -> int:
    cfg = json.loads((Path(ws.model) / "config.json").read_text()) if (Path(ws.model) / "config.json").exists() else {}
    return int(cfg.get("vocab_size", 100))


def machine_info(threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = library_versions(("attncal", "torch", "transformers", "onnxruntime", "onnx", "numpy"), omit_missing=True)
    return {"cpu": cpu, "cpu_class": cpu_class(), "cpu_path": kernel_cpu_path(),
            "cpu_path_forced": bool(os.environ.get(oplib.CPU_PATH_ENV)), **oplib.blas_record(),
            "cores": os.cpu_count(), "threads": threads,
            "python": platform.python_version(), "platform": platform.platform(), "versions": versions}


def kernel_cpu_path() -> str | None:
    """The instruction-set path (oplib.CPU_PATHS) the attncal library's CPU kernels take in this process: the widest
    this CPU runs, or the one $ATTNCAL_CPU_PATH names; None where no library is loaded, and no native engine runs.
    The same path on two machines runs the same kernels, so a ratio that moves on one path shows there."""
    library = oplib.resolve_library(notice=False)
    return oplib.cpu_path(library) if library is not None else None


def source_commit() -> str | None:
    """The commit of the git checkout attncal runs from, with "+changes" where attncal/ or plugins/ differ from it,
    so a figure names the code it measured; None for an installed attncal."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists() or not (root / "pyproject.toml").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
        changes = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "attncal", "plugins"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if changes else "")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def memory_child(ws_json: str, engine: str, seq: int, batch: int) -> dict:
    """Body of the memory subprocess (see module docstring)."""
    ws = Workspace.from_json(ws_json)
    run = make_engine(engine, ws)
    feeds = make_feeds(batch, seq, _vocab(ws))
    # Baseline: model loaded, nothing run yet.  The peak then covers everything inference needs,
    # including what an allocator arena grows on the first batch and keeps for the next ones.
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    for _ in range(2):
        out = run(feeds)
        del out
    peak = _status_kib("VmHWM")
    return {"peak_mib": (peak - before) / 1024.0}


def measure_memory(ws: Workspace, engine: str, seq: int, batch: int) -> float:
    cmd = [sys.executable, "-m", "attncal.bench.harness", "--child", ws.to_json(), engine, str(seq), str(batch)]
    env = {**os.environ, "OMP_NUM_THREADS": str(ws.threads)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"memory probe for {engine} seq={seq} batch={batch} failed:\n{res.stderr[-2000:]}")
    return float(json.loads(res.stdout.strip().splitlines()[-1])["peak_mib"])


def clock_problem(clock: str, threads: int, engines: list[str]) -> str | None:
    """Why `clock` cannot time these engines at `threads` intra-op threads, or None: the cpu clock counts this
    process's CPU time, so it needs engines that run in this process, on one thread (no worker spinning)."""
    if clock != "cpu":
        return None
    elsewhere = [e for e in engines if e in OWN_PROCESS]
    if elsewhere:
        verb = "runs in its" if len(elsewhere) == 1 else "run in their"
        return f"the cpu clock times this process, and {', '.join(elsewhere)} {verb} own process"
    if threads != 1:
        return f"the cpu clock needs one intra-op thread (--threads 1), got {threads}"
    return None


def run_bench(
    ws: Workspace,
    engines: list[str],
    seqs: list[int],
    batches: list[int],
    repeats: int,
    *,
    memory: bool = True,
    memory_probes: int = 3,
    progress: bool = True,
    clock: str = "wall",
) -> tuple[list[Row], dict[str, str]]:
    """Measure every (engine, seq, batch); returns rows and notes on skipped engines.

    With `memory`, every (engine, seq, batch) is probed in `memory_probes` fresh processes (see the module
    docstring), the engines taking turns.  `clock` "cpu" times this process's CPU time (timing.CLOCKS): it
    needs one intra-op thread and engines that run in this process."""
    if memory and memory_probes < 1:
        raise ValueError(f"memory_probes must be >= 1, got {memory_probes}")
    problem = clock_problem(clock, ws.threads, engines) if clock != "wall" else None
    if problem:
        raise ValueError(problem)
    from tqdm.auto import tqdm

    notes: dict[str, str] = {}
    runners = {}
    for e in engines:
        try:
            runners[e] = make_engine(e, ws, own_process=True)  # the peers in their own processes
        except EngineUnavailable as exc:
            notes[e] = str(exc)
    shapes = [(s, b) for s in seqs for b in batches]
    total = len(shapes) * len(runners) * (repeats + 1) + (len(shapes) * len(runners) * memory_probes if memory else 0)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress)
    vocab = _vocab(ws)
    peer = peer_engine(list(runners))  # before the runners are freed for the memory probes
    times: dict[tuple[str, int, int], list[float]] = {}
    for seq, batch in shapes:
        feeds = make_feeds(batch, seq, vocab)
        # rotate: each engine takes each place in the round in turn, so that its place does not bias its time
        shape_times = interleaved_times({e: partial(run, feeds) for e, run in runners.items()}, repeats,
                                        on_run=bar.update, clock=clock, rotate=True)
        times.update(((e, seq, batch), ts) for e, ts in shape_times.items())
    peaks: dict[tuple[str, int, int], list[float]] = {}
    if memory:
        runners.clear()  # free the models before probing memory in fresh processes
        for seq, batch in shapes:
            for i in range(memory_probes):
                for e in [e for e in engines if e not in notes]:
                    bar.set_postfix_str(f"memory {e} {batch}x{seq} ({i + 1}/{memory_probes})")
                    peaks.setdefault((e, seq, batch), []).append(measure_memory(ws, e, seq, batch))
                    bar.update()
    bar.close()
    rows = []
    for (e, seq, batch), ts in times.items():
        ts_sorted = sorted(ts)
        p50 = statistics.median(ts_sorted)
        p95 = ts_sorted[min(len(ts_sorted) - 1, max(0, int(round(0.95 * (len(ts_sorted) - 1)))))]
        probes = peaks.get((e, seq, batch))
        rows.append(Row(e, seq, batch, 1e3 * p50, 1e3 * p95, batch / p50, batch * seq / p50,
                        statistics.median(probes) if probes else None, probes, times_ms=[1e3 * t for t in ts]))
    by_key = {(r.engine, r.seq, r.batch): r for r in rows}
    for r in rows:
        for ref, attr in (("ort", "vs_ort"), ("torch", "vs_torch"), (peer, "vs_peer")):
            base = by_key.get((ref, r.seq, r.batch))
            if base is None:
                continue
            setattr(r, f"latency_{attr}", r.p50_ms / base.p50_ms)
            if r.peak_mib is not None and base.peak_mib:
                setattr(r, f"memory_{attr}", r.peak_mib / base.peak_mib)
    return rows, notes


def rows_to_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]


def _child_main(argv: list[str]) -> None:
    ws_json, engine, seq, batch = argv
    import torch

    ws = Workspace.from_json(ws_json)
    torch.set_num_threads(ws.threads)
    print(json.dumps(memory_child(ws_json, engine, int(seq), int(batch))))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child_main(sys.argv[2:])
