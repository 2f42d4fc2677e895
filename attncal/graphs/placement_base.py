"""What every calibration placement returns, and the names the exporter and runtime share.

A placement is one module under `attncal/graphs/` with the same entry point,
`place(model, config, num_layers) -> PlacementResult`, which works on whichever graph it is given:
the plain export (standard ONNX, any runtime) or ONNX Runtime's optimized graph (fused
`com.microsoft::Attention` nodes).  `OPTIMIZE_FIRST` says how the optimized graph is made: True
means "optimize the uncalibrated export, then place" (row, split: they keep the fusions), False means
"place on the plain graph, then optimize" (softmax: calibrated layers stay unfused).  `FLOAT32_NODES` is
the node-name prefix of the calibration math the placement writes in standard ops, which a float16
conversion of the optimized graph keeps in float32 (None where an ai.attncal op computes it in float32).

Every placement checks before it edits: all of its refusals, for every calibrated layer, run before
the first change to the model, so a refused placement leaves the graph exactly as it was (and a caller
may fall back to another placement).  The helpers here only read the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import onnx_ir as ir

if TYPE_CHECKING:
    import numpy as np

    from .builder import Ops


@dataclass(frozen=True)
class PlacementResult:
    layers: list[int]
    op_type: str | None  # the ai.attncal op in the graph, None when the graph needs no custom op
    attrs: dict = field(default_factory=dict)  # the op's attributes (or the resolved config), without `layer`
    fused_attention: int = 0  # fused attention nodes outside subgraphs after placement


def count_fused_attention(model: ir.Model) -> int:
    """Fused attention nodes that compute a layer's attention (the ones a calibration must not lose):
    ONNX Runtime's, and the calibrated attention ops that replace them (one pass over the keys too)."""
    from .contract import ATTENTION_OP_TYPES, DOMAIN, PROJECTED_OP_TYPES
    from .softmax_pattern import FUSED_ATTENTION_OPS

    # Main graph only: split placement's per-basket calls live inside a Loop body.
    return sum(1 for n in model.graph if (n.domain == "com.microsoft" and n.op_type in FUSED_ATTENTION_OPS)
               or (n.domain == DOMAIN and n.op_type in ATTENTION_OP_TYPES + PROJECTED_OP_TYPES))


def fused_attention_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The ORT-fused `com.microsoft::Attention` nodes of a graph, in graph (= layer) order."""
    return [n for n in graph if n.op_type == "Attention" and n.domain == "com.microsoft"]


def has_fused_attention(model: ir.Model) -> bool:
    return bool(fused_attention_nodes(model.graph))


def fused_layers(model: ir.Model, num_layers: int, mask_input: str, error: type[Exception], need: str,
                 hint: str = "") -> tuple[list[ir.Node], ir.Value]:
    """(one fused Attention node per layer, the attention-mask input) of an uncalibrated optimized graph,
    or `error` saying what is wrong: `need` starts the message, `hint` ends it."""
    from .builder import graph_input
    from .contract import DOMAIN

    graph = model.graph
    if any(n.domain == DOMAIN for n in graph):
        raise error("the graph already contains attncal calibration nodes")
    atts = fused_attention_nodes(graph)
    if len(atts) != num_layers:
        raise error(f"{need} one fused com.microsoft::Attention node per layer ({num_layers}); found {len(atts)}{hint}")
    return atts, graph_input(graph, mask_input, error)


def fused_attention_parts(att: ir.Node, error: type[Exception]) -> tuple[ir.Value, np.ndarray, np.ndarray, int, float]:
    """(x, packed QKV weight [hidden, 3*hidden], bias [3*hidden], num_heads, scale) of an ORT-fused
    `com.microsoft::Attention` encoder node; raises `error` for anything else (the placements
    rebuild the layer from these alone, so anything they do not carry would be lost)."""
    import numpy as np

    x, w, bias = att.inputs[0], att.inputs[1], att.inputs[2]
    if w is None or w.const_value is None or bias is None or bias.const_value is None:
        raise error(f"fused Attention {att.name}: packed QKV weight and bias must be initializers")
    if len(att.inputs) > 4 and att.inputs[4] is not None:
        raise error(f"fused Attention {att.name} has a past state; not an encoder layer")
    extra = {a for a in att.attributes} - {"num_heads", "scale", "mask_filter_value"}
    if extra:
        raise error(f"fused Attention {att.name} has unsupported attributes {sorted(extra)}")
    heads = att.attributes.get_int("num_heads")
    W, bvec = w.const_value.numpy(), bias.const_value.numpy()
    head = W.shape[1] // 3 // heads
    scale = att.attributes.get_float("scale", 0.0) or 1.0 / float(np.sqrt(head))
    return x, W, bvec, heads, scale


def qkv_projections(ops: Ops, x: ir.Value, W: np.ndarray, bias: np.ndarray) -> tuple[ir.Value, ir.Value, ir.Value]:
    """The Q, K and V projections a fused `Attention` node packs ([hidden, 3*hidden] weight), as three
    MatMul + Add: the same FLOPs as inside the fused node, and [B,S,hidden] outputs in the BSD layout
    that `MultiHeadAttention` and the calibrated attention ops take."""
    import numpy as np

    hidden = W.shape[1] // 3
    out = []
    for i, name in enumerate("qkv"):
        Wi = np.ascontiguousarray(W[:, i * hidden : (i + 1) * hidden])
        bi = np.ascontiguousarray(bias[i * hidden : (i + 1) * hidden])
        out.append(ops("Add", ops("MatMul", x, ops.const(f"w{name}", Wi)), ops.const(f"b{name}", bi)))
    return out[0], out[1], out[2]
