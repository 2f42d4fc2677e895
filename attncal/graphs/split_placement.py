"""Split placement: calibration as split attention, so the probabilities are never materialised.

The calibrated context row is (`attncal.calibration.split` states and proves the identity)

    out_q = (1 − λ)·Attn(q; all valid keys)
          + (λ / total)·[ (content / n)·Σ_b Attn(q; basket b) + Σ_i share_i·v_i ]

Every term is ordinary attention over a contiguous key range, so on the ONNX Runtime-optimized
graph (BERT family, TorchScript export, `onnxruntime.transformers.optimizer`) each calibrated
layer becomes:

* Q, K, V projections (the fused node's packed weights, split in three MatMuls: the same FLOPs
  as inside the fused node);
* the full term: one `com.microsoft::MultiHeadAttention` (a fused attention node, so the graph
  keeps exactly as many fused attention nodes as the uncalibrated optimized graph);
* the basket terms: a `Loop` over the baskets, each iteration one `MultiHeadAttention` of the
  queries against that basket's keys (gathered per item, so every padding side works) with a
  key-padding mask for the partial last basket; the loop carries a [B,R,hidden] accumulator, so
  the extra memory is O(B·S·hidden), never O(B·H·S²);
* the blend, in [B,S,hidden] space before the output projection, with per-item coefficients
  computed once per batch from the attention mask.

Mean pooling calibrates every valid row; cls/last pooling only the pooling row (R = 1), which is
scattered back into the context.  An `original` share needs the row's probability of the isolated
token, which fused attention does not expose; for the pooling row it is recomputed from one row of
scores, for all rows (mean pooling with an `original` isolated token, not a default) split placement
refuses and the softmax placement applies.

Two rewrites, chosen by `place` from the graph:
* `insert_split_calibration_fused`: the ORT-optimized graph, as above;
* `insert_split_calibration_plain`: a plain graph, standard ONNX only (the basket terms as one
  batched MatMul → Softmax → MatMul per layer).
Each runs every refusal, for every calibrated layer, before its first edit.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..calibration.config import MODE_EQUAL, MODE_FIXED, MODE_ORIGINAL, CalibrationConfig, ResolvedCalibration
from .attention_chain import PlainAttention, inferred_shapes, replay_chain, side_inputs, walk_layer
from .builder import Ops, graph_input
from .placement_base import (PlacementResult, count_fused_attention, fused_attention_parts, fused_layers,
                             has_fused_attention, qkv_projections)
from .softmax_pattern import AttentionSoftmax, find_attention_softmaxes

MS_DOMAIN = "com.microsoft"
i64 = np.int64
f32 = np.float32


NAME = "split"
OPTIMIZE_FIRST = True
# Node-name prefix of what this placement adds in standard ops: the calibration math, kept float32 when an
# optimized graph is converted to float16 (attncal.export.fp16).
FLOAT32_NODES: str | None = "attncal_split_"


class SplitPlacementError(ValueError):
    """Split placement does not apply to this graph or config."""


def place(model: ir.Model, config: CalibrationConfig, num_layers: int) -> PlacementResult:
    """Split placement on whichever graph this is: fused attention (ORT-optimized) or the plain graph."""
    if has_fused_attention(model):
        layers = insert_split_calibration_fused(model, config, num_layers)
    else:
        layers = insert_split_calibration_plain(model, config, num_layers)
    rc = config.resolve()
    attrs = {"pooling": rc.pooling, "basket_size": rc.basket_size, "strength": rc.strength,
             "isolate_first": int(rc.isolate_first), "isolate_last": int(rc.isolate_last),
             "first_mode": rc.first_mode, "last_mode": rc.last_mode, "first_weight": rc.first_weight,
             "last_weight": rc.last_weight, "skip_short": int(rc.skip_short)}
    return PlacementResult(layers, None, attrs, count_fused_attention(model))


def check_supported(rc: ResolvedCalibration) -> None:
    """Raise SplitPlacementError for configs the split graph cannot express."""
    if rc.all_rows and any(e and m == MODE_ORIGINAL for e, m in ((rc.isolate_first, rc.first_mode),
                                                                    (rc.isolate_last, rc.last_mode))):
        raise SplitPlacementError(
            "split placement cannot weight an isolated token by its original attention in every row (fused "
            "attention does not expose the probabilities); use --placement softmax for this config"
        )


class _Geometry:
    """Per-item spans and blend coefficients, computed once per batch from the attention mask."""

    def __init__(self, ops: Ops, mask: ir.Value, rc: ResolvedCalibration) -> None:
        c = ops.const
        S = rc.basket_size
        n_iso = rc.n_isolated
        self.valid = ops("Cast", mask, to=ir.DataType.BOOL)
        shape = ops("Shape", mask)
        self.bsz = ops("Gather", shape, c("i0", i64(0)), axis=0)
        self.seq = ops("Gather", shape, c("i1", i64(1)), axis=0)
        pos = ops("Range", c("zero", i64(0)), self.seq, c("one", i64(1)))
        ax1 = c("ax1", np.array([1], i64))
        self.start = ops("ReduceMin", ops("Where", self.valid, pos, self.seq), ax1, keepdims=0)  # [B]
        self.end = ops("ReduceMax", ops("Where", self.valid, pos, c("m1", i64(-1))), ax1, keepdims=0)
        length = ops("Add", ops("Sub", self.end, self.start), c("one_l", i64(1)))
        self.C = ops("Max", ops("Sub", length, c("niso", i64(n_iso))), c("zero_c", i64(0)))  # content length
        self.c0 = ops("Add", self.start, c("isof", i64(int(rc.isolate_first))))
        self.c0_const = int(rc.isolate_first)  # c0 of every item under right padding
        active = ops("Greater", self.C, c("zero_a", i64(0)))
        if rc.skip_short:
            active = ops("And", active, ops("GreaterOrEqual", self.C, c("S_a", i64(S))))
        n = ops("Div", ops("Add", self.C, c("Sm1", i64(S - 1))), c("S_d", i64(S)))
        self.n = ops("Where", active, n, c("zero_n", i64(0)))  # baskets per item, 0 when not calibrated
        self.n_max = ops("ReduceMax", self.n, keepdims=0)  # the Loop's trip count
        self.nf = ops("Cast", self.n, to=ir.DataType.FLOAT)
        self.lam = ops("Mul", ops("Cast", active, to=ir.DataType.FLOAT), c("lam", f32(rc.strength)))
        t = ops("Add", self.nf, c("niso_f", f32(n_iso)))
        self.t_safe = ops("Max", t, c("one_f", f32(1.0)))
        self.seq_m1 = ops("Sub", self.seq, c("one_s", i64(1)))
        self.S = S


def _item(ops: Ops, v: ir.Value, rank: int, tag: str) -> ir.Value:
    """A per-item [B] tensor as [B,1,...] of the given rank, for broadcasting."""
    return ops("Unsqueeze", v, ops.const(f"unsq{rank}_{tag}", np.arange(1, rank, dtype=i64)))


def _coefficients(ops: Ops, g: _Geometry, rc: ResolvedCalibration, shares: list[ir.Value], n: ir.Value,
                  lam: ir.Value, rank: int, tag: str):
    """(coef_full, coef_basket, [coef_i]) from the non-empty basket count `n`, the strength `lam` (0 on
    rows that are not calibrated) and the shares, all broadcastable to `rank` dims."""
    c = ops.const
    zero, one = c(f"{tag}_0", f32(0.0)), c(f"{tag}_1", f32(1.0))
    share_sum = shares[0] if shares else zero
    for s in shares[1:]:
        share_sum = ops("Add", share_sum, s)
    has = ops("Greater", n, zero)
    if rc.any_non_equal:
        content = ops("Where", has, ops("Max", ops("Sub", one, share_sum), zero), zero)
    else:
        content = ops("Div", n, _item(ops, g.t_safe, rank, f"{tag}_t"))
    total = ops("Add", content, share_sum)
    nz = ops("Not", ops("Equal", total, zero))
    safe_total = ops("Where", nz, total, one)  # divide by total, never by its reciprocal (subnormal weights)
    coef_b = ops("Div", ops("Mul", lam, content), ops("Mul", ops("Max", n, one), safe_total))
    coef_b = ops("Where", ops("And", nz, has), coef_b, zero)
    coef_full = ops("Sub", one, lam)
    coef_i = [ops("Div", ops("Mul", lam, s), safe_total) for s in shares]
    return coef_full, coef_b, coef_i


def _equal_or_fixed_share(ops: Ops, g: _Geometry, mode: int, weight: float, rank: int, tag: str) -> ir.Value:
    if mode == MODE_EQUAL:
        return _item(ops, ops("Div", ops.const(f"one_{tag}", f32(1.0)), g.t_safe), rank, f"sh_{tag}")
    if mode == MODE_FIXED:
        return ops.const(f"w_{tag}", np.full([1] * rank, weight, dtype=f32))
    raise ValueError(f"unknown weight mode {mode}")


def _gather_rows(ops: Ops, x: ir.Value, row: ir.Value, hidden: int, tag: str) -> tuple[ir.Value, ir.Value]:
    """x[b, row[b], :] as [B,1,hidden], and the [B,1,hidden] index used (for ScatterElements)."""
    c = ops.const
    shape = ops("Concat", ops("Unsqueeze", ops("Gather", ops("Shape", x), c(f"{tag}_i0", i64(0)), axis=0),
                              c(f"{tag}_u0", np.array([0], i64))),
                c(f"{tag}_tail", np.array([1, hidden], i64)), axis=0)
    idx = ops("Expand", ops("Unsqueeze", row, c(f"{tag}_u12", np.array([1, 2], i64))), shape)
    return ops("GatherElements", x, idx, axis=1), idx


def _basket_loop(ops: Ops, g: _Geometry, q: ir.Value, k: ir.Value, v: ir.Value, heads: int, hidden: int,
                 scale: float, layer: int) -> ir.Value:
    """Σ over non-empty baskets of MultiHeadAttention(q, K_b, V_b): [B,R,hidden].

    A Loop runs only as many baskets as the batch has.  (Unrolling up to the position table's
    basket count was measured too: all-MiniLM at 8 x 128 tokens needed 1.51x the uncalibrated
    optimized graph's memory against 1.05x with the Loop, since every unrolled basket keeps an
    output buffer.)"""
    c = ops.const
    p = f"attncal_split_layer{layer}/loop"
    body = Ops(ops.graph, p)
    it = ir.Value(name=f"{p}/it", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    cond = ir.Value(name=f"{p}/cond", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    acc = ir.Value(name=f"{p}/acc", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([None, None, hidden]))
    # The fused graph is right-padded (ORT's fused attention takes key lengths), so every item's content
    # starts at the same offset c0 = isolate_first and a basket is a slice of the key axis.  Key lengths
    # of this basket per item are clamp(C - b·S, 1, S): the partial last basket masks its tail, and an
    # item with fewer baskets gets a harmless non-empty row that `ne` zeroes below.
    lo_rel = body("Mul", it, c("S_it", i64(g.S)))
    lo = body("Add", lo_rel, c("c0_it", i64(g.c0_const)))
    hi = body("Add", lo, c("S_hi", i64(g.S)))
    ax = c("ax1_it", np.array([1], i64))
    lo1 = body("Unsqueeze", lo, c("u0_lo", np.array([0], i64)))
    hi1 = body("Unsqueeze", hi, c("u0_hi", np.array([0], i64)))
    kb = body("Slice", k, lo1, hi1, ax)
    vb = body("Slice", v, lo1, hi1, ax)
    lens = body("Clip", body("Sub", g.C, lo_rel), c("one_len", i64(1)), c("S_len", i64(g.S)))
    kpm = body("Cast", lens, to=ir.DataType.INT32)  # [B] key lengths
    ob = body("MultiHeadAttention", q, kb, vb, None, kpm, domain=MS_DOMAIN, num_heads=heads, scale=float(scale))
    ne = body("Cast", body("Less", it, g.n), to=ir.DataType.FLOAT)  # this basket exists for the item
    ne = body("Unsqueeze", ne, c("u12", np.array([1, 2], i64)))
    acc_out = body("Add", acc, body("Mul", ob, ne))
    cond_out = body("Identity", cond)
    acc_out.type, acc_out.shape = acc.type, ir.Shape([None, None, hidden])
    cond_out.type, cond_out.shape = cond.type, ir.Shape([])
    graph = ir.Graph([it, cond, acc], [cond_out, acc_out], nodes=body.nodes, name=f"{p}/body")
    zeros = ops("Expand", c("zero_acc", f32(0.0)), ops("Shape", q))
    out = ops("Loop", g.n_max, c("true", np.array(True)), zeros, body=graph)
    return out


def _check_fused_layer(graph: ir.Graph, att: ir.Node) -> tuple[ir.Value, np.ndarray, np.ndarray, int, float]:
    """Every refusal for one fused layer; returns its `fused_attention_parts`."""
    parts = fused_attention_parts(att, SplitPlacementError)
    if any(o is att.outputs[0] for o in graph.outputs):
        raise SplitPlacementError(f"the context of {att.name} is a graph output; cannot rewire it (the fused node "
                                  "is replaced, and a graph output would be left without its producer)")
    return parts


def _layer(graph: ir.Graph, att: ir.Node, layer: int, rc: ResolvedCalibration, g: _Geometry, mask: ir.Value,
           parts: tuple[ir.Value, np.ndarray, np.ndarray, int, float]) -> None:
    """One checked fused layer rebuilt as split attention (`parts`: `fused_attention_parts` of `att`)."""
    x, W, bvec, heads, scale = parts
    hidden = W.shape[1] // 3
    head = hidden // heads
    ops = Ops(graph, f"attncal_split_layer{layer}")
    c = ops.const
    q, k, v = qkv_projections(ops, x, W, bvec)
    kpm = ops("Cast", ops("ReduceSum", mask, c("ax1_len", np.array([1], i64)), keepdims=0), to=ir.DataType.INT32)
    full = ops("MultiHeadAttention", q, k, v, None, kpm, domain=MS_DOMAIN, num_heads=heads, scale=float(scale))
    ctx = att.outputs[0]
    if rc.all_rows:
        acc = _basket_loop(ops, g, q, k, v, heads, hidden, scale, layer)
        shares: list[ir.Value] = []
        vis: list[ir.Value] = []
        for enabled, mode, weight, pos, tag in ((rc.isolate_first, rc.first_mode, rc.first_weight, g.start, "first"),
                                                (rc.isolate_last, rc.last_mode, rc.last_weight, g.end, "last")):
            if enabled:
                shares.append(_equal_or_fixed_share(ops, g, mode, weight, 3, tag))
                vis.append(_gather_rows(ops, v, pos, hidden, f"v_{tag}")[0])  # [B,1,hidden]
        coef_full, coef_b, coef_i = _coefficients(ops, g, rc, shares, _item(ops, g.nf, 3, "nf"),
                                                  _item(ops, g.lam, 3, "lam"), 3, "item")
        rows = ops("Unsqueeze", ops("Cast", mask, to=ir.DataType.FLOAT), c("u2r", np.array([2], i64)))  # [B,S,1]
        one = c("one_r", f32(1.0))
        out = ops("Mul", full, ops("Add", one, ops("Mul", ops("Sub", coef_full, one), rows)))  # pad rows: plain
        out = ops("Add", out, ops("Mul", acc, ops("Mul", coef_b, rows)))
        for ci, vi in zip(coef_i, vis):
            out = ops("Add", out, ops("Mul", vi, ops("Mul", ci, rows)))
    else:
        row = g.end if rc.pool_last else g.start
        q_row, row_idx = _gather_rows(ops, q, row, hidden, "q")
        acc = _basket_loop(ops, g, q_row, k, v, heads, hidden, scale, layer)  # [B,1,hidden]
        full_row = ops("GatherElements", full, row_idx, axis=1)
        to_heads = c("heads_shape", np.array([0, 1, heads, head], i64))  # [B,1,H,d]: per-head shares
        shares, vis = [], []
        probs = None
        for enabled, mode, weight, pos, tag in ((rc.isolate_first, rc.first_mode, rc.first_weight, g.start, "first"),
                                                (rc.isolate_last, rc.last_mode, rc.last_weight, g.end, "last")):
            if not enabled:
                continue
            vis.append(ops("Reshape", _gather_rows(ops, v, pos, hidden, f"v_{tag}")[0], to_heads))
            if mode == MODE_ORIGINAL:
                if probs is None:
                    probs = _row_probs(ops, q_row, k, g, heads, head, scale)  # [B,1,H,S]
                pidx = ops("Expand", ops("Unsqueeze", pos, c(f"u123_{tag}", np.array([1, 2, 3], i64))),
                           ops("Concat", ops("Unsqueeze", g.bsz, c(f"u0p_{tag}", np.array([0], i64))),
                               c(f"p_tail_{tag}", np.array([1, heads, 1], i64)), axis=0))
                shares.append(ops("GatherElements", probs, pidx, axis=3))  # [B,1,H,1]
            else:
                shares.append(_equal_or_fixed_share(ops, g, mode, weight, 4, tag))
        coef_full, coef_b, coef_i = _coefficients(ops, g, rc, shares, _item(ops, g.nf, 4, "nf"),
                                                  _item(ops, g.lam, 4, "lam"), 4, "item")
        out_row = ops("Add", ops("Mul", ops("Reshape", full_row, to_heads), coef_full),
                      ops("Mul", ops("Reshape", acc, to_heads), coef_b))
        for ci, vi in zip(coef_i, vis):
            out_row = ops("Add", out_row, ops("Mul", vi, ci))
        out_row = ops("Reshape", out_row, c("row_shape", np.array([0, 1, hidden], i64)))
        out = ops("ScatterElements", full, row_idx, out_row, axis=1)
    out.name = f"{ops.prefix}/context"
    for user, i in list(ctx.uses()):
        user.replace_input_with(i, out)
    ops.insert_after(att)
    graph.remove(att, safe=True)


def _row_probs(ops: Ops, q_row: ir.Value, k: ir.Value, g: _Geometry, heads: int, head: int, scale: float) -> ir.Value:
    """Softmax of the pooling row's scores over the valid keys, [B,1,H,S] (one row: cheap)."""
    c = ops.const
    qh = ops("Transpose", ops("Reshape", q_row, c("qh_shape", np.array([0, 1, heads, head], i64))), perm=[0, 2, 1, 3])
    kt = ops("Transpose", ops("Reshape", k, c("kh_shape", np.array([0, 0, heads, head], i64))), perm=[0, 2, 3, 1])
    s = ops("Mul", ops("MatMul", qh, kt), c("scale_row", f32(scale)))  # [B,H,1,S]
    bias = ops("Where", ops("Unsqueeze", g.valid, c("u12m", np.array([1, 2], i64))), c("m0", f32(0.0)),
               c("mneg", f32(np.finfo(np.float32).min)))
    p = ops("Softmax", ops("Add", s, bias), axis=-1)
    return ops("Transpose", p, perm=[0, 2, 1, 3])


def insert_split_calibration_fused(model: ir.Model, config: CalibrationConfig, num_layers: int,
                                   mask_input: str = "attention_mask") -> list[int]:
    """Split placement on an ORT-optimized graph: one fused Attention node per layer; returns the calibrated layers.

    Every refusal, for every selected layer, comes before the first edit."""
    rc = config.resolve()
    check_supported(rc)
    graph = model.graph
    atts, mask = fused_layers(model, num_layers, mask_input, SplitPlacementError,
                              "split placement on an optimized graph needs")
    selected = config.layer_indices(num_layers)
    if not selected or rc.strength == 0.0:
        return selected
    parts = {layer: _check_fused_layer(graph, atts[layer]) for layer in selected}
    gops = Ops(graph, "attncal_split_geometry")
    geometry = _Geometry(gops, mask, rc)
    gops.insert_before(atts[selected[0]])
    for layer in selected:
        _layer(graph, atts[layer], layer, rc, geometry, mask, parts[layer])
    for name, value in list(graph.initializers.items()):  # the replaced nodes' packed QKV weights
        if not list(value.uses()) and not any(value is o for o in graph.outputs):
            del graph.initializers[name]
    if MS_DOMAIN not in model.opset_imports:
        model.opset_imports[MS_DOMAIN] = 1
    return selected


# ---------------------------------------------------------------------------------------------
# The plain graph: standard ONNX only, for every architecture and exporter (TensorRT and others)
# ---------------------------------------------------------------------------------------------
def _basket_side(val: ir.Value, node: ir.Node) -> str:
    """How the chain's side input `val` (of `node`) reaches the basket scores [B,H,n,Q,S]: "baskets"
    (a rank-4 per-key mask, gathered into basket layout), "unsqueeze" (rank 4 with one key column)
    or "as-is" (a scalar, a vector or a constant, which broadcast).  Any other computed input is
    refused: its key axis is unknown, so it cannot be cut into baskets."""
    if val.shape is not None and val.shape.rank() == 4:
        last = val.shape[3]
        return "unsqueeze" if isinstance(last, int) and last == 1 else "baskets"
    if val.shape is not None and val.shape.rank() not in (0, 1) and val.const_value is None:
        raise SplitPlacementError(f"unsupported rank-{val.shape.rank()} input {val.name} of {node.name}: only "
                                  "rank-4 masks, scalars, vectors and constants can follow the scores into baskets")
    return "as-is"


def _check_plain_layer(graph: ir.Graph, att: AttentionSoftmax) -> PlainAttention:
    """Every refusal for one layer of a plain graph (shapes inferred)."""
    walked = walk_layer(att, SplitPlacementError)
    if att.softmax.inputs[0].dtype not in (ir.DataType.FLOAT, None):
        raise SplitPlacementError(f"split placement on the plain graph is float32 only ({att.softmax.name} works on "
                                  f"{att.softmax.inputs[0].dtype.name}: the blend coefficients are float32); "
                                  "drop --fp16")
    for val, node, _ in side_inputs(walked.chain, walked.scores_mm.outputs[0]):
        _basket_side(val, node)
    ctx = walked.value_mm.outputs[0]
    if any(o is ctx for o in graph.outputs):
        raise SplitPlacementError(f"the attention context {ctx.name} is a graph output; cannot rewire it (the output "
                                  "would keep the uncalibrated context)")
    return walked


def insert_split_calibration_plain(model: ir.Model, config: CalibrationConfig, num_layers: int,
                                   mask_input: str = "attention_mask") -> list[int]:
    """Split placement on a graph with explicit attention (Softmax between two MatMuls), standard ops only.

    The basket terms are one batched attention per layer: the queries against the keys and values
    gathered into [B,H,n,S,·] basket layout (per item, so left padding works), the layer's own
    scale/mask chain replayed on the basket scores (causal and sliding-window masks included),
    Softmax over each basket, MatMul with the basket values.  That is the MatMul → Softmax → MatMul
    shape other runtimes fuse into their attention kernels; no custom op and no function body.
    Every refusal, for every selected layer, comes before the first edit (shape inference, which
    the checks need, is undone on a refusal).
    """
    rc = config.resolve()
    graph = model.graph
    if any(n.domain == "ai.attncal" for n in graph):
        raise SplitPlacementError("the graph already contains attncal calibration nodes")
    mask = graph_input(graph, mask_input, SplitPlacementError)
    with inferred_shapes(model):
        selected = config.layer_indices(num_layers)
        if rc.strength == 0.0:
            return selected
        layers = [_check_plain_layer(graph, att) for att in find_attention_softmaxes(graph, num_layers)
                  if att.layer in selected]
    gops = Ops(graph, "attncal_split_geometry")
    g = _Geometry(gops, mask, rc)
    c = gops.const
    L = gops("Mul", g.n_max, c("S_L", i64(g.S)))
    j = gops("Range", c("zero_j", i64(0)), L, c("one_j", i64(1)))  # [L] content offsets
    pos = gops("Add", gops("Unsqueeze", g.c0, c("u1_p", np.array([1], i64))),
               gops("Unsqueeze", j, c("u0_p", np.array([0], i64))))
    pos = gops("Min", pos, g.seq_m1)  # [B,L] key position of each basket slot
    inside = gops("Less", gops("Unsqueeze", j, c("u0_i", np.array([0], i64))),
                  gops("Unsqueeze", g.C, c("u1_i", np.array([1], i64))))  # [B,L] slot within the content
    inside5 = gops("Reshape", inside, c("in_shape", np.array([0, 1, 1, -1, g.S], i64)))  # [B,1,1,n,S]
    inside5 = gops("Transpose", inside5, perm=[0, 1, 3, 2, 4])  # [B,1,n,1,S]
    if rc.all_rows:
        rows = gops("Unsqueeze", gops("Cast", mask, to=ir.DataType.FLOAT), c("u13", np.array([1, 3], i64)))
    else:
        row = g.end if rc.pool_last else g.start
        kpos = gops("Range", c("zero_k", i64(0)), g.seq, c("one_k", i64(1)))
        sel = gops("Equal", gops("Unsqueeze", kpos, c("u0_k", np.array([0], i64))),
                   gops("Unsqueeze", row, c("u1_k", np.array([1], i64))))  # [B,Q]
        rows = gops("Unsqueeze", gops("Cast", sel, to=ir.DataType.FLOAT), c("u13", np.array([1, 3], i64)))
    gops.insert_before(next(iter(graph)))
    neg = f32(np.finfo(np.float32).min)
    for att in layers:
        scores_mm, chain, post, value_mm = att.scores_mm, att.chain, att.post, att.value_mm
        ops = Ops(graph, f"attncal_split_layer{att.layer}")
        c = ops.const
        qx, kt, v = scores_mm.inputs[0], scores_mm.inputs[1], value_mm.inputs[1]

        def align(t: ir.Value, axis: int, tag: str) -> ir.Value:
            """Gather basket slots along `axis` (rank-4 tensor, batch-broadcast side inputs expanded)."""
            shape = ops("Shape", t)
            full = ops("Concat", ops("Unsqueeze", g.bsz, c(f"{tag}_u", np.array([0], i64))),
                       ops("Slice", shape, c(f"{tag}_s1", np.array([1], i64)), c(f"{tag}_s4", np.array([4], i64))),
                       axis=0)
            t_b = ops("Expand", t, full)
            idx_shape_parts = []
            for a in range(4):
                if a == 0:
                    idx_shape_parts.append(ops("Slice", full, c(f"{tag}_a0", np.array([0], i64)),
                                               c(f"{tag}_a1", np.array([1], i64))))
                elif a == axis:
                    idx_shape_parts.append(ops("Unsqueeze", L, c(f"{tag}_uL", np.array([0], i64))))
                else:
                    idx_shape_parts.append(ops("Slice", full, c(f"{tag}_b{a}", np.array([a], i64)),
                                               c(f"{tag}_e{a}", np.array([a + 1], i64))))
            idx_shape = ops("Concat", *idx_shape_parts, axis=0)
            perm_axes = [1, 2, 3]
            perm_axes.remove(axis)
            p4 = ops("Unsqueeze", pos, c(f"{tag}_pu", np.array(perm_axes, i64)))  # pos along `axis`
            return ops("GatherElements", t_b, ops("Expand", p4, idx_shape), axis=axis)

        def to_baskets(t: ir.Value, axis: int, tag: str) -> ir.Value:
            """[B,X,Y,L] (axis 3) -> [B,X,n,Y,S]; [B,X,L,Y] (axis 2) -> [B,X,n,S,Y]."""
            if axis == 3:
                r = ops("Reshape", t, c(f"{tag}_r", np.array([0, 0, 0, -1, g.S], i64)))
                return ops("Transpose", r, perm=[0, 1, 3, 2, 4])
            shp = ops("Shape", t)
            target = ops("Concat", ops("Slice", shp, c(f"{tag}_a", np.array([0], i64)), c(f"{tag}_b", np.array([2], i64))),
                         c(f"{tag}_nS", np.array([-1, g.S], i64)),
                         ops("Slice", shp, c(f"{tag}_c", np.array([3], i64)), c(f"{tag}_d", np.array([4], i64))), axis=0)
            return ops("Reshape", t, target)

        k5 = to_baskets(align(kt, 3, "k"), 3, "k5")  # [B,H,n,d,S]
        v5 = to_baskets(align(v, 2, "v"), 2, "v5")  # [B,H,n,S,d]
        cur = ops("MatMul", ops("Unsqueeze", qx, c("u2q", np.array([2], i64))), k5)  # [B,H,n,Q,S]
        def side(val: ir.Value, node: ir.Node, kk: int) -> ir.Value:
            """Rank-4 side inputs (masks) go to the basket layout; scalars and vectors broadcast as they are."""
            kind = _basket_side(val, node)
            if kind == "unsqueeze":
                return ops("Unsqueeze", val, c(f"side{kk}_u", np.array([2], i64)))
            if kind == "baskets":
                return to_baskets(align(val, 3, f"side{kk}"), 3, f"side{kk}_5")
            return val

        cur = replay_chain(ops, chain, scores_mm.outputs[0], cur, side)
        negc = c("neg", neg)
        cur = ops("Where", inside5, ops("Max", cur, negc), negc)  # -inf masks clamped; non-content slots out
        ne = ops("Cast", ops("Greater", ops("ReduceMax", cur, c("axm1", np.array([-1], i64)), keepdims=1),
                             c("half_neg", f32(neg / 2))), to=ir.DataType.FLOAT)  # [B,H,n,Q,1]
        pb = ops("Softmax", cur, axis=-1)
        for node in post:
            pb = ops(node.op_type, pb, **{a.name: a.value for a in node.attributes.values()})
        ob = ops("MatMul", pb, v5)  # [B,H,n,Q,d]
        ax2 = c("ax2", np.array([2], i64))
        acc = ops("ReduceSum", ops("Mul", ob, ne), ax2, keepdims=0)  # [B,H,Q,d]
        n_ne = ops("ReduceSum", ne, ax2, keepdims=0)  # [B,H,Q,1]
        probs = att.softmax.outputs[0]
        shares, vis = [], []
        for enabled, mode, weight, p_item, tag in ((rc.isolate_first, rc.first_mode, rc.first_weight, g.start, "first"),
                                                   (rc.isolate_last, rc.last_mode, rc.last_weight, g.end, "last")):
            if not enabled:
                continue
            p4 = ops("Unsqueeze", p_item, c(f"u123_{tag}", np.array([1, 2, 3], i64)))  # [B,1,1,1]
            vis.append(ops("GatherElements", v, ops("Expand", p4, ops("Concat", ops("Slice", ops("Shape", v),
                       c(f"{tag}_v0", np.array([0], i64)), c(f"{tag}_v2", np.array([2], i64))),
                       c(f"{tag}_v1", np.array([1], i64)), ops("Slice", ops("Shape", v), c(f"{tag}_v3", np.array([3], i64)),
                       c(f"{tag}_v4", np.array([4], i64))), axis=0)), axis=2))  # [B,H,1,d]
            if mode == MODE_ORIGINAL:
                pshape = ops("Concat", ops("Slice", ops("Shape", probs), c(f"{tag}_p0", np.array([0], i64)),
                                           c(f"{tag}_p3", np.array([3], i64))), c(f"{tag}_p1", np.array([1], i64)), axis=0)
                shares.append(ops("Cast", ops("GatherElements", probs, ops("Expand", p4, pshape), axis=3),
                                  to=ir.DataType.FLOAT))  # [B,H,Q,1]
            else:
                shares.append(_equal_or_fixed_share(ops, g, mode, weight, 4, tag))
        lam_rows = ops("Mul", _item(ops, g.lam, 4, "lam_r"), rows)  # [B,1,Q,1]: calibrated rows only
        coef_full, coef_b, coef_i = _coefficients(ops, g, rc, shares, n_ne, lam_rows, 4, "row")
        ctx = value_mm.outputs[0]
        uses = list(ctx.uses())
        out = ops("Add", ops("Mul", ctx, coef_full), ops("Mul", acc, coef_b))
        for ci, vi in zip(coef_i, vis):
            out = ops("Add", out, ops("Mul", vi, ci))
        out.name = f"{ops.prefix}/context"
        for user, i in uses:
            user.replace_input_with(i, out)
        ops.insert_after(value_mm)
    return selected
