"""Softmax placement: the `ai.attncal` op right after each calibrated layer's attention Softmax.

The simplest graph (standard ONNX plus a model-local function body, so any runtime runs it), at the
price of the full [B,H,S,S] probabilities in calibrated layers; the optimized graph is made by
optimizing the calibrated plain graph, so calibrated layers stay unfused.

One rewrite: `rewrite.insert_calibration`, split here into `check` (every refusal) and the edit, so
the fused-softmax placement can add its own check in between.
"""

from __future__ import annotations

import onnx_ir as ir

from ..calibration.config import CalibrationConfig
from .placement_base import PlacementResult, count_fused_attention, has_fused_attention
from .rewrite import CalibrationPlan, apply_calibration, plan_calibration
from .softmax_pattern import SoftmaxPatternError

NAME = "softmax"
OPTIMIZE_FIRST = False
# None: the ai.attncal op computes in float32 whatever its input type (contract).
FLOAT32_NODES: str | None = None


def check(model: ir.Model, config: CalibrationConfig, num_layers: int) -> CalibrationPlan:
    """Every refusal of the softmax placement, before any edit; returns what `place` will insert."""
    if has_fused_attention(model):
        raise SoftmaxPatternError("softmax placement needs the plain graph; this one has fused attention nodes")
    return plan_calibration(model, config, num_layers)


def place(model: ir.Model, config: CalibrationConfig, num_layers: int) -> PlacementResult:
    r = apply_calibration(model, check(model, config, num_layers))
    return PlacementResult(r.layers, r.op_type, r.attrs, count_fused_attention(model))
