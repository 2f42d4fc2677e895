"""A quiet, truthful console: `attncal export` and `attncal check` print only attncal's own
lines; the warnings and messages of torch, transformers and ONNX Runtime go to OUT/attncal-export.log
and, with --verbose, to the console as they come.

The commands run in a subprocess, as a user runs them: the capture works on file descriptors, and a
fresh interpreter shows every warning once (an in-process run would have seen them in earlier tests).
The mechanism (attncal.console) is tested in-process below.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import sys
import warnings
from pathlib import Path

import pytest

from attncal import console
from attncal.artifact import EXPORT_LOG_FILE

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

def _attncal_module() -> dict:
    """A function whose frame belongs to an attncal module: what the routers call attncal's own."""
    namespace = {"__name__": "attncal.console_test", "sys": sys, "warnings": warnings}
    exec(compile("def say(text):\n    print(text, file=sys.stderr)\n\ndef table(text):\n    print(text)\n\n"
                 "def warn(text):\n    warnings.warn(text, UserWarning)\n", "attncal/console_test.py", "exec"),
         namespace)
    return namespace


def test_library_output_is_recorded_and_attncals_reaches_the_terminal(capfd):
    own = _attncal_module()
    with console.capture(verbose=False) as cap:
        lib_logger = logging.getLogger("a_library.sub")
        handler = logging.StreamHandler()  # made during the capture, as transformers makes its own on import
        lib_logger.addHandler(handler)
        try:
            own["say"]("attncal: a step line")
            own["table"]("| a | table |")
            lib_logger.warning("a library's log record")
            print("a library's print")
            sys.stderr.write("progress 10%\rprogress 100%\n")
            os.write(1, b"C-level stdout\n")
            os.write(2, b"C-level stderr\n")
            thread = threading.Thread(target=print, args=("from a library's thread",))
            thread.start()
            thread.join()
            with console.capture() as inner:  # nested: the same capture
                assert inner is cap
        finally:
            lib_logger.removeHandler(handler)
    lines = cap.lines()
    got = capfd.readouterr()
    assert "attncal: a step line" in got.err and "| a | table |" in got.out
    for text in ("a library's", "C-level", "progress"):
        assert text not in got.out + got.err, (text, got)
    assert "attncal: a step line" in lines and "| a | table |" not in "\n".join(lines)  # own stderr: context
    third = [ln for ln in lines if ln.startswith("  ")]
    for expected in ("  log     a library's log record", "  output  a library's print", "  bar     progress 100%",
                     "  output  C-level stdout", "  output  C-level stderr", "  output  from a library's thread"):
        assert expected in third, (expected, third)
    assert "progress 10%" not in "\n".join(lines)
    assert cap.third_party_lines == len(third) - 1  # the warnings and messages: not the progress bar
    assert cap.log_text(start=lines.index("attncal: a step line") + 1).startswith(console.LOG_HEADER)


def test_verbose_shows_library_lines_in_order(capfd):
    own = _attncal_module()
    with console.capture(verbose=True):
        own["say"]("attncal: before")
        print("a library's line")
        own["say"]("attncal: after")
    err = capfd.readouterr().err
    assert err.index("attncal: before") < err.index("  output  a library's line") < err.index("attncal: after"), err


def test_a_warning_goes_where_the_code_that_issued_it_belongs():
    """pytest records warnings itself, so this runs in a fresh interpreter with Python's own warning display."""
    code = ("import sys, warnings\nfrom attncal import console\n"
            "ns = {'__name__': 'attncal.console_test', 'warnings': warnings}\n"
            "exec('def warn(text):\\n    warnings.warn(text, UserWarning)\\n', ns)\n"
            "with console.capture() as cap:\n"
            "    warnings.warn(\"a library's warning\", UserWarning)\n"
            "    ns['warn'](\"attncal: one of attncal's own\")\n"
            "print('\\n'.join(cap.lines()))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "attncal: one of attncal's own" in proc.stderr and "a library's" not in proc.stderr, proc.stderr
    assert re.search(r"^  warning .*UserWarning: a library's warning$", proc.stdout, re.M), proc.stdout


def test_nothing_of_the_process_is_touched_outside_a_capture(capfd):
    """Library use: no capture, nothing redirected; a handler made during a capture keeps its router, which
    passes on to whatever sys.stderr is afterwards; logging handlers, warning filters and showwarning are
    never swapped."""
    before = (dict(logging.root.manager.loggerDict), list(logging.root.handlers), list(warnings.filters),
              warnings.showwarning)
    with console.capture(verbose=False):
        router = sys.stderr
        during = (dict(logging.root.manager.loggerDict), list(logging.root.handlers), list(warnings.filters),
                  warnings.showwarning)
    assert during == before and console.active() is None
    os.write(2, b"library use: untouched\n")
    router.write("a router kept by a handler\n")
    assert capfd.readouterr().err == "library use: untouched\na router kept by a handler\n"


def test_encode_on_ray_prints_only_attncal_lines(quiet_export, tmp_path):
    """Ray's logger, its C++ core worker and its deprecation notes stay off the console; attncal's scan
    and encode bars and its summary still reach it (attncal's own frames wrote them)."""
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
