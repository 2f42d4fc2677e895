"""The feed-forward blocks of the native graph, run over chunks of rows in an ONNX `Scan`.

Why: once the attention is one op, a long batch's largest tensors are the feed-forward's intermediates,
[tokens, intermediate] each (four times the hidden state in the BERT family; the gate, the up projection and
their product in gated models), and ONNX Runtime holds two or three of them at once.  A row of the
feed-forward's output depends only on the same row of its input, so the block can run over chunks of rows:
the intermediates then exist for one chunk at a time (`CHUNK_ROWS` rows), and they stay in cache between
the two projections.  Every row is computed by the same kernels on the same values, so the output does not
change; how memory and time moved is in docs/performance.md.

What is chunked: the nodes between the block's input `x` and its output projection, found backwards from a
MatMul by a weight (`_cone`).  Every one of them must be row-wise (`ROW_WISE_OPS`, a Split of the last axis
written as -1, or a MatMul by a weight), take only `x`, each other's outputs or constants that broadcast
along the last axis, and be read by no node outside the block; the block must hold at least two MatMuls, and
an input projection must read `x` itself.  That matches each supported architecture's feed-forward (MatMul,
activation, MatMul; gated: two input MatMuls, or one split in two, and a product) and nothing else: the
attention's output projection reads the attention op, and the QKV projections end in Reshapes.

The rewrite works on the graph's structure only (weights stay in their data file); the Scan's body reads the
weights from the outer graph.  The input is flattened to [rows, width], padded to C equal chunks of at most
`CHUNK_ROWS` rows (fewer than C rows of padding), scanned, and the padding sliced off again."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..pass_base import IR, PROTO, GraphPass

CHUNK_ROWS = 1024

# Element-wise ops whose output row r depends only on row r of their inputs (with constants that broadcast
# along the last axis): the activations and products of the feed-forwards attncal exports.
ROW_WISE_OPS = {
    "": frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Erf", "Tanh", "Sigmoid", "Relu", "Neg", "Sqrt", "Exp",
                   "Gelu", "Softplus", "Clip"}),
    "com.microsoft": frozenset({"BiasGelu", "FastGelu", "Gelu", "QuickGelu"}),
}
_PREFIX = "attncal_ffn_chunks"


@dataclass
class _Graph:
    """The graph's nodes in order, who produces and who reads each value (node indices), and which values are
    constants (with their dims)."""
    nodes: list
    producer: dict = field(default_factory=dict)
    readers: dict = field(default_factory=dict)
    constant_dims: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)  # initializer name -> (dims, data type)
    outputs: frozenset = frozenset()

    @classmethod
    def of(cls, graph) -> "_Graph":
        g = cls(nodes=list(graph.node), outputs=frozenset(o.name for o in graph.output))
        for t in graph.initializer:
            g.constant_dims[t.name] = list(t.dims)
            g.weights[t.name] = (list(t.dims), t.data_type)
        for k, n in enumerate(g.nodes):
            for o in n.output:
                g.producer[o] = k
            for i in n.input:
                g.readers.setdefault(i, set()).add(k)
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output:
                g.constant_dims[n.output[0]] = _constant_node_dims(n)
        return g


def _constant_node_dims(node) -> list[int] | None:
    for a in node.attribute:
        if a.name == "value":
            return list(a.t.dims)
        if a.name in ("value_float", "value_int"):
            return []
        if a.name in ("value_floats", "value_ints"):
            return [len(a.floats) or len(a.ints)]
    return None


def _broadcasts_by_row(dims: list[int] | None) -> bool:
    """A constant that every row sees whole: a scalar, or one dimension (the last) after leading ones."""
    return dims is not None and all(d == 1 for d in dims[:-1])


def _is_weight_matmul(node, g: _Graph) -> bool:
    return (node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and len(node.input) == 2
            and len(g.weights.get(node.input[1], ([],))[0]) == 2)


def _row_wise(node, g: _Graph) -> bool:
    if node.op_type == "Split" and node.domain in ("", "ai.onnx"):  # a split of the last axis, as -1
        return any(a.name == "axis" and a.i == -1 for a in node.attribute)
    return _is_weight_matmul(node, g) or node.op_type in ROW_WISE_OPS.get(
        "" if node.domain == "ai.onnx" else node.domain, ())


def last_axis_as_negative(model) -> int:
    """Write the axis of every Split of its input's last axis as -1, in place on an onnx_ir model whose
    shapes are still recorded; returns how many.  Values are unchanged; `chunk_feed_forwards`, which reads
    the structure only, then knows such a split is row-wise (ModernBERT's gated projection is one)."""
    import onnx_ir as ir

    count = 0
    for node in model.graph.all_nodes():
        if node.op_type != "Split" or node.domain not in ("", "ai.onnx"):
            continue
        axis = node.attributes.get("axis")
        shape = node.inputs[0].shape if node.inputs and node.inputs[0] is not None else None
        if axis is None or shape is None or axis.as_int() < 0 or axis.as_int() != shape.rank() - 1:
            continue
        node.attributes["axis"] = ir.AttrInt64("axis", -1)
        count += 1
    return count


def _cone(last: int, g: _Graph) -> tuple[set[int], str, int] | None:
    """(the block's node indices, its input, the rank its output has when the input is [rows, width]) for the
    block that ends in MatMul `last`, or None where the nodes before it are not a row-wise block with one
    input.  The rank is 2, or a constant's rank where one of rank 3 or more broadcasts into the block."""
    members, roots, todo, seen, rank = {last}, set(), [g.nodes[last].input[0]], set(), 2
    while todo:
        value = todo.pop()
        if value in seen:
            continue
        seen.add(value)
        k = g.producer.get(value)
        if k is None or not _row_wise(g.nodes[k], g):
            roots.add(value)
            continue
        members.add(k)
        node = g.nodes[k]
        for i in [node.input[0]] if _is_weight_matmul(node, g) else [i for i in node.input if i]:
            if i in g.constant_dims:
                if not _broadcasts_by_row(g.constant_dims[i]):
                    return None
                rank = max(rank, len(g.constant_dims[i]))
                continue
            todo.append(i)
    x = next(iter(roots)) if len(roots) == 1 else None
    if x is None or sum(_is_weight_matmul(g.nodes[k], g) for k in members) < 2 or not any(
            _is_weight_matmul(g.nodes[k], g) and g.nodes[k].input[0] == x for k in members):
        return None  # one input, read by an input projection, and an output projection
    for k in members - {last}:  # nothing but `last` may be read outside the block
        for o in g.nodes[k].output:
            if o and (o in g.outputs or not g.readers.get(o, set()) <= members):
                return None
    return members, x, rank


def chunk_feed_forwards(model, rows: int = CHUNK_ROWS) -> int:
    """Rewrite every feed-forward block of `model` (a ModelProto, structure only is enough) to run over
    chunks of at most `rows` rows, in place; returns how many blocks were rewritten.

    long: the blocks are found, then each block's Scan is built from the same node list it is cut from and
    spliced in; the pieces share the graph's names and the nodes' positions."""
    import numpy as np
    from onnx import helper, numpy_helper

    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    graph = model.graph
    g = _Graph.of(graph)
    blocks, taken = [], set()
    for last in reversed(range(len(g.nodes))):  # from the output side: a block's last MatMul comes first
        if last in taken or not _is_weight_matmul(g.nodes[last], g):
            continue
        found = _cone(last, g)
        if found is None or found[0] & taken:
            continue
        taken |= found[0]
        blocks.append((last, *found))
    if not blocks:
        return 0

    def const(name: str, values: list[int]) -> str:
        graph.initializer.append(numpy_helper.from_array(np.array(values, dtype=np.int64), f"{_PREFIX}/{name}"))
        return f"{_PREFIX}/{name}"

    zero, one = const("zero", [0]), const("one", [1])
    chunk_rows, chunk_rows_less_one = const("rows", [rows]), const("rows_less_one", [rows - 1])
    replacement = {}
    for b, (last, members, x, rank) in enumerate(reversed(blocks)):
        p = f"{_PREFIX}/block{b}/"
        y = g.nodes[last].output[0]
        (_, out_dim), elem = g.weights[g.nodes[last].input[1]]
        width_out = const(f"block{b}/width_out", [out_dim])
        first = next(k for k in sorted(members) if _is_weight_matmul(g.nodes[k], g) and g.nodes[k].input[0] == x)
        width_in = const(f"block{b}/width_in", [g.weights[g.nodes[first].input[1]][0][0]])
        inner = []
        for k in sorted(members):  # the graph's order is a topological one
            copy = type(g.nodes[k])()
            copy.CopyFrom(g.nodes[k])
            for i, name in enumerate(copy.input):
                if name == x:
                    copy.input[i] = p + "in"
            if k == last:
                copy.output[0] = p + "out"
            inner.append(copy)
        body = helper.make_graph(inner, p + "body", [helper.make_tensor_value_info(p + "in", elem, [None, None])],
                                 [helper.make_tensor_value_info(p + "out", elem, [None] * rank)])
        v = lambda s: p + s  # noqa: E731 - the block's value names
        replacement[last] = [
            helper.make_node("Shape", [x], [v("lead")], end=-1),
            helper.make_node("ReduceProd", [v("lead")], [v("rows")], keepdims=1),
            helper.make_node("Concat", [v("rows"), width_in], [v("flat_shape")], axis=0),
            helper.make_node("Reshape", [x, v("flat_shape")], [v("flat")], allowzero=1),
            # chunks = max(1, ceil(rows / CHUNK_ROWS)); per chunk ceil(rows / chunks); the padding below chunks
            helper.make_node("Add", [v("rows"), chunk_rows_less_one], [v("rows_up")]),
            helper.make_node("Div", [v("rows_up"), chunk_rows], [v("chunks_raw")]),
            helper.make_node("Max", [v("chunks_raw"), one], [v("chunks")]),
            helper.make_node("Add", [v("rows"), v("chunks")], [v("rows_chunks")]),
            helper.make_node("Sub", [v("rows_chunks"), one], [v("rows_chunks_less_one")]),
            helper.make_node("Div", [v("rows_chunks_less_one"), v("chunks")], [v("per_chunk")]),
            helper.make_node("Mul", [v("chunks"), v("per_chunk")], [v("padded_rows")]),
            helper.make_node("Sub", [v("padded_rows"), v("rows")], [v("padding")]),
            helper.make_node("Concat", [zero, zero, v("padding"), zero], [v("pads")], axis=0),
            helper.make_node("Pad", [v("flat"), v("pads")], [v("padded")]),
            helper.make_node("Concat", [v("chunks"), v("per_chunk"), width_in], [v("chunked_shape")], axis=0),
            helper.make_node("Reshape", [v("padded"), v("chunked_shape")], [v("chunked")], allowzero=1),
            helper.make_node("Scan", [v("chunked")], [v("scanned")], name=p + "scan", num_scan_inputs=1,
                             body=body),
            helper.make_node("Concat", [v("padded_rows"), width_out], [v("out_flat_shape")], axis=0),
            helper.make_node("Reshape", [v("scanned"), v("out_flat_shape")], [v("out_flat")], allowzero=1),
            helper.make_node("Slice", [v("out_flat"), zero, v("rows")], [v("out_rows")]),
            helper.make_node("Concat", [v("lead"), width_out], [v("out_shape")], axis=0),
            helper.make_node("Reshape", [v("out_rows"), v("out_shape")], [y], allowzero=1),
        ]
    moved = {o for last, members, _, _ in blocks for k in members - {last} for o in g.nodes[k].output}
    nodes = []
    for k, n in enumerate(g.nodes):
        if k in replacement:
            nodes.extend(replacement[k])
        elif k not in taken:
            nodes.append(n)
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [vi for vi in graph.value_info if vi.name not in moved]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return len(blocks)


SPLIT_AXIS = GraphPass(
    "split_last_axis", IR, matches="Splits of their input's last axis written as a non-negative axis",
    checks="the input's shape is recorded", rewrite=last_axis_as_negative)
PASS = GraphPass(
    "feed_forward_chunks", PROTO, matches="the nodes between a block's input and a MatMul by a weight (`_cone`)",
    checks="every node row-wise, one input that an input projection reads, two MatMuls or more, no value read "
           "outside the block", rewrite=chunk_feed_forwards, keeps_data_file=True)
