"""The registry of calibration placements, and how `auto` chooses between them.

`PLACEMENTS` maps each name (`placement_names`, the one list) to its `placement_base.Placement`:
its rules, one module each, and what the exporter needs to know (which graphs and precisions it
applies to, how its optimized graph is made, which nodes a float16 conversion keeps in float32).
The exporter looks one up here (`get`) and calls its `place`, for the portable graph and, where ONNX
Runtime's transformer optimizer applies, for the optimized graphs; `plan` says which placement each
graph gets.

`auto` (the default) follows what `attncal bench` measured (docs/placements.md; the figures are on
docs/performance.md and docs/performance-log.md):
* cls / last pooling -> `row`: one row is recomputed beside the attention; every fused attention
  node is kept, so calibration costs little over the uncalibrated optimized graph.
* mean pooling -> `split` on the optimized graph: every row is calibrated, so the probabilities
  would otherwise be materialised; the split identity keeps fused attention (about the memory of the
  uncalibrated optimized graph) at the price of one more attention pass over the keys per
  calibrated layer.  On the portable graph, mean pooling gets `fused-softmax`: the calibrated
  layers' Softmax becomes one op computing softmax and calibration in one pass over each row (the
  native kernel; elsewhere its function body, which is the softmax placement's graph).  ONNX
  Runtime does not fuse the plain split graph's basket attention, which then costs more latency and
  memory than the softmax placements (`ort-split` vs `ort-cal`); `--placement split` writes it for
  runtimes that fuse attention themselves (TensorRT).  A mean-pooling config with an `original`
  isolated token cannot be split on fused attention and uses the softmax placements in both graphs.
* lmk / multi-cls / mean-every pooling -> `fused-softmax` on the portable graph and `softmax` on the optimized
  one: the calibrated rows are marked from the token ids (`row_marks`), neither the one row that row
  placement recomputes nor the every row that split placement computes over baskets; the native graph's
  attention op calibrates them in its one pass.
* Beside the optimized graph, every export where that graph applies, calibrated or not, also gets the
  native graph (`onnx/model_optimized_native.onnx`): each layer's fused attention becomes one
  calibrated attention op (strength 0 where the layer is not calibrated), softmax, calibration and
  the product with V in one pass (the native
  CPU kernel); in float32 exports the op also computes the Q, K and V projection
  (`projected-attention`), in fp16 and int8 exports it follows separate projections (`attention`).
  The runtime runs it where the attncal native library is loaded and the optimized graph (no custom
  op, or the function body) everywhere else, so a machine without the library is never slower than
  before (`attncal.runtime.encoder.select_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...calibration.config import ResolvedCalibration
from . import (attention_placement, fused_softmax_placement, placement_names, projected_attention_placement,
               row_placement, row_plain_placement, softmax_placement, split_placement, split_plain_placement)
from .placement_base import OPTIMIZED, PORTABLE, PRECISIONS, Placement
from .placement_names import ATTENTION, AUTO, FUSED_SOFTMAX, PROJECTED_ATTENTION, ROW, SOFTMAX, SPLIT

_BOTH_GRAPHS = frozenset({PORTABLE, OPTIMIZED})

PLACEMENTS: dict[str, Placement] = {p.name: p for p in (
    # Placed on the plain graph, which is then optimized: ORT cannot fuse a calibrated layer (the op
    # sits between its Softmax and value MatMul).  The op computes in float32 whatever its input type.
    Placement(SOFTMAX, (softmax_placement.RULE,), _BOTH_GRAPHS, PRECISIONS, optimize_first=False,
              float32_nodes=None),
    Placement(FUSED_SOFTMAX, (fused_softmax_placement.RULE,), _BOTH_GRAPHS, PRECISIONS, optimize_first=False,
              float32_nodes=None),
    # Placed on the optimized graph beside (row) or instead of (split) its fused attention nodes, which all
    # survive; their calibration math is standard ops, kept float32 in a float16 graph.
    Placement(ROW, (row_placement.FUSED_RULE, row_plain_placement.RULE), _BOTH_GRAPHS, PRECISIONS,
              optimize_first=True, float32_nodes=row_placement.NODE_PREFIX, check_request=row_placement.check_request),
    Placement(SPLIT, (split_placement.FUSED_RULE, split_plain_placement.RULE), _BOTH_GRAPHS, PRECISIONS,
              optimize_first=True, float32_nodes=split_placement.NODE_PREFIX,
              check_request=split_placement.check_request),
    # Rewrite ONNX Runtime's fused attention, so the optimized graphs only.  The calibrated attention op takes
    # float16 Q/K/V and computes its softmax and calibration in float32 itself; the projected op is float32 only.
    Placement(ATTENTION, (attention_placement.RULE,), frozenset({OPTIMIZED}), PRECISIONS, optimize_first=True,
              float32_nodes=None),
    Placement(PROJECTED_ATTENTION, (projected_attention_placement.RULE,), frozenset({OPTIMIZED}),
              projected_attention_placement.PRECISIONS, optimize_first=True, float32_nodes=None,
              check_request=projected_attention_placement.check_request),
)}
if tuple(PLACEMENTS) != placement_names.NAMES:
    raise ImportError(f"the placement registry {tuple(PLACEMENTS)} is not placement_names.NAMES "
                      f"{placement_names.NAMES}: every name there has one placement here, in that order")
CHOICES = placement_names.CHOICES
# The native graph's placement per precision: float32 graphs get the op that also projects Q, K and V
# (float32 kernel only); int8 keeps separate projection MatMuls for ONNX Runtime's quantizer, and fp16
# the attention op's float16 and CUDA kernels.
NATIVE_BY_PRECISION = {"fp32": PROJECTED_ATTENTION, "fp16": ATTENTION, "int8": ATTENTION}


@dataclass(frozen=True)
class Plan:
    portable: str  # placement of onnx/model.onnx (standard ONNX)
    optimized: str  # placement of onnx/model_optimized.onnx (ORT-optimized), when that graph is written
    reason: str
    native: str | None = None  # placement of onnx/model_optimized_native.onnx (run with the native library)


def get(name: str) -> Placement:
    if name not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(CHOICES)}, got {name!r}")
    return PLACEMENTS[name]


def plan(requested: str, rc: ResolvedCalibration, precision: str = "fp32") -> Plan:
    """Which placement each graph gets for `requested` (auto or an explicit name), config `rc` and the
    export's `precision` (fp32, fp16 or int8).  An explicit request is refused (its placement's
    `check_request`) where the placement cannot take the config or precision."""
    if requested not in CHOICES:
        raise ValueError(f"placement must be one of {', '.join(CHOICES)}, got {requested!r}")
    if precision not in NATIVE_BY_PRECISION:
        raise ValueError(f"precision must be one of {', '.join(NATIVE_BY_PRECISION)}, got {precision!r}")
    native_placement = NATIVE_BY_PRECISION[precision]
    if requested != AUTO:
        placement = PLACEMENTS[requested]
        refusal = placement.check_request(rc, precision)
        if refusal is not None:
            raise refusal.exception()
        if PORTABLE not in placement.graphs:  # no fused attention on the portable graph
            portable = FUSED_SOFTMAX if rc.all_rows or rc.row_set else ROW
            return Plan(portable, requested, f"requested: --placement {requested} (the ORT-optimized graph; "
                                             f"{portable} on the portable graph)")
        return Plan(requested, requested, f"requested: --placement {requested}")
    native = ("; where the attncal native library is loaded, the calibrated attention op computes every layer's "
              + ("Q/K/V projection, " if native_placement == PROJECTED_ATTENTION else "")
              + "softmax, calibration (where calibrated) and product with V in one pass "
              "(onnx/model_optimized_native.onnx)")
    if rc.row_set:
        return Plan(FUSED_SOFTMAX, SOFTMAX, f"auto: {rc.pooling} pooling calibrates the rows marked from the token ids "
                                            "(neither one row, which row placement recomputes, nor every row, which "
                                            "split placement computes over baskets); the calibration is fused with "
                                            "each calibrated layer's Softmax on the portable graph" + native,
                    native_placement)
    if not rc.all_rows:
        return Plan(ROW, ROW, f"auto: {rc.pooling} pooling calibrates one row; row placement recomputes it "
                              "beside the attention and keeps every fused attention node" + native, native_placement)
    if PLACEMENTS[SPLIT].check_request(rc, precision) is not None:
        return Plan(FUSED_SOFTMAX, SOFTMAX, "auto: mean pooling with an 'original' isolated token needs the "
                                            "probabilities of every row; the calibration is fused with the "
                                            "Softmax on the portable graph" + native, native_placement)
    return Plan(FUSED_SOFTMAX, SPLIT, "auto: mean pooling calibrates every row; on the ORT-optimized graph "
                                      "split placement computes it as attention over baskets, so fused attention "
                                      "is kept and the probabilities are never materialised; on the portable "
                                      "graph the calibration is fused with each calibrated layer's Softmax (one "
                                      "pass over the probabilities)" + native, native_placement)
