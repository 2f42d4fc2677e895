"""Row placement: calibrate the pooling row only, recomputed beside the attention, so that an ONNX
Runtime-optimized graph keeps every fused attention node.  This module holds the placement's error,
what its two rules share, and its fused rule; the plain rule is `row_plain_placement`.

Placing the calibration op between Softmax and the value MatMul stops
`onnxruntime.transformers.optimizer` from fusing that layer into an
`Attention` node, so calibrated layers materialise [B,H,S,S] probabilities.
Row placement instead keeps every fused `com.microsoft::Attention` node and
recomputes only the pooling row beside it:

    q      = x[b, row] · W_q + b_q                          (one row, [B,H,1,D])
    s_j    = ((q·W_kᵀ)·x_j + q·b_k) · scale + mask_j        (= q·k_j: K is never materialised)
    p      = PooledRowCalibration(softmax(s), attention_mask)   (the same op, Q == 1)
    ctx[b, row] = (p·x)·W_v + (Σp)·b_v                      (= p·V; written in place before the output projection)

This is exact: within a layer no other row depends on the pooling row.  It
costs O(B·H·S·hidden) per layer and allocates only [B,H,1,·]-sized tensors;
the fused node is left exactly as the optimizer made it.  We calibrate the *optimized* graph (rather than
rewriting the unoptimized one into a shape the fuser still accepts) because
the fused node is the stable interface: the fuser's pattern rules change
between ORT releases, the fused node's inputs (packed QKV weights and bias) do
not.

Scope: fused `Attention` nodes as produced for BERT-family encoders (BERT,
XLM-R, all-MiniLM).  Mean pooling calibrates every row (AllRowsCalibration)
and keeps the softmax placement; so do graphs the optimizer does not fuse
(Qwen3, ModernBERT), where there is no fusion to lose.

The two rules, chosen by the placement from the graph (`placement_base.Placement.rule_for`):
* `FUSED_RULE` (here): beside each fused `com.microsoft::Attention` node (above);
* `row_plain_placement.RULE`: on a plain graph (explicit Softmax between two MatMuls), the
  pooling row recomputed beside the value MatMul, for any architecture.
Each runs every refusal, for every calibrated layer, before its first edit.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from ...artifact import ONNX_FILE, ONNX_SUBDIR, OPTIMIZED_FILE, pooling_of, read_metadata, save_onnx, write_metadata
from ...calibration.config import CalibrationConfig, ResolvedCalibration
from . import placement_names
from ..builder import Ops as _Ops
from ..ops.contract import DOMAIN, POOLED_OP, VERSION, op_spec
from ..ops.function_body import make_function
from .placement_base import (FUSED, PlacementResult, Refusal, Rule, accepted, count_fused_attention,
                             fused_attention_parts, fused_layers)
from .rewrite import model_opset
from .softmax_pattern import SoftmaxPatternError

# Node-name prefix of everything both rules add (the calibrated row's standard-op math): the placement's
# `float32_nodes`, kept float32 in a float16 graph (attncal.exporting.fp16).
NODE_PREFIX = "attncal_row_"


class RowPlacementError(ValueError):
    """Row placement does not apply to this graph or config."""


REFUSES = (RowPlacementError, SoftmaxPatternError)  # SoftmaxPatternError: a model without a default opset


def check_request(rc: ResolvedCalibration, precision: str) -> Refusal | None:
    """An explicit row placement needs a single pooling row (every precision)."""
    if rc.all_rows:
        return Refusal(RowPlacementError, "row placement needs a single pooling row; mean pooling calibrates every "
                                          "row: use --placement split (or auto)")
    if rc.row_set:
        return Refusal(RowPlacementError, _MANY_ROWS.format(rc.pooling))
    return None


# The refusal of a row-set pooling, by every rule of the placement.
_MANY_ROWS = ("row placement needs a single pooling row; {} pooling calibrates every row marked from the token ids: "
              "use --placement fused-softmax, softmax or attention (or auto)")


def pooled_function(model: ir.Model) -> ir.Function:
    """The pooled op's model-local body at the model's opset (refuses a model without one)."""
    return ir.serde.deserialize_function(make_function(POOLED_OP, model_opset(model)))


def row_result(model: ir.Model, rc: ResolvedCalibration, layers: list[int]) -> PlacementResult:
    """What either rule returns: the pooled op, its attributes, the fused attention left in the graph."""
    spec = op_spec(rc, 0)
    attrs = {k: v for k, v in spec.attrs.items() if k != "layer"}
    return PlacementResult(layers, spec.op_type, attrs, count_fused_attention(model))


@dataclass(frozen=True)
class _FusedEdits:
    rc: ResolvedCalibration
    selected: list[int]
    atts: list[ir.Node]  # one fused Attention node per layer
    mask: ir.Value
    parts: dict[int, tuple[ir.Value, np.ndarray, np.ndarray, int, float]]  # fused_attention_parts per selected layer
    function: ir.Function


def _find_fused(model: ir.Model, config: CalibrationConfig, num_layers: int,
                mask_input: str = "attention_mask") -> _FusedEdits:
    """Every refusal of row placement beside the fused Attention nodes, for every selected layer; no edit."""
    rc = config.resolve()
    if rc.all_rows:
        raise RowPlacementError(
            "row placement needs a single pooling row; mean pooling calibrates every row "
            "(AllRowsCalibration) and keeps the softmax placement"
        )
    if rc.row_set:
        raise RowPlacementError(_MANY_ROWS.format(rc.pooling))
    atts, mask = fused_layers(model, num_layers, mask_input, RowPlacementError, "row placement needs",
                              ". Run onnxruntime.transformers.optimizer on a TorchScript export first, or use the "
                              "softmax placement")
    selected = config.layer_indices(num_layers)
    parts = {layer: fused_attention_parts(atts[layer], RowPlacementError) for layer in selected}
    return _FusedEdits(rc, selected, atts, mask, parts, pooled_function(model))


def _rewrite_fused(model: ir.Model, edits: _FusedEdits) -> PlacementResult:
    """Row-placement calibration beside the fused Attention nodes of the selected layers."""
    for layer in edits.selected:
        _calibrate_layer(model.graph, edits.atts[layer], layer, edits.rc, edits.mask, edits.parts[layer])
    model.opset_imports[DOMAIN] = VERSION
    model.functions[edits.function.identifier()] = edits.function
    return row_result(model, edits.rc, edits.selected)


def _calibrate_layer(graph: ir.Graph, att: ir.Node, layer: int, rc: ResolvedCalibration, mask: ir.Value,
                     parts: tuple[ir.Value, np.ndarray, np.ndarray, int, float]) -> None:
    """The pooling row recomputed beside one fused node (`parts`: `fused_attention_parts` of it)."""
    x, W, bvec, heads, scale = parts
    hidden = W.shape[1] // 3
    head = hidden // heads
    ops = _Ops(graph, f"{NODE_PREFIX}layer{layer}")
    i64 = np.int64
    Wq, Wk, Wv = (np.ascontiguousarray(W[:, i * hidden : (i + 1) * hidden]) for i in range(3))
    bq, bk, bv = (bvec[i * hidden : (i + 1) * hidden].copy() for i in range(3))
    # The pooling row index per item: first or last valid token.
    valid = ops("Cast", mask, to=ir.DataType.BOOL)
    pos = ops("Range", ops.const("zero", np.array(0, i64)), ops("Gather", ops("Shape", mask), ops.const("one", np.array(1, i64)), axis=0),
              ops.const("step", np.array(1, i64)))
    big = ops("Gather", ops("Shape", mask), ops.const("one_b", np.array(1, i64)), axis=0)
    if rc.pool_last:
        row = ops("ReduceMax", ops("Where", valid, pos, ops.const("neg", np.array(-1, i64))), ops.const("ax1", np.array([1], i64)), keepdims=1)
        row = ops("Max", row, ops.const("zero_r", np.array(0, i64)))
    else:
        row = ops("ReduceMin", ops("Where", valid, pos, big), ops.const("ax1", np.array([1], i64)), keepdims=1)
        row = ops("Min", row, ops("Sub", big, ops.const("one_r", np.array(1, i64))))
    # q for the pooling row only.
    x_shape = ops("Shape", x)
    idx_shape = ops("Concat", ops("Slice", x_shape, ops.const("s0", np.array([0], i64)), ops.const("s1", np.array([1], i64))),
                    ops.const("one_v", np.array([1], i64)),
                    ops("Slice", x_shape, ops.const("s2", np.array([2], i64)), ops.const("s3", np.array([3], i64))), axis=0)
    row_idx = ops("Expand", ops("Unsqueeze", row, ops.const("ax2", np.array([2], i64))), idx_shape)  # [B,1,hidden]
    x_row = ops("GatherElements", x, row_idx, axis=1)
    q = ops("Add", ops("MatMul", x_row, ops.const("wq", Wq)), ops.const("bq", bq))
    q = ops("Transpose", ops("Reshape", q, ops.const("qshape", np.array([0, 1, heads, head], i64))), perm=[0, 2, 1, 3])
    # Scores without materialising K: q·k_j = (q·W_kᵀ)·x_j + q·b_k, per head.
    wk_heads = np.ascontiguousarray(Wk.reshape(hidden, heads, head).transpose(1, 2, 0))  # [H,D,hidden]
    u = ops("MatMul", q, ops.const("wk_heads", wk_heads))  # [B,H,1,hidden]
    qb = ops("ReduceSum", ops("Mul", q, ops.const("bk_heads", bk.reshape(1, heads, 1, head))),
             ops.const("axl", np.array([-1], i64)), keepdims=1)  # [B,H,1,1]
    x4 = ops("Unsqueeze", x, ops.const("ax1x", np.array([1], i64)))  # [B,1,S,hidden]
    col = ops("MatMul", x4, ops("Transpose", u, perm=[0, 1, 3, 2]))  # [B,H,S,1]
    scores = ops("Reshape", col, ops.const("sshape", np.array([0, 0, 1, -1], i64)))  # [B,H,1,S], same layout
    scores = ops("Mul", ops("Add", scores, qb), ops.const("scale", np.array(scale, np.float32)))
    neg = np.finfo(np.float32).min
    mask_add = ops("Where", ops("Unsqueeze", valid, ops.const("ax12", np.array([1, 2], i64))),
                   ops.const("m0", np.array(0.0, np.float32)), ops.const("mneg", np.array(neg, np.float32)))
    probs = ops("Softmax", ops("Add", scores, mask_add), axis=-1)  # [B,H,1,S]
    spec = op_spec(rc, layer)
    calibrated = ops(spec.op_type, probs, mask, domain=DOMAIN, **spec.attrs)
    # p·v_j summed without materialising V: (p·x)·W_v + (Σp)·b_v, per head.
    px = ops("MatMul", calibrated, x4)  # [B,H,1,hidden]
    wv_heads = np.ascontiguousarray(Wv.reshape(hidden, heads, head).transpose(1, 0, 2))  # [H,hidden,D]
    mass = ops("ReduceSum", calibrated, ops.const("axl2", np.array([-1], i64)), keepdims=1)  # [B,H,1,1]
    ctx_row = ops("Add", ops("MatMul", px, ops.const("wv_heads", wv_heads)),
                  ops("Mul", mass, ops.const("bv_heads", bv.reshape(1, heads, 1, head))))  # [B,H,1,D]
    ctx_row = ops("Reshape", ops("Transpose", ctx_row, perm=[0, 2, 1, 3]), ops.const("cshape", np.array([0, 1, hidden], i64)))
    # Overwrite the pooling row of the fused node's context, before the output projection.
    ctx = att.outputs[0]
    uses = list(ctx.uses())
    new_ctx = ops("ScatterElements", ctx, row_idx, ctx_row, axis=1)
    new_ctx.name = f"{ops.prefix}/context"
    for user, i in uses:
        user.replace_input_with(i, new_ctx)
    ops.insert_after(att)


FUSED_RULE = Rule(FUSED, _find_fused, _rewrite_fused, REFUSES)


def calibrate_optimized(src: str | os.PathLike, dest: str | os.PathLike, config: CalibrationConfig) -> dict:
    """Row-placement calibration of an optimized export directory `src` into `dest` (atomic)."""
    import onnx

    src, dest = Path(src), Path(dest)
    meta = read_metadata(src)
    config = config.bind(pooling_of(meta))
    model = ir.load(src / ONNX_SUBDIR / ONNX_FILE)
    layers = FUSED_RULE.apply(model, accepted(FUSED_RULE.check(model, config, int(meta["num_layers"])))).layers
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    save_onnx(model, tmp / ONNX_SUBDIR / ONNX_FILE)
    (tmp / ONNX_SUBDIR / OPTIMIZED_FILE).unlink(missing_ok=True)  # model.onnx is the calibrated graph now
    meta.pop("graphs", None)
    onnx.checker.check_model(str(tmp / ONNX_SUBDIR / ONNX_FILE))
    meta.update(calibrated=True, config=config.to_dict(), calibrated_layers=layers, op_type=POOLED_OP,
                placement=placement_names.ROW, parity=None)
    write_metadata(tmp, meta)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return meta

