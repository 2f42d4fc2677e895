"""Small graphs of what an export builds from `attention_mask` (a mask, a relative position bias), for the tests
of the probes that read them (attncal.graphs.placements.mask_probe, attncal.graphs.placements.position_bias_probe)."""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx import TensorProto, helper


def position_nodes() -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """(nodes, constants) computing `q` [S,1] and `k` [1,S], the query and key positions 0..S-1, from
    attention_mask's length as transformers' exports do (Shape, Squeeze, Range, Unsqueeze); the constants
    `zero`, `one`, `ax0` and `ax1` are there for the caller's nodes too."""
    nodes = [
        helper.make_node("Shape", ["attention_mask"], ["S"], start=1, end=2),
        helper.make_node("Squeeze", ["S"], ["s"]),
        helper.make_node("Range", ["zero", "s", "one"], ["r"]),
        helper.make_node("Unsqueeze", ["r", "ax0"], ["k"]),
        helper.make_node("Unsqueeze", ["r", "ax1"], ["q"]),
    ]
    consts = [helper.make_tensor("zero", TensorProto.INT64, [], [0]), helper.make_tensor("one", TensorProto.INT64, [], [1]),
              helper.make_tensor("ax0", TensorProto.INT64, [1], [0]), helper.make_tensor("ax1", TensorProto.INT64, [1], [1])]
    return nodes, consts


def probe_model(nodes: list[onnx.NodeProto], consts: list[onnx.TensorProto], output: str) -> ir.Model:
    """A graph of `nodes` from the input attention_mask [B,S] (int64) to the float output `output`."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S"])],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)], consts)
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
