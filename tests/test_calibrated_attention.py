"""The calibrated attention ops (PooledRowCalibratedAttention, AllRowsCalibratedAttention):
their contract and standard-ONNX function body, run by ONNX Runtime on the CPU, against the float64
oracle composed with the attention math (`attncal.calibration.oracle.attention_reference`: the
calibration oracle applied to the softmax of scale·Q·Kᵀ plus the additive mask, times V).

The native kernel: tests/test_calibrated_attention_kernel.py; the placement: tests/test_attention_placement.py."""

from __future__ import annotations

import random

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from attncal.calibration import CalibrationConfig
from attncal.calibration.config import MODE_EQUAL, MODE_FIXED, MODE_ORIGINAL
from attncal.calibration.oracle import attention_reference
from attncal.graphs.ops.contract import (ALL_ROWS_OP, ATTENTION_ALL_ROWS_OP, ATTENTION_OP_TYPES, ATTENTION_POOLED_OP,
                                         ATTRIBUTES, DOMAIN, OP_TYPES, POOLED_OP, SOFTMAX_ALL_ROWS_OP,
                                         SOFTMAX_POOLED_OP, VERSION, attention_op_spec, attribute_names, calibration_of,
                                         input_names, is_all_rows, is_attention, op_spec, resolved_from_attrs,
                                         takes_scores, with_attention)
from attncal.graphs.ops.contract import (FULL_ATTENTION, GEOMETRY_DEFAULTS, OPTIONAL_DEFAULTS, RELATIVE_BIAS_INPUT,
                                         ROW_SET_DEFAULTS, AttentionGeometry, geometry_from_attrs)
from attncal.graphs.ops.function_body import make_function
from attncal.graphs.ops.single_op import single_op_model
from support.cases import random_config
from support.masks import mixed_mask
from support.oracle_loop import (attention_oracle_errors, random_attention_batch, random_geometry,
                                 random_relative_bias, relative_table)
from support.tensors import plain_attention, random_qkv

LOWEST = float(np.finfo(np.float32).min)


def plain_session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def feeds(q, k, v, mask, table=None) -> dict:
    """The calibrated attention op's inputs (with the relative position bias table where there is one)."""
    out = {"query": q.numpy(), "key": k.numpy(), "value": v.numpy(), "attention_mask": mask.numpy()}
    if table is not None:
        out[RELATIVE_BIAS_INPUT] = table.numpy()
    return out


def random_attention_spec(rng: random.Random, baskets: list[int], max_heads: int, geometry: bool = False,
                          relative: bool = False):
    """(S, N, D, D_v, exact, scale, rc, spec, buckets): one random attribute set of a calibrated attention op, with
    a random GQA / window geometry (`random_geometry`; `geometry_from_attrs(spec.attrs)` reads it back) when
    `geometry`, and a relative position bias of `buckets` buckets (`random_relative_bias`; 0 = none) when
    `relative`.  `exact`: q and k on a grid with a power-of-two scale (or 1/sqrt(D) for D in 1, 4), so the
    float32 scores are exact (see `random_qkv`)."""
    S = rng.choice(baskets)
    N, D, D_v = rng.randint(1, max_heads), rng.randint(1, 8), rng.randint(1, 6)
    exact = rng.random() < 0.5
    scale = rng.choice([0.0, 0.125, 0.5, 1.0] if not exact or D in (1, 4) else [0.125, 0.5, 1.0])
    rc = random_config(rng, S).resolve()
    geo = random_geometry(rng, N) if geometry else FULL_ATTENTION
    geo, buckets = random_relative_bias(rng, geo) if relative else (geo, 0)
    spec = attention_op_spec(rc, layer=rng.randint(0, 30), num_heads=N, scale=scale, geometry=geo)
    return S, N, D, D_v, exact, scale, resolved_from_attrs(spec.op_type, spec.attrs), spec, buckets


def tally(seen: dict, rc, mask: torch.Tensor, S: int, dead, q1: bool, scale: float) -> None:
    """Count what one run of B items covered, into the keys of `seen` that it has."""
    B, K = mask.shape
    lengths = mask.sum(1)
    first, last = mask.argmax(1), K - 1 - mask.flip(1).argmax(1)
    content = lengths - rc.n_isolated
    counts = {
        "mean" if rc.all_rows else "last" if rc.pool_last else "cls": B,
        "left": int(((mask[:, -1] == 1) & (mask[:, 0] == 0)).sum()),
        "right": int(((mask[:, 0] == 1) & (mask[:, -1] == 0)).sum()),
        "holes": int(((last - first + 1 != lengths) & (lengths > 0)).sum()),
        "empty_item": int((lengths == 0).sum()),
        "partial": int(((content > 0) & (content % S != 0)).sum()),
        "empty_basket": B * (dead is not None), "q1": B * q1, "lambda0": B * (rc.strength == 0),
        "lambda1": B * (rc.strength == 1), "skip_short": B * rc.skip_short, "scale0": B * (scale == 0),
        "no_iso": B * (rc.n_isolated == 0),
    }
    for enabled, mode, name in ((rc.isolate_first, rc.first_mode, "iso_first"),
                                (rc.isolate_last, rc.last_mode, "iso_last")):
        if enabled:
            counts[name] = B
            counts[{MODE_EQUAL: "equal", MODE_ORIGINAL: "original", MODE_FIXED: "fixed"}[mode]] = B
    for key, n in counts.items():
        if key in seen:
            seen[key] += n


# ------------------------------------------------------------------ the contract
def test_contract_names_inputs_and_attributes():
    assert OP_TYPES == (POOLED_OP, ALL_ROWS_OP, SOFTMAX_POOLED_OP, SOFTMAX_ALL_ROWS_OP)  # unchanged
    assert ATTENTION_OP_TYPES == (ATTENTION_POOLED_OP, ATTENTION_ALL_ROWS_OP)
    assert ATTENTION_OP_TYPES == ("PooledRowCalibratedAttention", "AllRowsCalibratedAttention")
    assert [with_attention(o) for o in OP_TYPES] == list(ATTENTION_OP_TYPES) * 2
    assert [calibration_of(o) for o in ATTENTION_OP_TYPES] == [POOLED_OP, ALL_ROWS_OP]
    assert [is_all_rows(o) for o in ATTENTION_OP_TYPES] == [False, True]
    assert not any(takes_scores(o) for o in ATTENTION_OP_TYPES) and all(map(is_attention, ATTENTION_OP_TYPES))
    assert not any(is_attention(o) for o in OP_TYPES)
    for op in ATTENTION_OP_TYPES:
        assert input_names(op) == ["query", "key", "value", "attention_mask"]
        names = attribute_names(op)
        assert names == attribute_names(calibration_of(op)) + ["num_heads", "scale", *GEOMETRY_DEFAULTS]
        assert set(names) <= set(ATTRIBUTES)
    for op in OP_TYPES:  # the other ops do not get the attention attributes
        assert not {"num_heads", "scale", *GEOMETRY_DEFAULTS} & set(attribute_names(op))
    rc = CalibrationConfig(pooling="last", variant="cls-hard").resolve()
    spec = attention_op_spec(rc, 3, num_heads=4, scale=0.125)
    assert spec.op_type == ATTENTION_POOLED_OP
    # The geometry is written only where it differs from its defaults.
    assert spec.attrs == {**op_spec(rc, 3).attrs, "num_heads": 4, "scale": 0.125}
    assert geometry_from_attrs(spec.attrs) == FULL_ATTENTION
    geo = AttentionGeometry(num_kv_heads=2, window_left=5, window_right=0)
    spec = attention_op_spec(rc, 3, num_heads=4, geometry=geo)
    assert spec.attrs == {**op_spec(rc, 3).attrs, "num_heads": 4, "scale": 0.0, "num_kv_heads": 2,
                          "window_left": 5, "window_right": 0}
    assert geometry_from_attrs(spec.attrs) == geo
    assert resolved_from_attrs(spec.op_type, spec.attrs) == rc
    assert attention_op_spec(CalibrationConfig(pooling="mean").resolve(), 0, 2).op_type == ATTENTION_ALL_ROWS_OP
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        attention_op_spec(rc, 0, 0)
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads=4"):
        attention_op_spec(rc, 0, 4, geometry=AttentionGeometry(num_kv_heads=3))
    with pytest.raises(ValueError, match="window_left and window_right must be >= 0, or -1"):
        attention_op_spec(rc, 0, 4, geometry=AttentionGeometry(window_left=-2))
    with pytest.raises(ValueError, match="packed Q|K|V weight"):
        attention_op_spec(rc, 0, 4, projected=True, geometry=AttentionGeometry(num_kv_heads=2))
    with pytest.raises(ValueError, match="unknown calibration op 'CalibratedAttention'"):
        is_attention("CalibratedAttention")


def _op_types(nodes) -> list[str]:
    return [n.op_type for n in nodes]


@pytest.mark.parametrize("relative", [False, True], ids=["plain", "relative_bias"])
@pytest.mark.parametrize("op_type", ATTENTION_OP_TYPES)
@pytest.mark.parametrize("opset", [18, 20, 21])
def test_function_body_is_standard_onnx_reads_attributes_and_reuses_the_fused_body(op_type, opset, relative):
    pooling = "mean" if is_all_rows(op_type) else "cls"
    geo = AttentionGeometry(relative_max_distance=128 if relative else 0)
    model = single_op_model(attention_op_spec(CalibrationConfig(pooling=pooling).resolve(), 0, 2, geometry=geo),
                            opset=opset)
    onnx.checker.check_model(model, full_check=True)
    (fn,) = model.functions
    assert (fn.domain, fn.name) == (DOMAIN, op_type)
    assert list(fn.input) == ["query", "key", "value", "attention_mask"] + [RELATIVE_BIAS_INPUT] * relative
    assert list(fn.output) == ["context"]
    assert {o.domain: o.version for o in fn.opset_import} == {"": opset}
    assert all(n.domain == "" for n in fn.node)  # standard ONNX only
    refs = {a.ref_attr_name for n in fn.node for a in n.attribute if a.ref_attr_name}
    # The geometry and marked-row attributes are optional: the function carries their defaults.  The body without
    # the bias input has no use for its attribute, the pooled op none for the marked rows'.
    defaults = {a.name: helper.get_attribute_value(a) for a in fn.attribute_proto}
    assert defaults == OPTIONAL_DEFAULTS
    unread = ({"layer"} | ({"relative_max_distance"} if not relative else set())
              | (set(ROW_SET_DEFAULTS) if not is_all_rows(op_type) else set()))
    assert refs == (set(fn.attribute) | set(defaults)) - unread and {"num_heads", "scale"} <= refs
    # The middle of the body is the Softmax-fused op's body, node for node (minus its final Identity).
    fused = _op_types(make_function(SOFTMAX_ALL_ROWS_OP if is_all_rows(op_type) else SOFTMAX_POOLED_OP,
                                    opset).node)[:-1]
    ops = _op_types(fn.node)
    start = ops.index("Softmax")
    assert ops.count("Softmax") == 1 and ops[start:start + len(fused)] == fused
    tail = [o for o in ops[start + len(fused):] if o != "Constant"]
    assert tail == ["MatMul", "Transpose", "Mul", "Concat", "Reshape", "CastLike", "Identity"]  # ·V, merge (N·D_v)
    # The Softmax reads the float32 masked scores: Add(MatMul(Mul(q, scale), kᵀ), bias), with the relative
    # position bias (a Gather of the table) added between them.
    producer = {o: n for n in fn.node for o in n.output}
    softmax = fn.node[start]
    add = producer[softmax.input[0]]
    assert add.op_type == "Add"
    if relative:
        add = producer[add.input[0]]
        assert add.op_type == "Add" and "Gather" in _op_types(fn.node)
    assert producer[add.input[0]].op_type == "MatMul"


# ------------------------------------------------------------------ against the oracle
@pytest.mark.parametrize("float16,n_configs,tol", [(False, 80, 1e-6), (True, 40, 2e-3)], ids=["fp32", "fp16"])
def test_function_body_matches_oracle(float16, n_configs, tol):
    """A case is one batch item (its own mask, padding side, length; sometimes none valid) under one
    attribute set; every context row is compared with the float64 oracle, calibrated or not.  Random
    weight modes, isolation, pooling (cls, last, mean), strength (0 and 1 included), skip_short,
    basket sizes, heads, head sizes, scale (0 = 1/sqrt(D)), Q = 1 for the pooled op, and keys whose
    probability is exactly 0 (empty baskets).

    Half the attribute sets get exact float32 scores (q, k on a grid, power-of-two scale): there the
    bound is `tol`.  Elsewhere it is `tol` plus 12·δ·max|v| (`score_rounding`): the contract computes
    the scores in float32, so their rounding (δ up to ~5e-6 for the largest logits here, |s| ≈ 50)
    is part of the op; the rest of the body (softmax, calibration, ·V) must stay within `tol`."""
    rng = random.Random(2001 + float16)
    gen = torch.Generator().manual_seed(20)
    dtype = torch.float16 if float16 else torch.float32
    cases, worst, runs, worst_ratio, worst_exact = 0, 0.0, 0, 0.0, 0.0
    seen = {k: 0 for k in ("cls", "last", "mean", "left", "right", "empty_item", "partial", "empty_basket", "q1",
                           "lambda0", "lambda1", "skip_short", "no_iso", "iso_first", "iso_last", "equal",
                           "original", "fixed", "scale0", "exact_scores")}
    seen.update(gqa=0, window=0, relative=0)
    for _ in range(n_configs):
        S, N, D, D_v, exact, scale, rc, spec, buckets = random_attention_spec(
            rng, [1, 2, 3, 4, 5, 8], max_heads=4, geometry=rng.random() < 0.5, relative=rng.random() < 0.3)
        geo = geometry_from_attrs(spec.attrs)
        sess = plain_session(single_op_model(spec, opset=rng.choice([18, 20]), float16=float16))
        for _ in range(3):
            K = rng.randint(1, 16 if rc.all_rows else 40)
            B = rng.randint(4, 12)
            mask, q1, dead, q, k, v = random_attention_batch(rng, gen, rc, S, N, D, D_v, exact, dtype, B, K, holes=0.0,
                                                             geometry=geo)
            table = relative_table(gen, buckets, N, dtype) if geo.relative else None
            (out,) = sess.run(None, feeds(q, k, v, mask, table))
            err, rounding = attention_oracle_errors(out, q, k, v, mask, rc, N, scale, exact, float16, geo, table)
            seen["gqa"] += B * (geo.num_kv_heads not in (0, N))
            seen["window"] += B * geo.windowed
            seen["relative"] += B * geo.relative
            bound = tol + rounding
            assert np.all(err <= bound), (float(err.max()), spec, K, int(np.argmax(err / bound)), bound.max())
            worst, cases, runs = max(worst, float(err.max())), cases + B, runs + 1
            worst_ratio = max(worst_ratio, float((err / bound).max()))
            if exact:
                worst_exact = max(worst_exact, float(err.max()))
                seen["exact_scores"] += B
            tally(seen, rc, mask, S, dead, q1, scale)
    print(f"\ncalibrated attention body {'fp16' if float16 else 'fp32'}: {cases} cases in {runs} runs, "
          f"max abs err {worst:.3g} (at most {worst_ratio:.2f} of the bound; {worst_exact:.3g} with exact "
          f"float32 scores), {seen}")
    assert min(seen.values()) >= (20 if float16 else 40), seen


# ------------------------------------------------------------------ edge cases
MASK = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [0] * 7, [0] * 2 + [1] * 5], dtype=torch.int64)


@pytest.mark.parametrize("float16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pooling", ["cls", "last", "mean"])
def test_fully_masked_item_gives_mean_of_value_and_padding_rows_plain_attention(pooling, float16):
    """Item 2 has no valid key: every row's scores are float32's lowest value, its softmax is the
    uniform row, its context the mean of V over all keys (not 0, not NaN), never calibrated.  The
    padding query rows of items 1 and 3 are plain attention over their valid keys."""
    rc = CalibrationConfig(pooling=pooling, basket_size=2, strength=0.8, skip_short=False).resolve()
    N, D, D_v = 2, 3, 4
    spec = attention_op_spec(rc, 0, N)
    dtype = torch.float16 if float16 else torch.float32
    tol = 2e-3 if float16 else 1e-6
    q, k, v = random_qkv(torch.Generator().manual_seed(5), 4, 7, 7, N, D, D_v, dtype, temp=2.0)
    (out,) = plain_session(single_op_model(spec, float16=float16)).run(None, feeds(q, k, v, MASK))
    out = out.astype(np.float64)
    ref = attention_reference(q, k, v, MASK, rc, N).numpy()
    assert np.all(np.isfinite(out)) and np.abs(out - ref).max() <= tol
    mean_v = v[2].double().mean(0).numpy()  # [N*D_v]: per head, the mean over all 7 keys
    assert np.abs(out[2] - mean_v[None, :]).max() <= tol
    assert np.abs(ref[2] - mean_v[None, :]).max() <= 1e-12
    plain = plain_attention(q, k, v, MASK, N).numpy()  # no calibration, over the valid keys, float64
    for b, rows in ((1, [4, 5, 6]), (3, [0, 1])):  # padding query rows
        assert np.abs(out[b, rows] - plain[b, rows]).max() <= tol
    calibrated = {"cls": [(0, 0), (1, 0), (3, 2)], "last": [(0, 6), (1, 3), (3, 6)],
                  "mean": [(0, 3), (1, 2), (3, 4)]}[pooling]
    for b, row in calibrated:  # and the calibration is on: the selected rows are not plain attention
        assert np.abs(out[b, row] - plain[b, row]).max() > 1e-2


@pytest.mark.parametrize("op_type", ATTENTION_OP_TYPES)
def test_nan_scores_give_nan_context_rows_only(op_type):
    """A NaN in one head of one query row: that head's context row is NaN at every column (Softmax of a
    row holding a NaN is NaN; calibrated or not), nothing else is: the other head of the same row and
    every other row match the oracle.  A NaN in a masked key: every row of that item and head."""
    pooling = "mean" if is_all_rows(op_type) else "cls"
    rc = CalibrationConfig(pooling=pooling, basket_size=2, strength=0.8, skip_short=False).resolve()
    N, D, D_v = 2, 3, 4
    q, k, v = random_qkv(torch.Generator().manual_seed(6), 4, 7, 7, N, D, D_v, torch.float32, temp=2.0)
    ref = attention_reference(q, k, v, MASK, rc, N).numpy()
    row = 2 if is_all_rows(op_type) else 0  # item 3's first valid token: calibrated by either op
    q[3, row, 1] = float("nan")  # head 0
    (out,) = plain_session(single_op_model(attention_op_spec(rc, 0, N))).run(None, feeds(q, k, v, MASK))
    assert np.all(np.isnan(out[3, row, :D_v]))
    nan = np.zeros(out.shape, bool)
    nan[3, row, :D_v] = True
    assert np.all(np.isfinite(out[~nan])) and np.abs(out[~nan] - ref[~nan]).max() <= 1e-6
    # A NaN in a masked key of item 1 (head 1): every row of item 1 meets it (NaN + lowest = NaN).
    k[1, 5, D + 1] = float("nan")
    (out,) = plain_session(single_op_model(attention_op_spec(rc, 0, N))).run(None, feeds(q, k, v, MASK))
    nan[1, :, D_v:] = True
    assert np.all(np.isnan(out[nan])) and np.abs(out[~nan] - ref[~nan]).max() <= 1e-6


def test_q1_pooled_row_is_the_pooling_row_of_the_full_op():
    """S_q = 1 (row placement's single query): the context equals the pooling row of the full op."""
    for pooling in ("cls", "last"):
        rc = CalibrationConfig(pooling=pooling, basket_size=2, strength=0.9, skip_short=False).resolve()
        spec = attention_op_spec(rc, 0, 2, scale=0.3)
        q, k, v = random_qkv(torch.Generator().manual_seed(7), 4, 7, 7, 2, 4, 3, torch.float32, temp=2.0)
        sess = plain_session(single_op_model(spec))
        (full,) = sess.run(None, feeds(q, k, v, MASK))
        pool = [int(m.nonzero()[-1 if pooling == "last" else 0]) if m.any() else 0 for m in MASK]
        q1 = torch.stack([q[b, p] for b, p in enumerate(pool)])[:, None]
        (one,) = sess.run(None, feeds(q1, k, v, MASK))
        assert one.shape == (4, 1, 6)
        ref = attention_reference(q1, k, v, MASK, rc, 2, 0.3).numpy()
        assert np.abs(one - ref).max() <= 1e-6
        for b, p in enumerate(pool):
            if MASK[b].any():
                assert np.abs(one[b, 0] - full[b, p]).max() <= 1e-6


def test_node_copied_with_other_attributes_computes_its_own_contract():
    """Two nodes with different attributes (num_heads and scale included) share one FunctionProto."""
    cfg_a = CalibrationConfig(pooling="mean", basket_size=2, strength=0.9, isolate_first=True,
                              first_weight="original")
    cfg_b = CalibrationConfig(pooling="mean", basket_size=3, strength=0.4, isolate_last=True, last_weight=0.2,
                              skip_short=False)
    spec_a = attention_op_spec(cfg_a.resolve(), 0, num_heads=2)
    spec_b = attention_op_spec(cfg_b.resolve(), 1, num_heads=3, scale=0.2)
    names = input_names(ATTENTION_ALL_ROWS_OP)
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node(ATTENTION_ALL_ROWS_OP, names, ["a"], domain=DOMAIN, **spec_a.attrs),
         helper.make_node(ATTENTION_ALL_ROWS_OP, names, ["b"], domain=DOMAIN, **spec_b.attrs)], "two",
        [helper.make_tensor_value_info("query", f, ["B", "S", 12]), helper.make_tensor_value_info("key", f, ["B", "S", 12]),
         helper.make_tensor_value_info("value", f, ["B", "S", 6]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S"])],
        [helper.make_tensor_value_info("a", f, ["B", "S", 6]), helper.make_tensor_value_info("b", f, ["B", "S", 6])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, VERSION)],
                              functions=[make_function(ATTENTION_ALL_ROWS_OP, 18)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    gen = torch.Generator().manual_seed(8)
    mask = mixed_mask(random.Random(8), 5, 16, holes=0.0)
    q, k = torch.randn(5, 16, 12, generator=gen) * 2, torch.randn(5, 16, 12, generator=gen)
    v = torch.rand(5, 16, 6, generator=gen) * 4 - 2
    a, b = plain_session(model).run(None, feeds(q, k, v, mask))
    assert np.abs(a - attention_reference(q, k, v, mask, cfg_a, 2).numpy()).max() <= 1e-6
    assert np.abs(b - attention_reference(q, k, v, mask, cfg_b, 3, 0.2).numpy()).max() <= 1e-6
    assert np.abs(a - b).max() > 1e-2


def test_strength_0_is_ort_multi_head_attention_on_the_same_inputs():
    """The layout is ORT MultiHeadAttention's (unpacked Q, K, V as [B,S,N*D], key padding mask
    [B,S_k]): with strength 0 and a valid key in every item, both give the same context."""
    rc = CalibrationConfig(pooling="mean", strength=0.0).resolve()
    N, D, D_v, S = 3, 4, 2, 9
    mask = torch.ones(3, S, dtype=torch.int64)
    mask[1, 6:] = 0
    mask[2, :3] = 0
    q, k, v = random_qkv(torch.Generator().manual_seed(9), 3, S, S, N, D, D_v, torch.float32, temp=2.0)
    (ours,) = plain_session(single_op_model(attention_op_spec(rc, 0, N, scale=0.4))).run(None, feeds(q, k, v, mask))
    f = TensorProto.FLOAT
    mha = helper.make_node("MultiHeadAttention", ["query", "key", "value", "", "key_padding_mask"], ["context"],
                           domain="com.microsoft", num_heads=N, scale=0.4)
    g = helper.make_graph([mha], "mha", [helper.make_tensor_value_info("query", f, ["B", "S", N * D]),
                                         helper.make_tensor_value_info("key", f, ["B", "S", N * D]),
                                         helper.make_tensor_value_info("value", f, ["B", "S", N * D_v]),
                                         helper.make_tensor_value_info("key_padding_mask", TensorProto.INT32,
                                                                       ["B", "S"])],
                          [helper.make_tensor_value_info("context", f, ["B", "S", N * D_v])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    (theirs,) = plain_session(m).run(None, {"query": q.numpy(), "key": k.numpy(), "value": v.numpy(),
                                            "key_padding_mask": mask.numpy().astype(np.int32)})
    assert np.abs(ours - theirs).max() <= 1e-5
