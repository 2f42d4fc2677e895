"""The console of attncal's commands: attncal's own output on the terminal, the libraries' output in a log.

A command that runs torch, transformers, ONNX Runtime or Ray owns its process, so `capture()` takes that process's
output for the command.  `sys.stdout` and `sys.stderr` become routers that ask of each write whose code made it
(the first frame up the stack that is not a carrier: logging, warnings, tqdm, ...): attncal's lines, bars and
tables reach the streams the command started with; a library's prints, warnings, logger lines and bars, from any
thread, are recorded, and so is what C++ code and child processes write to file descriptors 1 and 2 (a pipe for
the command).  No library's handlers, filters or settings change.  `verbose` shows the recorded lines as they
come; `Capture.log_text()` is the log (OUT/attncal-export.log).  Library use (`export()`, `Encoder`, the Ray
engine) never captures: it leaves its process's output be.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
from typing import Iterator

LOG_HEADER = ("# attncal: what torch, transformers, ONNX Runtime, ... wrote while attncal ran, with attncal's lines for\n"
              "# context.  Informational: a failure stops attncal with an error line; the parity check measures results.\n")
# Modules that write on someone else's behalf (the writer is further up the stack), with the kind of line.
_CARRIERS = {"logging": "log", "warnings": "warning", **dict.fromkeys(
    ("tqdm", "traceback", "contextlib", "threading", "codecs", "encodings"), "output")}
_lock = threading.RLock()
_active: "Capture | None" = None


class Capture:
    """The lines recorded during one command; `verbose` shows the libraries' ones on `echo` as they come."""

    def __init__(self, verbose: bool, echo=None) -> None:
        self.verbose, self.echo, self.third_party_lines, self._lines = verbose, echo or sys.stderr, 0, []

    def record(self, kind: str, text: str, own: bool = False) -> None:
        """Record `text`, attncal's own (context for the log) or a library's of `kind` (warning, log, output); a
        progress bar redraws with carriage returns: a "bar" line keeps its last state, not one of the messages."""
        ends = [(ln.split("\r")[-1].rstrip(), "bar" if "\r" in ln else kind) for ln in text.split("\n")]
        lines = [(end if own else f"  {k:<8}{end}", k) for end, k in ends if end.strip()]
        with _lock:
            self._lines.extend(line for line, _ in lines)
            self.third_party_lines += 0 if own else sum(k != "bar" for _, k in lines)
        if self.verbose and not own and lines:
            self.echo.write("".join(line + "\n" for line, _ in lines))

    def lines(self, start: int = 0) -> list[str]:
        """The lines recorded so far, from `start` (an earlier `len(capture.lines())`: one export of several)."""
        with _lock:
            return self._lines[start:]

    def log_text(self, start: int = 0) -> str:
        return LOG_HEADER + time.strftime("# %Y-%m-%d %H:%M:%S\n") + "".join(ln + "\n" for ln in self.lines(start))


def _writer(frame) -> tuple[bool, str]:
    """(whether attncal wrote it, the kind of line) for a write called from `frame`."""
    kind = "output"
    while frame is not None and (top := (frame.f_globals.get("__name__") or "").partition(".")[0]) in _CARRIERS:
        kind, frame = _CARRIERS[top] if kind == "output" else kind, frame.f_back
    return frame is not None and top == "attncal", kind


class _Router:
    """sys.stdout or sys.stderr during a capture: attncal's writes to `own`, the rest to the capture.  A router
    kept after its capture (a logging handler made meanwhile, colorama) passes everything on to sys's stream."""

    def __init__(self, capture: Capture, own, replaced, is_err: bool) -> None:
        self.capture, self.own, self.replaced, self.is_err = capture, own, replaced, is_err
        self.pending = {True: "", False: ""}

    def _now(self):
        if _active is self.capture:
            return self.own
        stream = getattr(sys, "stderr" if self.is_err else "stdout")
        return stream if stream is not self else self.replaced

    def __getattr__(self, name: str):  # flush, isatty, fileno, encoding, ...: the stream written to now
        return getattr(self._now(), name)

    def write(self, text: str) -> int:
        if _active is not self.capture:
            return self._now().write(text)
        own, kind = _writer(sys._getframe(1))
        if own:
            self.own.write(text)
        if not own or self.is_err:  # attncal's stderr lines are the log's context
            with _lock:
                *done, self.pending[own] = (self.pending[own] + text).split("\n")
            if done:
                self.capture.record(kind, "\n".join(done), own=own)
        return len(text)


def _terminal(stream, fd: int):
    """`stream`, or a stream on a duplicate of `fd` where `stream` writes to it (the fd is about to move)."""
    with contextlib.suppress(Exception):
        if stream.fileno() == fd:
            stream.flush()
            return os.fdopen(os.dup(fd), "w", buffering=1, encoding=stream.encoding, errors=stream.errors)
    return stream


def _read_pipe(capture: Capture, fd: int) -> None:
    with os.fdopen(fd, "rb") as pipe:
        for raw in pipe:
            capture.record("output", raw.decode("utf-8", "replace"))


def _flush_c_stdio() -> None:  # C stdio buffers (std::cout), so they land on the right side of a redirection
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def capture(verbose: bool = False) -> Iterator[Capture]:
    """Record the libraries' output for the block (see the module docstring); a nested use shares the outer one."""
    global _active
    if _active is not None:
        yield _active
        return
    streams = sys.stdout, sys.stderr
    out, err = _terminal(sys.stdout, 1), _terminal(sys.stderr, 2)
    cap = Capture(verbose, err)
    routers = _Router(cap, out, streams[0], False), _Router(cap, err, streams[1], True)
    saved, (r, w) = (os.dup(1), os.dup(2)), os.pipe()
    reader = threading.Thread(target=_read_pipe, args=(cap, r), name="attncal-console", daemon=True)
    reader.start()
    _flush_c_stdio()
    try:
        for fd in (1, 2):
            os.dup2(w, fd)
        os.close(w)
        (sys.stdout, sys.stderr), _active = routers, cap
        yield cap
    finally:
        (sys.stdout, sys.stderr), _active = streams, None
        _flush_c_stdio()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        reader.join(timeout=5)  # EOF once every writer closed it; a child that kept it is not waited for
        for stream in {out, err} - set(streams):
            stream.close()


def active() -> Capture | None:
    """The capture of the running command, or None (library use)."""
    return _active
