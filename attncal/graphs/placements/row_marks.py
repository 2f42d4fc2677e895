"""The calibration mask of a row-set pooling (lmk, multi-cls, mean-every), built in the graph from its token ids: the one
helper of every placement that calibrates marked rows.

The calibration ops take the rows to calibrate in their `attention_mask` input (attncal.graphs.ops.contract, "Marked
rows"): 0 at padding, 1 at a valid token, `ROW_MARK` at a valid token whose row is pooled.  The exported graph's
inputs stay `input_ids` and `attention_mask`; these few nodes derive the marks from them once per batch, as
`ResolvedCalibration.marked_mask` does in PyTorch:

    lmk, multi-cls: rows = valid AND input_ids == token_id
    mean-every:  rank = CumSum(valid), count = its last column (the valid tokens)
                 rows = valid AND (rank mod k == 0 OR (count < k AND rank == count))
                 (the k-th, 2k-th, ... valid token; a text shorter than k: its last)
    mask         = Cast(valid) + Cast(rows)

Two steps, as every placement's rule: `find_ids` (the refusal: a graph without `input_ids`) makes no edit, and
`insert` adds the nodes at the top of the graph and returns the mask the ops take.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ...calibration.config import ResolvedCalibration
from ..builder import Ops, graph_input

IDS_INPUT = "input_ids"
NODE_PREFIX = "attncal_row_marks"


def find_ids(graph: ir.Graph, rc: ResolvedCalibration, error: type[Exception]) -> ir.Value | None:
    """The token-id input the marks are derived from (`error` when the graph has none), or None where the
    config marks no rows (not a row-set pooling, or strength 0: the ops then calibrate nothing)."""
    if not rc.row_set or rc.strength == 0.0:
        return None
    try:
        return graph_input(graph, IDS_INPUT, error)
    except error as exc:
        raise error(f"{rc.pooling} pooling marks its calibrated rows from the token ids: {exc}") from None


def insert(graph: ir.Graph, rc: ResolvedCalibration, mask: ir.Value, ids: ir.Value | None) -> ir.Value:
    """The mask the calibration ops take: `mask` itself where `ids` is None, else the marked mask, its nodes
    inserted before the graph's first node."""
    if ids is None:
        return mask
    ops = Ops(graph, NODE_PREFIX)
    valid = ops("Not", ops("Equal", mask, ops.const("zero", np.array(0, dtype=mask.dtype.numpy()))))
    if rc.pooling.inserts:
        token = ops.const("token", np.array(rc.pooling.token_id, dtype=ids.dtype.numpy()))
        rows = ops("And", valid, ops("Equal", ids, token))
    else:
        i64 = np.int64
        rank = ops("CumSum", ops("Cast", valid, to=ir.DataType.INT64), ops.const("axis", np.array(1, dtype=i64)))
        k = ops.const("every", np.array(rc.pooling.every, dtype=i64))
        kth = ops("Equal", ops("Mod", rank, k), ops.const("zero_i64", np.array(0, dtype=i64)))
        count = ops("ReduceMax", rank, ops.const("last_axis", np.array([1], dtype=i64)), keepdims=1)
        last = ops("And", ops("Less", count, k), ops("Equal", rank, count))
        rows = ops("And", valid, ops("Or", kth, last))
    marked = ops("Add", ops("Cast", valid, to=ir.DataType.INT64), ops("Cast", rows, to=ir.DataType.INT64))
    marked.name, marked.type = f"{NODE_PREFIX}/attention_mask", ir.TensorType(ir.DataType.INT64)
    marked.shape = mask.shape
    ops.insert_before(next(iter(graph)))
    return marked
