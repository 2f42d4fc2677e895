"""Row placement's plain rule: the pooling row recomputed beside each calibrated layer's value MatMul,
on a graph with explicit attention (Softmax between two MatMuls).

Why a rule of its own: the fused rule (`row_placement`) reads the layer from ONNX Runtime's packed
`Attention` node, which a plain graph does not have; this one walks the explicit attention instead
(`attention_chain`), so it applies to any architecture and exporter (Qwen3 with GQA and rotary,
ModernBERT, ...), and it is the row placement's portable graph.

For each selected layer: gather the pooling row of the scores MatMul's Q input (after rotary, with
GQA keys already repeated), replay the scale/mask chain on that row, Softmax, calibrate, multiply
by V, and overwrite that row of the value MatMul's output.  The layer's own Softmax path stays
untouched, so the other rows are computed exactly as before.  Every refusal, for every selected
layer, comes before the first edit; the checks read ranks from ONNX's shape inference, which `find`
takes off again and `rewrite` redoes (`placement_base.checked_on_inferred_shapes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ...calibration.config import CalibrationConfig, ResolvedCalibration
from .attention_chain import PlainAttention, replay_chain, side_inputs, walk_layer
from ..builder import Ops as _Ops
from ..builder import graph_input
from ..ops.contract import DOMAIN, VERSION, op_spec
from .placement_base import PLAIN, PlacementResult, Rule, checked_on_inferred_shapes, keep_inferred_shapes
from .row_placement import NODE_PREFIX, REFUSES, RowPlacementError, check_request, pooled_function, row_result
from .softmax_pattern import AttentionSoftmax, find_attention_softmaxes


def _takes_row(v: ir.Value, node: ir.Node) -> bool:
    """Whether the chain's side input `v` (of `node`) is cut to the pooling row: computed rank-4
    inputs (per-row masks) are; constants and graph inputs broadcast as they are.  A computed input
    of unknown rank is refused: gathering a row from a tensor without one would be wrong."""
    if v.const_value is None and v.producer() is not None and v.producer().op_type != "Constant":
        if v.shape is None:
            raise RowPlacementError(f"unknown rank of {v.name} feeding {node.name}: a rank-4 (per-row) input must "
                                    "be cut to the pooling row, so its rank must be known")
        return v.shape.rank() == 4
    return False


def _check_plain_layer(att: AttentionSoftmax) -> PlainAttention:
    """Every refusal for one layer of a plain graph (shapes inferred)."""
    if att.calibration is not None:
        raise RowPlacementError("the graph already contains attncal calibration nodes")
    walked = walk_layer(att, RowPlacementError)
    for v, node, _ in side_inputs(walked.chain, walked.scores_mm.outputs[0]):
        _takes_row(v, node)
    return walked


@dataclass(frozen=True)
class _PlainEdits:
    rc: ResolvedCalibration
    selected: list[int]
    mask: ir.Value
    function: ir.Function
    layers: list[PlainAttention]  # the selected layers, walked and checked


def find(model: ir.Model, config: CalibrationConfig, num_layers: int,
         mask_input: str = "attention_mask") -> _PlainEdits:
    """Every refusal of row placement on the plain graph, for every selected layer; no edit."""
    rc = config.resolve()
    if rc.all_rows:
        raise RowPlacementError("row placement needs a single pooling row; mean pooling keeps the softmax placement")
    refusal = check_request(rc, "fp32")
    if refusal is not None:
        raise refusal.exception()
    graph = model.graph
    mask = graph_input(graph, mask_input, RowPlacementError)
    selected = config.layer_indices(num_layers)
    fn = pooled_function(model)
    # Side inputs of the scale/mask chain are row-gathered only when they are rank 4, so ranks must be known.
    layers = checked_on_inferred_shapes(model, lambda: [_check_plain_layer(att) for att in
                                                        find_attention_softmaxes(graph, num_layers)
                                                        if att.layer in selected])
    return _PlainEdits(rc, selected, mask, fn, layers)


def rewrite(model: ir.Model, edits: _PlainEdits) -> PlacementResult:
    """The pooling row recomputed beside each checked layer (the side inputs' ranks inferred again)."""
    keep_inferred_shapes(model)
    for layer in edits.layers:
        _calibrate_plain_layer(model.graph, layer, edits.rc, edits.mask)
    model.opset_imports[DOMAIN] = VERSION
    model.functions[edits.function.identifier()] = edits.function
    return row_result(model, edits.rc, edits.selected)


def _calibrate_plain_layer(graph: ir.Graph, att: PlainAttention, rc: ResolvedCalibration, mask: ir.Value) -> None:
    """The pooling row recomputed beside one checked layer of a plain graph."""
    i64 = np.int64
    scores_mm, chain, post, value_mm = att.scores_mm, att.chain, att.post, att.value_mm
    ops = _Ops(graph, f"{NODE_PREFIX}layer{att.layer}")
    c = lambda name, arr: ops.const(name, np.asarray(arr))  # noqa: E731
    valid = ops("Cast", mask, to=ir.DataType.BOOL)
    seq = ops("Gather", ops("Shape", mask), c("one", i64(1)), axis=0)
    pos = ops("Range", c("zero", i64(0)), seq, c("step", i64(1)))
    if rc.pool_last:
        row = ops("Max", ops("ReduceMax", ops("Where", valid, pos, c("neg", i64(-1))), c("ax1", np.array([1], i64)),
                             keepdims=1), c("z", i64(0)))
    else:
        row = ops("Min", ops("ReduceMin", ops("Where", valid, pos, seq), c("ax1", np.array([1], i64)), keepdims=1),
                  ops("Sub", seq, c("one_b", i64(1))))
    row4 = ops("Unsqueeze", row, c("ax23", np.array([2, 3], i64)))  # [B,1,1,1]

    def take_row(t: ir.Value, tag: str) -> ir.Value:
        """Row `row[b]` of axis 2 of a rank-4 tensor (clamped, so broadcast rows of size 1 work)."""
        shape = ops("Shape", t)
        bsz = ops("Gather", ops("Shape", mask), c(f"{tag}_b0", i64(0)), axis=0)
        full = ops("Concat", ops("Unsqueeze", bsz, c(f"{tag}_u0", np.array([0], i64))),
                   ops("Slice", shape, c(f"{tag}_s1", np.array([1], i64)), c(f"{tag}_s4", np.array([4], i64))), axis=0)
        t_b = ops("Expand", t, full)  # batch-broadcast side inputs get a batch dim
        idx_shape = ops("Concat", ops("Slice", full, c(f"{tag}_a", np.array([0], i64)), c(f"{tag}_b", np.array([2], i64))),
                        c(f"{tag}_one", np.array([1], i64)),
                        ops("Slice", full, c(f"{tag}_c", np.array([3], i64)), c(f"{tag}_d", np.array([4], i64))), axis=0)
        last = ops("Sub", ops("Gather", full, c(f"{tag}_two", i64(2)), axis=0), c(f"{tag}_one_s", i64(1)))
        idx = ops("Expand", ops("Min", row4, last), idx_shape)
        return ops("GatherElements", t_b, idx, axis=2)

    q_row = take_row(scores_mm.inputs[0], "q")
    cur = ops("MatMul", q_row, scores_mm.inputs[1])  # [B,H,1,S]

    def side(v: ir.Value, node: ir.Node, k: int) -> ir.Value:
        """Side inputs computed per row (rank-4 masks) are cut to the pooling row."""
        return take_row(v, f"side{k}") if _takes_row(v, node) else v

    cur = replay_chain(ops, chain, scores_mm.outputs[0], cur, side)
    attrs = {a.name: a.value for a in att.softmax.attributes.values()}
    cur = ops("Softmax", cur, **attrs)
    spec = op_spec(rc, att.layer)
    cur = ops(spec.op_type, cur, mask, domain=DOMAIN, **spec.attrs)
    for node in post:
        cur = ops(node.op_type, cur, **{a.name: a.value for a in node.attributes.values()})
    ctx_row = ops("MatMul", cur, value_mm.inputs[1])  # [B,H,1,D]
    out = value_mm.outputs[0]
    uses = list(out.uses())
    idx = ops("Expand", row4, ops("Shape", ctx_row))
    new_out = ops("ScatterElements", out, idx, ctx_row, axis=2)
    for user, i in uses:
        user.replace_input_with(i, new_out)
    ops.insert_after(value_mm)


RULE = Rule(PLAIN, find, rewrite, REFUSES)
