"""Stop or measure a process at an exact point of its work, for the tests that kill or measure one.

A test that sleeps and then kills, or samples memory every few milliseconds, depends on the machine's speed:
the kill lands anywhere, a sample misses a short peak or is labelled with the step before.  These hooks act
where the work itself reaches a point instead:

* Shard hooks, for `attncal.corpus.shards.FAULT_HOOK` (called at the "written" and "committed" points of
  every shard; the Ray engine hands it to its actors): `KillAt` SIGKILLs the writing process there, at one
  shard; `Park` holds the writing process there (a Ray actor in the middle of a piece), names its pid in a
  marker file and waits until its task is cancelled or the process is killed.
* Step hooks, for `attncal.memory.STEP_HOOK` (called in the export process as each step starts and when the
  export's sampler stops): `KillAtStep`; `StepPeaks`, each step's peak memory from high-water marks.
* Run as a program, this file is the attncal command line with one of them installed first, so a test can
  kill or measure a subprocess at that point:

      python tests/support/hooks.py kill-at-shard STAGE NAME -- encode ...
      python tests/support/hooks.py kill-at-step LABEL -- export ...
      python tests/support/hooks.py step-peaks REPORT.json -- export ...

  (`hooked_cli` builds these command lines.)
* `wait_until` waits, bounded, for something another process does (a marker file, an exit); the bound is
  never what a test's outcome depends on.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from attncal import memory
from attncal.cli import main as attncal_main
from attncal.corpus import shards
from attncal.corpus.ray_engine import _cancel_requested

HOOKS_PY = Path(__file__).resolve()


def hooked_cli(hook: list[str], argv: list[str]) -> list[str]:
    """The command line running `attncal ARGV` with `hook` (e.g. ["kill-at-shard", "committed", NAME])."""
    return [sys.executable, str(HOOKS_PY), *hook, "--", *argv]


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.02):
    """`predicate()` once it is true; AssertionError naming `what` if it is still false after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)


def process_gone(pid: int) -> bool:
    """Whether process `pid` has ended (gone, or a zombie: it runs no more code)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def ship_with_ray() -> None:
    """Let Ray send these hooks to its workers by value: the workers' import path has no tests/."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- shard hooks -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KillAt:
    """SIGKILL this process at `stage` ("written" or "committed") of shard `name`: what the kernel's OOM
    killer or a lost machine does, so no handler or `finally` runs."""

    stage: str
    name: str

    def __call__(self, stage: str, name: str) -> None:
        if (stage, name) == (self.stage, self.name):
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Park:
    """Hold the process writing shard `name` at `stage`, once across all processes: the first to get there
    creates `marker` holding its pid and waits; any later one (a retry of the piece on another actor) goes on.

    `until="cancelled"` returns once the Ray task it runs in is cancelled, so the piece meets the cancellation
    at its next batch; `until="killed"` waits for the process to be killed.  Either way `timeout_s` bounds the
    wait, after which the piece goes on and the test's own assertions fail."""

    stage: str
    name: str
    marker: str
    until: str = "cancelled"
    timeout_s: float = 300.0

    def __call__(self, stage: str, name: str) -> None:
        if (stage, name) != (self.stage, self.name):
            return
        tmp = f"{self.marker}.{os.getpid()}"
        Path(tmp).write_text(str(os.getpid()))
        try:
            os.link(tmp, self.marker)  # atomic and exclusive: the marker appears with its pid in it
        except FileExistsError:
            return
        finally:
            os.unlink(tmp)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.until == "cancelled" and _cancel_requested():
                return
            time.sleep(0.01)


def parked_pid(marker: Path) -> int:
    return int(marker.read_text())


# -- step hooks --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KillAtStep:
    """SIGKILL this process as step `label` starts, before the export's watcher hears of it: the watcher
    then names the step before `label` as the one the export was killed in."""

    label: str

    def __call__(self, label: str | None) -> None:
        if label == self.label:
            os.kill(os.getpid(), signal.SIGKILL)


def _status_bytes(key: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/{pid}/status has no {key}")


def _reset_high_water_mark() -> None:
    """VmHWM := VmRSS for this process (Linux >= 4.0); from here VmHWM is the peak since this call."""
    Path("/proc/self/clear_refs").write_text("5")


def _live_children_peak() -> int:
    """The lifetime peaks (VmHWM) of this process's children alive now (the export's watcher): their
    memory during the step that ends now is at most that."""
    total = 0
    for pid in memory._children(os.getpid()):
        try:
            total += _status_bytes("VmHWM", pid)
        except (OSError, KeyError):
            pass  # ended meanwhile (or a zombie): holds no memory now
    return total


def _reaped_children_peak() -> int:
    """The largest peak of any child this process has waited for (ru_maxrss of RUSAGE_CHILDREN)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


class StepPeaks:
    """Each step's peak resident memory of this process and its children, as an upper bound that no peak
    escapes, whatever the machine's speed, taken from high-water marks at exact points instead of samples.

    At each step boundary (`__call__`, the STEP_HOOK) and around each child run with `subprocess.run` (the
    optimizer's child), this process's VmHWM is read and reset (/proc/self/clear_refs), so a step's own peak is
    the largest VmHWM of its segments.  A child run with `subprocess.run` adds its peak (ru_maxrss of the
    waited children, exact when it is the largest child so far, else that larger one) to this process's peak
    while it ran; a child alive at a boundary (the watcher) adds its lifetime peak.  The sum is at least the
    tree's peak: the parts' peaks need not coincide."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.label: str | None = None
        self._reaped = _reaped_children_peak()

    def _fold(self, value: int) -> None:
        if self.label is not None:
            self.peaks[self.label] = max(self.peaks.get(self.label, 0), value)

    def _segment(self, children: int) -> None:
        """Close the segment since the last reset: this process's peak in it plus `children`'s."""
        reaped = _reaped_children_peak()
        if reaped > self._reaped:  # a child this process waited for outside `subprocess.run`: bound it
            children += reaped
            self._reaped = reaped
        self._fold(_status_bytes("VmHWM") + children + _live_children_peak())
        _reset_high_water_mark()

    def __call__(self, label: str | None) -> None:
        self._segment(0)
        self.label = label

    def run_child(self, run: Callable, *args, **kwargs):
        """`run(*args, **kwargs)` (subprocess.run) as a segment of its own, the child's peak added."""
        self._segment(0)
        try:
            return run(*args, **kwargs)
        finally:
            self._reaped = _reaped_children_peak()
            self._segment(self._reaped)


# -- the command line --------------------------------------------------------------------------------------

def main(args: list[str]) -> int:
    split = args.index("--")
    hook, argv = args[:split], args[split + 1:]
    if hook[0] == "kill-at-shard":
        shards.FAULT_HOOK = KillAt(hook[1], hook[2])
        return attncal_main(argv)
    if hook[0] == "kill-at-step":
        memory.STEP_HOOK = KillAtStep(hook[1])
        return attncal_main(argv)
    if hook[0] == "step-peaks":
        peaks = memory.STEP_HOOK = StepPeaks()
        real_run = subprocess.run
        subprocess.run = lambda *a, **k: peaks.run_child(real_run, *a, **k)
        code = attncal_main(argv)
        Path(hook[1]).write_text(json.dumps(peaks.peaks))
        return code
    raise SystemExit(f"unknown hook {hook[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
