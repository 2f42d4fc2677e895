"""Split placement's plain rule: calibration as split attention on a graph with explicit attention
(Softmax between two MatMuls), in standard ONNX only: no custom op and no function body.

Why a rule of its own: the fused rule (`split_placement`) rebuilds a layer from ONNX Runtime's packed
`Attention` node, which a plain graph does not have; this one walks the explicit attention
(`attention_chain`) and writes the basket terms as one batched attention per layer: the queries
against the keys and values gathered into [B,H,n,S,·] basket layout (per item, so left padding
works), the layer's own scale/mask chain replayed on the basket scores (causal and sliding-window
masks included), Softmax over each basket, MatMul with the basket values.  That is the MatMul →
Softmax → MatMul shape other runtimes (TensorRT) fuse into their attention kernels.

Every refusal, for every selected layer, comes before the first edit; the checks read ranks and
dtypes from ONNX's shape inference, which `find` takes off again and `rewrite` redoes
(`placement_base.checked_on_inferred_shapes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ...calibration.config import MODE_ORIGINAL, CalibrationConfig, ResolvedCalibration
from .attention_chain import PlainAttention, replay_chain, side_inputs, walk_layer
from ..builder import Ops, graph_input
from .placement_base import PLAIN, PlacementResult, Rule, checked_on_inferred_shapes, keep_inferred_shapes
from .softmax_pattern import AttentionSoftmax, SoftmaxPatternError, find_attention_softmaxes
from .split_placement import (NODE_PREFIX, Geometry, SplitPlacementError, coefficients, equal_or_fixed_share, f32, i64,
                              item, split_result, unsupported_config)


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


@dataclass(frozen=True)
class _PlainEdits:
    rc: ResolvedCalibration
    selected: list[int]
    mask: ir.Value
    layers: list[PlainAttention] | None  # the selected layers, walked and checked; None at strength 0


def find(model: ir.Model, config: CalibrationConfig, num_layers: int,
         mask_input: str = "attention_mask") -> _PlainEdits:
    """Every refusal of split placement on the plain graph, for every selected layer; no edit."""
    rc = config.resolve()
    graph = model.graph
    if any(n.domain == "ai.attncal" for n in graph):
        raise SplitPlacementError("the graph already contains attncal calibration nodes")
    mask = graph_input(graph, mask_input, SplitPlacementError)
    if rc.row_set:
        raise unsupported_config(rc).exception()
    selected = config.layer_indices(num_layers)
    if rc.strength == 0.0:
        return _PlainEdits(rc, selected, mask, None)
    layers = checked_on_inferred_shapes(model, lambda: [_check_plain_layer(graph, att) for att in
                                                        find_attention_softmaxes(graph, num_layers)
                                                        if att.layer in selected])
    return _PlainEdits(rc, selected, mask, layers)


def rewrite(model: ir.Model, edits: _PlainEdits) -> PlacementResult:
    """The split attention of each checked layer (shapes inferred again, as the check saw them; the
    written graph keeps them, at strength 0 too).

    long: a layer's basket attention is one sequence of nodes (the basket gathers, the replayed chain, Softmax,
    MatMul, the blend), each read by the next only."""
    keep_inferred_shapes(model)
    if edits.layers is None:
        return split_result(model, edits.rc, edits.selected)
    rc, mask, layers, graph = edits.rc, edits.mask, edits.layers, model.graph
    gops = Ops(graph, f"{NODE_PREFIX}geometry")
    g = Geometry(gops, mask, rc)
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
        ops = Ops(graph, f"{NODE_PREFIX}layer{att.layer}")
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
                shares.append(equal_or_fixed_share(ops, g, mode, weight, 4, tag))
        lam_rows = ops("Mul", item(ops, g.lam, 4, "lam_r"), rows)  # [B,1,Q,1]: calibrated rows only
        coef_full, coef_b, coef_i = coefficients(ops, g, rc, shares, n_ne, lam_rows, 4, "row")
        ctx = value_mm.outputs[0]
        uses = list(ctx.uses())
        out = ops("Add", ops("Mul", ctx, coef_full), ops("Mul", acc, coef_b))
        for ci, vi in zip(coef_i, vis):
            out = ops("Add", out, ops("Mul", vi, ci))
        out.name = f"{ops.prefix}/context"
        for user, i in uses:
            user.replace_input_with(i, out)
        ops.insert_after(value_mm)
    return split_result(model, rc, edits.selected)


RULE = Rule(PLAIN, find, rewrite, (SplitPlacementError, SoftmaxPatternError))
