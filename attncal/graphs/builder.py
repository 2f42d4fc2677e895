"""A tiny node builder for graph rewrites: nodes are created into a list and inserted together.

Shared by the row and split placements, which both add a block of nodes beside an attention layer.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


class Ops:
    """Creates nodes into `self.nodes` (names prefixed), to be inserted into `graph` by the caller."""

    def __init__(self, graph: ir.Graph, prefix: str) -> None:
        self.graph, self.prefix, self.nodes, self.n = graph, prefix, [], 0

    def __call__(self, op_type: str, *inputs: ir.Value | None, domain: str = "", num_outputs: int = 1, **attrs):
        self.n += 1
        node = ir.node(op_type, list(inputs), attrs or None, domain=domain, num_outputs=num_outputs,
                       name=f"{self.prefix}/{op_type}_{self.n}")
        for i, out in enumerate(node.outputs):
            out.name = f"{self.prefix}/{op_type}_{self.n}_out{i}"
        self.nodes.append(node)
        return node.outputs[0] if num_outputs == 1 else node.outputs

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        """An initializer of the main graph (visible inside subgraphs too)."""
        v = ir.Value(name=f"{self.prefix}/{name}", const_value=ir.tensor(np.asarray(array)))
        self.graph.register_initializer(v)
        return v


def graph_input(graph: ir.Graph, name: str, error: type[Exception]) -> ir.Value:
    """The graph input called `name`, or `error` naming it."""
    value = next((v for v in graph.inputs if v.name == name), None)
    if value is None:
        raise error(f"the graph has no input named {name!r}")
    return value
