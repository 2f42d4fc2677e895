"""Softmax placement's one rule (plain graph): the `ai.attncal` op right after each calibrated layer's
attention Softmax.

The simplest graph (standard ONNX plus a model-local function body, so any runtime runs it), at the
price of the full [B,H,S,S] probabilities in calibrated layers; the optimized graph is made by
optimizing the calibrated plain graph, so calibrated layers stay unfused.

The rule is `rewrite.insert_calibration` in its two halves: `plan_calibration` (every refusal) is its
check and `apply_calibration` its rewrite.  The fused-softmax rule runs this check, then its own.
"""

from __future__ import annotations

import onnx_ir as ir

from ...calibration.config import CalibrationConfig
from .placement_base import PLAIN, PlacementResult, Rule, count_fused_attention, has_fused_attention
from .rewrite import AlreadyCalibratedError, CalibrationPlan, apply_calibration, plan_calibration
from .softmax_pattern import SoftmaxPatternError

REFUSES = (SoftmaxPatternError, AlreadyCalibratedError)


def find(model: ir.Model, config: CalibrationConfig, num_layers: int) -> CalibrationPlan:
    """Every refusal of the softmax placement, before any edit; returns what `rewrite` will insert."""
    if has_fused_attention(model):
        raise SoftmaxPatternError("softmax placement needs the plain graph; this one has fused attention nodes")
    return plan_calibration(model, config, num_layers)


def rewrite(model: ir.Model, plan: CalibrationPlan) -> PlacementResult:
    r = apply_calibration(model, plan)
    return PlacementResult(r.layers, r.op_type, r.attrs, count_fused_attention(model))


RULE = Rule(PLAIN, find, rewrite, REFUSES)
