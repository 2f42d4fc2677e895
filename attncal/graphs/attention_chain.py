"""The explicit attention of a plain (unfused) graph: Q·Kᵀ MatMul → scale/mask chain → Softmax → ·V MatMul.

Row and split placement both walk it (from the Softmax back to the scores MatMul, and forward to
the value MatMul) and replay the elementwise scale/mask chain on their own scores; each placement
decides how the chain's side inputs (masks) are reshaped for its scores.
"""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from .builder import Ops

_CHAIN_OPS = {"Add", "Mul", "Div", "Sub", "Cast", "Identity", "Where"}


def scores_chain(softmax: ir.Node, error: type[Exception]) -> tuple[ir.Node, list[ir.Node]]:
    """Walk back from the Softmax to the scores MatMul; returns (matmul, elementwise chain in order)."""
    chain: list[ir.Node] = []
    value = softmax.inputs[0]
    for _ in range(8):
        node = value.producer()
        if node is None:
            break
        if node.op_type == "MatMul" and node.domain == "":
            return node, list(reversed(chain))
        if node.op_type not in _CHAIN_OPS or node.domain != "":
            break
        users = [u for u, _ in value.uses()]
        if len(users) != 1:
            break
        # The chain input is the one whose producer leads back to the MatMul: the first non-constant
        # input with a producer (scale and mask are the other inputs).
        chain.append(node)
        candidates = [v for v in node.inputs if v is not None and v.producer() is not None and v.const_value is None]
        if not candidates:
            break
        value = candidates[0]
    raise error(f"could not find the scores MatMul before {softmax.name}")


def value_path(softmax: ir.Node, error: type[Exception]) -> tuple[list[ir.Node], ir.Node]:
    """From the Softmax output to the value MatMul: (pass-through casts, matmul)."""
    chain: list[ir.Node] = []
    value = softmax.outputs[0]
    for _ in range(4):
        uses = list(value.uses())
        mm = [u for u, i in uses if u.op_type == "MatMul" and u.domain == "" and i == 0]
        if mm:
            return chain, mm[0]
        nxt = [u for u, i in uses if u.op_type in ("Cast", "Identity") and u.domain == "" and i == 0]
        if not nxt:
            break
        chain.append(nxt[0])
        value = nxt[0].outputs[0]
    raise error(f"could not find the value MatMul after {softmax.name}")


def replay_chain(ops: Ops, chain: list[ir.Node], start: ir.Value, cur: ir.Value,
                 side: Callable[[ir.Value, ir.Node, int], ir.Value]) -> tuple[ir.Value, ir.Value]:
    """Apply `chain` (which consumes `start`) to `cur` instead; `side(v, node, k)` maps every other input.

    Returns (the new chain output, the original chain's last output) so the caller can check that
    the chain really ends at the Softmax."""
    prev = start
    for k, node in enumerate(chain):
        inputs = [cur if v is prev else (side(v, node, k) if v is not None else None) for v in node.inputs]
        cur = ops(node.op_type, *inputs, **{a.name: a.value for a in node.attributes.values()})
        prev = node.outputs[0]
    return cur, prev
