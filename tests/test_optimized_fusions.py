"""ORT's transformer optimizer fuses Add + LayerNormalization (SkipLayerNormalization) in the
optimized graph: its symbolic shape inference must get through the whole TorchScript export.

It has no handler for ReduceL2 / ReduceMin / ReduceMax with an opset-18 `axes` input, so a pooling
head written with F.normalize (ReduceL2 -> Clip -> Expand) or amin/amax (cls / last pooling)
made it raise a TypeError and the optimizer left every Add + LayerNormalization unfused
(attncal.exporting.wrapper writes the head with ReduceSum / ArgMin / ArgMax instead)."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
import torch

from attncal import CalibrationConfig, console
from attncal.calibration.encode import pool
from attncal.artifact import EXPORT_LOG_FILE
from attncal.exporting.exporter import ExportOptions, export
from attncal.exporting.wrapper import export_normalize, export_pool
from attncal.synthetic import save_synthetic_model

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return save_synthetic_model("bert", tmp_path_factory.mktemp("tiny") / "bert", seed=3, layers=2,
                                max_positions=64)


def _ops(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


@pytest.mark.parametrize("pooling,calibrate", [("cls", False), ("mean", False), ("last", False), ("mean", True)])
def test_optimized_graph_has_skip_layer_norm(tiny_bert, tmp_path, pooling, calibrate):
    out = tmp_path / "out"
    with console.capture():  # as `attncal export` runs it: the export log holds the optimizer's messages
        meta = export(tiny_bert, out, ExportOptions(config=CalibrationConfig(pooling=pooling), calibrate=calibrate,
                                                    exporter="torchscript"), quiet=True)
    ops = _ops(out / "onnx" / "model_optimized.onnx")
    assert ops["SkipLayerNormalization"] == 2 * 2, ops  # two per layer (attention and FFN outputs)
    assert ops["LayerNormalization"] == 0, ops
    assert ops["EmbedLayerNormalization"] == 1, ops
    log = (out / EXPORT_LOG_FILE).read_text()
    assert "failed in shape inference" not in log and "shape inference disabled or failed" not in log
    for name, graph in meta["graphs"].items():  # the head's rewrite keeps every graph on the PyTorch reference
        assert graph["parity"]["ok"] and graph["parity"]["max_abs"] <= 1e-5, (name, graph["parity"])
    assert meta["graphs"]["onnx/model_optimized.onnx"]["fused_attention"] == 2


def test_export_head_matches_pool_and_normalize():
    """The export's pooling head gathers the same rows as encode.pool (fully masked rows included)."""
    gen = torch.Generator().manual_seed(0)
    for seq in (1, 2, 5, 9):
        hidden = torch.randn(6, seq, 3, generator=gen)
        mask = (torch.rand(6, seq, generator=gen) < 0.6).long()
        mask[0] = 0
        mask[1] = 1
        for pooling in ("cls", "last", "mean"):
            assert torch.equal(export_pool(hidden, mask, pooling), pool(hidden, mask, pooling)), (pooling, mask)
    emb = torch.randn(8, 5, generator=gen) * torch.logspace(-14, 3, 8)[:, None]
    emb[0] = 0
    torch.testing.assert_close(export_normalize(emb), torch.nn.functional.normalize(emb, dim=-1),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("calibrate", [False, True])
def test_portable_dynamo_graph_gets_ort_load_time_fusions(tiny_bert, tmp_path, calibrate):
    """The dynamo export's GELU is reordered into the pattern ONNX Runtime's GeluFusion
    matches (so BiasGelu forms at load), and intermediate shapes are dropped (so ORT does not form
    SkipLayerNormalization, slower on its CPU than Add + Add + LayerNormalization, and keeps its buffer
    reuse as on an optimum / TorchScript export).  Values unchanged: parity at export."""
    import onnxruntime as ort

    out = tmp_path / "out"
    meta = export(tiny_bert, out, ExportOptions(config=CalibrationConfig(pooling="mean", basket_size=8),
                                                calibrate=calibrate, exporter="dynamo", optimized=False), quiet=True)
    model = onnx.load(str(out / "onnx" / "model.onnx"), load_external_data=False)
    named = ({o.name for o in model.graph.output} | {i.name for i in model.graph.input}
             | {t.name for t in model.graph.initializer})  # graph inputs, outputs and weights keep theirs
    cal_io = {v for n in model.graph.node if n.domain == "ai.attncal" for v in (*n.input, *n.output)}
    shaped = [v.name for v in model.graph.value_info if v.name not in named | cal_io
              and v.type.tensor_type.HasField("shape")]  # only the op's, relabelled for in-place runs
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "loaded.onnx")
    ort.InferenceSession(str(out / "onnx" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    ops = _ops(tmp_path / "loaded.onnx")
    assert ops["BiasGelu"] == 2 and ops["Erf"] == 0, ops  # one per layer
    assert ops["SkipLayerNormalization"] == 0 and ops["LayerNormalization"] >= 4, ops
    assert meta["parity"]["ok"] and meta["parity"]["max_abs"] <= 1e-5
    assert not shaped, shaped[:5]
