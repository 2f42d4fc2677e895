"""A watcher for `attncal export`: if the export process is killed (the kernel's out-of-memory killer sends
SIGKILL, which no handler can catch), a small separate process says which step it was in and removes the
half-written working directory, so the user gets a line instead of a bare "Killed" and no debris beside OUT.

The watcher is a fresh interpreter without site packages (a few MiB; a fork of the export would share, and
be counted with, its pages).  The export tells it each step and its working directory over a pipe, and
"done" when it ends by itself, error or not; end of file without "done" means the export was killed.
"""

from __future__ import annotations

import subprocess
import sys

_WATCHER = r"""
import os, shutil, sys
step, workdir, note = "start", None, ""
for line in sys.stdin:
    kind, _, value = line.rstrip("\n").partition(" ")
    if kind == "done":
        sys.exit(0)
    if kind == "step":
        step = value
    elif kind == "dir":
        workdir = value
    elif kind == "note":
        note = value
if workdir and os.path.isdir(workdir):
    shutil.rmtree(workdir, ignore_errors=True)
sys.stderr.write(
    f"attncal: the export was killed during its '{step}' step (a kill without a message is most often the kernel's "
    f"out-of-memory killer{'; ' + note if note else ''}); its working directory was removed and nothing was "
    "written to the output\n")
sys.stderr.flush()
"""


def _stderr_fd() -> int | None:
    """The descriptor `sys.stderr` writes to (under `attncal.console`'s capture, the terminal's), else inherit."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


class Watch:
    """Context manager around one export: `step(name)`, `workdir(path)` and `note(text)` keep the watcher informed."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "Watch":
        try:
            self._proc = subprocess.Popen([sys.executable, "-S", "-c", _WATCHER], stdin=subprocess.PIPE, text=True,
                                          stderr=_stderr_fd(),  # attncal's line: the terminal under a command
                                          start_new_session=True)  # outlives a kill of the export's process group
        except OSError:
            self._proc = None  # no watcher: the export runs as before
        return self

    def _send(self, kind: str, value: str = "") -> None:
        if self._proc is not None and self._proc.stdin is not None:
            try:
                self._proc.stdin.write(f"{kind} {value}".rstrip() + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._proc = None

    def step(self, name: str) -> None:
        self._send("step", name)

    def workdir(self, path) -> None:
        self._send("dir", str(path))

    def note(self, text: str) -> None:
        self._send("note", text.replace("\n", " "))

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._send("done")
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
