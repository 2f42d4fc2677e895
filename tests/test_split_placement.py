"""Split placement (calibration as attention over baskets) in exported graphs, and `auto` placement.

Parity: split vs softmax placement vs the eager PyTorch reference, for every architecture and pooling,
on the portable graph (standard ONNX) and, for BERT-family models, on the ORT-optimized graph, whose
fused attention nodes must all survive.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from attncal import CalibrationConfig
from attncal.calibration import TorchEncoder
from attncal.cli import main
from attncal.exporting.exporter import ExportOptions, export
from attncal.graphs.placements import plan
from attncal.graphs.placements.split_placement import SplitPlacementError
from attncal.runtime import Encoder
from attncal.synthetic import save_synthetic_model, synthetic_text
from conftest import quick_exporter

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options

# Mixed lengths: under one basket (16 tokens) to the max length (256); 16 does not divide most of them,
# so partial last baskets are exercised.
TEXTS = [synthetic_text(n, seed=n) for n in (4, 30, 70, 140, 400, 9, 55)]
BASKET = 16


# The architectures whose attention ONNX Runtime's transformer optimizer fuses in every layer (the exporter
# finds out by running it; this is what it finds for transformers 5 / onnxruntime 1.32).
ORT_FUSES = ("bert", "xlm-roberta", "distilbert", "roberta")


def fused_count(path: Path) -> int:
    m = onnx.load(str(path), load_external_data=False)
    return sum(1 for n in m.graph.node if n.domain == "com.microsoft" and n.op_type in ("Attention", "MultiHeadAttention"))


@pytest.fixture(scope="module")
def pooled_models(tmp_path_factory):
    """A random-weight model per (architecture, pooling): conftest's `tiny_models` seed and length, so that where
    the pooling is the architecture's default the directory is byte for byte the tiny model's, and
    `shared_raw_exports` hands over the torch export another test of this run made of it (T5's and Gemma3's
    dynamo exports: test_export.py's)."""
    root = tmp_path_factory.mktemp("split-models")
    cases = {("bert", "mean"), ("bert", "cls"), ("xlm-roberta", "mean"), ("qwen3", "mean"), ("qwen3", "last"),
             ("modernbert", "mean"), ("modernbert", "cls"), ("mpnet", "mean"), ("distilbert", "cls"),
             ("roberta", "mean"), ("t5", "mean"), ("gemma3_text", "mean")}
    return {c: save_synthetic_model(c[0], root / f"{c[0]}-{c[1]}", seed=1, pooling=c[1], max_positions=256)
            for c in cases}


@pytest.mark.parametrize("arch,pooling,exporter,variant", [
    ("bert", "mean", "dynamo", "uniform"),
    ("bert", "cls", "torchscript", "cls-soft"),
    ("xlm-roberta", "mean", "torchscript", "cls-hard"),
    ("qwen3", "last", "torchscript", "cls-soft"),
    ("qwen3", "mean", "dynamo", "uniform"),
    ("modernbert", "mean", "torchscript", "uniform"),
    ("modernbert", "cls", "torchscript", "cls-hard"),
    ("mpnet", "mean", "torchscript", "uniform"),
    ("distilbert", "cls", "dynamo", "cls-soft"),
    ("roberta", "mean", "torchscript", "uniform"),
    ("t5", "mean", "dynamo", "uniform"),
    ("gemma3_text", "mean", "dynamo", "uniform"),
])
def test_split_export_matches_softmax_placement_and_torch(arch, pooling, exporter, variant, pooled_models, tmp_path):
    """GQA + rotary + left padding (Qwen3), sliding windows (ModernBERT; Gemma3's bidirectional windows),
    relative position bias replayed on the basket scores (MPNet, T5), both exporters, every variant."""
    src = pooled_models[arch, pooling]
    cfg = CalibrationConfig(pooling=pooling, basket_size=BASKET, strength=0.8, variant=variant)
    opts = dict(exporter=exporter, check=False)
    # Where ORT does not fuse, trying its optimizer is test_export.py::test_dynamo_export_end_to_end's subject.
    split_meta = export(src, tmp_path / "split", ExportOptions(config=cfg, placement="split", optimized=arch in ORT_FUSES,
                                                               **opts), quiet=True)
    # The softmax placement is only the reference here, from the quicker exporter.
    export(src, tmp_path / "softmax", ExportOptions(config=cfg, placement="softmax", optimized=False, check=False,
                                                    exporter=quick_exporter(arch)), quiet=True)
    portable = tmp_path / "split" / "onnx" / "model.onnx"
    model = onnx.load(str(portable))
    onnx.checker.check_model(model, full_check=True)
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}, "the portable split graph is standard ONNX only"
    assert not model.functions
    ref = TorchEncoder(src, attn_implementation="eager").encode(TEXTS, cfg)
    soft = Encoder(tmp_path / "softmax").encode(TEXTS)
    got = Encoder(tmp_path / "split", graph="portable").encode(TEXTS)
    assert np.abs(got - ref).max() <= 1e-5
    assert np.abs(got - soft).max() <= 1e-5
    uncal = TorchEncoder(src, attn_implementation="eager").encode(TEXTS)
    assert np.abs(got - uncal).max() > 1e-5, "calibration must move long texts"
    graphs = split_meta["graphs"]
    optimizable = arch in ORT_FUSES
    assert ("onnx/model_optimized.onnx" in graphs) == optimizable
    if optimizable:
        opt = Encoder(tmp_path / "split")
        assert opt.graph_file == "onnx/model_optimized.onnx"
        assert np.abs(opt.encode(TEXTS) - ref).max() <= 1e-5
        assert graphs["onnx/model_optimized.onnx"]["fused_attention"] == 4
        assert fused_count(tmp_path / "split" / "onnx" / "model_optimized.onnx") == 4


def test_auto_placement_is_recorded_and_shown(pooled_models, tmp_path, capsys):
    meta = export(pooled_models["bert", "mean"], tmp_path / "mean", ExportOptions(
        config=CalibrationConfig(basket_size=BASKET), exporter="torchscript"), quiet=True)
    assert meta["placement"] == "auto"
    assert meta["graphs"]["onnx/model_optimized.onnx"]["placement"] == "split"
    assert meta["graphs"]["onnx/model.onnx"]["placement"] == "fused-softmax"
    assert all(g["parity"]["ok"] for g in meta["graphs"].values()), "parity is checked for both graphs"
    assert "mean pooling" in meta["placement_reason"]
    meta = export(pooled_models["bert", "cls"], tmp_path / "cls", ExportOptions(
        config=CalibrationConfig(basket_size=BASKET), exporter="torchscript", optimized=False, check=False), quiet=True)
    assert list(meta["graphs"]) == ["onnx/model.onnx"] and meta["graphs"]["onnx/model.onnx"]["placement"] == "row"
    assert json.loads((tmp_path / "cls" / "attncal.json").read_text())["placement_reason"].startswith("auto: cls")
    assert main(["inspect", str(tmp_path / "mean")]) == 0
    shown = capsys.readouterr().out
    assert "reason     auto: mean pooling" in shown and "model_optimized.onnx" in shown
    assert "placement split" in shown and "placement fused-softmax" in shown


def test_split_refusals_and_right_padding_guard(pooled_models, tmp_path):
    rc = CalibrationConfig(pooling="mean", isolate_first=True, first_weight="original").resolve()
    with pytest.raises(SplitPlacementError, match="original attention in every row"):
        plan("split", rc)
    assert plan("auto", rc).optimized == "softmax"  # auto falls back instead of refusing
    assert plan("auto", rc).portable == "fused-softmax"
    with pytest.raises(ValueError, match="mean pooling calibrates every row"):
        plan("row", CalibrationConfig(pooling="mean").resolve())
    out = tmp_path / "e"
    export(pooled_models["bert", "mean"], out, ExportOptions(config=CalibrationConfig(basket_size=BASKET),
                                                             exporter="torchscript", check=False), quiet=True)
    enc = Encoder(out)
    enc.padding_side = "left"
    with pytest.raises(ValueError, match="needs right padding"):
        enc.encode(TEXTS[:3])
    assert Encoder(out, graph="portable").graph_file == "onnx/model.onnx"
    with pytest.raises(ValueError, match="graph must be one of"):
        Encoder(out, graph="fastest")

