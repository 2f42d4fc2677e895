"""Attention placement: each layer's fused attention on the ORT-optimized graph becomes Q/K/V
projections plus one calibrated attention op (strength 0 where the layer is not calibrated, and in
every layer of an uncalibrated export); `auto` writes that graph beside the split graph, and the
runtime picks it where the native library is loaded, the split graph elsewhere.

Parity against the eager PyTorch reference (≤ 1e-5) for mean and cls pooling, left/right mixed
lengths, partial baskets; the graph choice of `Encoder`, `attncal encode` and `attncal triton-repo`;
refusals that say why and leave the graph as it was."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from attncal import CalibrationConfig
from attncal.artifact import NATIVE_GRAPH, OPTIMIZED_GRAPH, PORTABLE_GRAPH
from attncal.calibration import TorchEncoder
from attncal.cli import main
from attncal.exporting.exporter import ExportError, ExportOptions, export
from attncal.graphs import placements
from attncal.graphs.placements.attention_placement import AttentionPlacementError
from attncal.graphs.placements.projected_attention_placement import ProjectedAttentionPlacementError
from attncal.graphs.placements import plan
from attncal.graphs.placements.rewrite import remove_calibration
from attncal.graphs.placements.softmax_pattern import SoftmaxPatternError
from attncal.runtime import Encoder
from attncal.runtime.encoder import planned_graph
from attncal.synthetic import save_synthetic_model, synthetic_text
from test_native_kernel import library  # noqa: F401  (the built-library fixture)

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options

TEXTS = [synthetic_text(n, seed=n) for n in (4, 30, 70, 140, 400, 9, 55)]
BASKET = 16


@pytest.fixture(scope="module")
def exports(tmp_path_factory, library):
    """A calibrated export (auto placement, torchscript) per pooling of a random-weight BERT."""
    root = tmp_path_factory.mktemp("attention")
    out = {}
    for pooling in ("mean", "cls"):
        src = save_synthetic_model("bert", root / f"src-{pooling}", seed=3, pooling=pooling, max_positions=256)
        cfg = CalibrationConfig(basket_size=BASKET, variant="cls-soft" if pooling == "cls" else "uniform")
        meta = export(src, root / pooling, ExportOptions(config=cfg, exporter="torchscript"), quiet=True)
        out[pooling] = (src, root / pooling, meta, cfg)
    return out


def op_types(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_auto_writes_the_native_graph_and_it_matches_pytorch(exports, pooling):
    src, out, meta, cfg = exports[pooling]
    graphs = meta["graphs"]
    assert graphs[NATIVE_GRAPH]["placement"] == "projected-attention"  # fp32: the op projects Q, K, V itself
    assert graphs[OPTIMIZED_GRAPH]["placement"] == ("split" if pooling == "mean" else "row")
    assert all(g["parity"]["ok"] for g in graphs.values()), "the export checks every graph"
    assert graphs[NATIVE_GRAPH]["parity"]["max_abs"] <= 1e-5
    ops = op_types(out / NATIVE_GRAPH)
    n_cal = len(meta["calibrated_layers"])
    op = "AllRowsCalibratedProjectedAttention" if pooling == "mean" else "PooledRowCalibratedProjectedAttention"
    assert ops.count(op) == meta["num_layers"] and "Attention" not in ops  # every layer, calibrated or not
    graph = onnx.load(str(out / NATIVE_GRAPH), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    strengths = []
    for node in (n for n in graph.node if n.op_type == op):  # one node per layer: the fused node's packed weights
        assert node.input[1] in inits and node.input[2] in inits and node.input[3] == "attention_mask"
        strengths.append(next(a.f for a in node.attribute if a.name == "strength"))
    assert strengths == [cfg.strength if k in meta["calibrated_layers"] else 0.0 for k in range(meta["num_layers"])]
    assert 0 < n_cal < meta["num_layers"]
    assert graphs[NATIVE_GRAPH]["fused_attention"] == meta["num_layers"]
    ref = TorchEncoder(src, attn_implementation="eager").encode(TEXTS, cfg.with_pooling(pooling))
    enc = Encoder(out, providers=["CPUExecutionProvider"])
    assert enc.graph_file == NATIVE_GRAPH and enc.custom_op_library is not None
    assert np.abs(enc.encode(TEXTS) - ref).max() <= 1e-5
    split = Encoder(out, providers=["CPUExecutionProvider"], graph="optimized").encode(TEXTS)
    assert np.abs(split - ref).max() <= 1e-5


def test_uncalibrated_export_writes_the_native_graph_at_strength_0(exports, tmp_path):
    """An uncalibrated export of a fused model gets the native graph too: the op at strength 0 in every
    layer, no ONNX Runtime `Attention` left (whose CPU kernel writes every layer's probabilities).  It
    gives the uncalibrated optimized graph's embeddings and the eager model's, and is what `Encoder` runs
    where the library is loaded."""
    src, _, _, _ = exports["cls"]
    out = tmp_path / "plain"
    meta = export(src, out, ExportOptions(calibrate=False, exporter="torchscript"), quiet=True)
    entry = meta["graphs"][NATIVE_GRAPH]
    assert entry["placement"] == "projected-attention" and entry["parity"]["ok"]
    assert entry["parity"]["max_abs"] <= 1e-5 and entry["fused_attention"] == meta["num_layers"]
    graph = onnx.load(str(out / NATIVE_GRAPH), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "PooledRowCalibratedProjectedAttention"]
    assert len(nodes) == meta["num_layers"] and "Attention" not in [n.op_type for n in graph.node]
    assert all(next(a.f for a in n.attribute if a.name == "strength") == 0.0 for n in nodes)
    enc = Encoder(out, providers=["CPUExecutionProvider"])
    assert enc.graph_file == NATIVE_GRAPH and enc.custom_op_library is not None
    got = enc.encode(TEXTS)
    fused = Encoder(out, providers=["CPUExecutionProvider"], graph="optimized").encode(TEXTS)
    ref = TorchEncoder(src, attn_implementation="eager").encode(TEXTS, None)
    assert np.abs(got - fused).max() <= 1e-5 and np.abs(got - ref).max() <= 1e-5


def test_explicit_attention_placement_keeps_separate_projections(exports, tmp_path):
    """`--placement attention` on a float32 export: the Q, K and V projections stay MatMul + Add (what fp16 and
    int8 exports get in their native graph) before the unprojected op, with parity."""
    src, _, _, cfg = exports["mean"]
    meta = export(src, tmp_path / "att", ExportOptions(config=cfg, exporter="torchscript", placement="attention"),
                  quiet=True)
    graph = meta["graphs"][OPTIMIZED_GRAPH]
    assert graph["placement"] == "attention" and graph["parity"]["ok"] and graph["parity"]["max_abs"] <= 1e-5
    ops = op_types(tmp_path / "att" / OPTIMIZED_GRAPH)
    assert ops.count("AllRowsCalibratedAttention") == meta["num_layers"]
    assert "AllRowsCalibratedProjectedAttention" not in ops


def test_without_the_library_the_split_graph_runs(exports, monkeypatch, tmp_path, capfd):
    _, out, _, _ = exports["mean"]
    from attncal.runtime import oplib

    # Nothing built: the split graph runs, and no "using the ONNX function body" notice (none runs).
    monkeypatch.setenv("ATTNCAL_ORT_LIBRARY", str(tmp_path / "missing.so"))
    monkeypatch.setattr(oplib, "_fallback_said", False)
    enc = Encoder(out, providers=["CPUExecutionProvider"])
    assert enc.graph_file == OPTIMIZED_GRAPH and enc.custom_op_library is None
    assert "function body" not in capfd.readouterr().err
    monkeypatch.delenv("ATTNCAL_ORT_LIBRARY")
    assert Encoder(out, providers=["CPUExecutionProvider"], native=False).graph_file == OPTIMIZED_GRAPH
    monkeypatch.setenv("ATTNCAL_NATIVE", "0")
    enc = Encoder(out, providers=["CPUExecutionProvider"])
    assert enc.graph_file == OPTIMIZED_GRAPH and enc.custom_op_library is None
    assert planned_graph(out, ["CPUExecutionProvider"]) == OPTIMIZED_GRAPH
    monkeypatch.delenv("ATTNCAL_NATIVE")
    assert planned_graph(out, ["CPUExecutionProvider"]) == NATIVE_GRAPH
    # Explicit choices; a graph the export lacks is named.
    assert Encoder(out, providers=["CPUExecutionProvider"], graph="native").graph_file == NATIVE_GRAPH
    assert Encoder(out, providers=["CPUExecutionProvider"], graph="portable").graph_file == PORTABLE_GRAPH
    (out / NATIVE_GRAPH).rename(out / "moved.onnx")
    try:
        with pytest.raises(FileNotFoundError, match="model_optimized_native.onnx"):
            Encoder(out, providers=["CPUExecutionProvider"])
    finally:
        (out / "moved.onnx").rename(out / NATIVE_GRAPH)


def test_inspect_triton_repo_and_encode_name_the_graph(exports, tmp_path, capsys):
    _, out, _, _ = exports["mean"]
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "placement projected-attention" in shown and "AllRowsCalibratedProjectedAttention" in shown
    assert "native library" in shown
    # The native graph's ops count as fused attention, as its attncal.json entry counts them (one per layer).
    native_block = shown[shown.index(NATIVE_GRAPH):]
    assert "fused attention nodes: 4;" in native_block
    assert main(["triton-repo", str(out), "-o", str(tmp_path / "repo"), "--backend", "onnxruntime", "--name", "m"]) == 0
    shown = capsys.readouterr().out
    assert f"serves the export's {NATIVE_GRAPH}" in shown
    enc_meta = json.loads(next((tmp_path / "repo").glob("*/attncal.json")).read_text())
    assert enc_meta["triton"]["graph"] == NATIVE_GRAPH
    assert not list((tmp_path / "repo").rglob("*.log")), "the export's log is not copied into the repository"
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    assert main(["encode", str(out), "--input", str(corpus), "--output", str(tmp_path / "emb"), "--workers", "1"]) == 0
    assert NATIVE_GRAPH in capsys.readouterr().out


def test_refusals_say_why_and_leave_the_graph_unchanged(exports, tmp_path):
    src, out, _, _ = exports["mean"]
    cfg = CalibrationConfig(pooling="mean", basket_size=BASKET)
    plain = ir.load(out / PORTABLE_GRAPH)
    with pytest.raises(AttentionPlacementError, match="fused com.microsoft::Attention nodes, and this graph has none"):
        placements.get("attention").place(plain, cfg, 2)
    uncal = tmp_path / "uncal"
    export(src, uncal, ExportOptions(calibrate=False, exporter="torchscript", check=False), quiet=True)
    model = ir.load(uncal / OPTIMIZED_GRAPH)
    atts = [n for n in model.graph if n.op_type == "Attention"]
    model.graph.outputs.append(atts[-1].outputs[0])  # the last layer's context is now a graph output
    before = ir.to_proto(model).SerializeToString()
    with pytest.raises(AttentionPlacementError, match="is a graph output; cannot rewire it"):
        placements.get("attention").place(model, cfg, len(atts))
    assert ir.to_proto(model).SerializeToString() == before
    with pytest.raises(ProjectedAttentionPlacementError, match="is a graph output; cannot rewire it"):
        placements.get("projected-attention").place(model, cfg, len(atts))
    assert ir.to_proto(model).SerializeToString() == before
    for placement, opts, why in (
            ("attention", dict(fp16=True), "--placement attention with --fp16: use --placement auto"),
            ("attention", dict(optimized=False), "drop --no-optimized"),
            ("projected-attention", dict(fp16=True), "--placement projected-attention with --fp16"),
            ("projected-attention", dict(quantize="int8"), "quantizes only separate projection MatMuls"),
            ("projected-attention", dict(optimized=False), "drop --no-optimized")):
        with pytest.raises(ValueError, match=why):
            export(src, tmp_path / "x", ExportOptions(config=cfg, placement=placement, **opts), quiet=True)
    qwen = save_synthetic_model("qwen3", tmp_path / "qwen", seed=1, pooling="mean", max_positions=64)
    with pytest.raises(ExportError, match="rewrites ONNX Runtime's fused attention: ONNX Runtime's transformer "
                                          "optimizer fuses BERT-shaped attention only; this qwen3 attention has "
                                          "grouped key/value heads and rotary position embeddings"):
        export(qwen, tmp_path / "q", ExportOptions(config=cfg, placement="attention", exporter="torchscript"),
               quiet=True)
    assert not (tmp_path / "q").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".q.tmp")]
    assert not (tmp_path / "x").exists() and not (tmp_path / "q").exists()
    native = ir.load(out / NATIVE_GRAPH)
    before = ir.to_proto(native).SerializeToString()
    with pytest.raises(SoftmaxPatternError, match="calibrated attention node .* re-export the model"):
        remove_calibration(native)
    assert ir.to_proto(native).SerializeToString() == before


def test_plan_names_the_native_graph():
    mean = plan("auto", CalibrationConfig(pooling="mean").resolve())
    assert (mean.portable, mean.optimized, mean.native) == ("fused-softmax", "split", "projected-attention")
    assert "Q/K/V projection" in mean.reason
    cls = plan("auto", CalibrationConfig(pooling="cls").resolve())
    assert (cls.portable, cls.optimized, cls.native) == ("row", "row", "projected-attention")
    for precision in ("fp16", "int8"):  # separate projections: float16/CUDA kernels, ORT's quantizer
        assert plan("auto", CalibrationConfig(pooling="mean").resolve(), precision).native == "attention"
    with pytest.raises(ValueError, match="precision must be one of fp32, fp16, int8"):
        plan("auto", CalibrationConfig(pooling="mean").resolve(), "bf16")
    with pytest.raises(ValueError, match="writes a float32 op; a int8 export keeps separate"):
        plan("projected-attention", CalibrationConfig(pooling="mean").resolve(), "int8")
    projected = plan("projected-attention", CalibrationConfig(pooling="cls").resolve())
    assert (projected.portable, projected.optimized, projected.native) == ("row", "projected-attention", None)
    explicit = plan("attention", CalibrationConfig(pooling="mean").resolve())
    assert (explicit.portable, explicit.optimized, explicit.native) == ("fused-softmax", "attention", None)
    assert plan("split", CalibrationConfig(pooling="mean").resolve()).native is None
