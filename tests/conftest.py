"""Shared fixtures: random attention tensors with left/right padding, tiny model directories."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

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
                       "test_row_placement.py",
                       "test_encode_corpus.py", "test_serving_architectures.py", "test_calibration_math.py")


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


@pytest.fixture(scope="module")
def shared_raw_exports(tmp_path_factory):
    """torch.onnx's export of one model, shared by the tests of this run that export it again.

    A tiny model's dynamo export takes 12-35 s here (Gemma3's 30-35 s), and the suite made 162 torch.onnx
    exports, 266 s of them repeats of an earlier one: the same model files, pooling, opset, exporter and dtype,
    in another test or on the other xdist worker.  Within a module that asks for this fixture, attncal's
    `torch_export` step is memoised on exactly those inputs (the model directory by content, so both workers'
    copies of `tiny_models` share).  The first request of a key runs the real torch.onnx export; later ones
    copy its files.  Everything after that step (placement, ORT's optimizer, parity, the artifact) runs as
    usual.  The cache lives in this run's own temporary root (shared by its xdist workers): no other run sees it."""
    import attncal.export.exporter as exporter

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "raw-exports"
    root.mkdir(parents=True, exist_ok=True)
    real = exporter.torch_export

    def torch_export(info, pooling, onnx_path, opset, exporter_name, fp16=False, model=None):
        fields = {k: str(v).replace(str(info.root), "<root>").replace(str(info.path), "<path>")
                  for k, v in dataclasses.asdict(info).items() if k not in ("path", "root")}
        key = hashlib.sha256(json.dumps([_tree_digest(info.root, info.path), fields, pooling, onnx_path.name,
                                         opset, exporter_name, fp16]).encode()).hexdigest()[:24]
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
        mp.setattr(exporter, "torch_export", torch_export)
        yield root


def random_mask(rng: random.Random, B: int, K: int, left: bool, min_len: int = 0) -> torch.Tensor:
    """A [B,K] mask with one contiguous run per row (right or left padding)."""
    mask = torch.zeros(B, K, dtype=torch.long)
    for b in range(B):
        n = rng.randint(min(min_len, K), K)
        if left:
            mask[b, K - n :] = 1
        else:
            mask[b, :n] = 1
    return mask


def random_probs(gen: torch.Generator, mask: torch.Tensor, H: int, dtype=torch.float64, temp: float = 2.0) -> torch.Tensor:
    """Post-softmax attention [B,H,K,K] with masked keys at exactly 0 (fully masked rows all 0)."""
    B, K = mask.shape
    logits = torch.randn(B, H, K, K, generator=gen, dtype=torch.float64) * temp
    logits = logits.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
    return torch.softmax(logits, -1).nan_to_num(0.0).to(dtype)


def random_scores(gen: torch.Generator, mask: torch.Tensor, H: int, dtype=torch.float32, temp: float = 2.0,
                  Q: int | None = None) -> torch.Tensor:
    """Attention scores [B,H,Q,K] (the input of the attention Softmax) as encoders build them: logits
    plus an additive mask of the dtype's lowest value at masked keys (fully masked rows all equal)."""
    B, K = mask.shape
    logits = torch.randn(B, H, K if Q is None else Q, K, generator=gen, dtype=torch.float64) * temp
    return logits.to(dtype).masked_fill(mask[:, None, None, :] == 0, torch.finfo(dtype).min)


def softmax_reference(scores: torch.Tensor, mask: torch.Tensor, rc) -> torch.Tensor:
    """The fused ops' spec in float64: the oracle applied to Softmax(scores)."""
    from attncal.calibration import reference

    return reference(torch.softmax(scores.double(), -1), mask, rc)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """One saved random-weight model directory per architecture (built once per test session)."""
    from attncal.synthetic import ARCHITECTURES, save_synthetic_model

    root = tmp_path_factory.mktemp("tiny")
    return {a: save_synthetic_model(a, root / a, seed=1, max_positions=256) for a in ARCHITECTURES}


def calibrated_rows(mask: torch.Tensor, rc) -> torch.Tensor:
    """[B,Q] bool: which query rows the spec calibrates (derived from the spec, not from an implementation)."""
    B, K = mask.shape
    out = torch.zeros(B, K, dtype=torch.bool)
    if rc.strength == 0:
        return out
    for b in range(B):
        idx = mask[b].nonzero().flatten()
        if len(idx) == 0:
            continue
        start, end = int(idx[0]), int(idx[-1])
        C = end - start + 1 - rc.n_isolated  # the span's length: a hole inside it still counts
        if C <= 0 or (rc.skip_short and C < rc.basket_size):
            continue
        if rc.all_rows:
            out[b, start : end + 1] = True
        else:
            out[b, end if rc.pool_last else start] = True
    return out
