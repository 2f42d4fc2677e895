"""The graph-pass protocol: a rewrite of a whole graph outside the placements.

A placement inserts the calibration (`attncal.graphs.placements.placement_base`); a **graph pass** (`GraphPass`)
prepares a written graph for ONNX Runtime without changing its values: the rotary fusion, the feed-forward chunks, the
load-time fusions' rewrites, the in-place shapes.  Each pass module declares its passes as `GraphPass` values
saying what the pass matches, what a match must satisfy before it is rewritten (a match that fails a check is
left as it is: a pass never refuses), what it rewrites, and what it reports (how many of each thing it
rewrote).  `attncal.graphs.fusions.passes` holds the ordered lists the exporter runs, with why each pass comes where
it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

IR, PROTO = "onnx_ir", "proto"  # the model a pass takes: an onnx_ir.Model, or a staged graph's structure-only ModelProto


@dataclass(frozen=True)
class GraphPass:
    """One graph pass: `rewrite(model)` edits `model` (of kind `takes`) in place and returns how many matches it
    rewrote, or a count per kind of match."""

    name: str
    takes: str  # IR or PROTO
    matches: str  # what the pass looks for
    checks: str  # what a match must satisfy to be rewritten
    rewrite: Callable[[Any], int | Mapping[str, int]]
    keeps_data_file: bool = False  # a graph it rewrote keeps its weights in a data file when written

    def run(self, model) -> dict[str, int]:
        """Rewrite `model` in place; the report: how many of each kind of match were rewritten."""
        done = self.rewrite(model)
        return dict(done) if isinstance(done, Mapping) else {self.name: int(done)}


@dataclass(frozen=True)
class Ordered:
    """A pass in one of the exporter's lists, with why it comes where it does."""

    graph_pass: GraphPass
    why: str


def run_passes(model, passes: tuple[Ordered, ...]) -> dict[str, dict[str, int]]:
    """Run `passes` on `model` in order; each pass's report by its name."""
    return {p.graph_pass.name: p.graph_pass.run(model) for p in passes}
