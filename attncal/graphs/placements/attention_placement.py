"""Attention placement's one rule (fused graph): each layer's fused attention becomes its Q/K/V
projections plus one calibrated attention op (`AllRowsCalibratedAttention` for mean pooling,
`PooledRowCalibratedAttention` for cls / last pooling; the all-rows op on the rows marked in its mask,
`attncal.graphs.placements.row_marks`, for lmk, multi-cls and mean-every pooling), which computes softmax, calibration and the
product with V in one pass; a layer the config does not calibrate, and every layer of an uncalibrated
export, gets the same op at strength 0, which is plain attention.  The projected-attention placement's
rule is the same `find` and `rewrite` with `projected=True` (`projected_attention_placement`).

Why: split placement keeps ONNX Runtime's fused attention but runs each calibrated layer's attention
core twice (the full term, then the baskets), and the softmax placements write every head's [B,H,S,S]
probabilities to memory.  The native kernel (`plugins/kernels/cpu/calibrated_attention.h`) computes a
block of query rows against all keys while the block is in cache and calibrates it there: the cost
of attention, no second pass, and per-thread scratch instead of a [B,H,S,S] buffer.

Every layer, not only the calibrated ones: ONNX Runtime's CPU `Attention` writes every layer's
[B,N,S,S] probabilities, so one such layer sets the graph's peak memory however many layers the op
replaces, and the kernel is about as fast at long sequences (docs/performance.md).

Only the ORT-optimized graph is rewritten (`com.microsoft::Attention`, one per layer, packed QKV
weights).  The op carries a standard-ONNX function body, so the graph still runs without the native
library, but that body materialises the probabilities; `attncal.graphs.placements.plan` therefore
writes this graph only beside the split graph, and the runtime picks it where the native library is
present (`attncal.runtime.encoder`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import numpy as np
import onnx_ir as ir

from ...calibration.config import CalibrationConfig, ResolvedCalibration
from . import row_marks
from ..builder import Ops
from ..ops.contract import DOMAIN, VERSION, attention_op_spec
from ..ops.function_body import make_function
from .placement_base import (FUSED, PlacementResult, Rule, count_fused_attention, fused_attention_parts, fused_layers,
                             has_fused_attention, qkv_projections)
from .rewrite import model_opset
from .softmax_pattern import SoftmaxPatternError


class AttentionPlacementError(ValueError):
    """Attention placement does not apply to this graph."""


def _check_layer(graph: ir.Graph, att: ir.Node, error: type[ValueError] = AttentionPlacementError):
    parts = fused_attention_parts(att, error)
    if any(o is att.outputs[0] for o in graph.outputs):
        raise error(f"the context of {att.name} is a graph output; cannot rewire it (the fused "
                    "node is replaced, and a graph output would be left without its producer)")
    return parts


@dataclass(frozen=True)
class AttentionEdits:
    rc: ResolvedCalibration
    projected: bool  # the op computes the Q, K and V projection itself (projected_attention_placement)
    selected: list[int]  # the calibrated layers; every other layer's op runs at strength 0
    atts: list[ir.Node]  # one fused Attention node per layer
    mask: ir.Value
    common: dict  # the op's attributes shared by every layer (the result's `attrs`)
    parts: dict[int, tuple[ir.Value, np.ndarray, np.ndarray, int, float]]  # per layer, what `rewrite` inserts
    op_type: str
    function: ir.Function
    ids: ir.Value | None = None  # the token ids the calibrated rows are marked from (row-set poolings)


def find(model: ir.Model, config: CalibrationConfig, num_layers: int, *, projected: bool,
         error: type[ValueError], mask_input: str = "attention_mask") -> AttentionEdits:
    """Every refusal, for every layer of an ORT-optimized graph, raised as `error`; no edit.  `projected`
    picks the op that also computes the Q, K and V projection; a config of strength 0 (an uncalibrated
    export) gives the op of its pooling at strength 0 in every layer."""
    rc = config.resolve()
    if not has_fused_attention(model):
        raise error(
            "attention placement rewrites ONNX Runtime's fused com.microsoft::Attention nodes, and this graph has "
            "none (the portable graph); it applies to the ORT-optimized graph only")
    graph = model.graph
    atts, mask = fused_layers(model, num_layers, mask_input, error, "attention placement needs")
    ids = row_marks.find_ids(graph, rc, error)
    selected = config.layer_indices(num_layers) if rc.strength != 0.0 else []
    spec = attention_op_spec(rc, 0, num_heads=1, projected=projected)
    common = {k: v for k, v in spec.attrs.items() if k not in ("layer", "num_heads", "scale")}
    parts = {layer: _check_layer(graph, att, error) for layer, att in enumerate(atts)}
    function = ir.serde.deserialize_function(make_function(spec.op_type, model_opset(model)))
    return AttentionEdits(rc, projected, selected, atts, mask, common, parts, spec.op_type, function, ids)


def rewrite(model: ir.Model, edits: AttentionEdits) -> PlacementResult:
    """Each layer's fused `Attention` becomes the calibrated attention op (strength 0 outside the calibrated
    layers): after its Q, K and V projections (three MatMul + Add), or, `projected`, the op that computes
    them itself from the fused node's packed weight and bias (`projected_attention_placement`)."""
    rc, projected, selected, atts, mask = edits.rc, edits.projected, edits.selected, edits.atts, edits.mask
    graph = model.graph
    parts, op_type, function = edits.parts, edits.op_type, edits.function
    mask = row_marks.insert(graph, rc, mask, edits.ids)
    off = dataclasses.replace(rc, strength=0.0)
    for layer, att in enumerate(atts):
        x, W, bias, heads, scale = parts[layer]
        ops = Ops(graph, f"attncal_attention_layer{layer}")
        spec = attention_op_spec(rc if layer in selected else off, layer, num_heads=heads, scale=float(scale),
                                 projected=projected)
        if projected:  # the fused node's own packed weight and bias initializers, in ORT's layout
            inputs = (x, att.inputs[1], att.inputs[2])
        else:
            inputs = qkv_projections(ops, x, W, bias)
        context = ops(spec.op_type, *inputs, mask, domain=DOMAIN, **spec.attrs)
        old = att.outputs[0]
        context.name, context.type, context.shape = f"{ops.prefix}/context", old.type, old.shape
        old.replace_all_uses_with(context)
        ops.insert_after(att)
        graph.remove(att, safe=True)
    for name, value in list(graph.initializers.items()):  # the replaced nodes' packed QKV weights
        if not list(value.uses()) and not any(value is o for o in graph.outputs):
            del graph.initializers[name]
    model.functions[function.identifier()] = function
    model.opset_imports[DOMAIN] = VERSION
    return PlacementResult(selected, op_type, edits.common, count_fused_attention(model))


RULE = Rule(FUSED, partial(find, projected=False, error=AttentionPlacementError), rewrite,
            (AttentionPlacementError, SoftmaxPatternError))  # SoftmaxPatternError: a model without a default opset
