"""The graph-rewrite pass: insert an `ai.attncal` calibration node after the attention softmax
of the selected layers, and attach the model-local function bodies.

Rewrites:
* `insert_calibration`: `plan_calibration` (every refusal, no edit) then `apply_calibration` (the
  edit, which cannot refuse); the fused-softmax placement adds its own check between the two.
* `remove_calibration`: the inverse, used before recalibrating (`replace=True`).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from ...calibration.config import CalibrationConfig, ResolvedCalibration
from . import row_marks
from ..builder import graph_input
from ..ops.contract import DOMAIN, VERSION, is_attention, op_spec, takes_scores
from ..ops.function_body import MIN_OPSET, make_function
from .softmax_pattern import AttentionSoftmax, SoftmaxPatternError, find_attention_softmaxes


class AlreadyCalibratedError(ValueError):
    """The graph already carries calibration nodes and `replace` was not asked for."""


@dataclass(frozen=True)
class RewriteResult:
    layers: list[int]
    op_type: str
    attrs: dict


def model_opset(model: ir.Model) -> int:
    opset = model.opset_imports.get("", None)
    if opset is None:
        raise SoftmaxPatternError("the model imports no default ONNX opset")
    return int(opset)


def remove_calibration(model: ir.Model) -> int:
    """Remove every attncal node (re-wiring its consumers to its `probs` input, or to a plain Softmax
    of the scores for a Softmax-fused op); returns how many.

    Refuses (`SoftmaxPatternError`, or `ValueError` for an unknown op type) before the first edit."""
    graph = model.graph
    nodes = [node for node in graph if node.domain == DOMAIN]
    fused = [takes_scores(node.op_type) for node in nodes]
    outputs = {id(v) for v in graph.outputs}
    for node in nodes:
        if is_attention(node.op_type):  # its output is the context, not rewritten probabilities
            raise SoftmaxPatternError(f"{node.name} is a calibrated attention node ({node.op_type}, attention "
                                      "placement): it replaced the layer's attention, so there are no probabilities "
                                      "to fall back to; re-export the model instead (attncal export)")
        if id(node.outputs[0]) in outputs:
            raise SoftmaxPatternError(f"the output {node.outputs[0].name} of calibration node {node.name} is a graph "
                                      "output; removing the node would leave that output without a producer")
    removed = 0
    for node, takes in zip(nodes, fused):
        probs = node.inputs[0]
        if takes:
            softmax = ir.Node("", "Softmax", [probs], attributes=[ir.AttrInt64("axis", -1)], num_outputs=1)
            probs = softmax.outputs[0]
            probs.name, probs.type, probs.shape = f"{node.outputs[0].name}_probs", node.outputs[0].type, \
                node.outputs[0].shape
            graph.insert_before(node, softmax)
        node.outputs[0].replace_all_uses_with(probs)
        graph.remove(node, safe=True)
        removed += 1
    for key in [k for k in model.functions if k[0] == DOMAIN]:
        del model.functions[key]
    model.opset_imports.pop(DOMAIN, None)
    return removed


@dataclass(frozen=True)
class CalibrationPlan:
    """What `apply_calibration` will do to a model, decided (or refused) before its first edit."""

    rc: ResolvedCalibration
    num_layers: int
    selected: list[int]
    mask: ir.Value
    # The selected layers' softmaxes; empty when `remove_first`, since removing a Softmax-fused op
    # creates the Softmax (they are found again after the removal).
    softmaxes: list[AttentionSoftmax]
    remove_first: bool  # the model carries calibration nodes and `replace` was asked for
    function: ir.Function  # the op's model-local body
    ids: ir.Value | None = None  # the token ids the calibrated rows are marked from (row-set poolings)


def _selected(softmaxes: list[AttentionSoftmax], selected: list[int]) -> list[AttentionSoftmax]:
    return [att for att in softmaxes if att.layer in selected]


def plan_calibration(
    model: ir.Model,
    config: CalibrationConfig,
    num_layers: int,
    *,
    replace: bool = False,
    mask_input: str = "attention_mask",
) -> CalibrationPlan:
    """Every refusal of `insert_calibration`, without editing `model`; `config.pooling` must be concrete.

    With `replace`, the pattern search that would follow the removal of the old calibration runs on
    a copy of the model (tensors shared), so a graph that cannot be recalibrated keeps its old
    calibration rather than losing it."""
    rc = config.resolve()
    graph = model.graph
    opset = model_opset(model)
    if opset < MIN_OPSET:
        raise SoftmaxPatternError(f"the model uses opset {opset}; attncal needs opset >= {MIN_OPSET}")
    calibrated = any(node.domain == DOMAIN for node in graph)
    if calibrated and not replace:
        raise AlreadyCalibratedError(
            "the model already contains attncal calibration nodes; pass replace=True (CLI: --overwrite on a "
            "fresh export) to recalibrate"
        )
    mask = graph_input(graph, mask_input, SoftmaxPatternError)
    ids = row_marks.find_ids(graph, rc, SoftmaxPatternError)
    selected = config.layer_indices(num_layers)
    if calibrated:
        probe = model.clone()
        remove_calibration(probe)
        find_attention_softmaxes(probe.graph, num_layers)
        softmaxes: list[AttentionSoftmax] = []
    else:
        softmaxes = _selected(find_attention_softmaxes(graph, num_layers), selected)
    # layer_indices() is never empty; the op type does not depend on the layer.
    function = ir.serde.deserialize_function(make_function(op_spec(rc, selected[0]).op_type, opset))
    return CalibrationPlan(rc, num_layers, selected, mask, softmaxes, calibrated, function, ids)


def apply_calibration(model: ir.Model, plan: CalibrationPlan) -> RewriteResult:
    """Insert the calibration nodes `plan` (from `plan_calibration` on this model) describes."""
    graph = model.graph
    softmaxes = plan.softmaxes
    if plan.remove_first:
        remove_calibration(model)
        # The same search succeeded on a copy of the model in plan_calibration.
        softmaxes = _selected(find_attention_softmaxes(graph, plan.num_layers), plan.selected)
    mask = row_marks.insert(graph, plan.rc, plan.mask, plan.ids)
    spec = None
    for att in softmaxes:
        spec = op_spec(plan.rc, att.layer)
        probs = att.softmax.outputs[0]
        uses = list(probs.uses())
        node = ir.Node(
            DOMAIN,
            spec.op_type,
            [probs, mask],
            attributes=[ir.AttrInt64(k, v) if isinstance(v, int) else ir.AttrFloat32(k, v) for k, v in spec.attrs.items()],
            name=f"attncal_{spec.op_type}_layer{att.layer}",
            num_outputs=1,
        )
        out = node.outputs[0]
        out.name = f"{probs.name}_attncal"
        out.type = probs.type
        out.shape = probs.shape
        for user, idx in uses:
            user.replace_input_with(idx, out)
        graph.insert_after(att.softmax, node)
    assert spec is not None  # layer_indices() is never empty and every layer has a softmax
    model.opset_imports[DOMAIN] = VERSION
    model.functions[plan.function.identifier()] = plan.function
    attrs = {k: v for k, v in spec.attrs.items() if k != "layer"}
    return RewriteResult(layers=plan.selected, op_type=spec.op_type, attrs=attrs)


def insert_calibration(
    model: ir.Model,
    config: CalibrationConfig,
    num_layers: int,
    *,
    replace: bool = False,
    mask_input: str = "attention_mask",
) -> RewriteResult:
    """Calibrate `model` in place. `config.pooling` must be concrete (cls, last, mean, lmk, multi-cls or mean-every).

    Every refusal (`SoftmaxPatternError`, `AlreadyCalibratedError`) comes before the first edit."""
    return apply_calibration(model, plan_calibration(model, config, num_layers, replace=replace,
                                                     mask_input=mask_input))
