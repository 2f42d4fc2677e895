"""Projected attention placement's one rule (fused graph): as the attention placement, each layer's fused
`com.microsoft::Attention` becomes one calibrated attention op (strength 0 where the layer is not calibrated), but
the op also computes
the Q, K and V projection, from the fused node's own packed weight and bias
(`AllRowsCalibratedProjectedAttention` / `PooledRowCalibratedProjectedAttention`): one node per layer,
as the fused node it replaces.  The rule is the attention placement's `find` and `rewrite` with
`projected=True`.

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

from functools import partial

from ...calibration.config import ResolvedCalibration
from .attention_placement import find, rewrite
from .placement_base import FUSED, Refusal, Rule
from .softmax_pattern import SoftmaxPatternError

PRECISIONS = frozenset({"fp32"})  # the op's kernel is float32; int8 and fp16 exports keep separate projections


class ProjectedAttentionPlacementError(ValueError):
    """Projected attention placement does not apply to this graph."""


def check_request(rc: ResolvedCalibration, precision: str) -> Refusal | None:
    """An explicit request in a float16 or int8 export is refused (every calibration config)."""
    if precision not in PRECISIONS:
        return Refusal(ProjectedAttentionPlacementError,
                       f"--placement projected-attention writes a float32 op; a {precision} export keeps separate "
                       "Q, K and V projections: use --placement attention (or auto)")
    return None


RULE = Rule(FUSED, partial(find, projected=True, error=ProjectedAttentionPlacementError), rewrite,
            (ProjectedAttentionPlacementError, SoftmaxPatternError))  # SoftmaxPatternError: no default opset
