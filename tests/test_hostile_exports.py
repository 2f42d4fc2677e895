"""Exports made by someone else: a hostile one is refused before anything outside it is opened.

One tiny export per module (tests/test_artifact.py::tiny_export) has its portable graph's weights moved to
`onnx/model.onnx_data` by attncal's own writer; every case copies it and tampers with it in one way: an
external-data reference that leaves the export (an absolute path, `..`, a symlink), names a device, a FIFO or
a directory, or a range past the file's end or no range at all; initializer dims that claim more bytes than
are there; an `attncal.json` claiming absurd sizes; a tokenizer or graph file far larger than one can be.

Every entry point that applies (`Encoder`, `attncal inspect`, `attncal check`, `attncal triton-repo`, the
digest and copy readers of attncal.artifact, the int8 quantizer's block reader) must refuse it with one line
naming the file and the entry, having read at most `READ_LIMIT` bytes and opened none of the case's targets.
"Not opened" is proved two ways: every path Python opens (`open`, `io.open`, `os.open`) is recorded, and the targets outside
the export are FIFOs, which a watcher thread sees being opened by anyone, ONNX Runtime's C++ included (a
reader's open blocks until a writer comes; the watcher's non-blocking open as a writer succeeds only then,
records it and lets the reader go on, so a regression fails instead of hanging).
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import onnx
import onnxruntime
import pytest

from attncal import artifact
from attncal.artifact import ArtifactError, graph_digest, load_onnx_checked, open_export, write_graph_file
from attncal.cli import main
from attncal.exporting.quantize import _blocks
from attncal.runtime.encoder import Encoder
from attncal.serving.repository import RepoOptions, build_repository, validate_repository
from test_artifact import tiny_export
from test_corruption import _cli

# A refusal reads the tiny export's own small files (graph, attncal.json, config, tokenizer) and nothing of a
# hostile target, which is gigabytes: the entry points read 125 B to 109 kB each (75 refusals, kernel's rchar,
# 2026-12-07); 1 MiB is ten times the most and a thousandth of the smallest target.
READ_LIMIT = 2**20
TB = 10**12
_REAL_OS_OPEN = os.open  # the watcher's, untouched by the recording


# -- the export and its tampered copies ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def external(tmp_path_factory) -> Path:
    """A copy of the tiny export whose portable graph keeps its weights in onnx/model.onnx_data (written by
    `write_graph_file`, so its digest covers them)."""
    root = tmp_path_factory.mktemp("hostile")
    out = root / "export"
    shutil.copytree(tiny_export(tmp_path_factory), out)
    graph = out / artifact.PORTABLE_GRAPH
    stage = root / "stage"
    stage.mkdir()
    onnx.save(onnx.load(str(graph)), str(stage / "model.onnx"), save_as_external_data=True,
              location="model.onnx_data", size_threshold=1024)
    write_graph_file(onnx.load(str(stage / "model.onnx"), load_external_data=False), stage, graph, external=True)
    shutil.rmtree(stage)
    # Warm the imports and the library lookup the entry points make, so the timings below are the refusals'.
    Encoder(out, providers=["CPUExecutionProvider"])
    for command in ("inspect", "check", "triton-repo"):
        main([command, str(root / "absent")] + (["-o", str(root / "repo")] if command == "triton-repo" else []))
    return out


@pytest.fixture
def outside(tmp_path) -> Path:
    """A FIFO outside the export: what a hostile reference points at."""
    d = tmp_path / "outside"
    d.mkdir()
    os.mkfifo(d / "secret")
    return d / "secret"


def _weight(model) -> onnx.TensorProto:
    """The first MatMul weight held in the data file (what the int8 quantizer reads block by block)."""
    external = {t.name: t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    return next(external[n.input[1]] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in external)


def _entries(**values) -> Callable:
    """A tampering that sets the tampered weight's external-data entries: a value, a function of (export,
    outside FIFO) giving one, or None to remove the entry."""
    def tamper(t, d: Path, outside: Path) -> None:
        info = {e.key: e.value for e in t.external_data}
        for key, value in values.items():
            value = value(d, outside) if callable(value) else value
            if value is None:
                del info[key]
            else:
                info[key] = str(value)
        del t.external_data[:]
        for key, value in info.items():
            t.external_data.add(key=key, value=value)
    return tamper


def _symlink(target: Callable, **entries) -> Callable:
    """A tampering that points the weight at onnx/weights.bin, a symlink to `target(outside FIFO)`."""
    def tamper(t, d: Path, outside: Path) -> None:
        (d / "onnx" / "weights.bin").symlink_to(target(outside))
        _entries(location="weights.bin", **entries)(t, d, outside)
    return tamper


def _fifo_inside(t, d: Path, outside: Path) -> None:
    os.mkfifo(d / "onnx" / "pipe")
    _entries(location="pipe")(t, d, outside)


def _directory(t, d: Path, outside: Path) -> None:
    (d / "onnx" / "weights").mkdir()
    _entries(location="weights")(t, d, outside)


def _huge_dims(t, d: Path, outside: Path) -> None:
    t.dims[:] = [10**6, 10**6]


def _past_eof(d: Path, outside: Path) -> int:
    return (d / "onnx" / "model.onnx_data").stat().st_size + 1


# case -> (tampering, what the message says after the tensor's name, the targets that must stay unopened)
GRAPH_CASES: dict[str, tuple[Callable, str, Callable]] = {
    "absolute-path-outside": (_entries(location=lambda d, o: o), "is an absolute path", lambda d, o: [o]),
    "dotdot-climbs-out": (_entries(location=lambda d, o: os.path.relpath(o, d / "onnx")),
                          "resolves outside the export folder", lambda d, o: [o]),
    "symlink-points-out": (_symlink(lambda o: o), "resolves outside the export folder", lambda d, o: [o]),
    "dev-zero-1TB": (_entries(location="/dev/zero", offset=0, length=TB), "is an absolute path",
                     lambda d, o: [Path("/dev/zero")]),
    "symlink-to-dev-zero-1TB": (_symlink(lambda o: "/dev/zero", offset=0, length=TB),
                                "resolves outside the export folder", lambda d, o: [Path("/dev/zero")]),
    "fifo-inside": (_fifo_inside, "is a FIFO, not a regular file", lambda d, o: [d / "onnx" / "pipe"]),
    "directory": (_directory, "is a directory, not a regular file", lambda d, o: [d / "onnx" / "weights"]),
    "length-past-eof": (_entries(length=_past_eof, offset=0), "truncated external data", lambda d, o: []),
    "negative-offset": (_entries(offset=-8), "offset '-8' is not a non-negative integer", lambda d, o: []),
    "non-integer-length": (_entries(length="4e3"), "length '4e3' is not a non-negative integer", lambda d, o: []),
    "no-length": (_entries(length=None), "external data has no length", lambda d, o: []),
    "huge-declared-dims": (_huge_dims, "declares shape [1000000, 1000000] (4,000,000,000,000 bytes)",
                           lambda d, o: []),
}


def _hostile(external: Path, tmp_path: Path, outside: Path, case: str) -> tuple[Path, str, list[Path]]:
    """(export, tampered tensor's name, targets) of a tampered copy; the graph keeps its stale digest."""
    d = tmp_path / "export"
    shutil.copytree(external, d)
    graph = d / artifact.PORTABLE_GRAPH
    model = onnx.load(str(graph), load_external_data=False)
    t = _weight(model)
    tamper, _, targets = GRAPH_CASES[case]
    tamper(t, d, outside)
    graph.write_bytes(model.SerializeToString())
    return d, t.name, [Path(p) for p in targets(d, outside)]


# -- proving what was not opened ----------------------------------------------------------------------------

@contextlib.contextmanager
def _watch_fifos(fifos: list[Path]):
    """The FIFOs among `fifos` that anyone opened for reading while the block ran (see the module doc)."""
    fifos = [p for p in fifos if p.exists() and p.is_fifo()]
    opened: set[Path] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for p in fifos:
                try:
                    fd = _REAL_OS_OPEN(p, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:  # ENXIO: no reader has it open
                    continue
                opened.add(p)
                os.close(fd)  # the reader sees the end of the file and goes on
            time.sleep(0.002)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield opened
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def _recording_opens():
    """Every path opened through open / io.open / os.open while the block runs."""
    seen: list[str] = []
    real_open = io.open

    def rec_open(file, *args, **kwargs):
        if not isinstance(file, int):
            seen.append(os.fsdecode(file))
        return real_open(file, *args, **kwargs)

    def rec_os_open(path, *args, **kwargs):
        seen.append(os.fsdecode(path))
        return _REAL_OS_OPEN(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "open", rec_open)
        mp.setattr(io, "open", rec_open)
        mp.setattr(os, "open", rec_os_open)
        yield seen


def _bytes_read() -> int:
    """The bytes this process has read through read(2) and its kin so far, every thread and library included
    (the kernel's `rchar` in /proc/self/io)."""
    text = Path("/proc/self/io").read_text()
    return int(re.search(r"^rchar: (\d+)$", text, re.MULTILINE).group(1))


def _refused(call: Callable[[], str], targets: list[Path]) -> tuple[str, int]:
    """Run `call` (it refuses and returns its one-line message); assert it opened none of `targets` and read
    at most READ_LIMIT bytes; returns (message, bytes read)."""
    with _watch_fifos(targets) as fifo_opened, _recording_opens() as seen:
        before = _bytes_read()
        message = call()
        read = _bytes_read() - before
    real = {os.path.realpath(p) for p in targets}
    opened = [p for p in seen if os.path.realpath(p) in real]
    assert not fifo_opened and not opened, f"opened {fifo_opened or opened}"
    assert "\n" not in message, message
    assert read <= READ_LIMIT, f"read {read:,} bytes: {message}"
    return message, read


def _raises(call: Callable[[], object]) -> Callable[[], str]:
    def run() -> str:
        with pytest.raises(ArtifactError) as info:
            call()
        return str(info.value)
    return run


def _command(capsys, argv: list[str], out: Path | None = None) -> Callable[[], str]:
    def run() -> str:
        code, line = _cli(capsys, argv)
        assert code == 2, line
        assert out is None or not out.exists(), f"{out} written"
        return line
    return run


def _entry_points(d: Path, tmp_path: Path, capsys) -> dict[str, Callable[[], str]]:
    """The readers of a whole export, each returning the refusal's message."""
    return {
        "Encoder": _raises(lambda: Encoder(d, providers=["CPUExecutionProvider"])),
        "inspect": _command(capsys, ["inspect", str(d)]),
        "check": _command(capsys, ["check", str(d)]),
        "triton-repo": _command(capsys, ["triton-repo", str(d), "-o", str(tmp_path / "repo"), "--name", "x"],
                                tmp_path / "repo"),
        "open_export": _raises(lambda: open_export(d)),
    }


# -- the cases ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_hostile_external_data_is_refused_before_it_is_opened(case, external, outside, tmp_path, capsys):
    d, tensor, targets = _hostile(external, tmp_path, outside, case)
    graph = d / artifact.PORTABLE_GRAPH
    model = onnx.load(str(graph), load_external_data=False)
    copy = tmp_path / "copy" / "model.onnx"
    points = {
        **_entry_points(d, tmp_path, capsys),
        "inspect FILE": _command(capsys, ["inspect", str(graph)]),
        "load_onnx_checked": _raises(lambda: load_onnx_checked(graph)),
        "graph_digest": _raises(lambda: graph_digest(model, graph.parent)),
        "write_graph_file": _raises(lambda: write_graph_file(model, graph.parent, copy)),
        "quantize _blocks": _raises(lambda: next(_blocks(_weight(model), graph.parent, _weight(model).dims[-1]))),
    }
    expected = GRAPH_CASES[case][1]
    for name, call in points.items():
        message, _ = _refused(call, targets)
        assert f"initializer {tensor!r}" in message and expected in message, (name, message)
        named = graph.parent if name in ("graph_digest", "write_graph_file", "quantize _blocks") else graph  # a proto
        assert str(named) in message, (name, message)
    assert not copy.parent.exists()


def test_without_a_digest_onnx_runtime_is_never_reached(external, outside, tmp_path, monkeypatch):
    """A format-1 export has no digest to check, so nothing of attncal reads the weights before ONNX Runtime,
    which follows external data itself: the reference is refused before a session is made."""
    d, tensor, targets = _hostile(external, tmp_path, outside, "absolute-path-outside")
    graph = d / artifact.PORTABLE_GRAPH
    model = onnx.load(str(graph), load_external_data=False)
    del model.metadata_props[:]
    graph.write_bytes(model.SerializeToString())
    meta = json.loads((d / "attncal.json").read_text())
    meta["format"] = 1
    (d / "attncal.json").write_text(json.dumps(meta))
    sessions = []
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: sessions.append(a))
    message, _ = _refused(_raises(lambda: Encoder(d, providers=["CPUExecutionProvider"])), targets)
    assert f"initializer {tensor!r} external data location" in message and not sessions


def test_parity_check_api_refuses_before_onnx_runtime(external, outside, tmp_path):
    """`attncal.check` (the exporter's parity check) runs its graph through `Encoder`, which checks it first."""
    from attncal.runtime.parity import check_parity

    d, tensor, targets = _hostile(external, tmp_path, outside, "symlink-points-out")
    with _watch_fifos(targets) as fifo_opened:
        with pytest.raises(ArtifactError, match=re.escape(f"initializer {tensor!r} external data location "
                                                          "'weights.bin' resolves outside the export folder")):
            check_parity(d, texts=["one short text"])
    assert not fifo_opened


def test_serve_refuses_a_repository_whose_graph_points_out(external, outside, tmp_path):
    """`attncal serve` validates the repository before Triton starts; Triton's ONNX Runtime would follow it."""
    repo = tmp_path / "repo"
    build_repository(external, repo, RepoOptions(name="x"))
    graph = repo / "x-encoder" / "1" / "model.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    t = _weight(model)
    _entries(location=lambda d, o: o)(t, repo, outside)
    graph.write_bytes(model.SerializeToString())
    message, _ = _refused(_raises(lambda: validate_repository(repo)), [outside])
    assert str(graph) in message and f"initializer {t.name!r}" in message and "is an absolute path" in message


META_CASES = {
    "max_seq_length-1e12": ({"max_seq_length": TB},
                            f"key 'max_seq_length' is {TB}, outside 1 to {artifact.MAX_SEQ_LENGTH_LIMIT}"),
    "num_layers-1e9": ({"num_layers": 10**9},
                       f"key 'num_layers' is 1000000000, outside 1 to {artifact.DIMENSION_LIMIT}"),
    "calibrated-layer-1e9": ({"calibrated_layers": [10**9]},
                             "key 'calibrated_layers' holds 1000000000, outside 0 to 1"),
}


@pytest.mark.parametrize("case", list(META_CASES))
def test_absurd_sizes_in_attncal_json_are_refused(case, external, tmp_path, capsys):
    d = tmp_path / "export"
    shutil.copytree(external, d)
    edit, expected = META_CASES[case]
    meta = json.loads((d / "attncal.json").read_text())
    meta.update(edit)
    (d / "attncal.json").write_text(json.dumps(meta))
    points = {**_entry_points(d, tmp_path, capsys),
              "read_metadata": _raises(lambda: artifact.read_metadata(d))}
    for name, call in points.items():
        message, _ = _refused(call, [])
        assert str(d / "attncal.json") in message and expected in message, (name, message)


def test_absurd_model_dimension_in_config_json_is_refused(external, tmp_path):
    d = tmp_path / "export"
    shutil.copytree(external, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_attention_heads"] = 10**9
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match=rf"config\.json: num_attention_heads is 1000000000, outside 1 to "
                                            rf"{artifact.DIMENSION_LIMIT}$"):
        artifact.config_int(d, "num_attention_heads")
    assert artifact.config_int(external, "num_attention_heads") >= 1


def _sparse(path: Path, size: int) -> None:
    """Make `path` a file of `size` bytes that takes no disk (and must never be read)."""
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.parametrize("case", ["tokenizer.json-4GiB", "model.onnx-3GiB"])
def test_oversized_files_are_refused_unread(case, external, tmp_path, capsys):
    d = tmp_path / "export"
    shutil.copytree(external, d)
    target = d / ("tokenizer.json" if case.startswith("tokenizer") else artifact.PORTABLE_GRAPH)
    _sparse(target, (4 if case.startswith("tokenizer") else 3) * 1024**3)
    points = _entry_points(d, tmp_path, capsys)
    if case.startswith("model"):
        points["inspect FILE"] = _command(capsys, ["inspect", str(target)])
        points["load_onnx_checked"] = _raises(lambda: load_onnx_checked(target))
    limit = "256.0 MiB limit (tokenizer or config file)" if case.startswith("tokenizer") else \
        "2.0 GiB limit (ONNX graph)"
    for name, call in points.items():
        message, _ = _refused(call, [target])
        assert str(target) in message and limit in message, (name, message)


# -- the controls: the proofs above can fail ------------------------------------------------------------------

def test_the_untampered_export_passes_every_reader(external, tmp_path, capsys):
    """The same readers accept the intact copy, and the recording sees them open its data file (so a reader
    that opened a case's target would be seen)."""
    d = tmp_path / "export"
    shutil.copytree(external, d)
    graph = d / artifact.PORTABLE_GRAPH
    data = graph.with_name("model.onnx_data")
    with _recording_opens() as seen:
        assert Encoder(d, providers=["CPUExecutionProvider"]).encode(["intact"]).shape == (1, 32)
    assert str(data) in seen
    assert main(["inspect", str(d)]) == 0
    model = load_onnx_checked(graph, require_digest=True)
    assert graph_digest(model, graph.parent) == artifact.stored_digest(model)
    write_graph_file(model, graph.parent, tmp_path / "copy" / "model.onnx")
    load_onnx_checked(tmp_path / "copy" / "model.onnx", require_digest=True)
    open_export(d)
    capsys.readouterr()


def test_the_read_limit_sees_a_large_read(tmp_path):
    """A refusal that read more than READ_LIMIT bytes fails, whoever read them."""
    big = tmp_path / "big"
    big.write_bytes(b"x" * (2 * READ_LIMIT))

    def reads_it() -> str:
        big.read_bytes()
        return "refused"

    assert _refused(lambda: "refused", [])[1] <= READ_LIMIT
    with pytest.raises(AssertionError, match="read .* bytes: refused"):
        _refused(reads_it, [])


def test_the_fifo_watcher_sees_a_reader(outside):
    """A reader of the outside FIFO is seen, and released (it reads the end of the file, it does not hang)."""
    with _watch_fifos([outside]) as opened:
        with open(outside, "rb") as f:
            assert f.read() == b""
    assert opened == {outside}
