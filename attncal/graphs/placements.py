"""The calibration placements and how `auto` chooses between them.

Each placement is one module with the same entry point, `place(model, config, num_layers)`
(see `placement_base`); the exporter looks one up here and calls it, for the portable graph and,
where ONNX Runtime's transformer optimizer applies, for the optimized graph.

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
* Beside the optimized graph, every calibrated export where that graph applies also gets the
  native graph (`onnx/model_optimized_native.onnx`): each calibrated layer's fused attention becomes
  one calibrated attention op, softmax, calibration and the product with V in one pass (the native
  CPU kernel); in float32 exports the op also computes the Q, K and V projection
  (`projected-attention`), in fp16 and int8 exports it follows separate projections (`attention`).
  The runtime runs it where the attncal native library is loaded and the optimized graph (no custom
  op, or the function body) everywhere else, so a machine without the library is never slower than
  before (`attncal.runtime.encoder.select_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from ..calibration.config import ResolvedCalibration
from . import (attention_placement, fused_softmax_placement, projected_attention_placement, row_placement,
               softmax_placement, split_placement)

PLACEMENTS: dict[str, ModuleType] = {m.NAME: m for m in (softmax_placement, fused_softmax_placement, row_placement,
                                                        split_placement, attention_placement,
                                                        projected_attention_placement)}
# The native graph's placement per precision: float32 graphs get the op that also projects Q, K and V
# (float32 kernel only); int8 keeps separate projection MatMuls for ONNX Runtime's quantizer, and fp16
# the attention op's float16 and CUDA kernels.
NATIVE_BY_PRECISION = {"fp32": projected_attention_placement.NAME, "fp16": attention_placement.NAME,
                       "int8": attention_placement.NAME}
CHOICES = ("auto",) + tuple(PLACEMENTS)


@dataclass(frozen=True)
class Plan:
    portable: str  # placement of onnx/model.onnx (standard ONNX)
    optimized: str  # placement of onnx/model_optimized.onnx (ORT-optimized), when that graph is written
    reason: str
    native: str | None = None  # placement of onnx/model_optimized_native.onnx (run with the native library)


def get(name: str) -> ModuleType:
    if name not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(CHOICES)}, got {name!r}")
    return PLACEMENTS[name]


def plan(requested: str, rc: ResolvedCalibration, precision: str = "fp32") -> Plan:
    """Which placement each graph gets for `requested` (auto or an explicit name), config `rc` and the
    export's `precision` (fp32, fp16 or int8)."""
    if requested not in CHOICES:
        raise ValueError(f"placement must be one of {', '.join(CHOICES)}, got {requested!r}")
    if precision not in NATIVE_BY_PRECISION:
        raise ValueError(f"precision must be one of {', '.join(NATIVE_BY_PRECISION)}, got {precision!r}")
    native_placement = NATIVE_BY_PRECISION[precision]
    if requested != "auto":
        if requested == "row" and rc.all_rows:
            raise row_placement.RowPlacementError(
                "row placement needs a single pooling row; mean pooling calibrates every row: use "
                "--placement split (or auto)"
            )
        if requested == "split":
            split_placement.check_supported(rc)
        if requested in ("attention", "projected-attention"):  # no fused attention on the portable graph
            if requested == "projected-attention" and precision != "fp32":
                raise projected_attention_placement.ProjectedAttentionPlacementError(
                    f"--placement projected-attention writes a float32 op; a {precision} export keeps separate "
                    "Q, K and V projections: use --placement attention (or auto)")
            portable = "fused-softmax" if rc.all_rows else "row"
            return Plan(portable, requested, f"requested: --placement {requested} (the ORT-optimized graph; "
                                             f"{portable} on the portable graph)")
        return Plan(requested, requested, f"requested: --placement {requested}")
    native = ("; where the attncal native library is loaded, the calibrated attention op computes each calibrated "
              "layer's " + ("Q/K/V projection, " if native_placement == projected_attention_placement.NAME else "")
              + "softmax, calibration and product with V in one pass (onnx/model_optimized_native.onnx)")
    if not rc.all_rows:
        return Plan("row", "row", f"auto: {rc.pooling} pooling calibrates one row; row placement recomputes it "
                                  "beside the attention and keeps every fused attention node" + native, native_placement)
    try:
        split_placement.check_supported(rc)
    except split_placement.SplitPlacementError:
        return Plan("fused-softmax", "softmax", "auto: mean pooling with an 'original' isolated token needs the "
                                                "probabilities of every row; the calibration is fused with the "
                                                "Softmax on the portable graph" + native, native_placement)
    return Plan("fused-softmax", "split", "auto: mean pooling calibrates every row; on the ORT-optimized graph "
                                          "split placement computes it as attention over baskets, so fused attention "
                                          "is kept and the probabilities are never materialised; on the portable "
                                          "graph the calibration is fused with each calibrated layer's Softmax (one "
                                          "pass over the probabilities)" + native, native_placement)
