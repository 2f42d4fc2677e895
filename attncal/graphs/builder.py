"""A tiny node builder for graph rewrites: nodes and their constants are collected, then added together.

Shared by the row and split placements, which both add a block of nodes beside an attention layer.
Nothing reaches the graph before `Ops.insert_before`/`Ops.insert_after`: a placement runs every
refusal first, and a builder that is dropped leaves neither nodes nor orphan initializers behind.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir


class Ops:
    """Creates nodes into `self.nodes` and constants into `self.initializers` (names prefixed); both are
    added to `graph` by `insert_before`/`insert_after`.

    Why hold the constants: registering an initializer edits the graph, so a rewrite that creates
    constants while it is still deciding whether it applies would leave unused weights behind when
    it refuses."""

    def __init__(self, graph: ir.Graph, prefix: str) -> None:
        self.graph, self.prefix = graph, prefix
        self.nodes: list[ir.Node] = []
        self.initializers: list[ir.Value] = []
        self.n = 0

    def __call__(self, op_type: str, *inputs: ir.Value | None, domain: str = "", num_outputs: int = 1,
                 **attrs) -> ir.Value | Sequence[ir.Value]:
        self.n += 1
        node = ir.node(op_type, list(inputs), attrs or None, domain=domain, num_outputs=num_outputs,
                       name=f"{self.prefix}/{op_type}_{self.n}")
        for i, out in enumerate(node.outputs):
            out.name = f"{self.prefix}/{op_type}_{self.n}_out{i}"
        self.nodes.append(node)
        return node.outputs[0] if num_outputs == 1 else node.outputs

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        """A constant that becomes an initializer of the main graph (visible inside subgraphs too) when
        the nodes are inserted."""
        v = ir.Value(name=f"{self.prefix}/{name}", const_value=ir.tensor(np.asarray(array)))
        self.initializers.append(v)
        return v

    def insert_before(self, anchor: ir.Node) -> None:
        """Register the constants, then insert the nodes before `anchor`."""
        self._register()
        self.graph.insert_before(anchor, self.nodes)

    def insert_after(self, anchor: ir.Node) -> None:
        """Register the constants, then insert the nodes after `anchor`."""
        self._register()
        self.graph.insert_after(anchor, self.nodes)

    def _register(self) -> None:
        for v in self.initializers:
            self.graph.register_initializer(v)


def graph_input(graph: ir.Graph, name: str, error: type[Exception]) -> ir.Value:
    """The graph input called `name`, or `error` naming it."""
    value = next((v for v in graph.inputs if v.name == name), None)
    if value is None:
        raise error(f"the graph has no input named {name!r}")
    return value


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or of a Constant node's output (TorchScript exports write Constant nodes;
    the dynamo exporter, initializers), or None for a computed value."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else np.asarray(tensor.numpy())


def scalar_value(value: ir.Value | None) -> float | None:
    """A one-element constant's value (`const_array`), or None."""
    c = const_array(value)
    return None if c is None or c.size != 1 else float(c.reshape(()))
