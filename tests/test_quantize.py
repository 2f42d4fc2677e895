"""int8 exports: ONNX Runtime's dynamic quantization of every graph, calibration kept in fp32, parity judged by
cosine to the fp32 PyTorch reference with per-precision tolerances."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from attncal import CalibrationConfig
from attncal.calibration import TorchEncoder
from attncal.cli import main
from attncal.export.exporter import ExportOptions, export
from attncal.export.quantize import weight_nodes
from attncal.graphs.contract import DOMAIN
from attncal.modelinfo import default_model_path
from attncal.runtime import Encoder
from attncal.runtime.parity import TOLERANCES, ParityReport, precision_of
from attncal.synthetic import save_synthetic_model, synthetic_text

TEXTS = [synthetic_text(n, seed=n) for n in (5, 60, 150, 400)]
_INT8_OPS = {"MatMulInteger", "DynamicQuantizeMatMul", "QAttention", "DynamicQuantizeLinear", "MatMulIntegerToFloat"}


def _float_inputs_only(model: onnx.ModelProto) -> None:
    """The calibration (attncal ops) and the attention core read fp32 values, never quantized ones."""
    producers = {o: n for n in model.graph.node for o in n.output}
    for n in model.graph.node:
        if n.domain == DOMAIN:
            for i in n.input:
                p = producers.get(i)
                assert p is None or p.op_type not in ("DynamicQuantizeLinear", "QuantizeLinear"), (n.name, i)
        if n.op_type == "Softmax":
            p = producers.get(n.input[0])
            assert p is None or p.op_type not in _INT8_OPS, f"attention scores of {n.name} come from an int8 op"


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_int8_export_quantizes_weights_only_and_checks_cosine(pooling, tmp_path, capsys):
    src = save_synthetic_model("bert", tmp_path / "m", seed=2, pooling=pooling, max_positions=256)
    cfg = CalibrationConfig(basket_size=16, strength=0.8)
    out = tmp_path / "int8"
    meta = export(src, out, ExportOptions(config=cfg, quantize="int8", exporter="torchscript"), quiet=True)
    assert meta["quantization"]["precision"] == "int8" and meta["quantization"]["per_channel"] is True
    assert set(meta["graphs"]) == {"onnx/model.onnx", "onnx/model_optimized.onnx", "onnx/model_optimized_native.onnx"}
    for graph_file, g in meta["graphs"].items():
        par = g["parity"]
        assert par["precision"] == "int8" and par["ok"]
        assert (par["tol_max_abs"], par["tol_min_cos"]) == TOLERANCES["int8"]
        assert par["p1_cos"] >= par["min_cos"] and par["p50_cos"] >= par["p1_cos"]
        assert all(b["p50_cos"] is not None for b in par["buckets"])
        model = onnx.load(str(out / graph_file))
        ops = {n.op_type for n in model.graph.node}
        assert ops & _INT8_OPS, graph_file
        assert g["quantized_nodes"] > 0 and not weight_nodes(model), "every weight node is quantized"
        _float_inputs_only(model)
    got = Encoder(out).encode(TEXTS)
    ref = TorchEncoder(src).encode(TEXTS, cfg.with_pooling(pooling))
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= TOLERANCES["int8"][1]
    assert np.abs(got - ref).max() > 1e-5, "an int8 graph is not the fp32 graph"
    assert main(["check", str(out)]) == 0
    assert "int8" in capsys.readouterr().out
    # `attncal encode` re-indexes with the int8 export: the shards hold what its Encoder computes.
    from attncal.corpus.shards import read_embeddings

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    assert main(["encode", str(out), "--input", str(corpus), "--output", str(tmp_path / "shards"), "-q"]) == 0
    ids, emb = read_embeddings(tmp_path / "shards")
    assert ids == [str(i) for i in range(len(TEXTS))] and np.abs(emb - got).max() <= 1e-6
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "precision  int8 (onnxruntime.quantization.quantize_dynamic" in shown and "(int8)" in shown


def test_int8_refusals_and_tolerances(tmp_path):
    src = save_synthetic_model("bert", tmp_path / "m", seed=2)
    with pytest.raises(ValueError, match="quantize must be one of int8, got 'int4'"):
        export(src, tmp_path / "a", ExportOptions(quantize="int4"), quiet=True)
    with pytest.raises(ValueError, match="--quantize int8 and --fp16 exclude each other"):
        export(src, tmp_path / "b", ExportOptions(quantize="int8", fp16=True), quiet=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert precision_of({"quantization": {"precision": "int8"}}) == "int8"
    assert precision_of({"fp16": True}) == "fp16" and precision_of({}) == "fp32"
    # A quantization that bent the embeddings fails loudly even when every |Δ| is small (the issue's
    # per-tensor case: cosine p1 0.921 with small components).
    bent = ParityReport("onnx/model.onnx", "int8", 0.02, 0.93, *TOLERANCES["int8"])
    assert not bent.ok and "int8: max abs diff 0.02" in bent.summary()
    assert ParityReport("onnx/model.onnx", "int8", 0.02, 0.995, *TOLERANCES["int8"]).ok


def test_int8_minilm_real_weights(tmp_path):
    """all-MiniLM-L6-v2 int8, calibrated by default: parity by cosine on every graph, and what it moves."""
    out = tmp_path / "int8"
    meta = export(default_model_path(), out, ExportOptions(quantize="int8", exporter="torchscript"), quiet=True)
    for g in meta["graphs"].values():
        assert g["parity"]["ok"] and g["parity"]["p50_cos"] >= 0.99, g["parity"]
    written = json.loads((out / "attncal.json").read_text())
    assert written["quantization"] == meta["quantization"]
