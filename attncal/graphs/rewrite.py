"""The graph-rewrite pass: insert an `ai.attncal` calibration node after the attention softmax
of the selected layers, and attach the model-local function bodies."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from ..calibration.config import CalibrationConfig
from .builder import graph_input
from .contract import DOMAIN, VERSION, op_spec, takes_scores
from .function_body import MIN_OPSET, make_function
from .softmax_pattern import SoftmaxPatternError, find_attention_softmaxes


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
    of the scores for a Softmax-fused op); returns how many."""
    graph = model.graph
    removed = 0
    for node in list(graph):
        if node.domain != DOMAIN:
            continue
        probs = node.inputs[0]
        if takes_scores(node.op_type):
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


def insert_calibration(
    model: ir.Model,
    config: CalibrationConfig,
    num_layers: int,
    *,
    replace: bool = False,
    mask_input: str = "attention_mask",
) -> RewriteResult:
    """Calibrate `model` in place. `config.pooling` must be concrete (cls, last or mean)."""
    rc = config.resolve()
    graph = model.graph
    opset = model_opset(model)
    if opset < MIN_OPSET:
        raise SoftmaxPatternError(f"the model uses opset {opset}; attncal needs opset >= {MIN_OPSET}")
    if any(node.domain == DOMAIN for node in graph):
        if not replace:
            raise AlreadyCalibratedError(
                "the model already contains attncal calibration nodes; pass replace=True (CLI: --overwrite on a "
                "fresh export) to recalibrate"
            )
        remove_calibration(model)
    mask = graph_input(graph, mask_input, SoftmaxPatternError)
    selected = config.layer_indices(num_layers)
    softmaxes = find_attention_softmaxes(graph, num_layers)
    spec = None
    for att in softmaxes:
        if att.layer not in selected:
            continue
        spec = op_spec(rc, att.layer)
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
    fn = ir.serde.deserialize_function(make_function(spec.op_type, opset))
    model.functions[fn.identifier()] = fn
    attrs = {k: v for k, v in spec.attrs.items() if k != "layer"}
    return RewriteResult(layers=selected, op_type=spec.op_type, attrs=attrs)
