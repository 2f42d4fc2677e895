"""Row placement: calibrate an ONNX Runtime-optimized graph without giving up fused attention.

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

Two rewrites, chosen by `place` from the graph:
* `insert_row_calibration`: beside each fused `com.microsoft::Attention` node (above);
* `insert_row_calibration_unfused`: on a plain graph (explicit Softmax between two MatMuls), the
  pooling row recomputed beside the value MatMul, for any architecture.
Each runs every refusal, for every calibrated layer, before its first edit.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir

from ..calibration.config import CalibrationConfig, ResolvedCalibration
from .contract import DOMAIN, POOLED_OP, VERSION, op_spec
from .attention_chain import PlainAttention, inferred_shapes, replay_chain, side_inputs, walk_layer
from .builder import Ops as _Ops
from .builder import graph_input
from .placement_base import PlacementResult, count_fused_attention, fused_attention_parts, fused_layers, has_fused_attention
from .function_body import make_function
from .rewrite import model_opset
from .softmax_pattern import AttentionSoftmax, find_attention_softmaxes


NAME = "row"
OPTIMIZE_FIRST = True
# Node-name prefix of the calibrated row's standard-op math, kept float32 in a float16 graph (attncal.export.fp16).
FLOAT32_NODES: str | None = "attncal_row_"


class RowPlacementError(ValueError):
    """Row placement does not apply to this graph or config."""


def place(model: ir.Model, config: CalibrationConfig, num_layers: int) -> PlacementResult:
    """Row placement on whichever graph this is: beside fused Attention nodes, or on the plain graph."""
    if has_fused_attention(model):
        layers = insert_row_calibration(model, config, num_layers)
    else:
        layers = insert_row_calibration_unfused(model, config, num_layers)
    spec = op_spec(config.resolve(), 0)
    attrs = {k: v for k, v in spec.attrs.items() if k != "layer"}
    return PlacementResult(layers, spec.op_type, attrs, count_fused_attention(model))


def _pooled_function(model: ir.Model) -> ir.Function:
    """The pooled op's model-local body at the model's opset (refuses a model without one)."""
    return ir.serde.deserialize_function(make_function(POOLED_OP, model_opset(model)))


def insert_row_calibration(model: ir.Model, config: CalibrationConfig, num_layers: int,
                           mask_input: str = "attention_mask") -> list[int]:
    """Add row-placement calibration to the fused Attention nodes of the selected layers; returns them.

    Every refusal, for every selected layer, comes before the first edit."""
    rc = config.resolve()
    if rc.all_rows:
        raise RowPlacementError(
            "row placement needs a single pooling row; mean pooling calibrates every row "
            "(AllRowsCalibration) and keeps the softmax placement"
        )
    graph = model.graph
    atts, mask = fused_layers(model, num_layers, mask_input, RowPlacementError, "row placement needs",
                              ". Run onnxruntime.transformers.optimizer on a TorchScript export first, or use the "
                              "softmax placement")
    selected = config.layer_indices(num_layers)
    parts = {layer: fused_attention_parts(atts[layer], RowPlacementError) for layer in selected}
    fn = _pooled_function(model)
    for layer in selected:
        _calibrate_layer(graph, atts[layer], layer, rc, mask, parts[layer])
    model.opset_imports[DOMAIN] = VERSION
    model.functions[fn.identifier()] = fn
    return selected


def _calibrate_layer(graph: ir.Graph, att: ir.Node, layer: int, rc: ResolvedCalibration, mask: ir.Value,
                     parts: tuple[ir.Value, np.ndarray, np.ndarray, int, float]) -> None:
    """The pooling row recomputed beside one fused node (`parts`: `fused_attention_parts` of it)."""
    x, W, bvec, heads, scale = parts
    hidden = W.shape[1] // 3
    head = hidden // heads
    ops = _Ops(graph, f"attncal_row_layer{layer}")
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


def calibrate_optimized(src: str | os.PathLike, dest: str | os.PathLike, config: CalibrationConfig) -> dict:
    """Row-placement calibration of an optimized export directory `src` into `dest` (atomic)."""
    import onnx

    from ..artifact import ONNX_FILE, ONNX_SUBDIR, OPTIMIZED_FILE, read_metadata, save_onnx, write_metadata

    src, dest = Path(src), Path(dest)
    meta = read_metadata(src)
    pooling = meta["pooling"] if config.pooling == "auto" else config.pooling
    config = config.with_pooling(pooling)
    model = ir.load(src / ONNX_SUBDIR / ONNX_FILE)
    layers = insert_row_calibration(model, config, int(meta["num_layers"]))
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    save_onnx(model, tmp / ONNX_SUBDIR / ONNX_FILE)
    (tmp / ONNX_SUBDIR / OPTIMIZED_FILE).unlink(missing_ok=True)  # model.onnx is the calibrated graph now
    meta.pop("graphs", None)
    onnx.checker.check_model(str(tmp / ONNX_SUBDIR / ONNX_FILE))
    meta.update(calibrated=True, config=config.to_dict(), calibrated_layers=layers, op_type=POOLED_OP,
                placement="row", parity=None)
    write_metadata(tmp, meta)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return meta


# ---------------------------------------------------------------------------------------------
# Row placement on unfused graphs (any architecture: Qwen3 with GQA and rotary, ModernBERT, ...)
# ---------------------------------------------------------------------------------------------
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


def insert_row_calibration_unfused(model: ir.Model, config: CalibrationConfig, num_layers: int,
                                   mask_input: str = "attention_mask") -> list[int]:
    """Row placement on a graph with explicit attention (Softmax between two MatMuls).

    For each selected layer: gather the pooling row of the scores MatMul's Q input (after rotary,
    with GQA keys already repeated), replay the scale/mask chain on that row, Softmax, calibrate,
    multiply by V, and overwrite that row of the value MatMul's output.  The layer's own Softmax
    path stays untouched, so the other rows are computed exactly as before.  Every refusal, for
    every selected layer, comes before the first edit (shape inference, which the checks need, is
    undone on a refusal).
    """
    rc = config.resolve()
    if rc.all_rows:
        raise RowPlacementError("row placement needs a single pooling row; mean pooling keeps the softmax placement")
    graph = model.graph
    mask = graph_input(graph, mask_input, RowPlacementError)
    selected = config.layer_indices(num_layers)
    fn = _pooled_function(model)
    # Side inputs of the scale/mask chain are row-gathered only when they are rank 4, so ranks must be known.
    with inferred_shapes(model):
        layers = [_check_plain_layer(att) for att in find_attention_softmaxes(graph, num_layers)
                  if att.layer in selected]
    for layer in layers:
        _calibrate_plain_layer(graph, layer, rc, mask)
    model.opset_imports[DOMAIN] = VERSION
    model.functions[fn.identifier()] = fn
    return selected


def _calibrate_plain_layer(graph: ir.Graph, att: PlainAttention, rc: ResolvedCalibration, mask: ir.Value) -> None:
    """The pooling row recomputed beside one checked layer of a plain graph."""
    i64 = np.int64
    scores_mm, chain, post, value_mm = att.scores_mm, att.chain, att.post, att.value_mm
    ops = _Ops(graph, f"attncal_row_layer{att.layer}")
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
