"""Rewrites of the portable graph that let ONNX Runtime apply, at load time, the fusions it applies to
optimum's and TorchScript exports of the same model.  Values are unchanged; the
graph stays standard ONNX.  The exporter runs both (`ERF_GELU`, `INTERMEDIATE_SHAPES`: `attncal.graphs.fusions.passes`)
after the placement, before saving `onnx/model.onnx` and the native graph of a plain export (docs/cli.md,
"The exporter")."""

from __future__ import annotations

from ..builder import scalar_value
from ..pass_base import IR, GraphPass


def _scalar_is(value, expected: float) -> bool:
    """`value` is a constant one-element tensor (initializer or Constant) equal to `expected`."""
    v = scalar_value(value)
    return v is not None and abs(v - expected) <= 1e-6 * max(1.0, abs(expected))


def reorder_erf_gelu(model) -> int:
    """Rewrite the exact GELU the dynamo exporter writes, x * (0.5 * (1 + erf(x / sqrt(2)))), as
    (x * 0.5) * (1 + erf(x / sqrt(2))); returns how many were rewritten.

    Same ops, same values (a product with 0.5 is exact), but ONNX Runtime's GeluFusion matches
    only the latter (or x * (1 + erf) * 0.5): its Mul after the Add must take x or a Mul(x, 0.5).
    Matched, ORT fuses Div/Erf/Add/Mul/Mul and the dense bias Add into one BiasGelu at load time."""
    count = 0
    for half in list(model.graph):
        if half.op_type != "Mul" or half.domain not in ("", "ai.onnx") or len(half.inputs) != 2:
            continue
        c = 0 if _scalar_is(half.inputs[0], 0.5) else 1 if _scalar_is(half.inputs[1], 0.5) else None
        if c is None:
            continue
        add = half.inputs[1 - c].producer() if half.inputs[1 - c] is not None else None
        if add is None or add.op_type != "Add" or len(add.inputs) != 2:
            continue
        erfs = [v.producer() for v in add.inputs if v is not None and v.producer() is not None
                and v.producer().op_type == "Erf"]
        if len(erfs) != 1 or not _scalar_is(add.inputs[1] if add.inputs[0] is erfs[0].outputs[0] else add.inputs[0],
                                             1.0):
            continue
        div = erfs[0].inputs[0].producer()
        if div is None or div.op_type != "Div" or not _scalar_is(div.inputs[1], 2.0 ** 0.5):
            continue
        x = div.inputs[0]
        uses = list(half.outputs[0].uses())
        if len(uses) != 1 or half.outputs[0].is_graph_output():
            continue
        outer, index = uses[0]
        if outer.op_type != "Mul" or outer.inputs[1 - index] is not x:
            continue
        half.replace_input_with(1 - c, x)  # half = x * 0.5
        outer.replace_input_with(1 - index, add.outputs[0])  # outer = half * (1 + erf)
        count += 1
    return count


def drop_intermediate_shapes(model) -> int:
    """Forget the shapes the dynamo exporter records on intermediate values (its value_info); returns how many.

    Graph inputs, outputs and initializers keep theirs; element types stay.  A TorchScript (or optimum)
    export has none, and ONNX Runtime's own inference cannot carry [batch, sequence, hidden] past the
    attention's runtime Reshapes.  With them, ORT at load time (onnxruntime 1.32, CPU, measured):
    - SkipLayerNormFusion, which needs equal 3-D shapes on both Add inputs, turns bias Add + residual Add
      + LayerNormalization into SkipLayerNormalization, whose CPU kernel is slower than the three ops;
    - the allocation planner, now able to prove sizes equal, reuses buffers in a way that makes the
      attention's Transposes and the scores' FusedMatMul slower (not so with enable_mem_reuse off).
    Runs after the placements (they read ranks); the exporter's in-place annotation (inplace_shapes) labels the calibration op's input
    again afterwards, so the native op still runs in place."""
    count = 0
    for node in model.graph:
        for value in node.outputs:
            if value.shape is not None and not value.is_graph_output():
                value.shape = None
                count += 1
    return count


ERF_GELU = GraphPass(
    "erf_gelu_order", IR, matches="x * (0.5 * (1 + erf(x / sqrt(2)))), as the dynamo exporter writes the exact GELU",
    checks="the constants are 0.5, 1 and sqrt(2), and the half's product has no other reader", rewrite=reorder_erf_gelu)
INTERMEDIATE_SHAPES = GraphPass(
    "intermediate_shapes", IR, matches="the recorded shapes of intermediate values",
    checks="the value is no graph output", rewrite=drop_intermediate_shapes)
