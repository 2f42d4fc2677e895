"""The graph passes the exporter runs (`attncal.graphs.pass_base.GraphPass`), in order, each with why it comes
where it does.

A graph from torch's export is placed first (the placements read its attention as torch wrote it), then passed
through one of the `onnx_ir` lists below; the exporter then stages it with its weights on disk and runs
`STAGED` on its structure (`attncal.artifact.write_graph`).  The ORT-optimized graphs come from ONNX Runtime's
optimizer, which makes its own fusions: they get `STAGED` only.
"""

from __future__ import annotations

from . import feed_forward_chunks, load_time_fusions, native_fusions, rotary_fusion
from ..ops import inplace_shapes
from ..pass_base import IR, GraphPass, Ordered

NATIVE_FUSIONS = GraphPass(
    "onnxruntime fusions", IR,
    matches="RMS normalizations and tanh GELUs (onnxscript's ort_fusions rules)",
    checks="norms of the hidden state or per head with no Transpose beside them",
    rewrite=native_fusions.fuse_norms_and_gelus)

_LOAD_TIME = (
    Ordered(load_time_fusions.ERF_GELU, "after the placements, which read the GELU's neighbours as torch wrote them"),
    Ordered(load_time_fusions.INTERMEDIATE_SHAPES, "last on the onnx_ir graph: every pass before it reads the "
            "shapes torch's exporter recorded"),
)

# onnx/model.onnx: standard ONNX, so only the rewrites that keep it standard.
PORTABLE: tuple[Ordered, ...] = _LOAD_TIME

# The native graph of a plain export (no ORT-optimized graph): ONNX Runtime's own ops are allowed there.
NATIVE_PLAIN: tuple[Ordered, ...] = (
    Ordered(rotary_fusion.PASS, "first: it reads the heads and head size from the recorded shapes, and the fused "
            "rotations take the Transposes out of the per-head norms' way"),
    Ordered(NATIVE_FUSIONS, "after the rotations, whose Transposes would keep Q's and K's per-head norms unfused"),
    Ordered(feed_forward_chunks.SPLIT_AXIS, "while the recorded shapes say which Split is of the last axis; the "
            "chunking, on the staged structure, reads the axis only"),
    *_LOAD_TIME,
)

# The staged structure of every written graph, weights on disk.
STAGED: tuple[Ordered, ...] = (
    Ordered(inplace_shapes.PASS, "after the recorded shapes are dropped: it labels the calibration op's input "
            "again, so the native op still runs in place"),
    Ordered(feed_forward_chunks.PASS, "last: the Scan body takes the block's nodes as they are; native float32 "
            "long-context graphs only (`attncal.exporting.optimized_graphs`)"),
)


def onnxruntime_fusions(reports: dict[str, dict[str, int]]) -> dict[str, int]:
    """How many of ONNX Runtime's ops `NATIVE_PLAIN`'s fusions wrote, by op, as attncal.json's
    `onnxruntime_fusions` records them."""
    rotations = reports[rotary_fusion.PASS.name][rotary_fusion.PASS.name]
    return {**reports[NATIVE_FUSIONS.name], rotary_fusion.ROTARY_OP: rotations}


def staged(chunk_feed_forwards: bool) -> tuple[Ordered, ...]:
    """`STAGED`, without the feed-forward chunks unless `chunk_feed_forwards`."""
    return tuple(p for p in STAGED if chunk_feed_forwards or p.graph_pass is not feed_forward_chunks.PASS)
