"""The Softmax-fused calibration ops (SoftmaxPooledRowCalibration, SoftmaxAllRowsCalibration):
their function body and the native CPU kernel against the float64 oracle applied to
Softmax(scores), thread-count independence and in-place runs, and the fused-softmax placement
(rewrite, removal, export, Encoder)."""

from __future__ import annotations

import random

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from attncal.calibration import CalibrationConfig
from attncal.graphs.ops.contract import (ALL_ROWS_OP, DOMAIN, OP_TYPES, POOLED_OP, SOFTMAX_ALL_ROWS_OP,
                                         SOFTMAX_POOLED_OP, VERSION, attribute_names, calibration_of, op_spec,
                                         resolved_from_attrs, takes_scores, with_softmax)
from attncal.graphs.placements.fused_softmax_placement import fuse_softmax
from attncal.graphs.ops.function_body import make_function
from attncal.graphs.placements.rewrite import remove_calibration
from attncal.graphs.ops.single_op import single_op_model
from support.cases import random_config
from support.masks import mixed_mask, random_mask
from support.oracle_loop import (random_calibration_batch, random_calibration_op, run_oracle_loop,
                                 tally_calibration_items)
from support.tensors import random_scores, softmax_reference
from test_native_kernel import counters, library, session  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options


def plain_session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_contract_pairs_each_op_with_its_fused_form():
    assert OP_TYPES == (POOLED_OP, ALL_ROWS_OP, SOFTMAX_POOLED_OP, SOFTMAX_ALL_ROWS_OP)
    assert [with_softmax(o) for o in OP_TYPES] == [SOFTMAX_POOLED_OP, SOFTMAX_ALL_ROWS_OP] * 2
    assert [calibration_of(o) for o in OP_TYPES] == [POOLED_OP, ALL_ROWS_OP] * 2
    assert [takes_scores(o) for o in OP_TYPES] == [False, False, True, True]
    assert attribute_names(SOFTMAX_ALL_ROWS_OP) == attribute_names(ALL_ROWS_OP)
    assert "pool_last" in attribute_names(SOFTMAX_POOLED_OP)
    with pytest.raises(ValueError, match="unknown calibration op 'Softmax'"):
        takes_scores("Softmax")
    rc = CalibrationConfig(pooling="last", variant="cls-hard").resolve()
    spec = op_spec(rc, 3, fused_softmax=True)
    assert spec.op_type == SOFTMAX_POOLED_OP and spec.attrs == op_spec(rc, 3).attrs
    assert resolved_from_attrs(spec.op_type, spec.attrs) == rc
    fn = make_function(SOFTMAX_ALL_ROWS_OP, 18)
    assert list(fn.input) == ["scores", "attention_mask"] and fn.node[0].op_type == "Softmax"


@pytest.mark.parametrize("float16,n_configs,tol", [(False, 120, 1e-6), (True, 60, 2e-3)], ids=["fp32", "fp16"])
def test_function_body_matches_oracle_of_softmax(float16, n_configs, tol):
    """Without the native library ORT inlines the body: Softmax, then the calibration body."""
    rng = random.Random(31 + float16)
    gen = torch.Generator().manual_seed(7)
    dtype = torch.float16 if float16 else torch.float32
    worst = 0.0
    for _ in range(n_configs):
        S = rng.choice([1, 2, 3, 4, 8])
        spec = op_spec(random_config(rng, S).resolve(), layer=rng.randint(0, 30), fused_softmax=True)
        rc = resolved_from_attrs(spec.op_type, spec.attrs)
        sess = plain_session(single_op_model(spec, opset=rng.choice([18, 20]), float16=float16))
        for _ in range(6):
            K = rng.randint(1, 40)
            mask = random_mask(rng, rng.randint(1, 4), K, left=rng.random() < 0.5)
            scores = random_scores(gen, mask, rng.randint(1, 3), dtype, temp=rng.choice([0.5, 3.0]))
            (out,) = sess.run(None, {"scores": scores.numpy(), "attention_mask": mask.numpy()})
            err = float(np.abs(out.astype(np.float64) - softmax_reference(scores, mask, rc).numpy()).max())
            assert err <= tol, (err, spec, K)
            worst = max(worst, err)
    print(f"\nfunction body {'fp16' if float16 else 'fp32'}: max abs err {worst:.3g}")


@pytest.mark.parametrize("float16,tol", [(False, 1e-6), (True, 2e-3)], ids=["fp32", "fp16"])
def test_native_fused_kernel_matches_oracle_on_20000_cases(library, counters, float16, tol):
    """A case is one batch item (its own mask, padding side, length) under one attribute set; every
    row is compared: calibrated rows with the oracle, the others with the plain softmax.  Logit
    ranges keep valid keys' float32 probabilities normal: a basket of subnormal mass is calibrated
    from a handful of significant bits, and the float64 oracle of the float64 softmax is not a
    meaningful bound there (test_subnormal_basket_mass_gives_the_oracle_not_inf covers it)."""
    rng = random.Random(4401 + float16)
    gen = torch.Generator().manual_seed(44)
    dtype = torch.float16 if float16 else torch.float32
    before = counters["compute"]()

    def configure():
        S, spec, rc = random_calibration_op(rng, fused_softmax=True)
        return S, spec, rc, session(single_op_model(spec, float16=float16), library)

    def run(config, seen):
        S, spec, rc, sess = config
        B, K, mask = random_calibration_batch(rng, rc)
        q1 = not rc.all_rows and rng.random() < 0.3  # Q == 1: the single row is the pooling row
        scores = random_scores(gen, mask, 1 if rc.all_rows else rng.randint(1, 2), dtype,
                               temp=rng.choice([0.5, 2.0, 6.0]), Q=1 if q1 else None)
        if rng.random() < 0.2:  # keys whose exp is exactly 0 in any precision: empty baskets
            scores[..., rng.randrange(K):][..., : 2 * S] -= 1e4
            scores.clamp_(min=torch.finfo(dtype).min)  # masked keys stay at the lowest value
        (out,) = sess.run(None, {"scores": scores.numpy(), "attention_mask": mask.numpy()})
        ref = softmax_reference(scores, mask, rc).numpy()
        err = np.abs(out.astype(np.float64) - ref).max(axis=(1, 2, 3))
        assert err.max() <= tol, (float(err.max()), spec, K, int(err.argmax()))
        seen["q1"] += B * q1
        tally_calibration_items(seen, mask, rc, S)
        seen["lambda0"] += B * (rc.strength == 0)
        return B, float(err.max())

    loop = run_oracle_loop(20000, configure, run, runs_per_config=2,
                           seen=("q1", "left", "right", "partial", "all_rows", "pooled", "lambda0"))
    assert counters["compute"]() - before == loop.runs, "every run must execute the native kernel"
    print(f"\nfused {'fp16' if float16 else 'fp32'}: {loop.cases} cases in {loop.runs} runs, max abs err "
          f"{loop.worst:.3g}, {loop.seen}")
    assert min(loop.seen.values()) > 1000, loop.seen


def scores_then_op(spec, float16: bool) -> onnx.ModelProto:
    """logits -> Add(0) -> fused op -> Relu: the op's input and output are intermediates, so ORT may
    run it in place (an input or output of the graph is never given another tensor's buffer)."""
    dtype = TensorProto.FLOAT16 if float16 else TensorProto.FLOAT
    zero = helper.make_tensor("zero", dtype, [], [0.0])
    nodes = [helper.make_node("Add", ["logits", "zero"], ["scores"]),
             helper.make_node(spec.op_type, ["scores", "attention_mask"], ["cal"], domain=DOMAIN, **spec.attrs),
             helper.make_node("Relu", ["cal"], ["calibrated"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("logits", dtype, ["B", "H", "Q", "K"]),
                                       helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "K"])],
                          [helper.make_tensor_value_info("calibrated", dtype, ["B", "H", "Q", "K"])],
                          initializer=[zero],
                          value_info=[helper.make_tensor_value_info("scores", dtype, ["B", "H", "Q", "K"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, VERSION)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("float16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_fused_threads_and_in_place_are_bit_identical(library, counters, float16, pooling):
    spec = op_spec(CalibrationConfig(pooling=pooling, basket_size=16, variant="cls-soft").resolve(), 0,
                   fused_softmax=True)
    gen = torch.Generator().manual_seed(9)
    B, H, K = 5, 3, 200
    mask = mixed_mask(random.Random(6), B, K)
    mask[0] = 1
    dtype = torch.float16 if float16 else torch.float32
    feeds = {"logits": random_scores(gen, mask, H, dtype, temp=3.0).numpy(), "attention_mask": mask.numpy()}
    results = []
    for threads in (1, 2, 4):
        inplace_before = counters["inplace"]()
        (a,) = session(scores_then_op(spec, float16), library, threads).run(None, feeds)
        assert counters["inplace"]() == inplace_before + 1, "ORT did not reuse the scores buffer"
        (b,) = session(single_op_model(spec, float16=float16), library, threads).run(
            None, {"scores": feeds["logits"], "attention_mask": feeds["attention_mask"]})
        results += [a, b]
        ref = softmax_reference(torch.from_numpy(feeds["logits"]), mask, resolved_from_attrs(spec.op_type, spec.attrs))
        assert np.abs(b.astype(np.float64) - ref.numpy()).max() <= (2e-3 if float16 else 1e-6)
    for r in results[1:]:
        assert np.array_equal(r.view(np.uint8), results[0].view(np.uint8))  # in place or not, any thread count


@pytest.mark.parametrize("float16", [False, True], ids=["fp32", "fp16"])
def test_fused_subnormal_fixed_weight_is_divided_not_inverted(library, float16):
    """Content keys whose exp underflows to exactly 0 and a subnormal cls-hard weight: total = w and
    1/total overflows float32; the kernel divides, so the pooling token gets exactly 1."""
    cfg = CalibrationConfig(variant="cls-hard", strength=1.0, basket_size=1, pooling="cls", self_weight=1e-40,
                            skip_short=False)
    spec = op_spec(cfg.resolve(), 0, fused_softmax=True)
    dtype = np.float16 if float16 else np.float32
    scores = np.full((1, 2, 3, 3), -1e4, dtype)
    scores[..., 0] = 0
    mask = np.ones((1, 3), np.int64)
    (out,) = session(single_op_model(spec, float16=float16), library).run(
        None, {"scores": scores, "attention_mask": mask})
    ref = softmax_reference(torch.from_numpy(scores), torch.from_numpy(mask), resolved_from_attrs(spec.op_type,
                                                                                                  spec.attrs))
    assert np.all(np.isfinite(out)) and np.all(out[0, :, 0, 0] == 1.0), out[0, :, 0]
    assert np.array_equal(out.astype(np.float64), ref.numpy())


def attention_graph(extra_reader: bool) -> ir.Model:
    """scores -> Softmax -> AllRowsCalibration -> MatMul(V); optionally the probabilities are also a
    graph output (a reader the fusion must not take them from)."""
    f = TensorProto.FLOAT
    spec = op_spec(CalibrationConfig(pooling="mean", basket_size=4).resolve(), 0)
    nodes = [helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
             helper.make_node(spec.op_type, ["probs", "attention_mask"], ["cal"], domain=DOMAIN, name="cal0",
                              **spec.attrs),
             helper.make_node("MatMul", ["cal", "v"], ["ctx"])]
    outputs = [helper.make_tensor_value_info("ctx", f, ["B", 2, "K", 4])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("probs", f, ["B", 2, "K", "K"]))
    g = helper.make_graph(nodes, "att", [helper.make_tensor_value_info("scores", f, ["B", 2, "K", "K"]),
                                         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "K"]),
                                         helper.make_tensor_value_info("v", f, ["B", 2, "K", 4])], outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, VERSION)],
                          functions=[make_function(spec.op_type, 18)])
    m.ir_version = 10
    return ir.from_proto(m)


def test_fuse_softmax_rewrites_only_sole_readers_and_removal_restores_softmax():
    gen = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, 6:] = 0
    feeds = {"scores": random_scores(gen, mask, 2).numpy(), "attention_mask": mask.numpy(),
             "v": torch.randn(2, 2, 9, 4, generator=gen).numpy()}
    model = attention_graph(extra_reader=False)
    (before,) = plain_session(ir.to_proto(model)).run(None, feeds)
    assert fuse_softmax(model) == 1
    assert [n.op_type for n in model.graph] == [SOFTMAX_ALL_ROWS_OP, "MatMul"]
    assert [k[1] for k in model.functions] == [SOFTMAX_ALL_ROWS_OP]  # the unused plain body is dropped
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    (after,) = plain_session(proto).run(None, feeds)
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-6)

    assert remove_calibration(model) == 1
    assert [n.op_type for n in model.graph] == ["Softmax", "MatMul"]
    probs = torch.softmax(torch.from_numpy(feeds["scores"]), -1).numpy()
    (plain,) = plain_session(ir.to_proto(model)).run(None, feeds)
    np.testing.assert_allclose(plain, probs @ feeds["v"], rtol=1e-5, atol=1e-6)

    shared = attention_graph(extra_reader=True)
    assert fuse_softmax(shared) == 0  # the probabilities are also a graph output: left alone
    assert [n.op_type for n in shared.graph] == ["Softmax", ALL_ROWS_OP, "MatMul"]


def test_auto_mean_export_fuses_softmax_and_runs_the_native_kernel_in_place(library, counters, tmp_path,
                                                                            monkeypatch, capsys):
    """`auto` gives mean pooling's portable graph the fused ops; the native kernel runs in place once
    per calibrated layer, and the embeddings match the function body and the softmax placement."""
    from attncal.cli import main
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.runtime import Encoder, oplib
    from attncal.synthetic import save_synthetic_model, synthetic_text

    model = save_synthetic_model("bert", tmp_path / "m", seed=4, max_positions=256)
    cfg = CalibrationConfig(pooling="mean", basket_size=8, strength=0.7)
    base = dict(config=cfg, exporter="torchscript", optimized=False)
    meta = export(str(model), tmp_path / "fused", ExportOptions(**base), quiet=True)
    export(str(model), tmp_path / "softmax", ExportOptions(placement="softmax", check=False, **base), quiet=True)
    assert meta["graphs"]["onnx/model.onnx"]["placement"] == "fused-softmax"
    assert meta["op_type"] == SOFTMAX_ALL_ROWS_OP and meta["parity"]["ok"] and meta["parity"]["max_abs"] <= 1e-5
    graph = onnx.load(str(tmp_path / "fused/onnx/model.onnx"))
    ops = [n.op_type for n in graph.graph.node if n.domain == DOMAIN]
    n_layers = len(meta["calibrated_layers"])
    assert ops == [SOFTMAX_ALL_ROWS_OP] * n_layers
    assert sum(n.op_type == "Softmax" for n in graph.graph.node) + n_layers == meta["num_layers"]  # absorbed

    texts = [synthetic_text(n, seed=i) for i, n in enumerate([15, 70, 140, 220])]
    c0, i0 = counters["compute"](), counters["inplace"]()
    native = Encoder(tmp_path / "fused", providers=["CPUExecutionProvider"], custom_op_library=library).encode(texts)
    assert counters["compute"]() - c0 == n_layers and counters["inplace"]() - i0 == n_layers
    monkeypatch.setenv(oplib.NATIVE_ENV, "0")
    body = Encoder(tmp_path / "fused", providers=["CPUExecutionProvider"]).encode(texts)
    separate = Encoder(tmp_path / "softmax", providers=["CPUExecutionProvider"]).encode(texts)
    assert float(np.abs(native - body).max()) <= 1e-6
    assert float(np.abs(body - separate).max()) == 0.0  # the inlined body is the softmax placement's graph

    assert main(["inspect", str(tmp_path / "fused")]) == 0
    assert "placement fused-softmax" in capsys.readouterr().out


def test_subnormal_basket_mass_gives_the_oracle_not_inf(library):
    """Regression: a basket whose float32 mass is subnormal (keys far below a dominant one) made
    1 / mass overflow: inf in the efficient path and the native kernel, NaN across the whole row in
    the function body (inf * 0 in the membership MatMul).  Every implementation must now match the
    oracle, separate ops on the probabilities and fused ops on the scores alike.  The fused body's softmax
    is ONNX Runtime's Softmax, which flushes subnormal results to zero on AVX2-only CPUs (onnxruntime 1.32
    on a Zen 3 host gives [0.5, 0.5, 0, 0, 0, 0] here; with AVX-512 it keeps them): that body must match
    the oracle of the probabilities its Softmax gives."""
    from attncal.calibration import apply, reference

    cfg = CalibrationConfig(pooling="cls", basket_size=2, strength=0.5, variant="uniform")
    scores = torch.tensor([0.0, 0.0, -88.0, -89.0, -95.0, -101.0], dtype=torch.float32).expand(1, 2, 6, 6).clone()
    mask = torch.ones(1, 6, dtype=torch.int64)
    probs = torch.softmax(scores, -1)
    rc = cfg.resolve()
    assert rc.isolate_first and not rc.isolate_last  # content keys 1-5: baskets {1,2}, {3,4}, {5}; t = 4
    assert 0 < float(probs[0, 0, 0, 3:5].sum()) < 2.0 ** -126 and 0 < float(probs[0, 0, 0, 5]) < 2.0 ** -126
    ref = reference(probs.double(), mask, rc).numpy()  # the oracle of these float32 probabilities
    # each subnormal basket gets a full basket's share: lambda / t (+ (1 - lambda) * its tiny mass)
    assert float(ref[0, 0, 0, 3:5].sum()) == pytest.approx(0.5 / 4, rel=1e-6)
    assert float(ref[0, 0, 0, 5]) == pytest.approx(0.5 / 4, rel=1e-6)
    softmax = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "softmax",
                                [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(scores.shape))],
                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(scores.shape))])
    ort_probs = plain_session(helper.make_model(softmax, opset_imports=[helper.make_opsetid("", 17)])).run(
        None, {"x": scores.numpy()})[0]
    refs = {"fused body": reference(torch.from_numpy(ort_probs).double(), mask, rc).numpy()}
    got = {"efficient": apply(probs.clone(), mask, cfg).numpy()}
    for name, fused in (("separate", False), ("fused", True)):
        spec = op_spec(cfg.resolve(), 0, fused_softmax=fused)
        feeds = {"scores" if fused else "probs": (scores if fused else probs).numpy(), "attention_mask": mask.numpy()}
        got[f"{name} body"] = plain_session(single_op_model(spec)).run(None, feeds)[0]
        got[f"{name} native"] = session(single_op_model(spec), library).run(None, feeds)[0]
    for name, out in got.items():
        assert np.all(np.isfinite(out)), name
        want = refs.get(name, ref)
        assert np.abs(out.astype(np.float64) - want).max() <= 1e-6, (name, out[0, 0, 0], want[0, 0, 0])


def test_native_fused_op_rejects_bad_shapes_by_name(library):
    """Wrong rank or a mask that does not match: an ORT error naming the fused op's `scores` input."""
    spec = op_spec(CalibrationConfig(pooling="mean").resolve(), 0, fused_softmax=True)
    node = helper.make_node(spec.op_type, ["scores", "attention_mask"], ["out"], domain=DOMAIN, **spec.attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None),
                                        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, None)],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, VERSION)],
                          functions=[make_function(spec.op_type, 18)])
    m.ir_version = 10
    sess = session(m, library)
    with pytest.raises(Exception, match=r"attncal: scores must have rank 4 \[B,H,Q,K\], got rank 3"):
        sess.run(None, {"scores": np.zeros((2, 3, 3), np.float32), "attention_mask": np.ones((2, 3), np.int64)})
    with pytest.raises(Exception, match=r"attention_mask must be \[B,K\]=\[1,3\], got \[1,4\]"):
        sess.run(None, {"scores": np.zeros((1, 2, 3, 3), np.float32), "attention_mask": np.ones((1, 4), np.int64)})
