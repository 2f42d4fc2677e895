"""The graph passes outside the placements: one protocol (attncal.graphs.pass_base), run from ordered lists."""

from __future__ import annotations

import onnx_ir as ir

from attncal.graphs.fusions import feed_forward_chunks, load_time_fusions, passes, rotary_fusion
from attncal.graphs.ops import inplace_shapes
from attncal.graphs.pass_base import IR, PROTO, GraphPass, run_passes


def _split_model(axis: int) -> ir.Model:
    x = ir.Value(name="x", shape=ir.Shape([2, 3, 8]), type=ir.TensorType(ir.DataType.FLOAT))
    split = ir.node("Split", [x], attributes={"axis": axis}, num_outputs=2)
    for k, out in enumerate(split.outputs):
        out.name = f"y{k}"
        out.shape = ir.Shape([2, 3, 4])
    graph = ir.Graph([x], list(split.outputs), nodes=[split], opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


def test_each_pass_declares_the_protocol_and_its_place():
    declared = [rotary_fusion.PASS, passes.NATIVE_FUSIONS, feed_forward_chunks.PASS, feed_forward_chunks.SPLIT_AXIS, inplace_shapes.PASS,
                load_time_fusions.ERF_GELU, load_time_fusions.INTERMEDIATE_SHAPES]
    assert all(isinstance(p, GraphPass) and p.matches and p.checks for p in declared)
    assert len({p.name for p in declared}) == len(declared)
    lists = (passes.PORTABLE, passes.NATIVE_PLAIN, passes.STAGED)
    assert all(entry.why for entries in lists for entry in entries)
    # the onnx_ir lists take onnx_ir models, the staged list ModelProtos; dropping the shapes comes last
    assert {e.graph_pass.takes for e in passes.NATIVE_PLAIN} == {IR} and {e.graph_pass.takes for e in passes.STAGED} == {PROTO}
    assert passes.PORTABLE[-1].graph_pass is passes.NATIVE_PLAIN[-1].graph_pass is load_time_fusions.INTERMEDIATE_SHAPES
    assert feed_forward_chunks.PASS not in [e.graph_pass for e in passes.staged(False)]
    assert passes.staged(True) == passes.STAGED


def test_run_passes_reports_what_each_rewrote():
    model = _split_model(axis=2)
    reports = run_passes(model, passes.NATIVE_PLAIN[2:])  # the Split, then the load-time rewrites
    assert reports[feed_forward_chunks.SPLIT_AXIS.name] == {feed_forward_chunks.SPLIT_AXIS.name: 1}
    assert reports[load_time_fusions.ERF_GELU.name] == {load_time_fusions.ERF_GELU.name: 0}
    assert model.graph.node(0).attributes["axis"].as_int() == -1
    assert all(out.shape is not None for out in model.graph.outputs)  # graph outputs keep their shapes
    again = run_passes(_split_model(axis=0), passes.NATIVE_PLAIN[2:3])
    assert again[feed_forward_chunks.SPLIT_AXIS.name][feed_forward_chunks.SPLIT_AXIS.name] == 0
