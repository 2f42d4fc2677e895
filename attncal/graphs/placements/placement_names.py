"""The placement names: the registry's keys, and the choices the exporter and the command line offer.

Why a module of its own: the registry (`attncal.graphs.placements`) imports the rewrite modules and
onnx_ir with them (about a second), while the exporter's option checks and the command line's
`--placement` choices need only the names, and must load without it.  The registry takes each
placement's name from here and refuses to import unless its placements are exactly `NAMES`, in this
order, so this is the one list.
"""

from __future__ import annotations

AUTO = "auto"  # not a placement: `placements.plan` chooses one per graph
SOFTMAX = "softmax"
FUSED_SOFTMAX = "fused-softmax"
ROW = "row"
SPLIT = "split"
ATTENTION = "attention"
PROJECTED_ATTENTION = "projected-attention"

NAMES = (SOFTMAX, FUSED_SOFTMAX, ROW, SPLIT, ATTENTION, PROJECTED_ATTENTION)  # the registry, in its order
CHOICES = (AUTO,) + NAMES  # what `--placement` accepts
