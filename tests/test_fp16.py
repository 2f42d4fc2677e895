"""fp16 exports for GPU serving: the ORT-optimized graphs (split or row, and the native attention graph) are
converted after placement by ONNX Runtime's converter, with the placement's calibration nodes kept float32.
Parity against the fp32 PyTorch reference uses the fp16 tolerances, here on ONNX Runtime's CPU provider."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from attncal import CalibrationConfig
from attncal.cli import main
from attncal.exporting.exporter import ExportOptions, export
from attncal.graphs import placements
from attncal.runtime import Encoder
from attncal.runtime.parity import TOLERANCES
from attncal.synthetic import save_synthetic_model, synthetic_text

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options

TEXTS = [synthetic_text(n, seed=n) for n in (5, 60, 150, 400)]
FP16_MAX_ABS = TOLERANCES["fp16"][0]


def _float_types(model: onnx.ModelProto, prefix: str | None) -> tuple[set[str], set[str]]:
    """(element types of the initializers read by nodes outside `prefix`, ... read by nodes inside it)."""
    inits = {i.name: onnx.TensorProto.DataType.Name(i.data_type) for i in model.graph.initializer}
    inside, outside = set(), set()
    for n in model.graph.node:
        kept = bool(prefix) and n.name.startswith(prefix)
        for i in n.input:
            if inits.get(i) in ("FLOAT", "FLOAT16") and n.op_type in ("MatMul", "Attention", "SkipLayerNormalization"):
                (inside if kept else outside).add(inits[i])
    return outside, inside


def _peaky_model(path, pooling: str):
    """A tiny BERT whose attention is far from uniform (query and key weights scaled up), so that calibration
    moves the embedding well beyond fp16 rounding: random-weight attention is nearly flat, and calibrating a
    flat row changes little."""
    import torch
    from transformers import AutoModel

    src = save_synthetic_model("bert", path, seed=4, pooling=pooling, max_positions=512)
    model = AutoModel.from_pretrained(src)
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(8.0)
            layer.attention.self.key.weight.mul_(8.0)
    model.save_pretrained(src)
    return src


# The default exporter (dynamo, whose portable graph is exported in fp16) on one case, TorchScript on the other.
@pytest.mark.parametrize("pooling,optimized,exporter", [("mean", "split", "dynamo"), ("cls", "row", "torchscript")])
def test_fp16_export_writes_optimized_graphs_with_fp32_calibration(tmp_path, capsys, pooling, optimized, exporter):
    src = _peaky_model(tmp_path / "src", pooling)
    cfg = CalibrationConfig(basket_size=16, strength=1.0, layers="last-half")
    meta = export(src, tmp_path / "fp16", ExportOptions(config=cfg, fp16=True, exporter=exporter), quiet=True)
    graphs = meta["graphs"]
    assert set(graphs) == {"onnx/model.onnx", "onnx/model_optimized.onnx", "onnx/model_optimized_native.onnx"}
    assert graphs["onnx/model.onnx"]["placement"] == "softmax"
    assert graphs["onnx/model_optimized.onnx"]["placement"] == optimized
    assert graphs["onnx/model_optimized_native.onnx"]["placement"] == "attention"
    prefix = placements.get(optimized).float32_nodes
    assert graphs["onnx/model_optimized.onnx"]["float32_nodes"] > 0 and prefix
    assert graphs["onnx/model_optimized_native.onnx"]["float32_nodes"] == 0
    for name, g in graphs.items():
        assert g["parity"]["ok"] and g["parity"]["precision"] == "fp16", (name, g["parity"])
        assert g["parity"]["max_abs"] <= FP16_MAX_ABS, (name, g["parity"])
        assert g["fused_attention"] == 4 or name == "onnx/model.onnx"
    outside, inside = _float_types(onnx.load(tmp_path / "fp16" / "onnx" / "model_optimized.onnx"), prefix)
    assert outside == {"FLOAT16"}  # the model's own weights are converted
    assert inside == {"FLOAT"}  # the calibration's projections stay float32
    written = json.loads((tmp_path / "fp16" / "attncal.json").read_text())
    assert written["fp16"] is True and "convert_float_to_float16" in written["fp16_method"]
    assert main(["inspect", str(tmp_path / "fp16")]) == 0
    shown = capsys.readouterr().out
    assert "precision  fp16 (portable graph exported in fp16; ORT-optimized graphs: onnxruntime" in shown
    assert f"{graphs['onnx/model_optimized.onnx']['float32_nodes']} calibration nodes kept float32" in shown

    # The calibration is really in the fp16 graphs: each is much closer to the fp32 calibrated export than to
    # the fp32 uncalibrated one.  (The fp32 references need neither dynamo nor their own parity check.)
    ref_opts = dict(config=cfg, exporter="torchscript", check=False)
    export(src, tmp_path / "cal32", ExportOptions(**ref_opts), quiet=True)
    export(src, tmp_path / "uncal32", ExportOptions(**ref_opts, calibrate=False), quiet=True)
    cal32 = Encoder(tmp_path / "cal32", graph="optimized", native=False).encode(TEXTS)
    uncal32 = Encoder(tmp_path / "uncal32", graph="optimized", native=False).encode(TEXTS)
    effect = np.abs(cal32 - uncal32).max()
    for graph, native in (("optimized", False), ("native", True)):
        cal16 = Encoder(tmp_path / "fp16", graph=graph, native=native).encode(TEXTS)
        assert cal16.dtype == np.float32
        error = np.abs(cal16 - cal32).max()
        print(f"{pooling} {graph}: fp16 vs fp32 calibrated {error:.2e}; calibration moves the embedding {effect:.2e}")
        assert error <= FP16_MAX_ABS and error < effect / 2, (graph, error, effect)  # uncalibrated: error ~ effect


def test_fp16_refuses_explicit_optimized_placements(tmp_path):
    src = save_synthetic_model("bert", tmp_path / "src", seed=4, pooling="mean", max_positions=128)
    for placement in ("split", "row"):
        with pytest.raises(ValueError, match=f"--placement {placement} with --fp16: use --placement auto"):
            export(src, tmp_path / "x", ExportOptions(placement=placement, fp16=True), quiet=True)
    assert not (tmp_path / "x").exists()


def test_on_disk_conversion_is_the_converters_graph_weight_for_weight(tmp_path, monkeypatch):
    """The conversion an export runs (weights on disk, converted block by block when saved) gives the graph
    ONNX Runtime's converter gives with every weight in memory."""
    import onnx_ir as ir

    from attncal.artifact import stage_onnx
    from attncal.exporting import fp16
    from attncal.exporting.fp16 import convert_model_to_fp16, convert_to_fp16

    monkeypatch.setattr(fp16, "_BLOCK", 100)  # many blocks per weight of this tiny model

    src = save_synthetic_model("bert", tmp_path / "src", seed=2)
    export(str(src), tmp_path / "e", ExportOptions(config=CalibrationConfig(basket_size=8), check=False,
                                                  exporter="torchscript"), quiet=True)
    graph = tmp_path / "e" / "onnx" / "model_optimized.onnx"
    prefix = placements.get(json.loads((tmp_path / "e" / "attncal.json").read_text())["graphs"][
        "onnx/model_optimized.onnx"]["placement"]).float32_nodes
    staged = stage_onnx(ir.load(graph), tmp_path / "stage" / "model.onnx")
    in_memory, kept_a = convert_to_fp16(onnx.load(str(staged)), prefix)  # every weight read into the proto
    assert any(t.data_location == onnx.TensorProto.EXTERNAL
               for t in onnx.load(str(staged), load_external_data=False).graph.initializer)
    lazy, kept_b = convert_model_to_fp16(ir.load(staged), prefix)
    on_disk = onnx.load(str(stage_onnx(lazy, tmp_path / "out" / "model.onnx")))
    assert kept_a == kept_b > 0
    assert [n.SerializeToString(deterministic=True) for n in in_memory.graph.node] == \
        [n.SerializeToString(deterministic=True) for n in on_disk.graph.node]
    a = {t.name: t for t in in_memory.graph.initializer}
    b = {t.name: t for t in on_disk.graph.initializer}
    assert a.keys() == b.keys() and {t.data_type for t in b.values()} >= {onnx.TensorProto.FLOAT16}
    for name, t in a.items():
        assert t.data_type == b[name].data_type, name
        assert np.array_equal(onnx.numpy_helper.to_array(t), onnx.numpy_helper.to_array(b[name])), name
