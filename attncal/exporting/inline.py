"""The inlined graph, `onnx/model_inlined.onnx`: the portable graph with every model-local function (the
`ai.attncal` ops' ONNX bodies) expanded into standard ONNX nodes, every attribute reference bound to its call
site's value.

A calibrated portable graph calls its calibration as custom-domain ops whose bodies are model-local ONNX
functions.  ONNX Runtime runs those bodies; a consumer that does not read function bodies (OpenVINO's ONNX
frontend: "No conversion rule found for operations: ai.attncal.SoftmaxAllRowsCalibration") refuses the graph.
`onnx.inliner.inline_local_functions` expands the calls but leaves a body's attribute references
(`ref_attr_name`) unbound outside any function, which ONNX Runtime then refuses ("Constant node has no data
attributes").  onnx_ir's inliner clones each body with its references resolved against the call site's
attributes (or the function's defaults), so each call becomes the nodes it stands for, with the values that
call gave.  Values are unchanged: the parity check measures the inlined graph like every other.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import InlinePass

from ..artifact import INLINED_GRAPH
from .errors import ExportError

INLINED_RUNTIME = ("any ONNX runtime that reads standard ONNX (no functions, no custom domain): ONNX Runtime, "
                   "OpenVINO")
STANDARD_DOMAINS = ("", "ai.onnx")


def function_calls(model: ir.Model) -> int:
    """How many nodes of the main graph (and its subgraphs) call a model-local function."""
    return sum(1 for node in ir.traversal.RecursiveGraphIterator(model.graph)
               if node.op_identifier() in model.functions)


def inline_functions(model: ir.Model) -> int:
    """Expand every model-local function call of `model` in place, attributes bound; returns how many calls
    were expanded.  Raises ExportError when a node outside standard ONNX is left (a custom op with no body)."""
    calls = function_calls(model)
    InlinePass()(model)
    left = sorted({f"{n.domain}::{n.op_type}" for n in ir.traversal.RecursiveGraphIterator(model.graph)
                   if n.domain not in STANDARD_DOMAINS})
    if left:
        raise ExportError(f"{INLINED_GRAPH}: ops outside standard ONNX remain after inlining "
                          f"({', '.join(left)}): they have no ONNX function body")
    unbound = [f"{n.name or n.op_type}.{a.name}" for n in ir.traversal.RecursiveGraphIterator(model.graph)
               for a in n.attributes.values() if a.is_ref()]
    if unbound:
        raise ExportError(f"{INLINED_GRAPH}: attribute references left unbound after inlining "
                          f"({', '.join(unbound[:3])})")
    for domain in [d for d in model.opset_imports if d not in STANDARD_DOMAINS]:
        del model.opset_imports[domain]  # no node of it is left: a reader sees standard ONNX only
    return calls
