"""The calibration op contract: a fixed interface shared by the function body, the ORT custom-op
library and the TensorRT plugin.

Domain `ai.attncal`, version 1, four op types:

* `PooledRowCalibration`: calibrates the pooling row only (cls or last pooling).
* `AllRowsCalibration`: calibrates every valid query row (mean pooling).

Inputs: `probs` T[B,H,Q,K] (post-softmax attention of one layer, Q == K; for
`PooledRowCalibration` also Q == 1, meaning the single row *is* the pooling row,
as produced by row placement) and
`attention_mask` int64[B,K]; T is float or float16.  Output: T[B,H,Q,K]; only
the calibrated rows differ from `probs`.  Every attribute below is present on
every exported node.

* `SoftmaxPooledRowCalibration`, `SoftmaxAllRowsCalibration`: the same two
  calibrations fused with the attention Softmax.  Input `scores` T[B,H,Q,K] is
  the Softmax's input (scaled, masked logits); the output is
  `<op>(Softmax(scores, axis=-1), attention_mask)` with `<op>`'s attributes.
  Why: a separate op costs one more read and write of the probabilities; fused,
  the calibration rides on the softmax's own pass over the row.

Rows that are fully masked or not finite.  The ops follow the graph they
replace.  The function body, the native CPU kernels (in place and out of
place) and the PyTorch path `attncal.calibration.apply` give what the float64
oracle `attncal.calibration.reference` gives, row kind by row kind
(`tests/test_masked_rows.py`); the CUDA kernels follow the same rules
(`plugins/kernels/calibration_cuda.h`; compiled in CI, never run here):

* Scores all -inf (a fully masked row of an additive -inf mask), or holding a
  NaN or +inf: ONNX Softmax has no value for such a row; ONNX Runtime's Softmax
  and torch.softmax give NaN at every key.  So do the Softmax-fused ops, for
  every key of the row, calibrated or not: exactly Softmax followed by the
  separate op.
* Scores all the dtype's lowest finite value (how transformers masks): the
  softmax is the uniform row, 1/K at each of the K keys, masked keys included;
  a calibrated such row is then calibrated as usual (masked keys are excluded
  by `attention_mask`, not by the scores: they come out 0).  Scores partly
  -inf with the valid keys finite are ordinary rows (exp(-inf) = 0).
* Separate ops: a calibrated row that holds a NaN or an infinity at any of its
  K keys, masked keys included, comes back NaN at every key (no probability
  row holds either; the ones after a fully masked Softmax are all NaN).  A row
  that is not calibrated (another query row, a padding query row, an item too
  short to calibrate, strength 0) is returned as it is, NaN included.
* No op turns a NaN into a finite value or a finite row into NaN, and one
  row's NaN never reaches another row or head.

A future one-pass attention op (Softmax and the product with V in one kernel)
must state its own rule for a fully masked row: FlashAttention returns 0 for
it, ONNX Runtime's MultiHeadAttention and torch's scaled_dot_product_attention
differ by backend, so "the graph it replaces" does not decide it by itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..calibration.config import ResolvedCalibration

DOMAIN = "ai.attncal"
VERSION = 1
POOLED_OP = "PooledRowCalibration"
ALL_ROWS_OP = "AllRowsCalibration"
SOFTMAX_POOLED_OP = "SoftmaxPooledRowCalibration"
SOFTMAX_ALL_ROWS_OP = "SoftmaxAllRowsCalibration"
OP_TYPES = (POOLED_OP, ALL_ROWS_OP, SOFTMAX_POOLED_OP, SOFTMAX_ALL_ROWS_OP)
_WITH_SOFTMAX = {POOLED_OP: SOFTMAX_POOLED_OP, ALL_ROWS_OP: SOFTMAX_ALL_ROWS_OP}
_CALIBRATION_OF = {v: k for k, v in _WITH_SOFTMAX.items()}

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


def _check(op_type: str) -> str:
    if op_type not in OP_TYPES:
        raise ValueError(f"unknown calibration op {op_type!r}; the {DOMAIN} ops are {', '.join(OP_TYPES)}")
    return op_type


def takes_scores(op_type: str) -> bool:
    """True for the ops fused with the Softmax (first input: scores, not probabilities)."""
    return _check(op_type) in _CALIBRATION_OF


def calibration_of(op_type: str) -> str:
    """The calibration a (fused or plain) op applies: PooledRowCalibration or AllRowsCalibration."""
    return _CALIBRATION_OF.get(_check(op_type), op_type)


def with_softmax(op_type: str) -> str:
    """The fused counterpart of a plain calibration op."""
    return _WITH_SOFTMAX[calibration_of(op_type)]


def is_all_rows(op_type: str) -> bool:
    return calibration_of(op_type) == ALL_ROWS_OP


def first_input(op_type: str) -> str:
    return "scores" if takes_scores(op_type) else "probs"


def attribute_names(op_type: str) -> list[str]:
    names = list(ATTRIBUTES)
    if is_all_rows(op_type):
        names.remove("pool_last")
    return names


@dataclass(frozen=True)
class OpSpec:
    """One calibration node: its op type and attribute values."""

    op_type: str
    attrs: dict[str, int | float]


def op_spec(rc: ResolvedCalibration, layer: int, *, fused_softmax: bool = False) -> OpSpec:
    """The node that implements the resolved calibration `rc` in layer `layer` (fused with the
    Softmax: takes the scores)."""
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
        spec = OpSpec(ALL_ROWS_OP, attrs)
    else:
        spec = OpSpec(POOLED_OP, {"pool_last": int(rc.pool_last), **attrs})
    return OpSpec(with_softmax(spec.op_type), spec.attrs) if fused_softmax else spec


def resolved_from_attrs(op_type: str, attrs: dict[str, int | float]) -> ResolvedCalibration:
    """Inverse of `op_spec`: what a node with these attributes computes."""
    if is_all_rows(op_type):
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
