"""A quiet, truthful console: `attncal export` and `attncal check` print only attncal's own
lines; the warnings and messages of torch, transformers and ONNX Runtime go to OUT/attncal-export.log
and, with --verbose, to the console as they come.

The commands run in a subprocess, as a user runs them: the capture works on file descriptors, and a
fresh interpreter shows every warning once (an in-process run would have seen them in earlier tests).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from attncal import library_output

# attncal's own console lines: step lines and notes, error/hint lines, its progress bars, summaries.
OWN_STDERR = re.compile(r"^(attncal: |attncal [a-z-]+: )")
OWN_BARS = ("encode (onnx)", "encode (torch)")
OWN_EXPORT_STDOUT = re.compile(r"^(exported \S+ -> |calibrated layers |uncalibrated$|  onnx/\S+: placement |"
                               r"third-party warnings and messages )")
OWN_CHECK_STDOUT = re.compile(r"^(onnx/\S+:$|length bucket |< 1 basket|\d+-\d+ baskets |max length \(|all |"
                              r"OK \(fp32\): )")
# What a user must not see: library warnings, their loggers' lines, a "failed" that is no failure.
NOISE = re.compile(r"\b\w+Warning\b|failed|Loading weights|\[torch\.onnx\]|torchvision|symbolic shape|"
                   r"^[WE]\d{4} ", re.M)
THIRD_PARTY_LINE = re.compile(r"^  (warning|log|output) +(.*)$")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from attncal.synthetic import save_synthetic_model

    return save_synthetic_model("bert", tmp_path_factory.mktemp("console") / "bert", seed=1, layers=2,
                                max_positions=128)


def attncal(*argv) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONWARNINGS", None)  # the warnings a user gets by default
    return subprocess.run([sys.executable, "-m", "attncal", *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=300)


def own_stderr_only(err: str) -> None:
    for line in err.splitlines():
        if not line.strip():
            continue
        if OWN_STDERR.match(line):
            continue
        updates = [u for u in line.split("\r") if u.strip()]  # a progress bar redraws with carriage returns
        assert updates and all(u.startswith(OWN_BARS) for u in updates), f"not attncal's: {line!r}\n{err}"


def third_party_lines(log: str) -> list[str]:
    return [m.group(2) for m in map(THIRD_PARTY_LINE.match, log.splitlines()) if m]


@pytest.fixture(scope="module")
def quiet_export(tiny_bert, tmp_path_factory):
    """The dynamo exporter (torch.onnx prints, logs and warns), and for the ORT-optimized graph the
    TorchScript exporter (TracerWarning, aten::index) and ONNX Runtime's optimizer ("failed in shape
    inference"): every source of noise of a default export."""
    out = tmp_path_factory.mktemp("quiet") / "out"
    proc = attncal("export", tiny_bert, "-o", out, "--basket-size", "16", "--skip-check")
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_export_prints_only_attncal_lines_and_logs_the_rest(quiet_export):
    from attncal.artifact import open_export

    out, proc = quiet_export
    assert not NOISE.search(proc.stdout + proc.stderr), proc.stdout + proc.stderr
    own_stderr_only(proc.stderr)
    for line in proc.stdout.splitlines():
        assert OWN_EXPORT_STDOUT.match(line), f"not attncal's: {line!r}"
    assert "attncal: [1/4] exporting bert" in proc.stderr and "attncal: [4/4] wrote" in proc.stderr

    from attncal.export.exporter import EXPORT_LOG_FILE

    log_file = out / EXPORT_LOG_FILE
    assert log_file.is_file(), "the export log is part of the export"
    assert str(log_file) in proc.stdout
    log = log_file.read_text(encoding="utf-8")
    captured = third_party_lines(log)
    assert captured, log
    assert any(m in log for m in ("[torch.onnx]", "TracerWarning", "failed in shape inference")), log
    for text in captured:  # kept in the log, not shown
        assert text not in proc.stdout + proc.stderr, text
    assert "attncal: [1/4] exporting bert" in log  # attncal's step lines give the log its context
    if "failed in shape inference" in log:  # said in attncal's words, as what it means
        assert "attncal: note: onnx/model_optimized.onnx keeps Add + LayerNormalization unfused" in proc.stderr

    # The log does not disturb the export: attncal.json still validates, the graphs' digests hold,
    # and the log went in before the rename (no temporary directory left beside OUT).
    exp = open_export(out)
    assert EXPORT_LOG_FILE not in exp.meta["files"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_check_prints_only_attncal_lines(quiet_export):
    out, _ = quiet_export
    texts = out.parent / "texts.txt"
    texts.write_text("a short text\n" + "a longer text about position bias in encoders " * 8 + "\n", encoding="utf-8")
    proc = attncal("check", out, "--graph", "portable", "--texts", texts)
    assert proc.returncode == 0, proc.stderr
    assert not NOISE.search(proc.stdout + proc.stderr), proc.stdout + proc.stderr
    own_stderr_only(proc.stderr)
    for line in proc.stdout.splitlines():
        assert OWN_CHECK_STDOUT.match(line), f"not attncal's: {line!r}"
    assert "OK (fp32)" in proc.stdout


def test_verbose_shows_third_party_messages_as_they_come(tiny_bert, tmp_path):
    from attncal.export.exporter import EXPORT_LOG_FILE

    out = tmp_path / "out"
    proc = attncal("export", tiny_bert, "-o", out, "--exporter", "torchscript", "--no-optimized", "--skip-check",
                   "--verbose")
    assert proc.returncode == 0, proc.stderr
    shown = third_party_lines(proc.stderr)
    assert any("TracerWarning" in t or "UserWarning" in t for t in shown), proc.stderr
    # Shown between the step lines they belong to, and kept in the log as well.
    err = proc.stderr
    assert err.index("[1/4] exporting") < err.index("Warning") < err.index("[2/4]"), err
    log = (out / EXPORT_LOG_FILE).read_text(encoding="utf-8")
    assert set(shown) <= set(third_party_lines(log))


# -- the mechanism, in-process (fast) ------------------------------------------------------------------

@contextlib.contextmanager
def library_logger():
    """A library logger with its own console handler, as torch and transformers install one."""
    lg = logging.getLogger("transformers.attncal_test")
    handler = logging.StreamHandler(sys.stderr)
    lg.addHandler(handler)
    try:
        yield lg
        assert lg.handlers == [handler], "the library's handler is given back"
    finally:
        lg.removeHandler(handler)


def test_capture_records_warnings_logs_and_fd_output(tmp_path, capfd):
    log_path = tmp_path / "x.log"
    with warnings.catch_warnings(), library_logger() as lib_logger, \
            library_output.capture_third_party(verbose=False, log_path=log_path) as cap:
        warnings.simplefilter("always")  # whatever filters the run has (-W ignore, an earlier "once")
        warnings.warn("a library's warning", UserWarning)
        lib_logger.getChild("sub").warning("a library's log record")
        with library_output.third_party_output():
            os.write(1, b"C-level stdout\n")
            os.write(2, b"progress 10%\rprogress 100%\n")
        with library_output.capture_third_party() as inner:  # nested: shares the recorder, sees its own part
            with library_output.third_party_output():
                os.write(2, b"inner output\n")
        assert inner.lines() == ["  output  inner output"]
        assert cap.third_party_lines == 5
    text = log_path.read_text()
    for expected in ("  warning UserWarning (", "a library's warning", "  log     WARNING transformers.attncal_test.sub: a library's log "
                     "record", "  output  C-level stdout", "  output  progress 100%", "  output  inner output"):
        assert expected in text, text
    assert "progress 10%" not in text
    got = capfd.readouterr()
    assert "C-level" not in got.out + got.err and "a library's" not in got.out + got.err


def test_verbose_echoes_and_attncal_warnings_stay_visible(capfd, recwarn):
    with library_logger() as lib_logger, library_output.capture_third_party(verbose=True):
        with library_output.third_party_output():
            os.write(2, b"shown as it comes\n")
        lib_logger.warning("shown too")
    err = capfd.readouterr().err
    assert "  output  shown as it comes" in err and "  log     WARNING transformers.attncal_test: shown too" in err
    with library_output.capture_third_party(verbose=False):
        warnings.warn("attncal: one of attncal's own", UserWarning)
        warnings.warn("a library's", UserWarning)
    assert [str(w.message) for w in recwarn] == ["attncal: one of attncal's own"]


def test_without_a_capture_nothing_is_redirected(capfd):
    with library_output.third_party_output():
        os.write(2, b"library use: untouched\n")
    assert "library use: untouched" in capfd.readouterr().err
    assert library_output.active() is None and library_output.ort_log_severity() == 2


def test_an_applications_own_logger_is_left_alone():
    """attncal run as a library keeps its hands off the caller's logging: only the loggers of the
    libraries it drives (library_output.THIRD_PARTY_LOGGERS) are routed into the log."""
    import io

    stream = io.StringIO()
    app = logging.getLogger("my_application")
    handler = logging.StreamHandler(sys.stderr)
    app.addHandler(handler)
    try:
        with library_output.capture_third_party(verbose=False):
            assert handler in app.handlers
        handler.stream = stream
        app.warning("still mine")
        assert "still mine" in stream.getvalue()
    finally:
        app.removeHandler(handler)


def test_encode_on_ray_prints_only_attncal_lines(quiet_export, tmp_path):
    """Ray's logger, its C++ core worker and its deprecation notes stay off the console; attncal's scan
    and encode bars and its summary still reach it (they write to library_output.terminal())."""
    pytest.importorskip("ray")
    out, _ = quiet_export
    src = tmp_path / "c.jsonl"
    src.write_text("".join(f'{{"id": "r{i}", "text": "text number {i} "}}\n' for i in range(20))
                   + '{"id": "bad", "text": \n', encoding="utf-8")
    proc = attncal("encode", out, "--input", src, "--output", tmp_path / "idx", "--engine", "ray",
                   "--workers", "1", "--on-error", "skip")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    assert not re.search(r"\bINFO\b|\bWARNING\b|core_worker|deprecated|Ray instance", text), text
    for line in text.splitlines():
        updates = [u for u in line.split("\r") if u.strip()]
        assert all(u.startswith(("scan", "encode", "encoded 20 rows")) for u in updates), f"not attncal's: {line!r}"
    assert "encoded 20 rows" in text and "1 skipped" in text
    assert re.search(r"encode: 100%.*20 rows", proc.stderr), proc.stderr  # the bar counts bytes and rows
