"""int8 exports: dynamic quantization of every graph, calibration kept in fp32, parity judged by cosine to the
fp32 PyTorch reference with per-precision tolerances; attncal's streamed quantizer against ONNX Runtime's
`quantize_dynamic` (the reference, here only), graph for graph, weight for weight, output for output; the CPU
classes an int8 graph records, and the warning where it runs on another.

The comparisons with ONNX Runtime are of structure (nodes, names, wiring: stable across its releases) and of
numbers within stated tolerances (`_assert_close_tensor`, `_assert_same_outputs`), not of bytes: with the
release the quantizer mirrors (attncal.exporting.quantize.MIRRORS_ORT) they are equal, and another release may
round a tie differently without the graph being wrong."""

from __future__ import annotations

import json
import shutil
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from attncal import CalibrationConfig, cpuinfo
from attncal.calibration import TorchEncoder
from attncal.corpus.shards import read_embeddings
from attncal.cli import main
from attncal.exporting.exporter import ExportOptions, export
from attncal import artifact
from attncal.artifact import DIGEST_KEY, external_data_name, load_onnx_checked
from attncal.exporting import exporter, quantize
from attncal.exporting.quantize import graph_record, quantization_record, quantize_graph, weight_nodes
from attncal.graphs.ops.contract import DOMAIN
from attncal.modelinfo import default_model_path
from attncal.runtime import Encoder
from attncal.runtime.parity import TOLERANCES, ParityReport, precision_of
from attncal.synthetic import save_synthetic_model, synthetic_text

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options

TEXTS = [synthetic_text(n, seed=n) for n in (5, 60, 150, 400)]
# Tolerances against ONNX Runtime's quantizer.  Scales: float32 from the same float64 division, so equal up to
# a few ulps.  Quantized weights and zero points: one integer step (a tie rounded the other way), in at most
# one value of a thousand.  Outputs: a weight one step off moves an output by about a step of its scale.
SCALE_RTOL = 1e-6
INT_STEPS = 1
INT_OFF_SHARE = 1e-3
OUTPUT_ATOL = 1e-3
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
def test_int8_export_quantizes_weights_only_and_checks_cosine(pooling, tmp_path, capsys, monkeypatch):
    src = save_synthetic_model("bert", tmp_path / "m", seed=2, pooling=pooling, max_positions=256)
    cfg = CalibrationConfig(basket_size=16, strength=0.8)
    out = tmp_path / "int8"
    _capture_fp32(monkeypatch, tmp_path / "fp32")
    meta = export(src, out, ExportOptions(config=cfg, quantize="int8", exporter="torchscript"), quiet=True)
    # The default target is this machine's: int8 weights on a VNNI CPU, uint8 elsewhere.
    target = quantize.resolve_target("auto")
    weights = quantize.TARGET_WEIGHTS[target]
    assert (target == "vnni") == (cpuinfo.cpu_class() in cpuinfo.VNNI_CLASSES)
    assert meta["quantization"]["target"] == target and meta["quantization"]["weights"] == weights
    # Every graph is the one ONNX Runtime's quantize_dynamic writes from the same float32 graph (mean pooling:
    # all-rows calibration, split placement with ORT Attention; cls: the pooled row, row placement).
    for graph_file in meta["graphs"]:
        name = Path(graph_file).name
        _reference(tmp_path / "fp32" / name, tmp_path / "ref" / name, weights=weights)
        _assert_same_graph(tmp_path / "ref" / name, out / graph_file)
        _assert_same_outputs(tmp_path / "ref" / name, out / graph_file)
    assert meta["quantization"]["precision"] == "int8" and meta["quantization"]["per_channel"] is True
    assert set(meta["graphs"]) == {"onnx/model.onnx", "onnx/model_optimized.onnx", "onnx/model_optimized_native.onnx"}
    for graph_file, g in meta["graphs"].items():
        par = g["parity"]
        assert par["precision"] == "int8" and par["ok"]
        assert (par["tol_max_abs"], par["tol_min_cos"]) == TOLERANCES["int8"]
        assert par["p1_cos"] >= par["min_cos"] and par["p50_cos"] >= par["p1_cos"]
        assert all(b["p50_cos"] is not None for b in par["buckets"])
        assert par["cpu"]["cpu_class"] == cpuinfo.cpu_class() and par["cpu"]["covers"] == meta["quantization"]["covers"]
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
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    assert main(["encode", str(out), "--input", str(corpus), "--output", str(tmp_path / "shards"), "-q"]) == 0
    ids, emb = read_embeddings(tmp_path / "shards")
    assert ids == [str(i) for i in range(len(TEXTS))] and np.abs(emb - got).max() <= 1e-6
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert (f"precision  int8 for {target} CPUs (attncal's streamed dynamic quantization, equal to onnxruntime"
            in shown) and "(int8)" in shown
    assert shown.count(f"int8 cpu   figures measured on {cpuinfo.cpu_class()}") == len(meta["graphs"])


def test_int8_refusals_and_tolerances(tmp_path):
    src = save_synthetic_model("bert", tmp_path / "m", seed=2)
    with pytest.raises(ValueError, match="quantize must be one of int8, got 'int4'"):
        export(src, tmp_path / "a", ExportOptions(quantize="int4"), quiet=True)
    with pytest.raises(ValueError, match="--quantize int8 and --fp16 exclude each other"):
        export(src, tmp_path / "b", ExportOptions(quantize="int8", fp16=True), quiet=True)
    with pytest.raises(ValueError, match="int8_target must be one of auto, vnni, avx2, portable, got 'arm'"):
        export(src, tmp_path / "c", ExportOptions(quantize="int8", int8_target="arm"), quiet=True)
    with pytest.raises(ValueError, match="--int8-target portable applies to int8 exports: add --quantize int8"):
        export(src, tmp_path / "d", ExportOptions(int8_target="portable"), quiet=True)
    assert not any((tmp_path / d).exists() for d in "abcd")
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


# -- attncal's streamed quantizer against ONNX Runtime's quantize_dynamic ------------------------------------

def _reference(src: Path, dst: Path, per_channel: bool = True, weights: str = quantize.WEIGHT_TYPE,
               reduce_range: bool = quantize.REDUCE_RANGE, exclude: tuple[str, ...] = ()) -> None:
    """ONNX Runtime's quantize_dynamic with the options attncal's int8 export stands for: per-channel weights of
    the quantizer's type (QUInt8 by default), MatMul / Gemm / Attention, the weight nodes but `exclude`."""
    model = onnx.load(str(src), load_external_data=False)
    quantize._name_unnamed(model)
    nodes = [n for n in weight_nodes(model) if n not in exclude]
    named = src.with_name(src.name + ".named.onnx")
    onnx.save(model, str(named))
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        quantize_dynamic(named, dst, weight_type=QuantType.QUInt8 if weights == "uint8" else QuantType.QInt8,
                         per_channel=per_channel, reduce_range=reduce_range, op_types_to_quantize=["Attention", "Gemm", "MatMul"], nodes_to_quantize=nodes,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        named.unlink(missing_ok=True)


def _capture_fp32(monkeypatch, dest: Path) -> None:
    """Copy each float32 graph (and its data file) the export hands to the quantizer into `dest` first (patched
    where the exporter looks it up)."""
    real = quantize.quantize_graph

    def spy(path, *args, **kwargs):
        dest.mkdir(parents=True, exist_ok=True)
        for f in (Path(path), Path(path).with_name(external_data_name(path))):
            if f.exists():
                shutil.copyfile(f, dest / f.name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(exporter, "quantize_graph", spy)


def _serialized(items) -> list[bytes]:
    return [x.SerializeToString(deterministic=True) for x in items]


def _assert_close_tensor(ref: onnx.TensorProto, got: onnx.TensorProto) -> None:
    """The same initializer as numbers: name, type and dims equal; values within SCALE_RTOL (float) or
    INT_STEPS in at most INT_OFF_SHARE of them (integer)."""
    assert (got.name, got.data_type, list(got.dims)) == (ref.name, ref.data_type, list(ref.dims)), got.name
    r, g = numpy_helper.to_array(ref), numpy_helper.to_array(got)
    if np.issubdtype(r.dtype, np.floating):
        np.testing.assert_allclose(g, r, rtol=SCALE_RTOL, atol=0, err_msg=got.name)
        return
    off = np.abs(g.astype(np.int64) - r.astype(np.int64))
    assert off.max(initial=0) <= INT_STEPS and np.count_nonzero(off) <= INT_OFF_SHARE * off.size, \
        f"{got.name}: {np.count_nonzero(off)} of {off.size} values differ, by up to {off.max(initial=0)}"


def _assert_same_graph(ref_path: Path, got_path: Path) -> None:
    """The same model: header, opsets, metadata (attncal's digest and int8 record aside: ours always has them,
    ONNX Runtime's copies the float32 graph's stale digest if any), inputs, outputs, value_info, functions and
    the node list (types, domains, attributes, wiring, names, order); the same initializers in the same order,
    each equal as numbers (`_assert_close_tensor`)."""
    ref, got = onnx.load(str(ref_path)), onnx.load(str(got_path))  # external data loaded where there is any
    for f in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        assert getattr(got, f) == getattr(ref, f), f
    assert _serialized(got.opset_import) == _serialized(ref.opset_import)
    ours = (DIGEST_KEY, cpuinfo.INT8_RECORD_KEY)
    props = [[(p.key, p.value) for p in m.metadata_props if p.key not in ours] for m in (ref, got)]
    assert props[1] == props[0] and {p.key for p in got.metadata_props} >= set(ours)
    assert _serialized(got.functions) == _serialized(ref.functions)
    for f in ("input", "output", "value_info", "sparse_initializer", "node"):
        a, b = _serialized(getattr(ref.graph, f)), _serialized(getattr(got.graph, f))
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert a == b, (f"{got_path.name}: graph.{f} differs from ONNX Runtime's at {i} of {len(a)} / {len(b)}:\n"
                        f"{getattr(ref.graph, f)[i] if i < len(a) else None}\n---\n"
                        f"{getattr(got.graph, f)[i] if i < len(b) else None}")
    assert [t.name for t in got.graph.initializer] == [t.name for t in ref.graph.initializer]
    for r, g in zip(ref.graph.initializer, got.graph.initializer):
        _assert_close_tensor(r, g)


def _feeds(session, seed: int):
    rng = np.random.default_rng(seed)
    feeds = []
    for batch, length in ((2, 11), (1, 23), (3, 7)):
        ids = rng.integers(6, 100, size=(batch, length), dtype=np.int64)
        mask = np.ones((batch, length), np.int64)
        mask[-1, length // 2:] = 0  # a padded row
        values = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        feeds.append({i.name: values[i.name] for i in session.get_inputs()})
    return feeds


def _assert_same_outputs(ref_path: Path, got_path: Path) -> None:
    """ONNX Runtime's outputs of both graphs within OUTPUT_ATOL on padded and unpadded batches."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    ref = ort.InferenceSession(str(ref_path), so, providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(str(got_path), so, providers=["CPUExecutionProvider"])
    for feed in _feeds(ref, 0):
        for a, b in zip(ref.run(None, feed), got.run(None, feed)):
            assert a.dtype == b.dtype and a.shape == b.shape, got_path.name
            np.testing.assert_allclose(b, a, rtol=0, atol=OUTPUT_ATOL, err_msg=got_path.name)


_INT8 = CalibrationConfig(basket_size=16, strength=0.8)


@pytest.fixture(scope="module")
def xlmr_int8(tmp_path_factory):
    """An XLM-R-like int8 export (cls pooling: row placement, ORT Attention, the attention op's native graph)
    with a Dense head (a Gemm), and the float32 graphs its quantizer was given."""
    root = tmp_path_factory.mktemp("xlmr-int8")
    src = save_synthetic_model("xlm-roberta", root / "m", seed=3, layers=2, max_positions=64, pooling="cls",
                               dense=((16, "Tanh", True),))
    with pytest.MonkeyPatch.context() as mp:
        _capture_fp32(mp, root / "fp32")
        meta = export(src, root / "out", ExportOptions(config=_INT8, quantize="int8", int8_target="portable",
                                                       exporter="torchscript", check=False), quiet=True)
    assert set(meta["graphs"]) == {"onnx/model.onnx", "onnx/model_optimized.onnx", "onnx/model_optimized_native.onnx"}
    return root, meta


def test_xlmr_int8_graphs_equal_onnxruntime_quantizer(xlmr_int8):
    root, meta = xlmr_int8
    for graph_file, info in meta["graphs"].items():
        name = Path(graph_file).name
        _reference(root / "fp32" / name, root / "ref" / name)
        _assert_same_graph(root / "ref" / name, root / "out" / graph_file)
        _assert_same_outputs(root / "ref" / name, root / "out" / graph_file)
        model = onnx.load(str(root / "out" / graph_file))
        ops = [n.op_type for n in model.graph.node]
        assert info["quantized_nodes"] == ops.count("MatMulInteger") + ops.count("QAttention") > 0
        # ONNX Runtime's dynamic mode does not quantize Gemm: the Dense head becomes a float32 MatMul on a
        # transposed copy of its weight, plus an Add, under a name outside the nodes to quantize.
        gemm = next(n for n in onnx.load(str(root / "fp32" / name), load_external_data=False).graph.node
                    if n.op_type == "Gemm")
        matmul = next(n for n in model.graph.node if n.name == gemm.name + "_MatMul")
        assert matmul.op_type == "MatMul" and matmul.input[1] == gemm.input[1] + "_Transposed"
        assert any(n.name == gemm.name + "_Add" for n in model.graph.node) and "Gemm" not in ops
        weight = next(t for t in model.graph.initializer if t.name == matmul.input[1])
        assert weight.data_type == onnx.TensorProto.FLOAT
    assert "QAttention" in {n.op_type for n in onnx.load(str(root / "out" / "onnx/model_optimized.onnx")).graph.node}


def _external_copy(src: Path, dest: Path) -> Path:
    """`src` rewritten with its tensors of 1 KiB and more in `<name>_data` beside it (as a large export is)."""
    dest.mkdir(parents=True, exist_ok=True)
    onnx.save(onnx.load(str(src)), str(dest / src.name), save_as_external_data=True,
              location=external_data_name(src), size_threshold=1024)
    return dest / src.name


def test_external_data_in_and_out_small_blocks(xlmr_int8, tmp_path, monkeypatch):
    """A graph with a data file (bge-m3's size), read a block of two rows at a time: the same graph as
    ONNX Runtime's; written as one file below 2 GiB (the float32 data file goes) and with its own data file
    above (here: a lowered limit); no working file left; the digest covers the int8 weights."""
    root, _ = xlmr_int8
    name = "model_optimized.onnx"  # Attention, MatMuls, the Gemm head
    _reference(root / "fp32" / name, tmp_path / "ref" / name)
    monkeypatch.setattr(quantize, "_BLOCK_BYTES", 2 * 4 * 32)  # hidden 32: two rows of a weight per read
    inline = _external_copy(root / "fp32" / name, tmp_path / "inline")
    assert (tmp_path / "inline" / external_data_name(name)).exists()
    quantize_graph(inline)
    assert sorted(f.name for f in inline.parent.iterdir()) == [name]  # the float32 data file is gone
    _assert_same_graph(tmp_path / "ref" / name, inline)
    load_onnx_checked(inline, interface=True, require_digest=True)

    monkeypatch.setattr(artifact.onnx_io, "INLINE_LIMIT", 1024)
    external = _external_copy(root / "fp32" / name, tmp_path / "external")
    fp32_data = (external.parent / external_data_name(name)).stat().st_size
    quantize_graph(external)
    data = external.parent / external_data_name(name)
    assert sorted(f.name for f in external.parent.iterdir()) == [name, data.name]
    assert 0 < data.stat().st_size < fp32_data
    weight_type = helper.np_dtype_to_tensor_dtype(np.dtype(quantize.WEIGHT_TYPE))
    assert any(t.data_location == onnx.TensorProto.EXTERNAL and t.data_type == weight_type
               for t in onnx.load(str(external), load_external_data=False).graph.initializer)
    _assert_same_graph(tmp_path / "ref" / name, external)
    _assert_same_outputs(tmp_path / "ref" / name, external)
    load_onnx_checked(external, interface=True, require_digest=True)
    with open(data, "r+b") as f:  # a flipped weight byte is caught by the digest
        f.seek(3)
        b = f.read(1)
        f.seek(3)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(artifact.ArtifactError, match="does not match its attncal digest"):
        load_onnx_checked(external, interface=True, require_digest=True)


def test_per_tensor_equals_onnxruntime_quantizer(xlmr_int8, tmp_path):
    root, _ = xlmr_int8
    name = "model.onnx"
    _reference(root / "fp32" / name, tmp_path / "ref" / name, per_channel=False)
    got = tmp_path / "got" / name
    got.parent.mkdir()
    shutil.copyfile(root / "fp32" / name, got)
    assert quantize_graph(got, per_channel=False) > 0
    _assert_same_graph(tmp_path / "ref" / name, got)
    _assert_same_outputs(tmp_path / "ref" / name, got)


def test_quantizer_holds_no_float32_copy_of_a_weight(tmp_path, monkeypatch):
    """One 16 MiB float32 weight on disk, read 1 MiB at a time: the quantizer's Python allocations (numpy
    included) stay below half the weight, where ONNX Runtime's hold it and its int8 copy; same graph."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4096, 1024), dtype=np.float32)
    w[:, 7] = 0.0  # an all-zero channel: scale 1.0
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4096])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1024])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    onnx.save(model, str(src), save_as_external_data=True, location="model.onnx_data")
    del model, graph
    _reference(src, tmp_path / "ref" / "model.onnx")
    got = tmp_path / "got" / "model.onnx"
    shutil.copytree(src.parent, got.parent)
    monkeypatch.setattr(quantize, "_BLOCK_BYTES", 1024**2)
    tracemalloc.start()
    try:
        assert quantize_graph(got) == 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < w.nbytes / 2, f"peak {peak / 2**20:.1f} MiB for a {w.nbytes / 2**20:.0f} MiB weight"
    _assert_same_graph(tmp_path / "ref" / "model.onnx", got)


@pytest.mark.parametrize("weights, reduce_range, bounds", [("uint8", False, (0, 255)), ("uint8", True, (0, 127)),
                                                           ("int8", False, (-127, 127)), ("int8", True, (-64, 64))])
def test_weight_formats_equal_onnxruntime_quantizer(weights, reduce_range, bounds, tmp_path):
    """Each weight format against quantize_dynamic with the same options, as numbers; the weights fill their
    range and no more (reduce_range: int8 within [-64, 64], so two products of 255 * 64 fit int16)."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 48), dtype=np.float32)
    w[3, 5] = 9.0  # an outlier in one channel
    w[:, 7] = 0.0  # an all-zero channel: scale 1.0
    w[:, 8] = np.abs(w[:, 8])  # a channel of one sign: the uint8 zero point at the end of its range
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 48])],
                              [numpy_helper.from_array(w, "w")])
    src = tmp_path / "src.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)  # any onnx, any ORT
    onnx.save(model, str(src))
    _reference(src, tmp_path / "ref" / "model.onnx", weights=weights, reduce_range=reduce_range)
    got = tmp_path / "got" / "model.onnx"
    got.parent.mkdir()
    shutil.copyfile(src, got)
    assert quantize_graph(got, weights=weights, reduce_range=reduce_range) == 1
    _assert_same_graph(tmp_path / "ref" / "model.onnx", got)
    q = numpy_helper.to_array(next(t for t in onnx.load(str(got)).graph.initializer if t.name == "w_quantized"))
    assert q.dtype == np.dtype(weights) and (int(q.min()), int(q.max())) == bounds
    x = rng.standard_normal((5, 64), dtype=np.float32)
    ref_y, got_y = (ort.InferenceSession(str(f), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                    for f in (tmp_path / "ref" / "model.onnx", got))
    np.testing.assert_allclose(got_y, ref_y, rtol=0, atol=OUTPUT_ATOL)
    assert graph_record(got) == json.loads(json.dumps(quantization_record(True, weights, reduce_range)))


def test_int8_graph_records_its_cpu_classes(xlmr_int8, tmp_path, monkeypatch):
    """Every graph of an int8 export carries its weights and the CPU class it was made (and checked) on, and
    the classes its figures cover: with uint8 weights, AVX2 and the VNNI classes alike."""
    root, meta = xlmr_int8
    for graph_file in meta["graphs"]:
        record = graph_record(root / "out" / graph_file)
        assert record["cpu_class"] == cpuinfo.cpu_class() and record["weights"] == quantize.WEIGHT_TYPE == "uint8"
        assert record["reduce_range"] is False and record["weight_range"] == [0, 255] and record["per_channel"]
        assert record["covers"] == list(cpuinfo.VNNI_CLASSES + cpuinfo.PAIR_SUM_CLASSES) or \
            record["covers"] == [record["cpu_class"]]  # a machine outside those classes covers itself alone
    monkeypatch.setattr(cpuinfo, "cpu_class", lambda: cpuinfo.AVX2)
    got = tmp_path / "model.onnx"
    shutil.copyfile(root / "fp32" / "model.onnx", got)
    quantize_graph(got)
    assert graph_record(got)["cpu_class"] == cpuinfo.AVX2 and cpuinfo.AVX2 in graph_record(got)["covers"]


@pytest.mark.parametrize("here, auto", [(cpuinfo.AVX512_VNNI, "vnni"), (cpuinfo.AVX_VNNI, "vnni"),
                                        (cpuinfo.AVX512, "avx2"), (cpuinfo.AVX2, "avx2"),
                                        (cpuinfo.AARCH64, "portable"), (cpuinfo.OTHER, "portable")])
def test_int8_targets_and_what_their_graphs_cover(here, auto, xlmr_int8, tmp_path, monkeypatch):
    """auto is vnni on a VNNI CPU, avx2 on the other AVX2 classes and portable elsewhere; a vnni graph (8-bit int8
    weights) made and checked on a VNNI CPU covers the VNNI classes alone, one made elsewhere covers its own class
    alone, and a portable (uint8) or avx2 (7-bit int8) one covers every x86-64 class with AVX2 wherever it was
    made among them."""
    root, _ = xlmr_int8
    assert quantize.resolve_target("auto", here) == auto
    assert quantize.resolve_target("portable", here) == "portable" and quantize.resolve_target("vnni", here) == "vnni"
    monkeypatch.setattr(cpuinfo, "cpu_class", lambda: here)
    x86 = list(cpuinfo.VNNI_CLASSES + cpuinfo.PAIR_SUM_CLASSES)
    for target, covers in (("vnni", list(cpuinfo.VNNI_CLASSES) if here in cpuinfo.VNNI_CLASSES else [here]),
                           ("portable", x86 if here in x86 else [here]), ("avx2", x86 if here in x86 else [here])):
        got = tmp_path / target / "model.onnx"
        got.parent.mkdir()
        shutil.copyfile(root / "fp32" / "model.onnx", got)
        quantize_graph(got, weights=quantize.TARGET_WEIGHTS[target], reduce_range=quantize.target_reduce_range(target))
        record = graph_record(got)
        assert record["weights"] == quantize.TARGET_WEIGHTS[target] and record["covers"] == covers, (target, record)
    with pytest.raises(ValueError, match="int8 target must be one of auto, vnni, avx2, portable, got 'arm'"):
        quantize.resolve_target("arm", here)


def test_encoder_and_inspect_say_when_this_cpu_is_not_covered(xlmr_int8, monkeypatch, capsys):
    root, _ = xlmr_int8
    out = root / "out"
    made_on = graph_record(out / "onnx/model.onnx")["cpu_class"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", cpuinfo.Int8CpuWarning)
        Encoder(out)  # the machine it was made on: covered, silent
    monkeypatch.setattr(cpuinfo, "cpu_class", lambda: cpuinfo.AARCH64)
    with pytest.warns(cpuinfo.Int8CpuWarning, match=f"measured on {made_on} and cover .*; this CPU is aarch64"):
        enc = Encoder(out)
    assert enc.encode(TEXTS[:1]).shape[0] == 1  # a warning, not a refusal
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert shown.count("this CPU: aarch64: WARNING") == 3


# -- 7-bit weights with the most sensitive MatMuls in fp32 (the avx2 target) ---------------------------------

def test_kept_nodes_equal_onnxruntime_quantizer_excluding_them(xlmr_int8, tmp_path):
    """`keep_fp32` is quantize_dynamic's nodes_to_exclude: the same graph, the kept MatMuls fp32 on their float
    weights; a name that is not a weight node is refused."""
    root, meta = xlmr_int8
    name = "model.onnx"
    model = onnx.load(str(root / "fp32" / name), load_external_data=False)
    quantize._name_unnamed(model)
    keep = tuple(weight_nodes(model)[1:3])
    assert all("MatMul" in n for n in keep)
    _reference(root / "fp32" / name, tmp_path / "ref" / name, weights="int8", reduce_range=True, exclude=keep)
    got = tmp_path / "got" / name
    got.parent.mkdir()
    shutil.copyfile(root / "fp32" / name, got)
    assert quantize_graph(got, weights="int8", reduce_range=True, keep_fp32=keep) == \
        meta["graphs"]["onnx/model.onnx"]["quantized_nodes"] - 2
    _assert_same_graph(tmp_path / "ref" / name, got)
    _assert_same_outputs(tmp_path / "ref" / name, got)
    assert {n.name for n in onnx.load(str(got)).graph.node if n.op_type == "MatMul"} >= set(keep)
    with pytest.raises(ValueError, match="nodes to keep in fp32 that are not weight nodes of the graph: \\['nope'\\]"):
        quantize_graph(got, keep_fp32=["nope"])


def _sensitive_chain(path: Path) -> None:
    """x -> mm1 -> mm2 -> mm3 -> sentence_embedding, where mm2's input has one channel 500 times the others
    that mm2's weight ignores: per-tensor uint8 activations leave mm2 a few levels for everything else, so mm2
    alone carries most of the int8 drift, and it is not the largest weight."""
    rng = np.random.default_rng(7)
    w1 = rng.standard_normal((32, 48)).astype(np.float32)
    w1[:, 0] *= 500.0
    w2 = rng.standard_normal((48, 48)).astype(np.float32)
    w2[0, :] = 0.0
    w3 = rng.standard_normal((48, 96)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
             helper.make_node("MatMul", ["h1", "w2"], ["h2"], name="mm2"),
             helper.make_node("MatMul", ["h2", "w3"], ["sentence_embedding"], name="mm3")]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 32])],
                              [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["n", 96])],
                              [numpy_helper.from_array(w, n) for w, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"))])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(path))


def test_sensitivity_keeps_the_matmul_that_moves_the_embeddings(tmp_path):
    path = tmp_path / "chain.onnx"
    _sensitive_chain(path)
    rng = np.random.default_rng(8)
    feeds = [{"x": rng.standard_normal((16, 32)).astype(np.float32)} for _ in range(4)]
    record = quantize.sensitivity(path, feeds, "int8", True, goal_p1=0.99999, max_share=0.34)
    assert [r["node"] for r in record["ranking"]][0] == "mm2" and record["fp32_nodes"] == ["mm2"], record
    assert record["candidates"] == 3 and record["texts"] == 64
    assert record["chosen"]["mean_drift"] < record["all_int8"]["mean_drift"] / 3, record
    assert record["chosen"]["p1_cosine"] > record["all_int8"]["p1_cosine"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain.onnx"]  # the probe graph and its data are gone
    # The chosen drift is what the int8 graph with those nodes kept computes.
    quantize_graph(path, weights="int8", reduce_range=True, keep_fp32=record["fp32_nodes"])
    src = tmp_path / "fp32.onnx"
    _sensitive_chain(src)
    int8, fp32 = (ort.InferenceSession(str(f), providers=["CPUExecutionProvider"]) for f in (path, src))
    a, b = (np.concatenate([s.run(None, f)[0] for f in feeds]) for s in (int8, fp32))
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert float(np.percentile(cos, 1)) == pytest.approx(record["chosen"]["p1_cosine"], abs=2e-6)
    # Nothing is kept where the goal holds with every MatMul quantized.
    _sensitive_chain(path)
    assert quantize.sensitivity(path, feeds, "int8", True, goal_p1=0.5)["fp32_nodes"] == []


def test_avx2_target_records_its_choice_per_graph(tmp_path):
    """--int8-target avx2: 7-bit int8 weights, each graph's sensitivity record in attncal.json, the kept nodes
    fp32 in the graph, figures covering every x86-64 class."""
    src = save_synthetic_model("bert", tmp_path / "m", seed=4, layers=2, max_positions=64)
    meta = export(src, tmp_path / "out", ExportOptions(config=_INT8, quantize="int8", int8_target="avx2",
                                                       exporter="torchscript", check=False), quiet=True)
    q = meta["quantization"]
    assert q["target"] == "avx2" and q["weights"] == "int8" and q["reduce_range"] and q["weight_range"] == [-64, 64]
    assert "reduce_range" in q["method"] and cpuinfo.AVX2 in q["covers"] or q["covers"] == [q["cpu_class"]]
    measured = meta["graphs"]["onnx/model_optimized_native.onnx"]["int8_sensitivity"]
    assert measured["texts"] == quantize.SENSITIVITY_TEXTS and measured["goal_p1"] == quantize.SENSITIVITY_GOAL_P1
    assert measured["chosen"]["p1_cosine"] >= measured["goal_p1"] or len(measured["fp32_nodes"]) == int(
        quantize.SENSITIVITY_MAX_SHARE * measured["candidates"])
    assert meta["graphs"]["onnx/model_optimized_native.onnx"]["quantized_nodes"] == \
        measured["candidates"] - len(measured["fp32_nodes"])
    for graph_file, entry in meta["graphs"].items():
        s = entry["int8_sensitivity"]
        assert s == measured or (s["measured_on"] == "onnx/model_optimized_native.onnx"
                                 and set(s["fp32_nodes"]) <= set(measured["fp32_nodes"]))
        model = onnx.load(str(tmp_path / "out" / graph_file))
        kept = {n.name for n in model.graph.node if n.op_type in ("MatMul", "Attention")}
        assert set(s["fp32_nodes"]) <= kept
        q8 = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("_quantized")]
        assert q8 and all(a.dtype == np.int8 and int(np.abs(a).max()) <= 64 for a in q8)
