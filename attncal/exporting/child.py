"""The export's child processes (ONNX Runtime's optimizer, a large model's torch export): a command run with its
error output passed on to this process, and a failure or a kill named in one line.

A child, because what it holds (an ONNX Runtime session, protobuf arenas, onnxscript's matchers and the torch
model they keep) is returned when it ends; and an out-of-memory kill then names the step that was running
instead of ending the export without a word.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def run_child(cmd: list[str], what: str, error: type[Exception], stdout=None) -> str:
    """Run `cmd`; returns what it wrote to stderr, which is also written to this process's file descriptor 2
    as the child wrote it (under a command, the export log has it).  Raises `error` saying "{what} was killed
    by SIGNAL" or "{what} failed: <its last line of stderr>".  `stdout`: the child's standard output
    (inherited by default)."""
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True)
    if proc.stderr:
        os.write(2, proc.stderr.encode("utf-8", "replace"))
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        why = " (the kernel's out-of-memory killer sends it)" if proc.returncode == -signal.SIGKILL else ""
        raise error(f"{what} was killed by {sig}{why}")
    if proc.returncode != 0:
        last = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.strip()), "no message")
        raise error(f"{what} failed: {last.strip()[:300]}")
    return proc.stderr
