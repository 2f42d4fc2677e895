"""Projected attention placement: as the attention placement, each calibrated layer's fused
`com.microsoft::Attention` becomes one calibrated attention op, but the op also computes the Q, K and
V projection, from the fused node's own packed weight and bias (`AllRowsCalibratedProjectedAttention`
/ `PooledRowCalibratedProjectedAttention`): one node per layer, as the fused node it replaces.

Why: with the projections as three MatMul + Add in the graph, ONNX Runtime plans Q, K and V as
tensors of its memory pattern, and the native graph needed 6-27 % more peak memory than the
uncalibrated optimized graph at 8 x 128-512 on all-MiniLM-L6-v2 (the same with ORT's own
MultiHeadAttention in the op's place).  Projected in the kernel, into scratch from ORT's arena as the
fused `Attention` does, it needs what the uncalibrated graph needs (docs/native-kernels.md).

float32 graphs only: the op has a float32 kernel, ONNX Runtime's dynamic quantizer quantizes only
separate MatMuls (an int8 export keeps them, with the attention placement), and the float16 export
keeps the attention placement, whose op has float16 and CUDA kernels.  `attncal.graphs.placements.plan`
picks this placement for the native graph of float32 exports.
"""

from __future__ import annotations

import onnx_ir as ir

from ..calibration.config import CalibrationConfig
from .attention_placement import rewrite
from .placement_base import PlacementResult

NAME = "projected-attention"
OPTIMIZE_FIRST = True
FLOAT32_NODES: str | None = None  # never converted: float32 exports only (see above)


class ProjectedAttentionPlacementError(ValueError):
    """Projected attention placement does not apply to this graph."""


def place(model: ir.Model, config: CalibrationConfig, num_layers: int,
          mask_input: str = "attention_mask") -> PlacementResult:
    """Rewrite the selected layers of an ORT-optimized graph; every refusal, for every selected layer,
    comes before the first edit."""
    return rewrite(model, config, num_layers, mask_input, projected=True, error=ProjectedAttentionPlacementError)
