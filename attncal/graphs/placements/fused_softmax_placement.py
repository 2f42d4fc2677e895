"""Fused-softmax placement's one rule (plain graph): each calibrated layer's attention Softmax becomes
one `ai.attncal` op that computes the softmax and the calibration together
(`SoftmaxAllRowsCalibration`, `SoftmaxPooledRowCalibration`).

Why: after a separate Softmax, the calibration op costs one more read and write of the
[B,H,S,S] probabilities per calibrated layer (about 4-6 % of MiniLM's latency at 512 tokens on
two cores).  Fused, the native kernel calibrates each row while the softmax has it in cache, so
calibration adds no memory traffic.  The op's function body is `Softmax` followed by the separate
op's body, so a runtime without the native kernel runs exactly the softmax placement's graph.

The rule is the softmax rule plus one rewrite, `fuse_softmax`: a calibration op whose input is a
last-axis Softmax read by nothing else (not a graph output) absorbs that Softmax.  `find` runs both
rewrites' refusals before either edits the graph.
"""

from __future__ import annotations

import onnx_ir as ir

from ...calibration.config import CalibrationConfig
from . import softmax_placement
from ..ops.contract import DOMAIN, takes_scores, with_softmax
from ..ops.function_body import make_function
from .placement_base import PLAIN, PlacementResult, Rule, count_fused_attention
from .rewrite import CalibrationPlan, apply_calibration, model_opset
from .softmax_pattern import SoftmaxPatternError


def _last_axis_softmax(node: ir.Node | None) -> bool:
    if node is None or node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
        return False
    axis = node.attributes.get_int("axis", -1)
    rank = node.outputs[0].shape.rank() if node.outputs[0].shape is not None else None
    return axis == -1 or (rank is not None and axis == rank - 1)


def _why_not_absorbable(softmax: ir.Node | None, graph: ir.Graph) -> str | None:
    """Why a calibration op could not absorb `softmax`, the producer of its probabilities (None: it
    can).  Readers other than the calibration op itself are the caller's to count."""
    if softmax is None:
        return "the probabilities have no producer"
    if softmax.op_type != "Softmax" or softmax.domain not in ("", "ai.onnx"):
        return f"{softmax.op_type} {softmax.name} is not an ONNX Softmax"
    if not _last_axis_softmax(softmax):
        shape = softmax.outputs[0].shape
        return (f"it is not over the last axis (axis {softmax.attributes.get_int('axis', -1)}, output rank "
                f"{shape.rank() if shape is not None else 'unknown'})")
    if any(v is softmax.outputs[0] for v in graph.outputs):
        return f"its output {softmax.outputs[0].name} is also a graph output, which needs the plain probabilities"
    return None


def fuse_softmax(model: ir.Model) -> int:
    """Replace each `Softmax -> calibration op` pair by the fused op, in place; returns how many.

    A pair is fused only when the Softmax works on the last axis and its output feeds the op
    alone, so no other reader loses the plain probabilities.  The pairs and the fused ops' bodies
    are found first; the graph is edited only once nothing is left that can fail."""
    graph = model.graph
    opset = model_opset(model)
    pairs: list[tuple[ir.Node, ir.Node]] = []
    plain_types: set[str] = set()
    for node in graph:
        if node.domain != DOMAIN or takes_scores(node.op_type):
            continue
        probs = node.inputs[0]
        softmax = probs.producer()
        if _why_not_absorbable(softmax, graph) is not None or len(list(probs.uses())) != 1:
            plain_types.add(node.op_type)
            continue
        pairs.append((node, softmax))
    functions = [ir.serde.deserialize_function(make_function(op_type, opset))
                 for op_type in sorted({with_softmax(node.op_type) for node, _ in pairs})]
    for node, softmax in pairs:
        op_type = with_softmax(node.op_type)
        fused = ir.Node(DOMAIN, op_type, [softmax.inputs[0], node.inputs[1]],
                        attributes=list(node.attributes.values()),
                        name=(node.name or "attncal").replace(node.op_type, op_type), num_outputs=1)
        out = fused.outputs[0]
        out.name, out.type, out.shape = node.outputs[0].name, node.outputs[0].type, node.outputs[0].shape
        # Same name, so a calibrated output that is also a graph output stays one.
        node.outputs[0].replace_all_uses_with(out, replace_graph_outputs=True)
        graph.insert_after(node, fused)
        graph.remove([node, softmax], safe=True)
    for fn in functions:
        model.functions[fn.identifier()] = fn
    for key in [k for k in model.functions if k[0] == DOMAIN and not takes_scores(k[1]) and k[1] not in plain_types]:
        del model.functions[key]  # the separate op's body is no longer used
    return len(pairs)


def find(model: ir.Model, config: CalibrationConfig, num_layers: int) -> CalibrationPlan:
    """Every refusal of the fused-softmax placement, before any edit: the softmax placement's, and
    for each calibrated layer a Softmax that the op can absorb.

    After the softmax placement the op is its Softmax's only reader (every reader is moved to the
    op), except for a graph output, which keeps the plain probabilities."""
    plan = softmax_placement.find(model, config, num_layers)
    for att in plan.softmaxes:
        why = _why_not_absorbable(att.softmax, model.graph)
        if why is not None:
            raise SoftmaxPatternError(f"fused-softmax placement: layer {att.layer}'s Softmax {att.softmax.name} cannot "
                                      f"be fused with the calibration: {why}; use --placement softmax")
    return plan


def rewrite(model: ir.Model, plan: CalibrationPlan) -> PlacementResult:
    r = apply_calibration(model, plan)
    fused = fuse_softmax(model)
    assert fused == len(r.layers), f"find() accepted every calibrated layer, yet {fused} of {len(r.layers)} fused"
    return PlacementResult(r.layers, with_softmax(r.op_type), r.attrs, count_fused_attention(model))


RULE = Rule(PLAIN, find, rewrite, softmax_placement.REFUSES)
