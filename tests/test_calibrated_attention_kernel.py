"""The native CPU kernel of the calibrated attention ops (plugins/kernels/cpu/calibrated_attention.h
through the ORT library): >= 20,000 random cases per dtype against the float64 oracle, every weight
mode and isolation, both padding sides and holes, partial and empty baskets, Q = 1, items with no
valid key, fp16; bit-identical results at 1, 2 and 4 threads; NaN rules; clear refusals of bad
shapes and attributes.  A case is one batch item under one attribute set (all heads and rows)."""

from __future__ import annotations

import ctypes
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from attncal.calibration import CalibrationConfig
from attncal.calibration.oracle import attention_reference
from attncal.graphs.ops.contract import AttentionGeometry, attention_op_spec, geometry_from_attrs
from attncal.graphs.ops.single_op import single_op_model
from attncal.runtime import oplib
from support.computed_once import computed_once
from support.cpu import run_on_each_path
from support.masks import mixed_mask
from support.oracle_loop import (attention_oracle_errors, kv_heads, random_attention_batch, relative_table,
                                 run_oracle_loop)
from support.tensors import random_qkv
from test_calibrated_attention import feeds, random_attention_spec, tally
from test_native_kernel import cpu_path, library  # noqa: F401  (the built-library and CPU-path fixtures)


@pytest.fixture(scope="module")
def attention_count(library):
    fn = ctypes.CDLL(str(library)).attncal_debug_attention_count
    fn.restype, fn.argtypes = ctypes.c_uint64, []
    return fn


def session(model: onnx.ModelProto, library: Path, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


GEOMETRY_TALLIES = ("gqa", "mqa", "causal", "sliding_causal", "sliding", "one_bound")


def tally_geometry(seen: dict, geo: AttentionGeometry, N: int, B: int) -> None:
    n_kv = geo.num_kv_heads or N
    kind = {(True, True): "sliding", (False, True): "one_bound", (True, False): "one_bound"}
    seen["gqa"] += B * (1 < n_kv < N)
    seen["mqa"] += B * (n_kv == 1 < N)
    if geo.relative:
        seen["relative"] += B
    if geo.windowed:
        left, right = geo.window_left >= 0, geo.window_right >= 0
        name = ("causal" if not left else "sliding_causal") if geo.window_right == 0 else kind[(left, right)]
        seen[name] += B


@pytest.mark.parametrize("geometry", [False, True, "relative"], ids=["mha", "geometry", "relative_bias"])
@pytest.mark.parametrize("float16,tol", [(False, 0.0), (True, 2e-3)], ids=["fp32", "fp16"])
def test_kernel_matches_oracle_on_20000_cases(library, attention_count, float16, tol, geometry):
    """Each batch runs on every instruction-set path this CPU runs, against one float64 oracle.  The bound is
    `tol` plus the float32 rounding of the scores (`score_rounding`, as for the function body: the contract
    computes the scores in float32, so their rounding is part of the op; zero for the half of the attribute sets
    whose scores are exact in float32) plus that of the kernel's sums (`accumulation_bound`: derived for any
    order of summation, so it holds for every path and every GEMM, OpenBLAS's per-CPU kernels included).  The
    largest error and its ratio to the bound are printed per path.  `geometry`: every attribute set also draws
    grouped key/value heads and a window (`random_geometry`); "relative": those and a relative position bias
    (`random_relative_bias`)."""
    rng = random.Random(2201 + float16 + 10 * bool(geometry) + 20 * (geometry == "relative"))
    gen = torch.Generator().manual_seed(22)
    dtype = torch.float16 if float16 else torch.float32
    paths, widest = oplib.cpu_paths(library), oplib.cpu_path(library)
    before = attention_count()
    worst = {p: [0.0, 0.0, 0.0] for p in paths}  # per path: largest error, with exact scores, error / bound

    def configure():
        S, N, D, D_v, exact, scale, rc, spec, buckets = random_attention_spec(
            rng, [1, 2, 3, 4, 5, 8, 16], max_heads=4 if geometry else 2, geometry=geometry,
            relative=geometry == "relative")
        # Without the function body: only the native kernel can run the node (the count below says it did).
        sess = session(single_op_model(spec, float16=float16, with_function=False), library, threads=2)
        return S, N, D, D_v, exact, scale, rc, spec, buckets, sess

    def run(config, seen):
        S, N, D, D_v, exact, scale, rc, spec, buckets, sess = config
        geo = geometry_from_attrs(spec.attrs)
        # Long rows now and then: more than one block of query rows per head (the kernel's unit; the
        # per-row float64 oracle makes them slow, and test_threads_give_identical_bits has more).
        # Mean pooling calibrates every row, cls/last one: the oracle's cost sets the lengths.
        K = rng.randint(1, 12 if rc.all_rows else 32) if rng.random() < 0.98 else rng.randint(280, 320)
        B = rng.randint(8, 24) if K < 100 else 1
        mask, q1, dead, q, k, v = random_attention_batch(rng, gen, rc, S, N, D, D_v, exact, dtype, B, K, holes=0.15,
                                                         geometry=geo)
        table = relative_table(gen, buckets, N, dtype) if geo.relative else None
        outs = []
        for path in paths:
            oplib.set_cpu_path(library, path)
            outs.append(sess.run(None, feeds(q, k, v, mask, table))[0])
        oplib.set_cpu_path(library, widest)
        errs, rounding = attention_oracle_errors(outs, q, k, v, mask, rc, N, scale, exact, float16, geo, table,
                                                 sums=True)
        for path, err in zip(paths, errs):
            assert np.all(err <= tol + rounding), (path, float(err.max()), spec, K, int(np.argmax(err - rounding)))
            w = worst[path]
            w[0], w[2] = max(w[0], float(err.max())), max(w[2], float((err / (tol + rounding)).max()))
            w[1] = max(w[1], float(err.max())) if exact else w[1]
        seen["exact_scores"] += B * exact
        seen["multi_block"] += B * (K >= 280)
        tally(seen, rc, mask, S, dead, q1, scale)
        if geometry:
            tally_geometry(seen, geo, N, B)
        return B, float(max(e.max() for e in errs))

    loop = run_oracle_loop(20000, configure, run, runs_per_config=3, seen=(
        "cls", "last", "mean", "left", "right", "holes", "empty_item", "partial", "empty_basket", "q1", "lambda0",
        "skip_short", "iso_first", "iso_last", "equal", "original", "fixed", "scale0", "exact_scores", "multi_block",
        *(GEOMETRY_TALLIES if geometry else ()), *(("relative",) if geometry == "relative" else ())))
    assert attention_count() - before == loop.runs * len(paths), "every run must execute the native kernel"
    for path, (err, exact_err, ratio) in worst.items():
        print(f"\ncalibrated attention kernel {'fp16' if float16 else 'fp32'}, {path} path: {loop.cases} cases in "
              f"{loop.runs} runs, max abs err {err:.3g} ({exact_err:.3g} with exact float32 scores), largest "
              f"error / bound {ratio:.3g}")
    print(loop.seen)
    seen = loop.seen
    multi_block = seen.pop("multi_block")
    if geometry == "relative":
        assert seen.pop("q1") == 0  # a relative position bias needs S_q == S_k
    assert min(seen.values()) >= 40 and multi_block >= 10, (seen, multi_block)


@pytest.mark.parametrize("float16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_threads_give_identical_bits(library, cpu_path, float16, pooling):
    """1, 2 and 4 intra-op threads give the same bits: long rows (several blocks of query rows per
    head), holes, both padding sides."""
    rc = CalibrationConfig(pooling=pooling, basket_size=16, variant="cls-soft").resolve()
    spec = attention_op_spec(rc, 0, num_heads=3)
    gen = torch.Generator().manual_seed(4)
    B, K = 3, 1100
    mask = mixed_mask(random.Random(6), B, K)
    mask[0] = 1
    q, k, v = random_qkv(gen, B, K, K, 3, 8, 8, torch.float16 if float16 else torch.float32, temp=2.0)
    outs = [session(single_op_model(spec, float16=float16), library, t).run(None, feeds(q, k, v, mask))[0]
            for t in (1, 2, 4)]
    for o in outs[1:]:
        assert np.array_equal(o.view(np.uint8), outs[0].view(np.uint8))
    ref = computed_once(attention_reference, q, k, v, mask, rc, 3, 0.0)  # the same on every path
    assert np.abs(outs[0].astype(np.float64) - ref).max() <= (2e-3 if float16 else 1e-5)


@pytest.mark.parametrize("pooling,K,geometry,float16", [
    ("cls", 2100, AttentionGeometry(), False),  # key tiles, packed in panels of 32 keys or of 16
    ("mean", 300, AttentionGeometry(), False),  # whole-row blocks, every row calibrated
    ("last", 1100, AttentionGeometry(num_kv_heads=1, window_right=0), False),  # causal MQA: a shared tile store
    ("cls", 1100, AttentionGeometry(relative_max_distance=64), True),  # a relative position bias, float16
], ids=["tiles", "blocks", "causal-mqa", "relative-fp16"])
def test_the_fma_paths_give_the_same_bits(library, pooling, K, geometry, float16):
    """The AVX-512 and AVX2 paths fuse the same multiply-adds and sum in the same order (plugins/kernels/cpu/isa.h),
    so they give the same bits, whatever their panel widths (32 and 16 keys)."""
    if not {"avx512", "avx2"} <= set(oplib.cpu_paths(library)):
        pytest.skip("needs a CPU that runs both the AVX-512 and the AVX2 path")
    rc = CalibrationConfig(pooling=pooling, basket_size=64).resolve()
    spec = attention_op_spec(rc, 0, num_heads=4, geometry=geometry)
    gen = torch.Generator().manual_seed(27)
    q, k, v = random_qkv(gen, 2, K, K, 4, 16, 16, torch.float16 if float16 else torch.float32, temp=2.0)
    k, v = kv_heads(k, 4, geometry), kv_heads(v, 4, geometry)
    mask = mixed_mask(random.Random(7), 2, K)
    table = relative_table(gen, 32, 4, torch.float16 if float16 else torch.float32) if geometry.relative else None
    widest = oplib.cpu_path(library)
    outs = []
    try:
        for path in ("avx512", "avx2"):
            oplib.set_cpu_path(library, path)
            sess = session(single_op_model(spec, float16=float16), library, threads=2)
            outs.append(sess.run(None, feeds(q, k, v, mask, table))[0])
    finally:
        oplib.set_cpu_path(library, widest)
    assert np.array_equal(outs[0].view(np.uint8), outs[1].view(np.uint8)), np.abs(outs[0] - outs[1]).max()


def test_nan_in_a_key_or_query_stays_in_its_item_and_rows(library, cpu_path):
    """Contract: a NaN in a query makes that row's context NaN; a NaN in any key of an item (masked keys
    included) every row of that item and head; a NaN in value that column of the head's context in every
    row (0·NaN is NaN); other items stay finite."""
    rc = CalibrationConfig(pooling="mean", basket_size=2).resolve()
    spec = attention_op_spec(rc, 0, num_heads=2)
    gen = torch.Generator().manual_seed(8)
    q, k, v = random_qkv(gen, 4, 6, 6, 2, 3, 3, torch.float32, temp=1.0)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 6, [0] * 2 + [1] * 4])
    q[0, 2, 0] = float("nan")  # item 0, row 2, head 0
    k[1, 5, 3] = float("nan")  # item 1, a masked key, head 1
    v[3, 4, 0] = float("nan")  # item 3, head 0's values
    (out,) = session(single_op_model(spec), library).run(None, feeds(q, k, v, mask))
    nan = np.isnan(out)
    assert nan[0, 2, :3].all() and not nan[0, 2, 3:].any() and not nan[0, :2].any() and not nan[0, 3:].any()
    assert nan[1, :, 3:].all() and not nan[1, :, :3].any()
    assert not nan[2].any()
    assert nan[3, :, 0].all() and not nan[3, :, 1:].any()


@pytest.mark.parametrize("shapes,attrs,message", [
    (((2, 5, 6), (2, 5, 6), (2, 5, 6), (2, 4)), {}, "attention_mask must be [B,S_k]=[2,5], got [2,4]"),
    (((2, 5, 6), (2, 5, 6), (2, 5, 6, 1), (2, 5)), {}, "Invalid rank for input: value"),  # ORT's own check
    (((2, 5, 6), (2, 5, 4), (2, 5, 6), (2, 5)), {}, "key's 2 heads of the same D (num_kv_heads)"),
    (((2, 5, 7), (2, 5, 7), (2, 5, 6), (2, 5)), {}, "query's last dimension must be num_heads=2 heads of D"),
    (((2, 5, 6), (2, 5, 6), (2, 5, 6), (2, 5)), {"num_kv_heads": 1}, "key's 1 heads of the same D"),
    (((2, 5, 6), (2, 5, 3), (2, 5, 6), (2, 5)), {"num_kv_heads": 3}, "num_kv_heads must divide num_heads=2"),
    (((2, 5, 6), (2, 5, 6), (2, 5, 6), (2, 5)), {"window_left": -2}, "must be >= 0, or -1 for no limit"),
    (((2, 1, 6), (2, 5, 6), (2, 5, 6), (2, 5)), {}, "AllRowsCalibratedAttention needs S_q == S_k"),
    (((2, 5, 6), (2, 5, 6), (2, 5, 6), (2, 5)), {"num_heads": 0}, "num_heads must be >= 1"),
    (((2, 5, 6), (2, 5, 6), (2, 5, 6), (2, 5)), {"scale": -1.0}, "scale must be finite and >= 0"),
    (((2, 5, 6), (2, 5, 6), (2, 5, 6), (2, 5)), {"basket_size": 0}, "basket_size must be >= 1"),
])
def test_bad_shapes_and_attributes_are_refused_with_the_reason(library, shapes, attrs, message):
    spec = attention_op_spec(CalibrationConfig(pooling="mean", basket_size=2).resolve(), 0, num_heads=2)
    model = single_op_model(type(spec)(spec.op_type, {**spec.attrs, **attrs}), with_function=False)
    rng = np.random.default_rng(0)
    names = ("query", "key", "value", "attention_mask")
    inputs = {n: (np.ones(s, np.int64) if n == "attention_mask" else rng.standard_normal(s, dtype=np.float32))
              for n, s in zip(names, shapes)}
    with pytest.raises(Exception) as info:
        session(model, library).run(None, inputs)
    assert message in str(info.value), str(info.value)


def test_a_window_needs_self_attention(library):
    spec = attention_op_spec(CalibrationConfig(pooling="cls").resolve(), 0, num_heads=1,
                             geometry=AttentionGeometry(window_right=0))
    x = np.ones((1, 5, 4), np.float32)
    with pytest.raises(Exception, match="a window .* needs S_q == S_k"):
        session(single_op_model(spec, with_function=False), library).run(
            None, {"query": x[:, :1], "key": x, "value": x, "attention_mask": np.ones((1, 5), np.int64)})


@pytest.mark.parametrize("pooling,S_q,table,md,message", [
    ("mean", 5, (8, 3), 20, "relative_bias must be [num_buckets, N] with N = num_heads = 2, got [8,3]"),
    ("mean", 5, (3, 2), 20, "needs at least 4 buckets and relative_max_distance above num_buckets / 4; got 3 buckets"),
    ("mean", 5, (32, 2), 8, "above num_buckets / 4; got 32 buckets and 8"),
    ("cls", 1, (8, 2), 20, "a relative position bias needs S_q == S_k (self-attention); got S_q=1, S_k=5"),
    ("mean", 5, (8, 2), 0, "the relative_bias input needs relative_max_distance > 0"),
    ("mean", 5, None, 20, "relative_max_distance=20 needs the relative_bias input (the bias table)"),
])
def test_a_bad_relative_position_bias_is_refused_with_the_reason(library, pooling, S_q, table, md, message):
    """The table's shape, the bucket function's domain, self-attention, and the input given exactly when the
    attribute is set (the node edited after it was built, as a hand-made graph could be)."""
    spec = attention_op_spec(CalibrationConfig(pooling=pooling).resolve(), 0, num_heads=2,
                             geometry=AttentionGeometry(relative_max_distance=20))
    model = single_op_model(spec, with_function=False)
    node = model.graph.node[0]
    next(a for a in node.attribute if a.name == "relative_max_distance").i = md
    if table is None:
        del node.input[4]
        del model.graph.input[4]
    x = np.ones((1, 5, 6), np.float32)
    feeds = {"query": x[:, :S_q], "key": x, "value": x, "attention_mask": np.ones((1, 5), np.int64)}
    if table is not None:
        feeds["relative_bias"] = np.zeros(table, np.float32)
    with pytest.raises(Exception) as info:
        session(model, library).run(None, feeds)
    assert message in str(info.value), str(info.value)


def test_pooled_op_accepts_one_query_row(library):
    """Q = 1 (row placement's shape): the single query is the pooling token's row."""
    rc = CalibrationConfig(pooling="last", basket_size=2).resolve()
    spec = attention_op_spec(rc, 0, num_heads=2)
    gen = torch.Generator().manual_seed(9)
    q, k, v = random_qkv(gen, 3, 1, 7, 2, 4, 4, torch.float32, temp=1.0)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [0] * 3 + [1] * 4])
    (out,) = session(single_op_model(spec), library).run(None, feeds(q, k, v, mask))
    ref = attention_reference(q, k, v, mask, rc, 2, 0.0).numpy()
    assert out.shape == (3, 1, 8) and np.abs(out - ref).max() <= 1e-5


@pytest.mark.parametrize("pooling,causal", [("cls", False), ("last", False), ("last", True)],
                         ids=["cls", "last", "last-causal"])
def test_long_rows_over_key_tiles_match_the_oracle(library, cpu_path, pooling, causal):
    """Rows long enough for key tiles (the online softmax of the rows the calibration does not select, many
    tiles per row): right and left padding (whole tiles of masked keys before the first valid one), holes,
    an item with no valid key (uniform over its keys), and the NaN, +inf and -inf rules, against the float64
    oracle, at 1 and 2 threads bit for bit.  Causal: a non-finite key in a tile that the rows before it would
    skip reaches those rows as the contract says (its score plus the mask is still +inf or NaN)."""
    rc = CalibrationConfig(pooling=pooling, basket_size=128).resolve()
    geometry = AttentionGeometry(window_right=0) if causal else AttentionGeometry()
    spec = attention_op_spec(rc, 0, num_heads=2, geometry=geometry)
    gen = torch.Generator().manual_seed(21)
    B, K = 6, 2100
    q, k, v = random_qkv(gen, B, K, K, 2, 8, 8, torch.float32, temp=2.0)
    mask = torch.ones(B, K, dtype=torch.int64)
    mask[1, 1500:] = 0  # right padding
    mask[2, :1700] = 0  # left padding: the first tiles hold masked keys only
    mask[3, 300:900] = 0  # a hole
    mask[4] = 0  # no valid key
    q[0, 700, 3] = float("nan")  # item 0, one row of head 0
    k[5, 2000, 12] = float("inf")  # item 5, head 1: +inf or NaN scores in a late tile
    k[3, 5, 4] = float("-inf")  # item 3, head 0: +inf or -inf scores early on
    ref = computed_once(attention_reference, q, k, v, mask, rc, 2, 0.0, **vars(geometry))  # the same on every path
    outs = [session(single_op_model(spec), library, t).run(None, feeds(q, k, v, mask))[0] for t in (1, 2)]
    assert np.array_equal(outs[0].view(np.uint8), outs[1].view(np.uint8))
    out = outs[0]
    assert np.array_equal(np.isnan(out), np.isnan(ref)), np.argwhere(np.isnan(out) != np.isnan(ref))[:5]
    assert np.isnan(out[0, 700, :8]).all() and not np.isnan(out[0, :700]).any() and not np.isnan(out[0, 700, 8:]).any()
    for b, h in ((5, 1), (3, 0)):  # ±inf times a query's component: +inf (a NaN row) or -inf (the key drops out)
        rows = np.isnan(out[b, :, 8 * h:8 * h + 8]).all(-1)
        assert rows.any() and (~rows).any() and not np.isnan(out[b, :, 8 * (1 - h):8 * (2 - h)]).any(), b
    finite = ~np.isnan(ref)
    assert np.abs(out[finite] - ref[finite]).max() <= 1e-5
    np.testing.assert_allclose(out[4], np.broadcast_to(v[4].numpy().mean(0), out[4].shape), atol=1e-5)


@pytest.mark.parametrize("pooling,geometry", [
    ("last", AttentionGeometry(num_kv_heads=2, window_right=0)),  # causal GQA (Qwen3)
    ("cls", AttentionGeometry(num_kv_heads=1, window_left=300, window_right=300)),  # sliding both sides, MQA
    ("last", AttentionGeometry(window_left=500, window_right=0)),  # causal sliding window
    ("cls", AttentionGeometry(window_left=-1, window_right=700)),  # one bound only
    ("cls", AttentionGeometry(relative_max_distance=128)),  # T5 / MPNet: the relative position bias
    ("mean", AttentionGeometry(window_left=300, window_right=300, relative_max_distance=128)),
], ids=["causal-gqa", "sliding-mqa", "causal-sliding", "right-bound", "relative", "relative-sliding"])
def test_long_rows_with_windows_and_gqa_match_the_oracle(library, cpu_path, pooling, geometry):
    """Key tiles under a window: tiles outside every row's window are skipped, the others masked key by key;
    right and left padding (padding rows that see no valid key in their window: uniform over all keys), and
    an item whose query carries a component large enough that no skip can be bounded (its rows are computed
    again without skipping and must equal the skipped item's bit for bit).  A relative position bias (32
    buckets) is added in the tiles and the whole-row blocks alike, its largest value part of the skip bound.
    Against the float64 oracle, at 1 and 2 threads bit for bit."""
    rc = CalibrationConfig(pooling=pooling, basket_size=128).resolve()
    N = 4
    spec = attention_op_spec(rc, 0, num_heads=N, geometry=geometry)
    gen = torch.Generator().manual_seed(25)
    B, K = 4, 2100
    q, k, v = random_qkv(gen, B, K, K, N, 8, 8, torch.float32, temp=2.0)
    k, v = kv_heads(k, N, geometry), kv_heads(v, N, geometry)
    q[3], k[3], v[3] = q[0], k[0], v[0]
    k[:, :, 0::8] = 0.0  # component 0 of every key head: zero
    q[3, :, 0::8] = 1e19  # so item 3's scores equal item 0's, but no bound on a skipped tile holds
    mask = torch.ones(B, K, dtype=torch.int64)
    mask[1, 1500:] = 0
    mask[2, :1700] = 0
    table = relative_table(gen, 32, N, torch.float32) * 4 if geometry.relative else None
    ref = computed_once(attention_reference, q, k, v, mask, rc, N, 0.0, **vars(geometry), relative_bias=table)
    outs = [session(single_op_model(spec), library, t).run(None, feeds(q, k, v, mask, table))[0] for t in (1, 2)]
    assert np.array_equal(outs[0].view(np.uint8), outs[1].view(np.uint8))
    out = outs[0]
    assert np.isfinite(out).all() and np.array_equal(out[0], out[3])
    assert np.abs(out[:3] - ref[:3]).max() <= 1e-5


@pytest.mark.parametrize("isolate", [False, True], ids=["content-only", "isolated-first"])
def test_windowed_blocks_compute_only_the_keys_their_rows_see(library, isolate):
    """Mean pooling (every row calibrated: whole-row blocks) under a sliding window: a block computes the
    scores and P*V of the keys its rows see, the rest exactly float32's lowest value and probability 0.  An
    isolated first token gets its share in rows whose window does not reach it, and a padding row that sees
    no valid key is uniform over all keys: such blocks take every key.  Against the float64 oracle, at 1 and
    2 threads bit for bit."""
    rc = CalibrationConfig(pooling="mean", basket_size=32, isolate_first=isolate, first_weight=0.2 if isolate else None,
                           skip_short=False).resolve()
    spec = attention_op_spec(rc, 0, num_heads=2, geometry=AttentionGeometry(num_kv_heads=1, window_left=40,
                                                                             window_right=40))
    gen = torch.Generator().manual_seed(26)
    B, K = 3, 600
    q, k, v = random_qkv(gen, B, K, K, 2, 8, 8, torch.float32, temp=2.0)
    geo = geometry_from_attrs(spec.attrs)
    k, v = kv_heads(k, 2, geo), kv_heads(v, 2, geo)
    mask = torch.ones(B, K, dtype=torch.int64)
    mask[1, 450:] = 0
    mask[2, :200] = 0
    ref = attention_reference(q, k, v, mask, rc, 2, 0.0, **vars(geo)).numpy()
    outs = [session(single_op_model(spec), library, t).run(None, feeds(q, k, v, mask))[0] for t in (1, 2)]
    assert np.array_equal(outs[0].view(np.uint8), outs[1].view(np.uint8))
    assert np.abs(outs[0] - ref).max() <= 1e-5


def test_long_rows_calibrated_in_blocks_past_l2_match_the_oracle(library, cpu_path):
    """Past 2,048 keys a whole-row block keeps 128 rows (it outgrows L2): mean pooling, whose rows are all
    calibrated, with right and left padding, against the float64 oracle, at 1 and 2 threads bit for bit."""
    rc = CalibrationConfig(pooling="mean", basket_size=128).resolve()
    spec = attention_op_spec(rc, 0, num_heads=1)
    gen = torch.Generator().manual_seed(23)
    B, K = 2, 2600
    q, k, v = random_qkv(gen, B, K, K, 1, 8, 8, torch.float32, temp=2.0)
    mask = torch.ones(B, K, dtype=torch.int64)
    mask[0, 2300:] = 0
    mask[1, :700] = 0
    ref = computed_once(attention_reference, q, k, v, mask, rc, 1, 0.0)  # the same on every path
    outs = [session(single_op_model(spec), library, t).run(None, feeds(q, k, v, mask))[0] for t in (1, 2)]
    assert np.array_equal(outs[0].view(np.uint8), outs[1].view(np.uint8))
    assert np.abs(outs[0] - ref).max() <= 1e-5


@pytest.mark.parametrize("pooling", ["cls", "last"])
def test_skipped_padding_tiles_change_no_bit(library, cpu_path, pooling):
    """Key tiles of padding (before the first valid key or after the last) are skipped where that is exact.
    Items 0/1 (right padding) and 2/3 (left padding) have the same scores and valid values; in items 1 and 3
    a huge query component meets a zero key component and a huge masked key component meets a zero query
    component, so the scores are unchanged but the kernel cannot bound the masked scores and computes those
    rows without skipping: every row must come out the same, bit for bit."""
    rc = CalibrationConfig(pooling=pooling, basket_size=128).resolve()
    spec = attention_op_spec(rc, 0, num_heads=1)
    gen = torch.Generator().manual_seed(24)
    B, K = 4, 2100
    q, k, v = random_qkv(gen, B, K, K, 1, 8, 8, torch.float32, temp=2.0)
    q[1::2] = q[0::2]
    k[1::2] = k[0::2]
    v[1::2] = v[0::2]
    mask = torch.ones(B, K, dtype=torch.int64)
    mask[0:2, 1400:] = 0
    mask[2:4, :1600] = 0
    k[:, :, 0] = 0.0
    q[:, :, 1] = 0.0
    q[1::2, :, 0] = 1e19  # times k[..., 0] = 0: no change to any score
    k[1, 1400:, 1] = 1e19  # masked keys, times q[..., 1] = 0
    k[3, :1600, 1] = 1e19
    (out,) = session(single_op_model(spec), library, 2).run(None, feeds(q, k, v, mask))
    assert np.isfinite(out).all()
    assert np.array_equal(out[0], out[1]) and np.array_equal(out[2], out[3])
    ref = computed_once(attention_reference, q[0::2], k[0::2], v[0::2], mask[0::2], rc, 1, 0.0)
    assert np.abs(out[0::2] - ref).max() <= 1e-5


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++)")
def test_kept_row_scalars_leave_every_row_bits_as_computed_anew_on_each_path(tmp_path):
    """The row scalars a thread keeps from its last calibrated row (cpu/row_calibration.h: row_scalars) are taken
    only where they are the ones the row would compute: tests/cpp/row_scalars_memo_test.cpp."""
    repo = Path(__file__).resolve().parents[1]
    exe = tmp_path / "row_scalars_memo_test"
    subprocess.run(["g++", "-std=gnu++17", "-O3", "-Wall", "-Wextra", "-Werror", "-pthread",
                    "-I", str(repo / "plugins" / "kernels"), "-o", str(exe),
                    str(repo / "tests" / "cpp" / "row_scalars_memo_test.cpp")], check=True)
    for path, res in run_on_each_path([str(exe)]):
        assert res.returncode == 0 and res.stdout.strip().endswith(" 0 failure(s)"), (path, res.stdout + res.stderr)
