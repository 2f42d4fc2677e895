"""Shared fixtures and hooks: tiny model directories, the shared torch.onnx exports, the suite's file order.

The helpers that build random masks, tensors and calibration cases are in tests/support (`support.*`),
shared with the GPU tests and the benchmarks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# OpenMP's threads (torch's) sleep when idle instead of spinning: the xdist workers share the cores, and a
# worker's spinning threads take the CPU the other worker's test is waiting for.  Set before torch loads
# libgomp, and inherited by every subprocess the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import onnxruntime as _ort  # noqa: E402
import torch  # noqa: E402, F401  (loaded before any test module and the native libraries it loads)


class _NonSpinningSessionOptions(_ort.SessionOptions):
    """ONNX Runtime's worker threads, likewise, wait without spinning in the suite's own processes.  The
    results are the same; a spinning session on one xdist worker (an oracle loop runs thousands of small
    sessions' runs) took the cores the other worker was computing on.  attncal builds its options with
    `ort.SessionOptions()` at call time, so every session made in a test process gets them; the
    subprocesses a test starts (the CLI, Ray actors, Triton) keep ONNX Runtime's default."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.add_session_config_entry("session.inter_op.allow_spinning", "0")


_ort.SessionOptions = _NonSpinningSessionOptions

# The checkout's build of the native libraries (oplib.build_library) compiles CUDA for sm_90 only; the wheel test
# builds sm_80, so each default architecture is compiled once per run (nvcc takes most of a build's time).
os.environ.setdefault("ATTNCAL_CUDA_ARCHS", "90")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# At its peak the suite holds about 3 GB in the temporary directory (the wheel test's user venv,
# real-weight exports); passing tests' directories are removed as they finish (pyproject's
# tmp_path_retention_policy).  The summary names the free space, so that a full disk shows up there
# instead of only as scattered OSErrors (CI's -q hides the header).
NEEDED_TMP_GIB = 4.0
_FREE_AT_START: list[float] = []


def _free_tmp_gib() -> float:
    return shutil.disk_usage(tempfile.gettempdir()).free / 2**30


def pytest_sessionstart(session) -> None:
    _FREE_AT_START.append(_free_tmp_gib())


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    start = _FREE_AT_START[0] if _FREE_AT_START else float("nan")
    line = f"attncal: {start:.1f} GiB free in {tempfile.gettempdir()} at the start, {_free_tmp_gib():.1f} GiB now"
    if start < NEEDED_TMP_GIB:
        line += f"; under {NEEDED_TMP_GIB:.0f} GiB, tests that write real-weight exports may fail with ENOSPC"
    terminalreporter.write_line(line, yellow=start < NEEDED_TMP_GIB)


# pytest-xdist's `--dist loadfile` hands each worker whole files, in collection order when `make test` passes
# `--no-loadscope-reorder` (by default it sorts files by their number of tests, which put the one-test wheel
# build, the longest file, last, where one worker runs it alone while the other idles).  The files that take
# longest in `--durations` go first, the longest first, so that the short files fill in around them
# (docs/development.md, "Tests and CI").
LONGEST_FILES_FIRST = ("test_export.py", "test_split_placement.py", "test_wheel.py", "test_large_export.py",
                       "test_row_placement.py", "test_calibrated_attention_kernel.py", "test_serving_architectures.py",
                       "test_calibration_math.py", "test_encode_cluster.py", "test_encode_corpus.py",
                       "test_docs.py", "test_landmark_pooling.py", "test_landmark_rows.py", "test_lowest_versions.py")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


def quick_exporter(arch: str) -> str:
    """The exporter for a test whose subject is not the exporter: TorchScript where it traces (a tiny model's
    dynamo export takes about 12 s more on the 2-core CI machine).  Not Gemma3: transformers builds
    EmbeddingGemma's bidirectional masks with an `or_mask_function`, which forces `use_vmap=True` in
    `masking_utils.sdpa_mask`, and the TorchScript tracer fails inside vmap (`unordered_map::at`).  The default
    (dynamo) exporter is test_export.py's subject, on every architecture."""
    return "dynamo" if arch == "gemma3_text" else "torchscript"


def _tree_digest(*dirs: Path) -> str:
    """Every file's relative name and bytes under `dirs` (a model directory: config, tokenizer, weights)."""
    h = hashlib.sha256()
    for d in dict.fromkeys(Path(p).resolve() for p in dirs):
        for f in sorted(p for p in d.rglob("*") if p.is_file()):
            h.update(f.relative_to(d).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _run_root(tmp_path_factory, name: str) -> Path:
    """A folder of this run's own temporary root, shared by its xdist workers: no other run sees it."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    root.mkdir(parents=True, exist_ok=True)
    return root


def memoized_optimizer(real, root: Path):
    """`real` (`attncal.exporting.optimized_graphs.run_optimizer`: src, dst, heads, width -> (dst, stderr)) run
    once per input: the key is what the child reads (the graph, its data file, the head count and width) and
    the name it writes; a later call copies the first call's output files into place and returns its messages
    (written to file descriptor 2, as the child's run passes them on).  Entries are folders under `root`, made
    atomically, so that concurrent xdist workers never read half of one."""
    from attncal.artifact import external_data_name

    def run_optimizer(src: Path, dst: Path, num_heads: int, hidden_size: int):
        h = hashlib.sha256(json.dumps([dst.name, num_heads, hidden_size]).encode())
        for f in (src, src.with_name(external_data_name(src))):
            h.update(f.name.encode() + b"\0" + (hashlib.sha256(f.read_bytes()).digest() if f.is_file() else b"-"))
        entry = root / h.hexdigest()[:24]
        outputs = (dst.name, external_data_name(dst))
        if not (entry / "stderr.txt").is_file():
            _, stderr = real(src, dst, num_heads, hidden_size)
            tmp = root / f".{entry.name}.{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name in outputs:
                if (dst.parent / name).is_file():
                    shutil.copyfile(dst.parent / name, tmp / name)
            (tmp / "stderr.txt").write_text(stderr)
            try:
                os.replace(tmp, entry)  # atomic; fails where the other worker got there first
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
            return dst, stderr
        dst.parent.mkdir(parents=True, exist_ok=True)
        for name in outputs:
            if (entry / name).is_file():
                shutil.copyfile(entry / name, dst.parent / name)
        stderr = (entry / "stderr.txt").read_text()
        if stderr:
            os.write(2, stderr.encode("utf-8", "replace"))
        return dst, stderr

    return run_optimizer


@pytest.fixture(scope="module")
def shared_optimizer_runs(tmp_path_factory):
    """ONNX Runtime's transformer optimizer run once per input graph in this run (`memoized_optimizer`),
    requested by `shared_raw_exports`, so every module that shares its torch exports shares these too.

    The exporter runs the optimizer (`attncal.exporting.ort_optimize`, a child process) on the TorchScript export,
    or on a placement of it, and the same graph comes back again and again: a calibrated and an uncalibrated
    export of one model (the row and split placements optimize first), the same model in another test, and tiny
    XLM-R's and RoBERTa's graphs, which are the same bytes.  The export's own code after the call runs as usual."""
    import attncal.exporting.optimized_graphs as optimized_graphs

    root = _run_root(tmp_path_factory, "optimizer-runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(optimized_graphs, "run_optimizer", memoized_optimizer(optimized_graphs.run_optimizer, root))
        yield root


@pytest.fixture(scope="module")
def shared_raw_exports(tmp_path_factory, shared_optimizer_runs):
    """torch.onnx's export of one model, shared by the tests of this run that export it again.

    A tiny model's dynamo export takes 12-35 s here (Gemma3's 30-35 s), and the suite made 162 torch.onnx
    exports, 266 s of them repeats of an earlier one: the same model files, pooling, opset, exporter and dtype,
    in another test or on the other xdist worker.  Within a module that asks for this fixture, attncal's
    `torch_export` step is memoised on exactly those inputs (the model directory by content, so both workers'
    copies of `tiny_models` share).  The first request of a key runs the real torch.onnx export; later ones
    copy its files.  Everything after that step (placement, ORT's optimizer, parity, the artifact) runs as
    usual.  The cache lives in this run's own temporary root (shared by its xdist workers): no other run sees it."""
    import attncal.exporting.from_torch as from_torch

    root = _run_root(tmp_path_factory, "raw-exports")
    real = from_torch.torch_export

    def torch_export(info, pooling, onnx_path, opset, exporter_name, fp16=False, model=None):
        fields = {k: str(v).replace(str(info.root), "<root>").replace(str(info.path), "<path>")
                  for k, v in dataclasses.asdict(info).items() if k not in ("path", "root")}
        key = hashlib.sha256(json.dumps([_tree_digest(info.root, info.path), fields, pooling, onnx_path.name,
                                         opset, exporter_name, fp16], default=repr).encode()).hexdigest()[:24]
        entry = root / key
        if not (entry / "names.json").is_file():
            tmp = root / f".{key}.{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            names = real(info, pooling, tmp / onnx_path.name, opset, exporter_name, fp16=fp16, model=model)
            (tmp / "names.json").write_text(json.dumps(names))
            try:
                os.replace(tmp, entry)  # atomic; fails where the other worker got there first
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        onnx_path.parent.mkdir(parents=True, exist_ok=True)
        for f in entry.iterdir():
            if f.name != "names.json":
                shutil.copyfile(f, onnx_path.parent / f.name)
        return json.loads((entry / "names.json").read_text())

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(from_torch, "torch_export", torch_export)
        yield root


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """One saved random-weight model directory per architecture (built once per test session)."""
    from attncal.synthetic import ARCHITECTURES, save_synthetic_model

    root = tmp_path_factory.mktemp("tiny")
    return {a: save_synthetic_model(a, root / a, seed=1, max_positions=256) for a in ARCHITECTURES}

