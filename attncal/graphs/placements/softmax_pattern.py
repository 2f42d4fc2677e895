"""Finding the attention Softmax of every layer in an exported encoder graph.

The pattern is explicit: a `Softmax` over the last axis whose output reaches
the value `MatMul` as its first input, directly or through `Cast`/`Identity`
nodes (fp32 upcasts in Qwen3/ModernBERT eager attention), or through an
existing attncal calibration node.  Each match is attributed to a layer index
from the exporter's scope metadata (`pkg.torch.onnx.name_scopes`, dynamo) or
from the node name (TorchScript exporter: `/encoder/layer.3/attention/self/Softmax`): the first
indexed layer container on the path (`layer.N`, `layers.N`, `block.N`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import onnx_ir as ir

from ..ops.contract import DOMAIN

# The first indexed layer container on the module path: `layer.3` (BERT), `layers.3` (Qwen3), `block.3` (T5,
# whose block then holds `layer.0` = self-attention, `layer.1` = feed-forward).
_LAYER_RE = re.compile(r"(?:^|[./])(?:layer|layers|block|blocks)\.(\d+)(?:[./]|$)")
_PASS_THROUGH = {("", "Cast"), ("", "Identity"), ("", "Dropout")}
FUSED_ATTENTION_OPS = {"Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention"}


class SoftmaxPatternError(ValueError):
    """The graph does not have the expected attention softmax structure."""


@dataclass
class AttentionSoftmax:
    layer: int
    softmax: ir.Node
    calibration: ir.Node | None  # an existing attncal node right after the softmax


def _scope_text(node: ir.Node) -> str:
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            parts = ast.literal_eval(scopes)
            if isinstance(parts, (list, tuple)):
                return " ".join(str(p) for p in parts)
        except (ValueError, SyntaxError):
            pass
        return scopes
    return node.name or ""


def layer_of(node: ir.Node) -> int | None:
    m = _LAYER_RE.search(_scope_text(node))
    return int(m.group(1)) if m else None


def _reaches_value_matmul(value: ir.Value, depth: int = 0) -> tuple[bool, ir.Node | None]:
    """Does `value` feed a MatMul as input 0 (possibly through casts or a calibration node)?"""
    cal = None
    for node, idx in value.uses():
        if node.op_type == "MatMul" and node.domain == "" and idx == 0:
            return True, None
        if depth < 4 and ((node.domain, node.op_type) in _PASS_THROUGH or node.domain == DOMAIN) and idx == 0:
            ok, inner = _reaches_value_matmul(node.outputs[0], depth + 1)
            if ok:
                if node.domain == DOMAIN:
                    cal = node
                return True, cal or inner
    return False, None


def _describe(graph: ir.Graph) -> str:
    counts: dict[str, int] = {}
    for node in graph:
        if node.op_type in FUSED_ATTENTION_OPS or node.op_type in ("Softmax", "MatMul"):
            key = f"{node.domain + '::' if node.domain else ''}{node.op_type}"
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no Softmax, MatMul or attention nodes"


def find_attention_softmaxes(graph: ir.Graph, num_layers: int) -> list[AttentionSoftmax]:
    """One `AttentionSoftmax` per layer, sorted by layer; raises `SoftmaxPatternError` otherwise."""
    found: list[tuple[ir.Node, ir.Node | None]] = []
    for node in graph:
        if node.op_type != "Softmax" or node.domain != "":
            continue
        axis = node.attributes.get_int("axis", -1)
        rank = node.inputs[0].shape.rank() if node.inputs[0].shape is not None else None
        if not (axis == -1 or (rank is not None and axis == rank - 1)):
            continue
        ok, cal = _reaches_value_matmul(node.outputs[0])
        if ok:
            found.append((node, cal))
    fused = [n for n in graph if n.op_type in FUSED_ATTENTION_OPS]
    if len(found) != num_layers:
        hint = ""
        if fused:
            hint = (f" The graph computes attention in fused {sorted({n.op_type for n in fused})} nodes "
                    "(e.g. an SDPA export at opset >= 23 or an optimized graph); export with eager attention "
                    "and without fusion before calibrating.")
        raise SoftmaxPatternError(
            f"expected one attention Softmax -> MatMul per layer ({num_layers} layers) but found {len(found)}; "
            f"the graph has {_describe(graph)}.{hint}"
        )
    layers = [layer_of(n) for n, _ in found]
    if all(l is None for l in layers):
        layers = list(range(num_layers))  # no scope information: graph order is layer order
    elif any(l is None for l in layers) or sorted(layers) != list(range(num_layers)):
        raise SoftmaxPatternError(
            f"could not attribute the {len(found)} attention Softmax nodes to layers 0..{num_layers - 1} "
            f"(got {layers} from node names / scope metadata)"
        )
    out = [AttentionSoftmax(layer=l, softmax=n, calibration=c) for l, (n, c) in zip(layers, found)]
    return sorted(out, key=lambda a: a.layer)
