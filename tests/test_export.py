"""Export, graph rewrite and ONNX Runtime parity for every architecture."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from attncal import CalibrationConfig
from attncal.calibration import TorchEncoder
from attncal.cli import main
from attncal.artifact import save_onnx
from attncal.exporting.exporter import ExportOptions, export
from attncal.graphs import AlreadyCalibratedError, SoftmaxPatternError, insert_calibration
from attncal.graphs.ops.contract import DOMAIN
from attncal.graphs.fusions.feed_forward_chunks import CHUNK_ROWS
from attncal.modelinfo import default_model_path
from attncal.runtime import Encoder
from attncal.synthetic import ARCHITECTURES, synthetic_text
from conftest import quick_exporter
from test_native_kernel import library  # noqa: F401  (the built-library fixture)

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options

REPO = Path(__file__).resolve().parents[1]
OVERLAY = REPO / ".venv" / "loader-overlay"
# Mixed lengths: under one basket (16 tokens) up to the max length (256).
TEXTS = [synthetic_text(n, seed=n) for n in (4, 30, 70, 140, 400, 9)]
BASKET = 16


def poolings(arch):
    return ("last", "mean") if arch == "qwen3" else ("cls", "mean")


@pytest.fixture(scope="module")
def base_exports(tiny_models, tmp_path_factory):
    """Uncalibrated TorchScript exports, one per (architecture, pooling); the rewrite pass runs on copies."""
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for arch in ARCHITECTURES:
        for pooling in poolings(arch):
            out[arch, pooling] = root / f"{arch}-{pooling}"
            export(tiny_models[arch], out[arch, pooling],
                   ExportOptions(config=CalibrationConfig(pooling=pooling), calibrate=False, exporter=quick_exporter(arch),
                                 check=False, optimized=False), quiet=True)
    return out


def calibrated_copy(base: Path, dest: Path, cfg: CalibrationConfig, num_layers: int = 4) -> Path:
    import shutil

    shutil.copytree(base, dest)
    model = ir.load(dest / "onnx" / "model.onnx")
    insert_calibration(model, cfg, num_layers)
    save_onnx(model, dest / "onnx" / "model.onnx")
    meta = json.loads((dest / "attncal.json").read_text())
    meta.update(calibrated=True, config=cfg.to_dict())
    (dest / "attncal.json").write_text(json.dumps(meta))
    onnx.checker.check_model(str(dest / "onnx" / "model.onnx"), full_check=True)
    return dest


_LOADED: dict = {}


def _loaded(kind, path: Path):
    """One Encoder per export and one TorchEncoder per model for this module: each call sets the padding side
    it encodes with, and the calibration is a context of each TorchEncoder.encode, so nothing else carries over."""
    if (kind, path) not in _LOADED:
        _LOADED[kind, path] = kind(path, providers=["CPUExecutionProvider"]) if kind is Encoder else kind(path)
    return _LOADED[kind, path]


def encode_both(out: Path, source: Path, cfg: CalibrationConfig | None, padding_side: str):
    enc = _loaded(Encoder, out)
    enc.padding_side = padding_side
    ref = _loaded(TorchEncoder, source)
    ref.tokenizer.padding_side = padding_side
    return enc.encode(TEXTS, batch_size=6), ref.encode(TEXTS, cfg, batch_size=6)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rewritten_exports_match_torch_reference(arch, tiny_models, base_exports, tmp_path):
    """Architecture x pooling x layers {last, last-half} x padding side: ORT equals encode_torch."""
    for pooling in poolings(arch):
        base = base_exports[arch, pooling]
        uncal = {}
        for side in ("right", "left"):
            got, exp = encode_both(base, tiny_models[arch], CalibrationConfig(strength=0.0, pooling=pooling), side)
            assert np.abs(got - exp).max() <= 1e-5
            uncal[side] = got
        for layers in ("last", "last-half"):
            cfg = CalibrationConfig(pooling=pooling, layers=layers, basket_size=BASKET, strength=0.9,
                                    variant="uniform" if pooling == "mean" else "cls-soft")
            out = calibrated_copy(base, tmp_path / f"{pooling}-{layers}", cfg)
            for side in ("right", "left"):
                got, exp = encode_both(out, tiny_models[arch], cfg, side)
                err = np.abs(got - exp).max()
                assert err <= 1e-5, (arch, pooling, layers, side, err)
                moved = np.abs(got - uncal[side]).max(axis=1)
                assert moved[0] == 0, "a text under one basket must not move"
                assert moved.max() > max(20 * err, 1e-6), "calibration must change long texts beyond parity noise"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_dynamo_export_end_to_end(arch, tiny_models, tmp_path):
    out = tmp_path / "out"
    meta = export(tiny_models[arch], out, ExportOptions(config=CalibrationConfig(basket_size=BASKET, strength=0.8)),
                  quiet=True)
    assert meta["parity"]["ok"] and meta["parity"]["max_abs"] <= 1e-5
    assert meta["calibrated_layers"] == [2, 3] and meta["exporter"] == "dynamo"
    model = onnx.load(str(out / "onnx" / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    nodes = [n for n in model.graph.node if n.domain == DOMAIN]
    assert sorted(next(a.i for a in n.attribute if a.name == "layer") for n in nodes) == [2, 3]
    opset = {o.domain: o.version for o in model.opset_import}
    assert {o.domain: o.version for o in model.functions[0].opset_import}[""] == opset[""] == 18
    names = [i.name for i in model.graph.input]
    assert names[:2] == ["input_ids", "attention_mask"]
    assert ("token_type_ids" in names) == (arch == "bert")
    assert [o.name for o in model.graph.output] == ["last_hidden_state", "sentence_embedding"]
    for f in ("config.json", "tokenizer.json", "modules.json", "1_Pooling/config.json", "attncal.json"):
        assert (out / f).exists(), f
    assert not any(p.suffix == ".safetensors" for p in out.rglob("*"))
    assert meta["tested"] is True and main(["check", str(out)]) == 0  # `attncal check` on every architecture
    # The optimizer is tried on every architecture; where it fuses every layer the optimized graph is written.
    fuses = arch in ("bert", "xlm-roberta", "distilbert", "roberta")
    assert ("onnx/model_optimized.onnx" in meta["graphs"]) == fuses
    assert ("in all 4 layers" if fuses else "no onnx/model_optimized.onnx is written") in meta["optimizer"]
    # Rotary embeddings, relative bias or grouped KV heads: ORT's BERT fusion cannot match, so it is not tried.
    assert ("was not tried" in meta["optimizer"]) == (arch in ("qwen3", "modernbert", "gemma3_text", "t5", "mpnet"))
    # Without it, the native graph is the plain export with the calibrated attention op in every layer, its
    # window read from the exported mask, T5's and MPNet's relative position bias passed as its table.
    native = meta["graphs"].get("onnx/model_optimized_native.onnx")
    assert native is not None
    # A short export (256 tokens) keeps its feed-forward blocks whole (the long-context test below chunks them).
    assert native["feed_forward_chunks"] == {"blocks": 0, "rows": CHUNK_ROWS}
    assert not (out / "onnx" / "model_optimized_native.onnx_data").exists()
    if arch in PLAIN_NATIVE_GEOMETRY:
        assert native["any_padding"] and native["parity"]["ok"] and native["parity"]["max_abs"] <= 1e-5
        assert native["attention_geometry"] == PLAIN_NATIVE_GEOMETRY[arch]
        model = onnx.load(str(out / "onnx" / "model_optimized_native.onnx"), load_external_data=False)
        ops = [n.op_type for n in model.graph.node]
        ops += [n.op_type for scan in model.graph.node if scan.op_type == "Scan"
                for n in next(a.g for a in scan.attribute if a.name == "body").node]
        assert "Softmax" not in ops and sum(n.domain == DOMAIN for n in model.graph.node) == 4
        # The bias is the model's table itself (one per model), and its [B,N,S,S] subgraph is gone.
        tables = {n.input[4] for n in model.graph.node if n.domain == DOMAIN and len(n.input) == 5}
        assert len(tables) == (arch in ("t5", "mpnet")) and "Log" not in ops
        strengths = [next(a.f for a in n.attribute if a.name == "strength") for n in model.graph.node
                     if n.domain == DOMAIN]
        assert strengths == pytest.approx([0.0, 0.0, 0.8, 0.8])  # calibration off in the layers it does not select
        # The RMS norms, tanh GELUs and Q's and K's rotations run as ONNX Runtime's ops (PLAIN_NATIVE_FUSIONS).
        fused = native["onnxruntime_fusions"]
        assert fused == PLAIN_NATIVE_FUSIONS[arch]
        assert tuple(ops.count(op) for op in fused) == tuple(fused.values())
        assert not fused["RotaryEmbedding"] or "Neg" not in ops  # the rotations' rotate_half is gone with them
        read = {name for node in model.graph.node for name in node.input}
        assert {t.name for t in model.graph.initializer} <= read  # no constant that only a replaced node read
        assert ops.count("ReduceMean") == PER_HEAD_NORMS[arch]


@pytest.mark.parametrize("arch", ["bert", "qwen3", "gemma3_text", "modernbert"])
def test_long_context_native_graph_runs_its_feed_forwards_in_chunks(arch, tmp_path):
    """A long-context export (1,024 tokens): every layer's feed-forward block of the native graph (made from
    ONNX Runtime's optimized graph for BERT, from torch's export for the others: Qwen3's SiLU gate, Gemma3's
    tanh-GELU gate as ONNX Runtime's FastGelu, ModernBERT's split projection) runs over chunks of rows, its
    weights in a data file beside it; a batch of more rows than one chunk gives what the portable graph gives.
    BERT's native graph is made from ONNX Runtime's optimized graph, which is always the TorchScript export's,
    so its export takes the TorchScript exporter (a dynamo export would make only the portable graph, at the
    cost of a second torch export); the others' native graphs are made from the dynamo export, the default."""
    from attncal.synthetic import save_synthetic_model

    src = save_synthetic_model(arch, tmp_path / "src", seed=1, max_positions=1024)
    out = tmp_path / "out"
    meta = export(src, out, ExportOptions(config=CalibrationConfig(basket_size=BASKET, strength=0.8),
                                          exporter="torchscript" if arch == "bert" else "dynamo"), quiet=True)
    native = meta["graphs"]["onnx/model_optimized_native.onnx"]
    assert meta["max_seq_length"] == 1024 and native["feed_forward_chunks"] == {"blocks": 4, "rows": CHUNK_ROWS}
    assert native["parity"]["ok"] and native["parity"]["max_abs"] <= 1e-5
    assert (out / "onnx" / "model_optimized_native.onnx_data").is_file() and main(["check", str(out)]) == 0
    model = onnx.load(str(out / "onnx" / "model_optimized_native.onnx"), load_external_data=False)
    assert [n.op_type for n in model.graph.node].count("Scan") == 4
    texts = [synthetic_text(n, seed=n) for n in (900, 700, 30)]  # about 1,600 rows: two chunks and padding
    native_enc, portable = Encoder(out), Encoder(out, graph="portable")
    assert native_enc.graph_file == "onnx/model_optimized_native.onnx"
    assert np.abs(native_enc.encode(texts, batch_size=3) - portable.encode(texts, batch_size=3)).max() <= 1e-5


# (SimplifiedLayerNormalization, FastGelu, RotaryEmbedding) in the native graph of the tiny models: Qwen3's pre-norms
# (2 a layer and the final norm) and its q_norm / k_norm, which read Q and K before any Transpose once the rotations
# are fused; Gemma3's four norms a layer and the final one with its tanh GELU (its q_norm / k_norm read a Transpose's
# output and keep their ReduceMean); T5's two and the final one; ModernBERT and MPNet use LayerNormalization.
# Qwen3, Gemma3 and ModernBERT rotate Q and K in every layer; T5 and MPNet have no rotary embedding.
PLAIN_NATIVE_FUSIONS = {
    "qwen3": {"SimplifiedLayerNormalization": 17, "FastGelu": 0, "RotaryEmbedding": 8},
    "gemma3_text": {"SimplifiedLayerNormalization": 17, "FastGelu": 4, "RotaryEmbedding": 8},
    "modernbert": {"SimplifiedLayerNormalization": 0, "FastGelu": 0, "RotaryEmbedding": 8},
    "t5": {"SimplifiedLayerNormalization": 9, "FastGelu": 0, "RotaryEmbedding": 0},
    "mpnet": {"SimplifiedLayerNormalization": 0, "FastGelu": 0, "RotaryEmbedding": 0},
}
PER_HEAD_NORMS = {"qwen3": 0, "gemma3_text": 8, "modernbert": 0, "t5": 0, "mpnet": 0}

# The synthetic models' masks (attncal.synthetic): Qwen3 causal with 2 key/value heads; Gemma3 bidirectional
# sliding windows in even layers (|q - k| < 13 from sliding_window=24, as transformers builds it), 2 key/value
# heads; ModernBERT local attention (64: |q - k| <= 32) in odd layers.
PLAIN_NATIVE_GEOMETRY = {
    "qwen3": [{"num_kv_heads": 2, "window_right": 0}] * 4,
    "gemma3_text": [{"num_kv_heads": 2, "window_left": 12, "window_right": 12}, {"num_kv_heads": 2}] * 2,
    "modernbert": [{}, {"window_left": 32, "window_right": 32}] * 2,
    "t5": [{"relative_max_distance": 64}] * 4,  # the tiny T5's config (8 buckets up to 64)
    "mpnet": [{"relative_max_distance": 128}] * 4,  # MPNet's fixed distance, read off the bias by the probe
}


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "t5", "mpnet"])
def test_uncalibrated_native_graph_runs_either_padding_side(arch, tiny_models, tmp_path, library):
    """An uncalibrated export gets the native graph too (every layer the op with strength 0); the runtime
    picks it where the library is loaded, and it equals the portable graph on both padding sides (T5, MPNet:
    texts up to 256 tokens, past the relative position bias's max distance, so every bucket is read)."""
    out = tmp_path / "out"
    meta = export(tiny_models[arch], out, ExportOptions(calibrate=False), quiet=True)
    assert meta["graphs"]["onnx/model_optimized_native.onnx"]["parity"]["ok"]
    native = Encoder(out, providers=["CPUExecutionProvider"], custom_op_library=library)
    portable = Encoder(out, providers=["CPUExecutionProvider"], graph="portable")
    assert native.graph_file == "onnx/model_optimized_native.onnx"
    for side in ("left", "right"):
        native.padding_side = portable.padding_side = side
        got, want = native.encode(TEXTS, batch_size=6), portable.encode(TEXTS, batch_size=6)
        assert np.abs(got - want).max() <= 1e-5, side


def test_rewrite_is_idempotent_and_reports_missing_patterns(base_exports, tmp_path):
    model = ir.load(base_exports["bert", "cls"] / "onnx" / "model.onnx")
    cfg = CalibrationConfig(pooling="cls", layers="all")
    insert_calibration(model, cfg, 4)
    with pytest.raises(AlreadyCalibratedError, match="already contains attncal calibration nodes"):
        insert_calibration(model, cfg, 4)
    insert_calibration(model, CalibrationConfig(pooling="cls", layers="last"), 4, replace=True)
    assert [n.attributes["layer"].value for n in model.graph if n.domain == DOMAIN] == [3]
    with pytest.raises(SoftmaxPatternError, match=r"one attention Softmax -> MatMul per layer \(6 layers\) but found 4"):
        insert_calibration(ir.load(base_exports["bert", "cls"] / "onnx" / "model.onnx"), cfg, 6)
    fused = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Attention", ["q", "k", "v"], ["o"])], "g",
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, 2, 4, 8]) for n in "qkv"]
        + [onnx.helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, [1, 4])],
        [onnx.helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, [1, 2, 4, 8])]),
        opset_imports=[onnx.helper.make_opsetid("", 23)])
    with pytest.raises(SoftmaxPatternError, match=r"found 0.*1 Attention.*fused \['Attention'\]"):
        insert_calibration(ir.from_proto(fused), cfg, 1)


def test_cli_export_check_inspect_and_errors(tiny_models, tmp_path, capsys, monkeypatch):
    out = tmp_path / "cli"
    src = str(tiny_models["xlm-roberta"])
    assert main(["export", src, "-o", str(out), "--basket-size", "16", "--exporter", "torchscript",
                 "--layers", "-1"]) == 0
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "layer   3  PooledRowCalibration" in text and "basket_size=16" in text
    texts_file = tmp_path / "texts.txt"
    texts_file.write_text("\n".join(TEXTS), encoding="utf-8")
    assert main(["check", str(out), "--texts", str(texts_file)]) == 0
    shown = capsys.readouterr().out
    assert shown.count("OK (fp32)") == 3 and "native" in shown  # every graph: portable, optimized, native
    assert main(["check", str(out), "--graph", "native", "--texts", str(texts_file)]) == 0
    assert capsys.readouterr().out.count("OK (fp32)") == 1

    def err(args):
        code = main(args)
        err_text = capsys.readouterr().err
        assert "Traceback" not in err_text, err_text
        errors = [line for line in err_text.splitlines() if ": error: " in line]
        assert len(errors) == 1, err_text  # one line, after any progress lines
        return code, errors[0]

    assert err(["export", str(tmp_path / "nope"), "-o", str(tmp_path / "x")])[1].endswith(
        "attncal never downloads models)")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2", "num_hidden_layers": 2}')
    assert "loading the gpt2 model from" in err(["export", str(gpt2), "-o", str(tmp_path / "x")])[1]
    (gpt2 / "config.json").write_text('{"model_type": "no-such-arch", "num_hidden_layers": 2}')
    assert "architecture 'no-such-arch' is not known" in err(["export", str(gpt2), "-o", str(tmp_path / "x")])[1]
    assert "layer index 7 is out of range" in err(["export", src, "-o", str(tmp_path / "x"), "--layers", "7"])[1]
    assert "strength: 1.5 is outside [0, 1]" in err(["export", src, "-o", str(tmp_path / "x"), "--strength", "1.5"])[1]
    assert "is not empty; pass --overwrite" in err(["export", src, "-o", str(out)])[1]
    assert "texts file" in err(["check", str(out), "--texts", str(tmp_path / "missing.txt")])[1]
    (out / "onnx" / "model_optimized_native.onnx").unlink()
    assert "model_optimized_native.onnx" in err(["check", str(out), "--graph", "native"])[1]

    # A graph without the softmax pattern: a clear error, and nothing left behind.
    import attncal.exporting.from_torch as from_torch

    def no_softmax(info, pooling, onnx_path, opset, exporter_name, fp16=False, model=None):
        onnx_path.parent.mkdir(parents=True, exist_ok=True)
        g = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["input_ids"], ["last_hidden_state"])], "g",
                                   [onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["B", "S"]),
                                    onnx.helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, ["B", "S"])],
                                   [onnx.helper.make_tensor_value_info("last_hidden_state", onnx.TensorProto.INT64, ["B", "S"])])
        onnx.save(onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 18)]), str(onnx_path))
        return ["input_ids", "attention_mask"]

    monkeypatch.setattr(from_torch, "torch_export", no_softmax)
    code, msg = err(["export", src, "-o", str(tmp_path / "broken")])
    assert code == 2 and "expected one attention Softmax -> MatMul per layer" in msg
    assert not (tmp_path / "broken").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".broken")], "temporary output left behind"


@pytest.fixture(scope="module")
def minilm_exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("minilm")
    metas = {}
    for name, cal in (("uncal", False), ("cal", True)):
        metas[name] = export(default_model_path(), root / name,
                             ExportOptions(calibrate=cal, exporter="torchscript", inlined=True), quiet=True)
    return root, metas


def test_real_minilm_parity(minilm_exports):
    root, metas = minilm_exports
    for name, meta in metas.items():
        assert meta["pooling"] == {"kind": "mean"} and meta["parity"]["ok"], (name, meta["parity"])
        assert meta["parity"]["max_abs"] <= 1e-5
    # Default placement (auto) for mean pooling: the Softmax-fused op on the portable graph, split on
    # the optimized graph, the calibrated attention op on the native graph, each parity-checked at export.
    assert metas["cal"]["calibrated_layers"] == [3, 4, 5] and metas["cal"]["op_type"] == "SoftmaxAllRowsCalibration"
    graphs = metas["cal"]["graphs"]
    assert [g["placement"] for g in graphs.values()] == ["fused-softmax", "fused-softmax", "split",
                                                         "projected-attention"]
    assert graphs["onnx/model_inlined.onnx"]["inlined"] == 3  # the portable graph's, inlined (--inlined)
    assert "onnx/model_inlined.onnx" not in metas["uncal"]["graphs"]  # standard ONNX already
    assert all(g["parity"]["ok"] and g["parity"]["max_abs"] <= 1e-5 for g in graphs.values())
    # Split placement keeps every fused attention of the uncalibrated optimized graph (six layers).
    assert graphs["onnx/model_optimized.onnx"]["fused_attention"] == 6
    assert metas["uncal"]["graphs"]["onnx/model_optimized.onnx"]["fused_attention"] == 6
    long_text = [" ".join(["Calibration spreads the pooling attention over the whole passage."] * 30)]
    a = Encoder(root / "uncal").encode(long_text)
    b = Encoder(root / "cal").encode(long_text)
    assert np.abs(a - b).max() > 1e-4


@pytest.mark.parametrize("name", ["uncal", "cal"])
def test_real_minilm_loads_in_optimum_and_sentence_transformers(minilm_exports, name, tmp_path):
    if not (OVERLAY / "optimum_onnx-0.1.0.dist-info").exists():
        pytest.fail(f"loader overlay missing at {OVERLAY}: run `make test` (it installs tests/loaders/requirements.txt)")
    root, _ = minilm_exports
    out = root / name
    texts = ["A short query.", " ".join(["A long passage about calibration and retrieval."] * 40), "Middle length " * 20]
    (tmp_path / "t.json").write_text(json.dumps(texts))
    env = {**os.environ, "PYTHONPATH": str(OVERLAY), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, str(REPO / "tests" / "loaders" / "run_loaders.py"), str(out),
                    str(tmp_path / "t.json"), str(tmp_path / "r.npz"), "--openvino"], check=True, env=env, cwd=tmp_path)
    res = np.load(tmp_path / "r.npz")
    ours = Encoder(out).encode(texts)
    assert np.abs(res["st"] - ours).max() <= 1e-5
    # sentence-transformers' OpenVINO backend (where the openvino extra is installed) on the standard-ONNX graph:
    # the calibrated export's onnx/model_inlined.onnx, the uncalibrated export's onnx/model.onnx.
    if importlib.util.find_spec("openvino") is not None:
        assert np.abs(res["st_openvino"] - ours).max() <= 1e-5
    m = res["attention_mask"][..., None]
    pooled = (res["optimum_hidden"] * m).sum(1) / m.sum(1)
    pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
    assert np.abs(pooled - ours).max() <= 1e-5
