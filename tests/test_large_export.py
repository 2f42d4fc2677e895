"""Large exports: bounded memory per step, a parity check that scales, refusal before an out-of-memory kill,
external-data graphs that every loader opens.

The budget test exports a model whose size is its embedding table (250,002 x 256 float32, two layers: about
260 MB) and takes the peak resident memory of the export process and its children per step from high-water
marks; the interpreter's own libraries are measured separately and allowed on top.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from attncal.artifact import onnx_io
from attncal.artifact import graph_digest, stage_onnx, stored_digest, write_graph_file
from attncal.memory import MIB, interpreter_rss
from attncal.runtime.parity import ATTENTION_COPIES, attention_bytes, plan_batches
from attncal.synthetic import save_synthetic_model
from support.hooks import hooked_cli

REPO = Path(__file__).resolve().parents[1]
BUDGET_WEIGHTS = 3.0  # float32 weight sizes above the interpreter's libraries: steps the memory plan does not list
# The export's step lines (stderr) -> its steps.
_STEP_LINES = {"[1/4] exporting": "torch export", "[2/4] portable graph": "portable graph",
               "[2/4] ORT-optimized graph (": "ORT-optimized graph", "[2/4] ORT-optimized graph with": "native graph",
               "[3/4] checking parity": "parity check", "[4/4] wrote": "write"}
_ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


@pytest.fixture(scope="module")
def large_vocab_model(tmp_path_factory) -> Path:
    return save_synthetic_model("xlm-roberta", tmp_path_factory.mktemp("large") / "src", layers=2, hidden=256,
                                heads=4, intermediate=1024, max_positions=8192, vocab=250002, pooling="cls")


def test_export_steps_stay_within_their_memory_budgets(large_vocab_model, tmp_path):
    """Each step's peak memory (the export process and its children), within the memory plan's estimate for
    it: the figure an export is refused by must not be exceeded.  The peaks are high-water marks read in the
    export process at its step boundaries (support.hooks.StepPeaks): an upper bound of the tree's peak that no
    short spike escapes and no late label misplaces, on any machine."""
    from attncal.exporting import memory_plan

    plan = memory_plan.estimate(large_vocab_model, exporter="dynamo", optimized=True, check=True)
    weights = plan.weights
    assert 250 * MIB < weights < 280 * MIB
    base = interpreter_rss()
    out, report = tmp_path / "out", tmp_path / "peaks.json"
    proc = subprocess.run(hooked_cli(["step-peaks", str(report)], ["export", str(large_vocab_model), "-o", str(out)]),
                          capture_output=True, text=True, env=_ENV, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [v for line in proc.stderr.splitlines() for k, v in _STEP_LINES.items()
               if line.startswith("attncal: " + k)]
    peaks = json.loads(report.read_text())
    assert printed == list(peaks) == list(_STEP_LINES.values()), (printed, list(peaks))
    optimizer = plan.steps["ONNX Runtime's optimizer"]
    budget = {"torch export": plan.steps["torch export (dynamo)"],
              "ORT-optimized graph": max(plan.steps[memory_plan.TORCHSCRIPT_STEP], optimizer),
              "native graph": optimizer, "parity check": plan.steps["parity check"]}
    for k in _STEP_LINES.values():
        budget.setdefault(k, base + BUDGET_WEIGHTS * weights)
    summary = ", ".join(f"{k} {(v - base) / weights:.2f}x (budget {(budget[k] - base) / weights:.2f}x)"
                        for k, v in peaks.items())
    print(f"\nweights {weights / MIB:.0f} MiB, libraries {base / MIB:.0f} MiB; per step above the libraries: {summary}")
    assert all(v <= budget[k] for k, v in peaks.items()), summary
    meta = json.loads((out / "attncal.json").read_text())
    assert [s["step"] for s in meta["export_steps"]] == list(_STEP_LINES.values())
    assert all(s["peak_rss_mib"] > 0 and s["seconds"] >= 0 for s in meta["export_steps"])
    for g, info in meta["graphs"].items():
        par = info["parity"]
        assert par["ok"] and par["max_abs"] <= 1e-5, g
        # The long built-in texts are checked at the longest length the activation budget allows, said so.
        assert par["length_cap"] is not None and par["max_tokens"] == par["length_cap"] >= 2000, par
        assert par["capped_texts"] >= 1 and par["batch_sizes"][0] == 1
        # Below 2 GiB one file, but for a native graph whose feed-forward blocks run over chunks of rows
        chunked = bool(info.get("feed_forward_chunks", {}).get("blocks"))
        assert (out / g).with_name(Path(g).name + "_data").exists() == chunked, g
    assert not list(tmp_path.glob(".out.*"))


def test_export_refuses_in_one_line_when_memory_cannot_suffice(tiny_models, tmp_path, monkeypatch, capsys):
    from attncal.cli import main
    from attncal.exporting import memory_plan

    monkeypatch.setattr(memory_plan, "available_bytes", lambda: 64 * MIB)
    out = tmp_path / "out"
    assert main(["export", str(tiny_models["bert"]), "-o", str(out)]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and len([ln for ln in err.splitlines() if "needs about" in ln]) == 1, err
    est = memory_plan.estimate(Path(tiny_models["bert"]), exporter="dynamo", optimized=True, check=True)
    assert est.peak > 64 * MIB and not out.exists() and not list(tmp_path.iterdir())
    with pytest.raises(memory_plan.ExportMemoryError, match=r"needs about .* GiB of memory .* and 0\.1 GiB is available; "
                       r"neither --skip-check nor --no-optimized nor --skip-check --no-optimized would fit; "
                       r"--no-memory-check tries anyway$"):
        memory_plan.check_fits(est, tmp_path, optimized=True, check=True)
    # With room for the export without its parity check and optimized graph, the refusal says so.
    smallest = memory_plan.estimate(Path(tiny_models["bert"]), exporter="dynamo", optimized=False, check=False).peak
    with pytest.raises(memory_plan.ExportMemoryError, match=r"; what would fit: --skip-check --no-optimized \(about "
                       r"[\d.]+ GiB; no parity check and no optimized graph\); --no-memory-check tries anyway$"):
        memory_plan.check_fits(est, tmp_path, optimized=True, check=True, available=smallest)


def test_a_killed_export_names_its_step_and_leaves_nothing_behind(tiny_models, tmp_path):
    """SIGKILL, what the out-of-memory killer sends, at the end of the 'portable graph' step, once that graph is
    written in the working directory (support.hooks.KillAtStep: in the export process, as the next step
    starts and before the watcher hears of it): the watcher names the step, removes the working directory and
    exits, so once the export's stderr is closed nothing is left."""
    out = tmp_path / "out"
    proc = subprocess.run(hooked_cli(["kill-at-step", "ORT-optimized graph"],
                                     ["export", str(tiny_models["bert"]), "-o", str(out), "--exporter", "torchscript"]),
                          stderr=subprocess.PIPE, text=True, env=_ENV, timeout=600)
    assert proc.returncode == -signal.SIGKILL
    assert "[2/4] portable graph" in proc.stderr and "ORT-optimized graph" not in proc.stderr, proc.stderr
    assert "the export was killed during its 'portable graph' step" in proc.stderr, proc.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_killed_optimizer_child_is_reported_by_its_signal(tmp_path, monkeypatch):
    from attncal.exporting import ort_optimize

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nkill -KILL $$\n")  # what the out-of-memory killer does to the child
    python.chmod(0o755)
    monkeypatch.setattr(ort_optimize.sys, "executable", str(python))
    with pytest.raises(ort_optimize.OptimizerError, match=r"^ONNX Runtime's transformer optimizer was killed by "
                       r"SIGKILL \(the kernel's out-of-memory killer sends it\)$"):
        ort_optimize.run(tmp_path / "in.onnx", tmp_path / "out" / "model.onnx", num_heads=4, hidden_size=32)


def test_a_killed_export_child_is_reported_by_its_signal(tmp_path, monkeypatch):
    """A large model's dynamo export runs in a child process (attncal.exporting.from_torch): killed, it is named,
    and the request it was given is not left behind."""
    from attncal.exporting import from_torch

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nkill -KILL $$\n")  # what the out-of-memory killer does to the child
    python.chmod(0o755)
    monkeypatch.setattr(from_torch.sys, "executable", str(python))
    raw = tmp_path / ".raw" / "model.onnx"
    with pytest.raises(from_torch.ChildExportError, match=r"^torch.onnx's dynamo export \(child\) was killed by "
                       r"SIGKILL \(the kernel's out-of-memory killer sends it\)$"):
        from_torch.torch_export(None, "cls", raw, 18, "dynamo")
    assert list(raw.parent.iterdir()) == []


def test_basic_optimizations_are_onnxruntimes_byte_for_byte(tiny_models, tmp_path):
    """The optimizer child's level-1 step builds its own session (ONNX Runtime's helper imports torch): the
    graph and data file it writes are the bytes `optimize_by_onnxruntime` writes with the same options."""
    from onnxruntime.transformers.optimizer import optimize_by_onnxruntime

    from attncal.exporting import ort_optimize

    src = _small_graph(tiny_models, tmp_path)
    theirs, ours = tmp_path / "theirs" / "m.onnx", tmp_path / "ours" / "m.onnx"
    theirs.parent.mkdir()
    ours.parent.mkdir()
    optimize_by_onnxruntime(str(src), use_gpu=False, optimized_model_path=str(theirs), opt_level=1,
                            disabled_optimizers=list(ort_optimize._DISABLED), save_as_external_data=True)
    ort_optimize._basic_optimizations(src, ours)
    for name in ("m.onnx", "m.onnx.data"):
        assert (ours.parent / name).read_bytes() == (theirs.parent / name).read_bytes(), name
    assert sorted(p.name for p in ours.parent.iterdir()) == sorted(p.name for p in theirs.parent.iterdir())


def _small_graph(tiny_models, tmp_path) -> Path:
    from attncal.exporting.exporter import ExportOptions, export

    export(tiny_models["bert"], tmp_path / "e", ExportOptions(check=False, optimized=False, exporter="torchscript"),
           quiet=True)
    return tmp_path / "e" / "onnx" / "model.onnx"


@pytest.mark.parametrize("external", [False, True])
def test_streamed_graph_file_is_the_ordinary_save(tiny_models, tmp_path, monkeypatch, external):
    """The fragment-streamed file parses to the model it was written from, with the digest `graph_digest`
    gives the parsed file, and its weights inline below `INLINE_LIMIT` or in one data file above."""
    import onnx_ir as ir

    staged = stage_onnx(ir.load(_small_graph(tiny_models, tmp_path)), tmp_path / "stage" / "model.onnx")
    ref = onnx.load(str(staged))  # weights read back from the staged data file
    if external:
        monkeypatch.setattr(onnx_io, "INLINE_LIMIT", 0)
    dest = tmp_path / "final" / "model.onnx"
    digest = write_graph_file(onnx.load(str(staged), load_external_data=False), staged.parent, dest)
    got = onnx.load(str(dest))
    assert digest == stored_digest(got) == graph_digest(onnx.load(str(dest), load_external_data=False), dest.parent)
    assert dest.with_name("model.onnx_data").exists() == external
    assert any(t.data_location == onnx.TensorProto.EXTERNAL
               for t in onnx.load(str(dest), load_external_data=False).graph.initializer) == external
    assert [t.name for t in ref.graph.initializer] == [t.name for t in got.graph.initializer]
    for a, b in zip(ref.graph.initializer, got.graph.initializer):
        assert np.array_equal(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b))
    strip = lambda m: [n.SerializeToString(deterministic=True) for n in m.graph.node]  # noqa: E731
    assert strip(ref) == strip(got) and ref.graph.input == got.graph.input and ref.graph.output == got.graph.output


def test_batches_fit_the_budget_down_to_one_text_and_cap_what_cannot():
    heads, budget = 4, 64 * MIB
    lengths = [10, 3000, 200, 900, 1500, 40]
    batches, cap = plan_batches(lengths, heads, budget, max_batch=4)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert cap is not None and ATTENTION_COPIES * heads * cap * cap * 4 <= budget < \
        ATTENTION_COPIES * heads * (cap + 1) ** 2 * 4
    assert batches[0] == [1] and cap < 3000  # the longest alone, capped
    for b in batches:
        longest = min(max(lengths[i] for i in b), cap)
        assert len(b) == 1 or attention_bytes(longest, heads, len(b)) <= budget
    assert plan_batches([5, 6, 7], heads, budget, max_batch=4) == ([[2, 1, 0]], None)


@pytest.fixture(scope="module")
def external_export(tiny_models, tmp_path_factory):
    """A calibrated export whose every graph is written with external data, as a model above 2 GiB is."""
    from attncal.exporting.exporter import ExportOptions, export

    mp = pytest.MonkeyPatch()
    mp.setattr(onnx_io, "INLINE_LIMIT", 0)
    out = tmp_path_factory.mktemp("external") / "out"
    try:
        meta = export(tiny_models["bert"], out, ExportOptions(exporter="torchscript"), quiet=True)
    finally:
        mp.undo()
    return out, meta


def test_external_data_export_writes_one_data_file_per_graph(external_export):
    out, meta = external_export
    assert len(meta["graphs"]) == 3
    for g, info in meta["graphs"].items():
        data = (out / g).with_name(Path(g).name + "_data")
        assert data.stat().st_size > 0 and info["parity"]["ok"] and info["parity"]["max_abs"] <= 1e-5
        locations = {e.value for t in onnx.load(str(out / g), load_external_data=False).graph.initializer
                     for e in t.external_data if e.key == "location"}
        assert locations == {data.name}
    assert not any(p.name.endswith((".writing", ".stage", ".saving")) for p in out.rglob("*"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_damaged_external_data_is_refused_by_name(external_export, tmp_path, damage):
    """The digest covers the weights in the data file: a flipped byte, a truncated or a missing data file is
    an ArtifactError naming the graph, never an embedding computed from other weights."""
    from attncal.artifact import ArtifactError
    from attncal.runtime.encoder import Encoder

    out = tmp_path / "out"
    shutil.copytree(external_export[0], out)
    data = out / "onnx" / "model.onnx_data"
    if damage == "flip":
        with open(data, "r+b") as f:
            f.seek(data.stat().st_size // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
    elif damage == "truncate":
        os.truncate(data, data.stat().st_size - 1)
    else:
        data.unlink()
    with pytest.raises(ArtifactError, match=r"model\.onnx.*(does not match its attncal digest|truncated external "
                       r"data|external data cannot be read)"):
        Encoder(out, graph="portable")


def test_external_data_export_loads_in_encoder_sentence_transformers_and_encode(external_export, tmp_path):
    from attncal.cli import main
    from attncal.corpus import read_embeddings
    from attncal.runtime.encoder import Encoder

    out, meta = external_export
    texts = ["a short one", "a somewhat longer passage about attention calibration " * 8]
    ours = {g: Encoder(out, graph=g).encode(texts) for g in ("portable", "optimized", "native")}
    assert max(np.abs(v - ours["portable"]).max() for v in ours.values()) <= 1e-5
    overlay = REPO / ".venv" / "loader-overlay"
    if not (overlay / "optimum_onnx-0.1.0.dist-info").exists():
        pytest.fail(f"loader overlay missing at {overlay}: run `make test` (it installs tests/loaders/requirements.txt)")
    (tmp_path / "t.json").write_text(json.dumps(texts))
    # The overlay's transformers 4 does not know the class name transformers 5 saved the synthetic
    # tokenizer under; a copy names it by the class both know.
    copy = tmp_path / "st"
    shutil.copytree(out, copy)
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}))
    env = {**_ENV, "PYTHONPATH": str(overlay)}
    subprocess.run([sys.executable, str(REPO / "tests" / "loaders" / "run_loaders.py"), str(copy),
                    str(tmp_path / "t.json"), str(tmp_path / "r.npz"), "model_optimized.onnx"],
                   check=True, env=env, cwd=tmp_path)
    res = np.load(tmp_path / "r.npz")
    assert np.abs(res["st"] - Encoder(out, graph="optimized").encode(texts)).max() <= 1e-5
    # Triton serves an external-data export with parity in tests/test_serving_architectures.py.
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts * 3)))
    assert main(["encode", str(out), "--input", str(corpus), "--output", str(tmp_path / "emb")]) == 0
    ids, got = read_embeddings(tmp_path / "emb")
    assert ids[:2] == ["0", "1"] and np.abs(got[:2] - Encoder(out).encode(texts)).max() <= 1e-5
