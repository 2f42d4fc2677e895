"""What every calibration placement returns, and the names the exporter and runtime share.

A placement is one module under `attncal/graphs/` with the same entry point,
`place(model, config, num_layers) -> PlacementResult`, which works on whichever graph it is given:
the plain export (standard ONNX, any runtime) or ONNX Runtime's optimized graph (fused
`com.microsoft::Attention` nodes).  `OPTIMIZE_FIRST` says how the optimized graph is made: True
means "optimize the uncalibrated export, then place" (row, split: they keep the fusions), False means
"place on the plain graph, then optimize" (softmax: calibrated layers stay unfused).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir


@dataclass(frozen=True)
class PlacementResult:
    layers: list[int]
    op_type: str | None  # the ai.attncal op in the graph, None when the graph needs no custom op
    attrs: dict = field(default_factory=dict)  # the op's attributes (or the resolved config), without `layer`
    fused_attention: int = 0  # fused attention nodes outside subgraphs after placement


def count_fused_attention(model: ir.Model) -> int:
    """Fused attention nodes that compute a layer's attention (the ones a calibration must not lose)."""
    from .softmax_pattern import FUSED_ATTENTION_OPS

    # Main graph only: split placement's per-basket calls live inside a Loop body.
    return sum(1 for n in model.graph if n.domain == "com.microsoft" and n.op_type in FUSED_ATTENTION_OPS)


def has_fused_attention(model: ir.Model) -> bool:
    return any(n.domain == "com.microsoft" and n.op_type == "Attention" for n in model.graph)
