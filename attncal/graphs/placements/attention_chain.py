"""The explicit attention of a plain (unfused) graph: Q·Kᵀ MatMul → scale/mask chain → Softmax → ·V MatMul.

Row and split placement both walk it (from the Softmax back to the scores MatMul, and forward to
the value MatMul) and replay the elementwise scale/mask chain on their own scores; each placement
decides how the chain's side inputs (masks) are reshaped for its scores.

* `scores_chain`, `value_path`: the two walks; a refusal names the node where the walk stopped and why.
* `check_chain`: the walked chain is a path from the scores MatMul to the Softmax (what the replay needs).
* `walk_layer`: the three above for one layer, as a `PlainAttention`.
* `side_inputs`: the chain's inputs other than the scores, for a placement's checks.
* `replay_chain`: the chain applied to other scores.
* `inferred_shapes`: ONNX shape inference for the checks, undone when a check refuses.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import onnx_ir as ir

from ..builder import Ops
from .softmax_pattern import AttentionSoftmax

_CHAIN_OPS = {"Add", "Mul", "Div", "Sub", "Cast", "Identity", "Where"}
# Exports put a scale, a mask or two and a few fp32 casts between the scores MatMul and the Softmax;
# a longer elementwise run is not an attention chain.
MAX_CHAIN = 8
# Between the Softmax and the value MatMul only casts back from fp32 (Qwen3, ModernBERT eager
# attention) and Identity nodes appear.
MAX_VALUE_PATH = 4


def _describe(node: ir.Node) -> str:
    """'Op node name' (with the domain when it is not ONNX's), for refusals."""
    domain = f"{node.domain}::" if node.domain not in ("", "ai.onnx") else ""
    return f"{domain}{node.op_type} node {node.name!r}"


def scores_chain(softmax: ir.Node, error: type[Exception]) -> tuple[ir.Node, list[ir.Node]]:
    """Walk back from the Softmax to the scores MatMul; returns (matmul, elementwise chain in order),
    or raises `error` naming where and why the walk stopped."""
    chain: list[ir.Node] = []
    value = softmax.inputs[0]
    for _ in range(MAX_CHAIN):
        node = value.producer()
        if node is None:
            stop = f"{value.name} has no producer (a graph input or initializer)"
            break
        if node.op_type == "MatMul" and node.domain == "":
            return node, list(reversed(chain))
        if node.op_type not in _CHAIN_OPS or node.domain != "":
            stop = (f"{_describe(node)} is neither the scores MatMul nor an elementwise scale/mask op "
                    f"({', '.join(sorted(_CHAIN_OPS))})")
            break
        users = [u for u, _ in value.uses()]
        if len(users) != 1:
            stop = (f"{value.name}, the output of {_describe(node)}, has {len(users)} readers; the scale/mask "
                    "chain may only feed the Softmax")
            break
        # The chain input is the one whose producer leads back to the MatMul: the first non-constant
        # input with a producer (scale and mask are the other inputs).
        chain.append(node)
        candidates = [v for v in node.inputs if v is not None and v.producer() is not None and v.const_value is None]
        if not candidates:
            stop = f"{_describe(node)} has no computed input to follow (only constants and graph inputs)"
            break
        value = candidates[0]
    else:
        stop = f"no MatMul within {MAX_CHAIN} nodes (the walk reached {_describe(chain[-1])})"
    raise error(f"could not find the scores MatMul before {softmax.name}: {stop}")


def value_path(softmax: ir.Node, error: type[Exception]) -> tuple[list[ir.Node], ir.Node]:
    """From the Softmax output to the value MatMul: (pass-through casts, matmul), or `error` naming
    the readers where the walk stopped."""
    chain: list[ir.Node] = []
    value = softmax.outputs[0]
    for _ in range(MAX_VALUE_PATH):
        uses = list(value.uses())
        mm = [u for u, i in uses if u.op_type == "MatMul" and u.domain == "" and i == 0]
        if mm:
            return chain, mm[0]
        nxt = [u for u, i in uses if u.op_type in ("Cast", "Identity") and u.domain == "" and i == 0]
        if not nxt:
            readers = ", ".join(f"{_describe(u)} (input {i})" for u, i in uses) or "nothing"
            stop = f"{value.name} is read by {readers}; expected the value MatMul (input 0), a Cast or an Identity"
            break
        chain.append(nxt[0])
        value = nxt[0].outputs[0]
    else:
        stop = f"no MatMul within {MAX_VALUE_PATH} Cast/Identity nodes"
    raise error(f"could not find the value MatMul after {softmax.name}: {stop}")


def check_chain(scores_mm: ir.Node, chain: list[ir.Node], softmax: ir.Node, error: type[Exception]) -> None:
    """Refuse unless each chain node reads the previous one's output (the MatMul's first) and the last
    output is the Softmax's input: `replay_chain` substitutes exactly those values.

    `scores_chain` follows single-output ops only, so a valid ONNX graph always passes; a node with
    more outputs than its schema allows does not."""
    prev = scores_mm.outputs[0]
    for node in chain:
        if not any(v is prev for v in node.inputs):
            raise error(f"unexpected graph between the scores MatMul and {softmax.name}: {_describe(node)} does "
                        f"not read {prev.name}, so the chain cannot be replayed on other scores")
        prev = node.outputs[0]
    if prev is not softmax.inputs[0]:
        raise error(f"unexpected graph between the scores MatMul and {softmax.name}: the Softmax reads "
                    f"{softmax.inputs[0].name}, not {prev.name}, so the chain cannot be replayed on other scores")


@dataclass(frozen=True)
class PlainAttention:
    """One layer's explicit attention, walked and checked."""

    layer: int
    softmax: ir.Node
    scores_mm: ir.Node
    chain: list[ir.Node]  # elementwise scale/mask ops from the scores MatMul to the Softmax
    post: list[ir.Node]  # Cast/Identity from the Softmax to the value MatMul
    value_mm: ir.Node


def walk_layer(att: AttentionSoftmax, error: type[Exception]) -> PlainAttention:
    """Both walks and `check_chain` for one layer; every refusal is `error`."""
    scores_mm, chain = scores_chain(att.softmax, error)
    post, value_mm = value_path(att.softmax, error)
    check_chain(scores_mm, chain, att.softmax, error)
    return PlainAttention(att.layer, att.softmax, scores_mm, chain, post, value_mm)


def side_inputs(chain: list[ir.Node], start: ir.Value) -> list[tuple[ir.Value, ir.Node, int]]:
    """(value, node, k) for every input of chain node k other than the scores, in the order
    `replay_chain` passes them to its `side` function."""
    out: list[tuple[ir.Value, ir.Node, int]] = []
    prev = start
    for k, node in enumerate(chain):
        out.extend((v, node, k) for v in node.inputs if v is not None and v is not prev)
        prev = node.outputs[0]
    return out


def replay_chain(ops: Ops, chain: list[ir.Node], start: ir.Value, cur: ir.Value,
                 side: Callable[[ir.Value, ir.Node, int], ir.Value]) -> ir.Value:
    """Apply `chain` (which consumes `start`; `check_chain` has accepted it) to `cur` instead;
    `side(v, node, k)` maps every other input.  Returns the new chain output."""
    prev = start
    for k, node in enumerate(chain):
        inputs = [cur if v is prev else (side(v, node, k) if v is not None else None) for v in node.inputs]
        cur = ops(node.op_type, *inputs, **{a.name: a.value for a in node.attributes.values()})
        prev = node.outputs[0]
    return cur


@contextmanager
def inferred_shapes(model: ir.Model) -> Iterator[None]:
    """Run ONNX shape inference on `model` in place, and keep its annotations only if the block
    completes.

    Why: the plain placements' checks need ranks and dtypes (the chain's side inputs, the float32
    refusal) that exports leave unannotated, so inference runs before them; a check that refuses
    must still leave the model as it found it.  onnx_ir's pass changes value types (in place, on
    the type object) and shapes, and re-registers the large initializers at the end of the
    initializer table; all of that is put back."""
    from onnx_ir.passes.common import ShapeInferencePass

    values: dict[int, ir.Value] = {}
    for graph in model.graphs():
        for v in (*graph.inputs, *graph.initializers.values(), *(o for n in graph for o in n.outputs)):
            values[id(v)] = v
    saved = [(v, v.type, v.dtype, v.shape) for v in values.values()]
    order = list(model.graph.initializers.values())
    ShapeInferencePass()(model)
    try:
        yield
    except BaseException:
        for v, type_, dtype, shape in saved:
            v.type, v.shape = type_, shape
            if isinstance(type_, ir.TensorType) and dtype is not None and type_.dtype != dtype:
                type_.dtype = dtype
        if [id(v) for v in model.graph.initializers.values()] != [id(v) for v in order]:
            for v in order:
                model.graph.initializers.pop(v.name)
            for v in order:
                model.graph.initializers.add(v)
        raise
