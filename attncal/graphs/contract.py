"""The calibration op contract: a fixed interface shared by the function body, the ORT custom-op
library and the TensorRT plugin.

Domain `ai.attncal`, version 1, two op types:

* `PooledRowCalibration`: calibrates the pooling row only (cls or last pooling).
* `AllRowsCalibration`: calibrates every valid query row (mean pooling).

Inputs: `probs` T[B,H,Q,K] (post-softmax attention of one layer, Q == K; for
`PooledRowCalibration` also Q == 1, meaning the single row *is* the pooling row,
as produced by row placement) and
`attention_mask` int64[B,K]; T is float or float16.  Output: T[B,H,Q,K]; only
the calibrated rows differ from `probs`.  Every attribute below is present on
every exported node.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..calibration.config import ResolvedCalibration

DOMAIN = "ai.attncal"
VERSION = 1
POOLED_OP = "PooledRowCalibration"
ALL_ROWS_OP = "AllRowsCalibration"
OP_TYPES = (POOLED_OP, ALL_ROWS_OP)

# name -> ("int" | "float", meaning); `pool_last` only on PooledRowCalibration.
ATTRIBUTES: dict[str, tuple[str, str]] = {
    "pool_last": ("int", "0 = row of the first valid token, 1 = row of the last valid token"),
    "basket_size": ("int", ">= 1"),
    "strength": ("float", "λ"),
    "isolate_first": ("int", "0 or 1"),
    "isolate_last": ("int", "0 or 1"),
    "first_mode": ("int", "0 = equal, 1 = original, 2 = fixed"),
    "last_mode": ("int", "0 = equal, 1 = original, 2 = fixed"),
    "first_weight": ("float", "used by fixed"),
    "last_weight": ("float", "used by fixed"),
    "skip_short": ("int", "0 or 1"),
    "layer": ("int", "informational"),
}


def attribute_names(op_type: str) -> list[str]:
    names = list(ATTRIBUTES)
    if op_type == ALL_ROWS_OP:
        names.remove("pool_last")
    return names


@dataclass(frozen=True)
class OpSpec:
    """One calibration node: its op type and attribute values."""

    op_type: str
    attrs: dict[str, int | float]


def op_spec(rc: ResolvedCalibration, layer: int) -> OpSpec:
    """The node that implements the resolved calibration `rc` in layer `layer`."""
    attrs: dict[str, int | float] = {
        "basket_size": int(rc.basket_size),
        "strength": float(rc.strength),
        "isolate_first": int(rc.isolate_first),
        "isolate_last": int(rc.isolate_last),
        "first_mode": int(rc.first_mode),
        "last_mode": int(rc.last_mode),
        "first_weight": float(rc.first_weight),
        "last_weight": float(rc.last_weight),
        "skip_short": int(rc.skip_short),
        "layer": int(layer),
    }
    if rc.all_rows:
        return OpSpec(ALL_ROWS_OP, attrs)
    return OpSpec(POOLED_OP, {"pool_last": int(rc.pool_last), **attrs})


def resolved_from_attrs(op_type: str, attrs: dict[str, int | float]) -> ResolvedCalibration:
    """Inverse of `op_spec`: what a node with these attributes computes."""
    if op_type == ALL_ROWS_OP:
        pooling = "mean"
    else:
        pooling = "last" if int(attrs["pool_last"]) else "cls"
    return ResolvedCalibration(
        pooling=pooling,  # type: ignore[arg-type]
        strength=float(attrs["strength"]),
        basket_size=int(attrs["basket_size"]),
        isolate_first=bool(attrs["isolate_first"]),
        isolate_last=bool(attrs["isolate_last"]),
        first_mode=int(attrs["first_mode"]),
        first_weight=float(attrs["first_weight"]),
        last_mode=int(attrs["last_mode"]),
        last_weight=float(attrs["last_weight"]),
        skip_short=bool(attrs["skip_short"]),
    )
