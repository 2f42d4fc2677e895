"""conftest's memoized ONNX Runtime optimizer runs: one run per input, keyed on everything the child reads."""

from __future__ import annotations

from pathlib import Path

from conftest import memoized_optimizer

CALLS: list[tuple] = []


def fake_optimizer(src: Path, dst: Path, num_heads: int, hidden_size: int):
    """Writes a graph and its data file derived from every input, as the child does, and says so on stderr."""
    CALLS.append((src, dst, num_heads, hidden_size))
    data = src.with_name(src.name + "_data")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes() + f"{num_heads} {hidden_size}".encode())
    dst.with_name(dst.name + "_data").write_bytes(data.read_bytes()[::-1])
    return dst, f"optimized {len(CALLS)}\n"


def graph(folder: Path, structure: bytes, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(structure)
    (folder / "model.onnx_data").write_bytes(weights)
    return folder / "model.onnx"


def test_each_input_runs_once_and_a_repeat_gets_its_files_and_messages(tmp_path, capfd):
    CALLS.clear()
    run = memoized_optimizer(fake_optimizer, tmp_path / "cache")
    first = run(graph(tmp_path / "a", b"graph", b"weights"), tmp_path / "out-a" / "model.onnx", 4, 32)
    assert len(CALLS) == 1 and first[1] == "optimized 1\n"
    # The same bytes elsewhere (another export's working folder): the first run's files and messages.
    again = run(graph(tmp_path / "b", b"graph", b"weights"), tmp_path / "out-b" / "model.onnx", 4, 32)
    assert len(CALLS) == 1 and again == (tmp_path / "out-b" / "model.onnx", "optimized 1\n")
    for name in ("model.onnx", "model.onnx_data"):
        assert (tmp_path / "out-b" / name).read_bytes() == (tmp_path / "out-a" / name).read_bytes()
    assert capfd.readouterr().err == "optimized 1\n"  # passed on as the child's run passes its stderr on
    # Anything else the child reads or writes: a run of its own.
    run(graph(tmp_path / "c", b"graph", b"weightz"), tmp_path / "out-c" / "model.onnx", 4, 32)  # one weight byte
    run(graph(tmp_path / "d", b"graph", b"weights"), tmp_path / "out-d" / "model.onnx", 2, 32)  # the heads
    run(graph(tmp_path / "e", b"graph", b"weights"), tmp_path / "out-e" / "model.onnx", 4, 16)  # the width
    run(graph(tmp_path / "f", b"graphs", b"weights"), tmp_path / "out-f" / "model.onnx", 4, 32)  # the structure
    run(tmp_path / "a" / "model.onnx", tmp_path / "out-g" / "other.onnx", 4, 32)  # the name it writes
    assert len(CALLS) == 6
    assert (tmp_path / "out-c" / "model.onnx_data").read_bytes() == b"zthgiew"
