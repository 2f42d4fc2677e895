"""Library output: attncal's own lines on the terminal, the chatter of the libraries it drives in a log.

The libraries an export runs through (torch.onnx, transformers, ONNX Runtime's
transformer optimizer) print warnings and messages that are not addressed to an
attncal user: TracerWarnings, notes about negative indices, and ONNX Runtime's
"failed in shape inference", which reads like a failed export but only means one
optional fusion was skipped.  The CLI shows attncal's own step lines, progress
bars and summary; everything else is kept:

* `capture_third_party(verbose, log_path)` is entered once per command (nesting
  shares the outer capture).  While it is active, Python warnings from other
  packages are recorded instead of printed (`warnings.showwarning`), and the
  stream handlers that the libraries attncal drives install on their loggers
  (`THIRD_PARTY_LOGGERS`: torch, transformers, ...) are replaced by one recording handler (records from loggers without handlers, which
  Python would print through `logging.lastResort`, are recorded the same way).
  With `verbose` every recorded line is also shown as it comes; `log_path`
  receives the lines on exit, and `Capture.write_log` writes them anywhere earlier
  (the exporter writes OUT/attncal-export.log into its temporary directory, so the
  log is part of the atomic export).  Without `verbose`, the Hugging Face progress
  bars (transformers' weight loading) are turned off.
* `third_party_output()` wraps a call into third-party code that prints (Python
  `print`, C++ `std::cerr`, tqdm bars of other packages): file descriptors 1 and 2
  are redirected into a pipe for its duration, and what arrives is recorded line by
  line.  attncal prints nothing of its own inside such a call, and without an
  active capture it does nothing, so library users and serving code are unaffected.

Warnings attncal issues itself (their message starts with "attncal") are shown as
usual.  Thread-safety: state changes are under one lock and reference-counted, so
overlapping captures or calls from several threads share one redirection; while a
`third_party_output()` call runs, other threads' writes to fd 1/2 go to the log
too.  An `Encoder` used from threads needs none of this (it prints nothing).

Layering: the bottom layer, beside `artifact` (whose atomic write it uses); nothing else from attncal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

LOG_HEADER = ("# attncal: warnings and messages of third-party libraries (torch, transformers, ONNX Runtime, ...)\n"
              "# captured while attncal ran, with attncal's own step lines for context.  They are informational:\n"
              "# a real failure stops attncal with an error line, and the parity check measures the result.\n")

THIRD_PARTY_LOGGERS = frozenset({
    "torch", "transformers", "onnxruntime", "onnx", "onnxscript", "onnx_ir", "optimum", "sentence_transformers",
    "huggingface_hub", "ray", "tritonclient", "matplotlib", "chonkie", "urllib3", "filelock", "PIL",
})
"""Top-level loggers of the libraries attncal drives: only their console handlers are swapped, so an
application that calls attncal keeps its own logging as it set it up."""

_lock = threading.RLock()
_recorder: "_Recorder | None" = None
_depth = 0
_window: "_Window | None" = None
_window_depth = 0


class _Recorder:
    """The lines captured during one command, shared by every nested capture."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.lines: list[str] = []
        self.third_party = 0  # how many of `lines` are third-party
        self.lock = threading.Lock()
        self.stack: contextlib.ExitStack | None = None  # undoes the capture's changes
        self.logs: _LoggingCapture | None = None
        try:
            self.term_fd: int | None = os.dup(2)  # the terminal's stderr, also while fd 2 is redirected
        except OSError:
            self.term_fd = None
        self.term = None  # a text stream on term_fd, made on first use (attncal's own progress bars)

    def add(self, kind: str, text: str) -> None:
        """Record third-party `text` (one or more lines) of `kind`: warning, log or output."""
        lines = [f"  {kind:<8}{ln.rstrip()}" for ln in str(text).splitlines() if ln.strip()]
        if not lines:
            return
        with self.lock:
            self.lines.extend(lines)
            self.third_party += len(lines)
        if self.verbose:
            self._echo("".join(ln + "\n" for ln in lines))

    def own(self, line: str) -> None:
        """Record one of attncal's own lines (printed by the caller) for context in the log."""
        with self.lock:
            self.lines.append(line.rstrip())

    def _echo(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        if self.term_fd is not None:
            with contextlib.suppress(OSError):
                os.write(self.term_fd, data)
                return
        with contextlib.suppress(Exception):
            (sys.__stderr__ or sys.stderr).write(text)

    def terminal(self):
        """A text stream on the terminal's stderr that a `third_party_output()` window does not capture."""
        if self.term is None and self.term_fd is not None:
            with contextlib.suppress(OSError):
                self.term = os.fdopen(os.dup(self.term_fd), "w", buffering=1, encoding="utf-8", errors="replace")
        return self.term if self.term is not None else sys.stderr

    def close(self) -> None:
        if self.term is not None:
            with contextlib.suppress(Exception):
                self.term.close()
            self.term = None
        if self.term_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.term_fd)
            self.term_fd = None


class _RecordingHandler(logging.Handler):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__(logging.NOTSET)
        self.recorder = recorder
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "_attncal_recorded", False):  # seen on a logger and again on the root
            return
        record._attncal_recorded = True
        try:
            self.recorder.add("log", self.format(record))
        except Exception:  # never let logging break the command
            self.handleError(record)


def _console_handler(h: logging.Handler) -> bool:
    consoles = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None}
    return (isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
            and id(getattr(h, "stream", None)) in consoles)


class _LoggingCapture:
    """Third-party console handlers swapped for one recording handler; undone by `restore`."""

    def __init__(self, recorder: _Recorder) -> None:
        self.handler = _RecordingHandler(recorder)
        self.root_added = False
        self.adopted: list[tuple[logging.Logger, logging.Handler]] = []

    def start(self) -> None:
        root = logging.getLogger()
        if not root.handlers:  # records Python would print through logging.lastResort
            root.addHandler(self.handler)
            self.root_added = True
        self.adopt()

    def adopt(self) -> None:
        """Swap the console handlers of third-party loggers (not the root's, not attncal's) for the
        recorder.  Called again after each third-party call, which may have imported a library that
        installed one (torch and transformers do)."""
        for name, lg in list(logging.root.manager.loggerDict.items()):
            if not isinstance(lg, logging.Logger) or name.split(".")[0] not in THIRD_PARTY_LOGGERS:
                continue  # attncal's own, and an application's loggers when attncal runs as a library
            for h in [h for h in lg.handlers if h is not self.handler and _console_handler(h)]:
                self.adopted.append((lg, h))
                lg.removeHandler(h)
                lg.addHandler(self.handler)

    def restore(self) -> None:
        for lg, h in reversed(self.adopted):
            lg.removeHandler(self.handler)
            lg.addHandler(h)
        self.adopted.clear()
        if self.root_added:
            logging.getLogger().removeHandler(self.handler)


class _Window:
    """fd 1 and 2 redirected into a pipe; a thread records what arrives, line by line."""

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder
        _flush_all()
        saved = os.dup(1)
        try:
            saved2 = os.dup(2)
        except OSError:
            os.close(saved)
            raise
        self.saved = (saved, saved2)
        r, w = os.pipe()
        self.reader = threading.Thread(target=self._read, args=(r,), name="attncal-console", daemon=True)
        self.reader.start()
        try:
            os.dup2(w, 1)
            os.dup2(w, 2)
        except OSError:
            os.close(w)
            self.close()
            raise
        os.close(w)

    def _read(self, fd: int) -> None:
        pending = b""
        try:
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                pending += chunk
                *done, pending = pending.split(b"\n")
                for raw in done:
                    self._line(raw)
            if pending:
                self._line(pending)
        finally:
            os.close(fd)

    def _line(self, raw: bytes) -> None:
        # A progress bar redraws itself with carriage returns: keep the state it ended in.
        parts = [p for p in raw.decode("utf-8", "replace").split("\r") if p.strip()]
        if parts:
            self.recorder.add("output", parts[-1])

    def close(self) -> None:
        _flush_all()
        try:
            os.dup2(self.saved[0], 1)
            os.dup2(self.saved[1], 2)
        finally:
            for fd in self.saved:
                os.close(fd)
        # EOF once no descriptor of the pipe is left open; a child process that kept one is not waited for.
        self.reader.join(timeout=10)


def _flush_all() -> None:
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    with contextlib.suppress(Exception):  # C stdio buffers (std::cout), so they land on the right side
        import ctypes

        ctypes.CDLL(None).fflush(None)


class Capture:
    """What `capture_third_party` yields: the shared recorder, seen from where this capture began."""

    def __init__(self, recorder: _Recorder) -> None:
        self._recorder = recorder
        with recorder.lock:
            self._start = len(recorder.lines)
            self._start_third = recorder.third_party

    @property
    def verbose(self) -> bool:
        return self._recorder.verbose

    @property
    def third_party_lines(self) -> int:
        """How many third-party lines were captured since this capture began."""
        with self._recorder.lock:
            return self._recorder.third_party - self._start_third

    def lines(self) -> list[str]:
        with self._recorder.lock:
            return list(self._recorder.lines[self._start:])

    def write_log(self, path: str | os.PathLike) -> Path:
        """Write the lines captured since this capture began to `path` (atomically)."""
        path = Path(path)
        from .artifact import write_text_atomic  # the export format's own atomic write

        write_text_atomic(path, LOG_HEADER + f"# {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                          + "".join(ln + "\n" for ln in self.lines()))
        return path


def _hf_progress_bars_off() -> Callable[[], None]:
    """Turn off the Hugging Face progress bars (transformers' "Loading weights" on every model load);
    returns the undo.  attncal's own bars are plain tqdm and stay.  huggingface_hub is imported here,
    not transformers (seconds): transformers reads the setting when it is imported."""
    try:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    except Exception:  # not installed or broken: nothing of it to quiet
        return lambda: None
    if are_progress_bars_disabled():  # already off ($HF_HUB_DISABLE_PROGRESS_BARS or the application)
        return lambda: None
    hf_logging = sys.modules.get("transformers.utils.logging")
    transformers_bars = hf_logging is None or hf_logging.is_progress_bar_enabled()
    if hf_logging is not None:
        hf_logging.disable_progress_bar()  # also huggingface_hub's
    else:
        disable_progress_bars()

    def undo() -> None:
        enable_progress_bars()
        later = sys.modules.get("transformers.utils.logging")
        if later is not None and transformers_bars:
            later.enable_progress_bar()

    return undo


def _showwarning_for(recorder: _Recorder, original):
    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text.startswith("attncal"):  # attncal's own warnings say so, and stay visible
            original(message, category, filename, lineno, file, line)
            return
        where = str(filename)
        for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
            if marker in where:
                where = where.split(marker, 1)[1]
        first, *rest = text.splitlines() or [""]
        recorder.add("warning", "\n".join([f"{category.__name__} ({where}:{lineno}): {first}", *rest]))

    return showwarning


@contextlib.contextmanager
def capture_third_party(verbose: bool = False, log_path: str | os.PathLike | None = None) -> Iterator[Capture]:
    """Keep third-party warnings, log records and (inside `third_party_output()`) output off the console.

    `verbose` shows them as they come, indented under attncal's lines.  `log_path`, when given,
    receives everything captured during this block when it ends.  Nested or concurrent uses share
    the first one's recorder (and its `verbose`)."""
    global _recorder, _depth
    with _lock:
        if _depth == 0:
            recorder = _Recorder(verbose)
            stack = contextlib.ExitStack()
            try:
                # Only the display is swapped, not the filters (warnings.catch_warnings would also undo
                # the filters that libraries imported meanwhile install).
                shown_by = warnings.showwarning
                warnings.showwarning = _showwarning_for(recorder, shown_by)
                stack.callback(setattr, warnings, "showwarning", shown_by)
                logs = _LoggingCapture(recorder)
                logs.start()
                stack.callback(logs.restore)
                if not verbose:
                    stack.callback(_hf_progress_bars_off())
            except BaseException:
                stack.close()
                recorder.close()
                raise
            recorder.stack, recorder.logs = stack, logs
            _recorder = recorder
        _depth += 1
        cap = Capture(_recorder)
    try:
        yield cap
    finally:
        try:
            if log_path is not None:
                cap.write_log(log_path)
        finally:
            with _lock:
                _depth -= 1
                if _depth == 0:
                    rec, _recorder = _recorder, None
                    try:
                        rec.stack.close()
                    finally:
                        rec.close()


@contextlib.contextmanager
def third_party_output() -> Iterator[None]:
    """Record what third-party code writes to stdout/stderr (Python and C++) during this block.

    Does nothing without an active `capture_third_party`."""
    global _window, _window_depth
    with _lock:
        rec = _recorder
        if rec is None:
            active = False
        else:
            active = True
            if _window_depth == 0:
                try:
                    _window = _Window(rec)
                except OSError:  # no usable fd 1/2 (a daemon): Python-level capture only
                    active = False
            if active:
                _window_depth += 1
    try:
        yield
    finally:
        if active:
            with _lock:
                _window_depth -= 1
                if _window_depth == 0 and _window is not None:
                    win, _window = _window, None
                    win.close()
                    if rec.logs is not None:
                        rec.logs.adopt()


def active() -> Capture | None:
    """The active capture (as seen from now), or None."""
    with _lock:
        return Capture(_recorder) if _recorder is not None else None


def terminal():
    """Where attncal's own progress bars write: the terminal's stderr, also inside a
    `third_party_output()` window that spans them (the Ray engine's pipeline); sys.stderr without a
    capture."""
    with _lock:
        rec = _recorder
    return rec.terminal() if rec is not None else sys.stderr


def adopt_loggers() -> None:
    """Route the console handlers that a library installed after the capture began (Ray does, on
    import) into the capture.  Does nothing without an active capture."""
    with _lock:
        rec = _recorder
        if rec is not None and rec.logs is not None:
            rec.logs.adopt()


def verbose() -> bool:
    """Whether third-party messages are being shown (an active capture with verbose, or none at all)."""
    with _lock:
        return _recorder is None or _recorder.verbose


def own_line(line: str) -> None:
    """Record one of attncal's own console lines in the log for context (the caller prints it)."""
    with _lock:
        rec = _recorder
    if rec is not None:
        rec.own(line)


def ort_log_severity() -> int:
    """ONNX Runtime session log level: warnings (2) when they are shown, else errors only (3)."""
    return 2 if verbose() else 3


def without_torch_advice() -> None:
    """Keep transformers' import-time "PyTorch was not found" advice off the terminal where torch is absent:
    the runtime install (`pip install attncal`) has no torch on purpose, and its tokenizers need none.  The
    advice is one of transformers' advisory warnings, which only an environment variable turns off."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
