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

The two rules, chosen by the placement from the graph (`placement_base.Placement.rule_for`):
* `FUSED_RULE` (here): the ORT-optimized graph, as above;
* `split_plain_placement.RULE`: a plain graph, standard ONNX only (the basket terms as one
  batched MatMul → Softmax → MatMul per layer).
Each runs every refusal, for every calibrated layer, before its first edit.  This module also holds
what both rules share: the placement's error, the config it refuses, the per-item geometry and the
blend coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ...calibration.config import MODE_EQUAL, MODE_FIXED, MODE_ORIGINAL, CalibrationConfig, ResolvedCalibration
from ..builder import Ops
from .placement_base import (FUSED, PlacementResult, Refusal, Rule, count_fused_attention, fused_attention_parts,
                             fused_layers, qkv_projections)

MS_DOMAIN = "com.microsoft"
i64 = np.int64
f32 = np.float32
# Node-name prefix of everything both rules add in standard ops (the calibration math): the placement's
# `float32_nodes`, kept float32 when an optimized graph is converted to float16 (attncal.exporting.fp16).
NODE_PREFIX = "attncal_split_"


class SplitPlacementError(ValueError):
    """Split placement does not apply to this graph or config."""


def unsupported_config(rc: ResolvedCalibration) -> Refusal | None:
    """The refusal of a config the split graph cannot express, or None."""
    if rc.row_set:
        return Refusal(SplitPlacementError,
                       f"split placement calibrates one row or every row; {rc.pooling} pooling calibrates the rows "
                       "marked from the token ids: use --placement fused-softmax, softmax or attention (or auto)")
    if rc.all_rows and any(e and m == MODE_ORIGINAL for e, m in ((rc.isolate_first, rc.first_mode),
                                                                    (rc.isolate_last, rc.last_mode))):
        return Refusal(SplitPlacementError,
                       "split placement cannot weight an isolated token by its original attention in every row (fused "
                       "attention does not expose the probabilities); use --placement softmax for this config")
    return None


def check_request(rc: ResolvedCalibration, precision: str) -> Refusal | None:
    """An explicit split placement refuses the configs it cannot express (every precision)."""
    return unsupported_config(rc)


def split_result(model: ir.Model, rc: ResolvedCalibration, layers: list[int]) -> PlacementResult:
    """What either rule returns: no custom op, the resolved config, the fused attention left in the graph."""
    attrs = {"pooling": rc.pooling.kind, "basket_size": rc.basket_size, "strength": rc.strength,
             "isolate_first": int(rc.isolate_first), "isolate_last": int(rc.isolate_last),
             "first_mode": rc.first_mode, "last_mode": rc.last_mode, "first_weight": rc.first_weight,
             "last_weight": rc.last_weight, "skip_short": int(rc.skip_short)}
    return PlacementResult(layers, None, attrs, count_fused_attention(model))


class Geometry:
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


def item(ops: Ops, v: ir.Value, rank: int, tag: str) -> ir.Value:
    """A per-item [B] tensor as [B,1,...] of the given rank, for broadcasting."""
    return ops("Unsqueeze", v, ops.const(f"unsq{rank}_{tag}", np.arange(1, rank, dtype=i64)))


def coefficients(ops: Ops, g: Geometry, rc: ResolvedCalibration, shares: list[ir.Value], n: ir.Value,
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
        content = ops("Div", n, item(ops, g.t_safe, rank, f"{tag}_t"))
    total = ops("Add", content, share_sum)
    nz = ops("Not", ops("Equal", total, zero))
    safe_total = ops("Where", nz, total, one)  # divide by total, never by its reciprocal (subnormal weights)
    coef_b = ops("Div", ops("Mul", lam, content), ops("Mul", ops("Max", n, one), safe_total))
    coef_b = ops("Where", ops("And", nz, has), coef_b, zero)
    coef_full = ops("Sub", one, lam)
    coef_i = [ops("Div", ops("Mul", lam, s), safe_total) for s in shares]
    return coef_full, coef_b, coef_i


def equal_or_fixed_share(ops: Ops, g: Geometry, mode: int, weight: float, rank: int, tag: str) -> ir.Value:
    if mode == MODE_EQUAL:
        return item(ops, ops("Div", ops.const(f"one_{tag}", f32(1.0)), g.t_safe), rank, f"sh_{tag}")
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


def _basket_loop(ops: Ops, g: Geometry, q: ir.Value, k: ir.Value, v: ir.Value, heads: int, hidden: int,
                 scale: float, layer: int) -> ir.Value:
    """Σ over non-empty baskets of MultiHeadAttention(q, K_b, V_b): [B,R,hidden].

    A Loop runs only as many baskets as the batch has.  (Unrolling up to the position table's
    basket count was measured too: all-MiniLM at 8 x 128 tokens needed 1.51x the uncalibrated
    optimized graph's memory against 1.05x with the Loop, since every unrolled basket keeps an
    output buffer.)"""
    c = ops.const
    p = f"{NODE_PREFIX}layer{layer}/loop"
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


def _layer(graph: ir.Graph, att: ir.Node, layer: int, rc: ResolvedCalibration, g: Geometry, mask: ir.Value,
           parts: tuple[ir.Value, np.ndarray, np.ndarray, int, float]) -> None:
    """One checked fused layer rebuilt as split attention (`parts`: `fused_attention_parts` of `att`)."""
    x, W, bvec, heads, scale = parts
    hidden = W.shape[1] // 3
    head = hidden // heads
    ops = Ops(graph, f"{NODE_PREFIX}layer{layer}")
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
                shares.append(equal_or_fixed_share(ops, g, mode, weight, 3, tag))
                vis.append(_gather_rows(ops, v, pos, hidden, f"v_{tag}")[0])  # [B,1,hidden]
        coef_full, coef_b, coef_i = coefficients(ops, g, rc, shares, item(ops, g.nf, 3, "nf"),
                                                  item(ops, g.lam, 3, "lam"), 3, "item")
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
                shares.append(equal_or_fixed_share(ops, g, mode, weight, 4, tag))
        coef_full, coef_b, coef_i = coefficients(ops, g, rc, shares, item(ops, g.nf, 4, "nf"),
                                                  item(ops, g.lam, 4, "lam"), 4, "item")
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


def _row_probs(ops: Ops, q_row: ir.Value, k: ir.Value, g: Geometry, heads: int, head: int, scale: float) -> ir.Value:
    """Softmax of the pooling row's scores over the valid keys, [B,1,H,S] (one row: cheap)."""
    c = ops.const
    qh = ops("Transpose", ops("Reshape", q_row, c("qh_shape", np.array([0, 1, heads, head], i64))), perm=[0, 2, 1, 3])
    kt = ops("Transpose", ops("Reshape", k, c("kh_shape", np.array([0, 0, heads, head], i64))), perm=[0, 2, 3, 1])
    s = ops("Mul", ops("MatMul", qh, kt), c("scale_row", f32(scale)))  # [B,H,1,S]
    bias = ops("Where", ops("Unsqueeze", g.valid, c("u12m", np.array([1, 2], i64))), c("m0", f32(0.0)),
               c("mneg", f32(np.finfo(np.float32).min)))
    p = ops("Softmax", ops("Add", s, bias), axis=-1)
    return ops("Transpose", p, perm=[0, 2, 1, 3])


@dataclass(frozen=True)
class _FusedEdits:
    rc: ResolvedCalibration
    selected: list[int]
    atts: list[ir.Node]  # one fused Attention node per layer
    mask: ir.Value
    # fused_attention_parts per selected layer; None when nothing is calibrated (no layer, or strength 0)
    parts: dict[int, tuple[ir.Value, np.ndarray, np.ndarray, int, float]] | None


def _find_fused(model: ir.Model, config: CalibrationConfig, num_layers: int,
                mask_input: str = "attention_mask") -> _FusedEdits:
    """Every refusal of split placement on an ORT-optimized graph (one fused Attention node per layer),
    for every selected layer; no edit."""
    rc = config.resolve()
    refusal = unsupported_config(rc)
    if refusal is not None:
        raise refusal.exception()
    graph = model.graph
    atts, mask = fused_layers(model, num_layers, mask_input, SplitPlacementError,
                              "split placement on an optimized graph needs")
    selected = config.layer_indices(num_layers)
    if not selected or rc.strength == 0.0:
        return _FusedEdits(rc, selected, atts, mask, None)
    parts = {layer: _check_fused_layer(graph, atts[layer]) for layer in selected}
    return _FusedEdits(rc, selected, atts, mask, parts)


def _rewrite_fused(model: ir.Model, edits: _FusedEdits) -> PlacementResult:
    """Each selected layer's fused Attention rebuilt as split attention."""
    rc, selected, atts, mask, parts = edits.rc, edits.selected, edits.atts, edits.mask, edits.parts
    if parts is None:
        return split_result(model, rc, selected)
    graph = model.graph
    gops = Ops(graph, f"{NODE_PREFIX}geometry")
    geometry = Geometry(gops, mask, rc)
    gops.insert_before(atts[selected[0]])
    for layer in selected:
        _layer(graph, atts[layer], layer, rc, geometry, mask, parts[layer])
    for name, value in list(graph.initializers.items()):  # the replaced nodes' packed QKV weights
        if not list(value.uses()) and not any(value is o for o in graph.outputs):
            del graph.initializers[name]
    if MS_DOMAIN not in model.opset_imports:
        model.opset_imports[MS_DOMAIN] = 1
    return split_result(model, rc, selected)


FUSED_RULE = Rule(FUSED, _find_fused, _rewrite_fused, (SplitPlacementError,))
