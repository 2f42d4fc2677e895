"""Memory on Linux: what is available to this process, and the resident size of a process tree over time.

The exporter refuses a job that cannot fit before it starts (`available_bytes`), and the tests and
benchmarks that hold the export to a per-step budget sample the resident set of the export process and
all its children together (`TreeSampler`), because a step that runs in a child process counts as much
as one that runs in the parent.  Only the standard library: every layer may import this module.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from pathlib import Path
from typing import Callable

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MIB = 1024 ** 2
GIB = 1024 ** 3


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup (v2 `memory.max`, or v1 `memory.limit_in_bytes`), if limited."""
    try:
        rel = next((ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                    if ln.startswith("0::")), None)
    except OSError:
        rel = None
    candidates = []
    if rel is not None:
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        candidates.append((base / "memory.max", base / "memory.current"))
    candidates.append((Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                       Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))
    for limit_file, usage_file in candidates:
        try:
            limit = limit_file.read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:
                continue
            return max(0, int(limit) - int(usage_file.read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def available_bytes() -> int | None:
    """Memory this process can still take without swapping or an OOM kill: the smaller of the kernel's
    MemAvailable and the room under the cgroup limit.  None where neither can be read (not Linux)."""
    values = [v for v in (_meminfo_available(), _cgroup_room()) if v is not None]
    return min(values) if values else None


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc/PID/task/*/children, else a scan of every process's parent)."""
    kids: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        for task in task_dir.iterdir():
            kids.extend(int(x) for x in (task / "children").read_text().split())
        return kids
    except (OSError, ValueError):
        pass
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return kids


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _rss(p)
        todo.extend(_children(p))
    return total


EXPORT_LIBRARIES = "torch, transformers, onnx, onnxruntime, onnx_ir, onnxscript, sentence_transformers"


def interpreter_rss(imports: str = EXPORT_LIBRARIES) -> int:
    """Resident bytes of a fresh interpreter that has imported `imports`: the fixed part of a process's
    memory, which budgets stated in weight sizes are measured above."""
    import subprocess
    import sys

    code = f"import {imports}\nprint(open('/proc/self/statm').read().split()[1])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    return int(out.stdout.split()[-1]) * _PAGE


# A test hook, None otherwise: called as STEP_HOOK(label) in the process that calls `TreeSampler.mark`, at the
# moment a phase starts, and as STEP_HOOK(None) when the sampler stops.  A test reads high-water marks there,
# exactly at the phase boundaries (a sample misses a peak shorter than its interval, and a label set from outside
# lags the phase), or stops the process at a chosen step.
STEP_HOOK: Callable[[str | None], None] | None = None


class TreeSampler:
    """Samples the resident size of a process tree in a background thread, keeping the peak per label.

    `mark(label)` starts a new phase (an export step); `peaks` maps each label to the largest tree RSS
    seen while it was current.  Sampling misses a peak shorter than `interval`, so budgets checked with it
    are for steps that hold memory for longer than that (weights, graphs), not for short spikes."""

    def __init__(self, pid: int | None = None, interval: float = 0.02) -> None:
        self.pid = pid if pid is not None else os.getpid()
        self.interval = interval
        self.peaks: dict[str, int] = {}
        self.label = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="attncal-rss-sampler", daemon=True)

    def mark(self, label: str) -> None:
        if STEP_HOOK is not None:
            STEP_HOOK(label)
        self.label = label

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = tree_rss(self.pid)
            label = self.label
            if rss > self.peaks.get(label, 0):
                self.peaks[label] = rss
            time.sleep(self.interval)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if STEP_HOOK is not None:
            STEP_HOOK(None)

    @property
    def peak(self) -> int:
        return max(self.peaks.values(), default=0)


RELEASE_FROM_BYTES = 64 * 1024**2
"""Float32 weight bytes from which `release_freed_memory` collects.  Below it, what a step frees is small
against the interpreter's own heap, and a full collection with torch loaded costs more time than the
memory it returns is worth (an export collects after each of its steps)."""


def release_freed_memory(weight_bytes: int) -> None:
    """Return freed heap memory to the operating system (glibc `malloc_trim`) after a step that built and
    dropped large objects (a torch model, a parsed graph), so the next step, or a child process, has it.
    Python's collector runs first (reference cycles keep torch modules alive); a no-op off glibc, and for a
    model of fewer than `RELEASE_FROM_BYTES` float32 weight bytes (`weight_bytes`)."""
    if weight_bytes < RELEASE_FROM_BYTES:
        return
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _safetensors_params(path: Path) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for d in t["shape"]:
            count *= int(d)
        total += count if t["dtype"] in _DTYPE_BYTES else 0
    return total


def float32_weight_bytes(model_dir: Path) -> int:
    """Bytes of the encoder's weights once loaded in float32 (what the export holds): parameter counts from
    safetensors headers, else the size of the PyTorch weight files scaled by their stored dtype."""
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return 4 * sum(_safetensors_params(f) for f in files)
    scale = 1
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
        scale = 2 if dtype in ("float16", "bfloat16") else 1
    except (OSError, ValueError):
        pass
    return scale * sum(f.stat().st_size for f in model_dir.glob("*.bin"))


class StepMeter:
    """Wall time and peak resident memory (this process and its children: the optimizer's) of each export step,
    recorded in `attncal.json` under `export_steps`, so a user sees what an export of this size takes.

    `watch`, where given (the CLI's `attncal.exporting.watch.Watch`), is told each step and the working directory,
    so an export killed by the kernel is reported with its step and leaves nothing behind."""

    def __init__(self, watch=None) -> None:
        self.sampler = TreeSampler(interval=0.05)
        self.watch = watch
        self.rows: list[dict] = []
        self._start = time.perf_counter()
        self._name: str | None = None

    def step(self, name: str) -> None:
        self._close()
        self._name, self._start = name, time.perf_counter()
        self.sampler.mark(name)
        if self.watch is not None:
            self.watch.step(name)

    def _close(self) -> None:
        if self._name is not None:
            peak = max(self.sampler.peaks.get(self._name, 0), tree_rss(self.sampler.pid))  # a step shorter than a sample
            self.rows.append({"step": self._name, "seconds": round(time.perf_counter() - self._start, 2),
                              "peak_rss_mib": round(peak / 1024**2, 1)})
            self._name = None

    def __enter__(self) -> "StepMeter":
        self.sampler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.sampler.__exit__(*exc)

    def report(self) -> list[dict]:
        self._close()
        return list(self.rows)
