"""Nothing a user hands attncal crashes it: damaged exports and model repositories.

One tiny export per session (tests/test_artifact.py::tiny_export); every case copies it and damages
the copy in one way, deterministically.  Every command and API that reads an export (`check`,
`inspect`, `bench OUT`, `triton-repo`, `eval OUT`, `Encoder`) must end with exactly one error line
that names the damaged file, exit status 2, no traceback, and nothing written to its output
directory.  A damaged Triton model repository makes `serve` fail the same way, before a server is
started.  The test ids count the cases.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from attncal.artifact import ArtifactError
from attncal.cli import main
from test_artifact import tiny_export

MODEL = Path("onnx/model.onnx")


# -- damages: each takes the copied export (or repository) and returns (path to pass, path to name) --

def _truncate(fraction: float | None = None, keep: int | None = None):
    def damage(d: Path, f: Path = MODEL):
        p = d / f
        data = p.read_bytes()
        p.write_bytes(data[: keep if keep is not None else int(len(data) * fraction)])
        return d, p
    return damage


def _flip(seed: int, n: int = 1):
    def damage(d: Path, f: Path = MODEL):
        p = d / f
        data = bytearray(p.read_bytes())
        for pos in np.random.default_rng(seed).choice(len(data), size=n, replace=False):
            data[pos] ^= 0xFF
        p.write_bytes(bytes(data))
        return d, p
    return damage


def _empty(d: Path, f: Path = MODEL):
    (d / f).write_bytes(b"")
    return d, d / f


def _not_attncal(d: Path, f: Path = MODEL):
    """A valid ONNX model (it passes onnx.checker) that is not an attncal encoder."""
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "other",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    onnx.save(model, str(d / f))
    return d, d / f


def _remove(rel: str):
    def damage(d: Path):
        p = d / rel
        shutil.rmtree(p) if p.is_dir() else p.unlink()
        return d, p
    return damage


def _edit_meta(edit: Callable[[dict], object], rel: str = "attncal.json"):
    def damage(d: Path):
        p = d / rel
        meta = json.loads(p.read_text())
        edit(meta)
        p.write_text(json.dumps(meta))
        return d, p
    return damage


def _write(rel: str, text: str):
    def damage(d: Path):
        (d / rel).write_text(text)
        return d, d / rel
    return damage


def _is_file(d: Path):
    return d / "config.json", d / "config.json"


def _no_permission(rel: str = ""):
    def damage(d: Path):
        p = d / rel if rel else d
        p.chmod(0)
        # The simulated condition: unreadable to the caller, or (as root, who bypasses the bits)
        # without any read permission, which attncal refuses whoever runs it.
        assert not os.access(p, os.R_OK) or not stat.S_IMODE(p.stat().st_mode) & 0o444
        return d, p
    return damage


EXPORT_CASES: dict[str, Callable] = {
    "onnx-truncated-100B": _truncate(keep=100),
    "onnx-truncated-10pct": _truncate(0.1),
    "onnx-truncated-50pct": _truncate(0.5),
    "onnx-truncated-90pct": _truncate(0.9),
    "onnx-truncated-last-byte": _truncate(keep=-1),
    "onnx-flipped-byte-seed0": _flip(0),
    "onnx-flipped-byte-seed1": _flip(1),
    "onnx-flipped-byte-seed2": _flip(2),
    "onnx-flipped-byte-seed3": _flip(3),
    "onnx-flipped-16-bytes": _flip(4, n=16),
    "onnx-empty": _empty,
    "onnx-valid-but-not-attncal": _not_attncal,
    "attncal.json-missing": _remove("attncal.json"),
    "config.json-missing": _remove("config.json"),
    "tokenizer.json-missing": _remove("tokenizer.json"),
    "onnx-dir-missing": _remove("onnx"),
    "onnx-file-missing": _remove("onnx/model.onnx"),
    "attncal.json-not-json": _write("attncal.json", '{"format": 2, "calibrated": tr'),
    "attncal.json-empty": _write("attncal.json", ""),
    "attncal.json-a-list": _write("attncal.json", "[1, 2]"),
    "attncal.json-missing-key-pooling": _edit_meta(lambda m: m.pop("pooling")),
    "attncal.json-missing-key-format": _edit_meta(lambda m: m.pop("format")),
    "attncal.json-missing-key-calibrated": _edit_meta(lambda m: m.pop("calibrated")),
    "attncal.json-wrong-type-calibrated": _edit_meta(lambda m: m.update(calibrated="yes")),
    "attncal.json-wrong-type-layers": _edit_meta(lambda m: m.update(calibrated_layers="1,2")),
    "attncal.json-wrong-type-config": _edit_meta(lambda m: m.update(config=[0.5])),
    "attncal.json-bad-config-value": _edit_meta(lambda m: m["config"].update(strength=3)),
    "attncal.json-unknown-format-99": _edit_meta(lambda m: m.update(format=99)),
    "attncal.json-unknown-format-0": _edit_meta(lambda m: m.update(format=0)),
    "config.json-not-json": _write("config.json", "{not json"),
    "path-is-a-file": _is_file,
    "dir-without-read-permission": _no_permission(),
    "onnx-dir-without-read-permission": _no_permission("onnx"),
    "attncal.json-without-read-permission": _no_permission("attncal.json"),
    "onnx-file-without-read-permission": _no_permission("onnx/model.onnx"),
}

COMMANDS = ("check", "inspect", "bench", "triton-repo", "eval", "Encoder")


def _restore_permissions(root: Path) -> None:
    for p in [root, *root.rglob("*")] if root.exists() else []:
        try:
            p.chmod(0o755 if p.is_dir() else 0o644)
        except OSError:
            pass


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return tiny_export(tmp_path_factory)


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory):
    from attncal.eval import write_synthetic

    d = tmp_path_factory.mktemp("eval-data") / "set"
    write_synthetic(d, n_per_class=2, words=20)
    return d


def _cli(capsys, argv: list[str]) -> tuple[int, str]:
    """Run the CLI in-process; assert one error line, no traceback; return (exit code, error line)."""
    code = main(argv)
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err + cap.out, cap.err
    errors = [ln for ln in cap.err.splitlines() if ": error: " in ln]
    assert len(errors) == 1, f"expected one error line, got: {cap.err!r}"
    return code, errors[0]


def _argv(command: str, target: Path, out: Path, data: Path) -> list[str]:
    return {
        "check": ["check", str(target)],
        "inspect": ["inspect", str(target)],
        "bench": ["bench", str(target), "--engines", "ort,ort-cal", "--seq", "8", "--batch", "1", "--repeats", "1",
                  "--no-memory", "--out", str(out / "bench")],
        "triton-repo": ["triton-repo", str(target), "-o", str(out / "repo"), "--name", "x"],
        "eval": ["eval", str(target), "--data", str(data), "--out", str(out / "eval"), "--no-cache", "--no-plots"],
    }[command]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", list(EXPORT_CASES), ids=[f"{i + 1:02d}-{c}" for i, c in enumerate(EXPORT_CASES)])
def test_damaged_export(case, command, good, eval_data, tmp_path, capsys, monkeypatch):
    d = tmp_path / "export"
    shutil.copytree(good, d)
    outs = tmp_path / "outs"
    outs.mkdir()
    target, named = EXPORT_CASES[case](d)
    try:
        if command == "Encoder":
            from attncal import Encoder

            with pytest.raises(ArtifactError) as info:
                Encoder(target, providers=["CPUExecutionProvider"])
            line = str(info.value)
            assert "\n" not in line
        else:
            import attncal.bench.harness as harness

            def no_bench(*a, **k):
                raise AssertionError("bench started benchmarking a damaged export")

            monkeypatch.setattr(harness, "run_bench", no_bench)
            code, line = _cli(capsys, _argv(command, target, outs, eval_data))
            assert code == 2, line
        assert str(named) in line, line
        assert not list(outs.iterdir()), f"output written: {list(outs.iterdir())}"
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary output left behind"
    finally:
        _restore_permissions(d)


def test_the_undamaged_export_passes_every_reader(good, eval_data, tmp_path, capsys):
    """The control: the same commands on the intact copy succeed (so the cases above fail for their damage)."""
    from attncal import Encoder

    d = tmp_path / "export"
    shutil.copytree(good, d)
    assert main(["check", str(d)]) == 0
    assert main(["inspect", str(d)]) == 0
    assert main(["triton-repo", str(d), "-o", str(tmp_path / "repo"), "--name", "x"]) == 0
    assert main(["eval", str(d), "--data", str(eval_data), "--out", str(tmp_path / "eval"), "--no-cache",
                 "--no-plots"]) == 0
    assert Encoder(d).encode(["intact"]).shape == (1, 32)
    capsys.readouterr()


# -- a Triton model repository given to `serve` --------------------------------------------------------

ENC = Path("x-encoder")
TOK = Path("x-tokenizer")
REPO_CASES: dict[str, Callable] = {
    "encoder-onnx-truncated-50pct": lambda r: _truncate(0.5)(r, ENC / "1/model.onnx"),
    "encoder-onnx-truncated-100B": lambda r: _truncate(keep=100)(r, ENC / "1/model.onnx"),
    "encoder-onnx-flipped-byte": lambda r: _flip(5)(r, ENC / "1/model.onnx"),
    "encoder-onnx-empty": lambda r: _empty(r, ENC / "1/model.onnx"),
    "encoder-onnx-not-attncal": lambda r: _not_attncal(r, ENC / "1/model.onnx"),
    "encoder-onnx-missing": _remove(str(ENC / "1/model.onnx")),
    "encoder-attncal.json-missing": _remove(str(ENC / "attncal.json")),
    "encoder-attncal.json-not-json": _write(str(ENC / "attncal.json"), "{"),
    "encoder-attncal.json-unknown-format": _edit_meta(lambda m: m.update(format=7), str(ENC / "attncal.json")),
    "encoder-attncal.json-missing-key": _edit_meta(lambda m: m.pop("calibrated"), str(ENC / "attncal.json")),
    "encoder-config.pbtxt-garbage": _write(str(ENC / "config.pbtxt"), "name: \"x-encoder\"\nbackend: {{{\n"),
    "tokenizer.json-missing": _remove(str(TOK / "1/tokenizer/tokenizer.json")),
    "tokenizer.json-truncated": lambda r: _truncate(0.3)(r, TOK / "1/tokenizer/tokenizer.json"),
    "tokenizer-config.json-missing": _remove(str(TOK / "1/tokenizer/config.json")),
    "repo-is-a-file": lambda r: (r / ENC / "config.pbtxt", r / ENC / "config.pbtxt"),
    "repo-without-read-permission": _no_permission(),
    "model-dir-without-read-permission": _no_permission(str(ENC)),
}


@pytest.fixture(scope="module")
def good_repo(good, tmp_path_factory):
    pytest.importorskip("tritonclient")
    from attncal.serving.repository import RepoOptions, build_repository

    repo = tmp_path_factory.mktemp("repo") / "r"
    build_repository(good, repo, RepoOptions(name="x", native=False))
    return repo


@pytest.mark.parametrize("case", list(REPO_CASES), ids=[f"{i + 1:02d}-{c}" for i, c in enumerate(REPO_CASES)])
def test_serve_refuses_damaged_repository_before_starting(case, good_repo, tmp_path, capsys, monkeypatch):
    from attncal.serving import server as server_mod

    started = []
    monkeypatch.setattr(server_mod.subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail(
        "a server was launched on a damaged repository"))
    r = tmp_path / "repo"
    shutil.copytree(good_repo, r)
    target, named = REPO_CASES[case](r)
    try:
        ports = [str(server_mod.free_port()) for _ in range(3)]
        code, line = _cli(capsys, ["serve", str(target), "--http-port", ports[0], "--grpc-port", ports[1],
                                   "--metrics-port", ports[2], "--ready-timeout", "5"])
        assert code == 2 and str(named) in line, line
        assert not started
    finally:
        _restore_permissions(r)


def test_serve_validation_passes_the_intact_repository(good_repo):
    from attncal.serving.repository import validate_repository

    assert validate_repository(good_repo) == ["x", "x-encoder", "x-tokenizer"]


# -- atomic outputs and the eval cache ------------------------------------------------------------------

def test_eval_cache_damaged_entries_are_recomputed_and_reported(good, eval_data, tmp_path):
    from attncal.eval import EvalOptions, evaluate, load_dataset

    data = load_dataset(eval_data)
    cache = tmp_path / "cache"
    opts = EvalOptions(cache_dir=cache, plots=False)
    first = evaluate(str(good), data, opts)
    entries = sorted(cache.glob("*.npy"))
    assert first["cache"]["misses"] == len(entries) >= 2 and not first["cache"]["repaired"]
    truncated, flipped = entries[0], entries[1]
    truncated.write_bytes(truncated.read_bytes()[:100])
    raw = bytearray(flipped.read_bytes())
    raw[-3] ^= 0x40  # inside the float data: np.load still succeeds, only the checksum sees it
    flipped.write_bytes(bytes(raw))
    second = evaluate(str(good), data, opts)
    repaired = second["cache"]["repaired"]
    assert len(repaired) == 2 and all("damaged and is recomputed" in r for r in repaired)
    assert any(truncated.name in r for r in repaired) and any(flipped.name in r for r in repaired)
    assert set(repaired) <= set(second["notes"])
    assert [r["scores"] for r in second["rows"]] == [r["scores"] for r in first["rows"]]
    third = evaluate(str(good), data, opts)  # rewritten entries are whole again
    assert third["cache"]["hits"] == len(entries) and not third["cache"]["repaired"]
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("writer", ["bench", "eval", "triton-repo"])
def test_outputs_are_committed_whole_or_not_at_all(writer, good, eval_data, tmp_path, monkeypatch):
    """A failure while an output directory is being written leaves the previous output as it was
    and no temporary directory behind."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "previous.txt").write_text("kept")

    def boom(*a, **k):
        raise RuntimeError("disk full (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        if writer == "bench":
            import attncal.bench.report as report

            monkeypatch.setattr(report, "_plot", boom)
            report.write_results(out, [], {"machine": {"cpu": "x", "cores": 1, "threads": 1, "versions": {}},
                                           "config": {}}, {})
        elif writer == "eval":
            import attncal.eval.runner as runner
            from attncal.eval import EvalOptions, load_dataset

            monkeypatch.setattr(runner, "markdown_table", boom)
            runner.evaluate(str(good), load_dataset(eval_data), EvalOptions(plots=False), out=out, overwrite=True)
        else:
            import attncal.serving.repository as repository

            monkeypatch.setattr(repository, "tokenizer_config", boom)
            repository.build_repository(good, out, repository.RepoOptions(name="x", native=False))
    assert sorted(p.name for p in out.iterdir()) == ["previous.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary output left behind"
