"""Row placement: calibration beside ONNX Runtime's fused attention."""

from __future__ import annotations

import collections
import random
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from attncal import CalibrationConfig
from attncal.bench.engines import optimize_export
from attncal.calibration import TorchEncoder, apply, reference
from attncal.exporting.exporter import ExportOptions, export
from attncal.graphs.ops.contract import op_spec
from attncal.graphs.placements.row_placement import RowPlacementError, calibrate_optimized
from attncal.graphs.ops.single_op import single_op_model
from attncal.runtime import Encoder
from attncal.synthetic import synthetic_text
from conftest import quick_exporter
from support.masks import random_mask
from support.tensors import random_probs

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options

TEXTS = [synthetic_text(n, seed=n) for n in (5, 40, 120, 300)]


@pytest.mark.parametrize("pooling", ["cls", "last"])
def test_single_row_tensor_is_the_pooling_row(pooling):
    """Q == 1: all implementations treat the single row as the pooling row."""
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    for left in (False, True):
        mask = random_mask(rng, 4, 40, left, min_len=5)
        probs = random_probs(gen, mask, 3, torch.float32)
        cfg = CalibrationConfig(pooling=pooling, basket_size=4, strength=0.7, skip_short=False)
        full = reference(probs.double(), mask, cfg)
        idx = [int(r.nonzero()[-1 if pooling == "last" else 0]) for r in mask]
        rows = torch.stack([probs[b, :, i : i + 1] for b, i in enumerate(idx)])  # [B,H,1,K]
        expected = torch.stack([full[b, :, i : i + 1] for b, i in enumerate(idx)])
        assert (reference(rows.double(), mask, cfg) - expected).abs().max() <= 1e-12
        assert (apply(rows.clone(), mask, cfg).double() - expected).abs().max() <= 1e-6
        sess = ort.InferenceSession(single_op_model(op_spec(cfg.resolve(), 0)).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        (out,) = sess.run(None, {"probs": rows.numpy(), "attention_mask": mask.numpy()})
        assert np.abs(out - expected.numpy()).max() <= 1e-6
        # The native kernel (plugins/) follows the same Q == 1 rule.
        from attncal.runtime import oplib

        so = ort.SessionOptions()
        so.register_custom_ops_library(str(oplib.build_library()))
        sess = ort.InferenceSession(single_op_model(op_spec(cfg.resolve(), 0)).SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
        (out,) = sess.run(None, {"probs": rows.numpy(), "attention_mask": mask.numpy()})
        assert np.abs(out - expected.numpy()).max() <= 1e-6


def fused(path: Path) -> collections.Counter:
    m = onnx.load(str(path / "onnx" / "model.onnx"))
    return collections.Counter(n.op_type for n in m.graph.node if n.domain == "com.microsoft" and n.op_type == "Attention")


@pytest.mark.parametrize("source", ["bert", "xlm-roberta"])
def test_row_placement_keeps_fusion_and_matches_softmax_placement_and_torch(source, tiny_models, tmp_path):
    path = tiny_models[source]
    cfg = CalibrationConfig(pooling="cls", basket_size=16, strength=0.8)
    opts = dict(exporter="torchscript", check=False)
    export(path, tmp_path / "uncal", ExportOptions(config=cfg, calibrate=False, **opts), quiet=True)
    export(path, tmp_path / "softmax", ExportOptions(config=cfg, **opts), quiet=True)
    optimize_export(tmp_path / "uncal", tmp_path / "opt")
    calibrate_optimized(tmp_path / "opt", tmp_path / "row", cfg)
    n_layers = 4
    assert fused(tmp_path / "opt")["Attention"] == n_layers
    assert fused(tmp_path / "row")["Attention"] == n_layers, "row placement must keep every fused attention"
    # The softmax placement is what loses fusion: the optimizer skips calibrated layers.
    optimize_export(tmp_path / "softmax", tmp_path / "softmax-opt")
    assert fused(tmp_path / "softmax-opt")["Attention"] == n_layers - len(cfg.layer_indices(n_layers))
    row = Encoder(tmp_path / "row").encode(TEXTS)
    soft = Encoder(tmp_path / "softmax").encode(TEXTS)
    ref = TorchEncoder(path).encode(TEXTS, cfg)
    uncal = Encoder(tmp_path / "opt").encode(TEXTS)
    assert np.abs(row - soft).max() <= 1e-5
    assert np.abs(row - ref).max() <= 1e-5
    assert np.abs(row - uncal).max() > 1e-5, "calibration must move long texts"


def test_row_placement_refuses_mean_pooling_and_unfused_graphs(tiny_models, tmp_path):
    cfg = CalibrationConfig(pooling="mean", basket_size=16)
    export(tiny_models["bert"], tmp_path / "u", ExportOptions(config=cfg, calibrate=False, exporter="torchscript",
                                                               check=False), quiet=True)
    optimize_export(tmp_path / "u", tmp_path / "o")
    with pytest.raises(RowPlacementError, match="mean pooling calibrates every row"):
        calibrate_optimized(tmp_path / "o", tmp_path / "r", cfg)
    export(tiny_models["qwen3"], tmp_path / "q", ExportOptions(config=cfg, calibrate=False, exporter="torchscript",
                                                               check=False), quiet=True)
    with pytest.raises(RowPlacementError, match="one fused com.microsoft::Attention node per layer"):
        calibrate_optimized(tmp_path / "q", tmp_path / "qr", CalibrationConfig(pooling="last", basket_size=16))
    assert not (tmp_path / "r").exists() and not (tmp_path / "qr").exists()


@pytest.mark.parametrize("arch,exporter", [("bert", "dynamo"), ("xlm-roberta", "torchscript"),
                                           ("qwen3", "torchscript"), ("modernbert", "torchscript"),
                                           ("mpnet", "torchscript"), ("distilbert", "torchscript"),
                                           ("roberta", "dynamo"), ("t5", "torchscript"), ("gemma3_text", "dynamo")])
def test_row_placement_export_matches_softmax_placement_and_torch(arch, exporter, tiny_models, tmp_path):
    """`--placement row` for every architecture: beside ORT-fused attention (BERT-family TorchScript
    exports, DistilBERT, RoBERTa) or on the plain graph (GQA + rotary in Qwen3, sliding windows in ModernBERT and
    Gemma3, relative position bias in MPNet and T5, dynamo)."""
    pooling = "last" if arch == "qwen3" else "cls"
    cfg = CalibrationConfig(pooling=pooling, basket_size=16, strength=0.8)
    path = tiny_models[arch]
    fuses = arch in ("bert", "xlm-roberta", "distilbert", "roberta")  # ORT's optimizer fuses their attention
    opts = dict(exporter=exporter, check=False, optimized=fuses)
    # The softmax placement is only the reference here: the portable graph, from the quicker exporter.
    export(path, tmp_path / "softmax", ExportOptions(config=cfg, exporter=quick_exporter(arch), check=False,
                                                     optimized=False), quiet=True)
    meta = export(path, tmp_path / "row", ExportOptions(config=cfg, placement="row", **opts), quiet=True)
    assert meta["placement"] == "row"
    model = onnx.load(str(tmp_path / "row" / "onnx" / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)  # the portable graph: standard ONNX + function body
    assert not any(n.domain == "com.microsoft" for n in model.graph.node)
    optimized = tmp_path / "row" / "onnx" / "model_optimized.onnx"
    assert optimized.exists() == fuses  # beside ORT-fused attention
    if optimized.exists():
        m = onnx.load(str(optimized))
        assert sum(n.op_type == "Attention" and n.domain == "com.microsoft" for n in m.graph.node) == 4
        opt = Encoder(tmp_path / "row", graph="optimized").encode(TEXTS)
        assert np.abs(opt - TorchEncoder(path).encode(TEXTS, cfg)).max() <= 1e-5
    row = Encoder(tmp_path / "row", graph="portable").encode(TEXTS)
    soft = Encoder(tmp_path / "softmax").encode(TEXTS)
    ref = TorchEncoder(path).encode(TEXTS, cfg)
    assert np.abs(row - soft).max() <= 1e-5
    assert np.abs(row - ref).max() <= 1e-5
    uncal = TorchEncoder(path).encode(TEXTS)
    assert np.abs(row - uncal).max() > 1e-6
