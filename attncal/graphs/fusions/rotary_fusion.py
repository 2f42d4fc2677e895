"""Rotary position embeddings of a plain export's native graph fused into ONNX Runtime's
`com.microsoft.RotaryEmbedding`, feeding the attention op directly.

Why: torch's export writes each rotation of Q and K as x·cos + rotate_half(x)·sin on [B,N,S,D], and the
placement reads the result through a Transpose back to [B,S,N·D]: two Slices, a Neg, a Concat, two Muls, an
Add and the Transposes, each a pass over the tensor.  ONNX Runtime's CPU kernel rotates in one pass, and its
3-D form takes and gives [B,S,N·D], the layout the attention op reads, so the Transposes go as well.

Matched, for the query and key input of every attention op that `plain_attention_placement` placed:

    op input = Reshape(Transpose(R, perm 0,2,1,3), [0,0,-1])   (the key without GQA: through Kᵀ's Transpose)
    R        = x·c + Concat(-x[..., h:], x[..., :h])·s          (operands in either order)
    x        [B,N,S,D], N and D = 2h known

where c and s are computed element-wise from one Concat(f, f) on the last axis, so the two halves of each are
equal (each frequency's cos and sin), and are shaped [1, .., 1, S, D]: one position per token, shared by the
batch and the heads.  That is the rotation of transformers' `rotate_half` models (Qwen3, Gemma3, ModernBERT).
It becomes

    op input = RotaryEmbedding(Reshape(x0, [0,0,-1]), [0], c[..., :h] as [S,h], s[..., :h] as [S,h],
                               num_heads=N, interleaved=0)

with x0 = x's [B,S,N,D] source where x is its Transpose (Qwen3, ModernBERT: no Transpose is left), else a
Transpose of x (Gemma3 normalises Q and K after their Transpose; ONNX Runtime moves the new Transpose up
through those element-wise ops and cancels the pair).

The caches are the graph's own cos and sin rows, so the rotation's angles are the ones the model computed, at
any length; a one-element `position_ids` is an offset in ONNX Runtime's op (positions 0..S-1 read rows
0..S-1).  The products and sums are the same, so outputs agree with the unfused graph to float32 rounding.
Any other form (partial rotary, interleaved pairs, per-batch positions) is left as it is.

Runs on the placed graph while torch's recorded shapes are still there (before
`load_time_fusions.drop_intermediate_shapes`): the heads, head size and sequence axis come from them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ..builder import Ops, const_array, scalar_value
from ..ops.contract import DOMAIN
from ..pass_base import IR, GraphPass

MS_DOMAIN = "com.microsoft"
ROTARY_OP = "RotaryEmbedding"  # com.microsoft, version 1 (contrib_defs.cc); CPU kernel for float and float16
NODE_PREFIX = "attncal_rotary"
# Element-wise steps allowed between Concat(f, f) and the rotation's c and s: each keeps the halves equal.
_UNARY = frozenset({"Cos", "Sin", "Cast", "Unsqueeze", "Identity"})
_BY_SCALAR = frozenset({"Mul", "Div"})
_BNSD = (0, 2, 1, 3)


@dataclass(frozen=True)
class Rotation:
    """One matched rotation of x ([B,N,S,D]) feeding input `index` of the attention op `op`."""

    op: ir.Node
    index: int
    flat: ir.Value  # the placement's [0,0,-1] shape, which the rotated input is reshaped by again
    x: ir.Value
    x0: ir.Value | None  # x's [B,S,N,D] source where x = Transpose(x0), else None
    heads: int
    head_size: int
    cos: ir.Value  # c, [1,..,1,S,D]
    sin: ir.Value


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _transposed(value: ir.Value | None) -> ir.Value | None:
    """The input of the Transpose(perm 0,2,1,3) that produces `value`, or of the two that compose to it (Kᵀ as
    the scores' MatMul reads it, perm 0,1,3,2, then 0,3,1,2: the placement's key without GQA), or None."""
    t = _producer(value, "Transpose")
    perm = tuple(t.attributes.get_ints("perm", ())) if t is not None else ()
    if perm == _BNSD:
        return t.inputs[0]
    inner = _producer(t.inputs[0], "Transpose") if perm == (0, 3, 1, 2) else None
    return inner.inputs[0] if inner is not None and tuple(inner.attributes.get_ints("perm", ())) == (0, 1, 3, 2) \
        else None


def _last_axis_slice(value: ir.Value | None) -> tuple[ir.Value, int, int] | None:
    """(input, start, end) of a step-1 Slice of the last axis of a [B,N,S,D] value that produces `value`, or None."""
    s = _producer(value, "Slice")
    if s is None or len(s.inputs) < 4:
        return None
    starts, ends, axes = (const_array(v) for v in s.inputs[1:4])
    steps = const_array(s.inputs[4]) if len(s.inputs) > 4 else np.ones(1)
    if any(a is None or a.size != 1 for a in (starts, ends, axes, steps)) or int(steps.ravel()[0]) != 1:
        return None
    if int(axes.ravel()[0]) not in (-1, 3):
        return None
    return s.inputs[0], int(starts.ravel()[0]), int(ends.ravel()[0])


def _doubled_frequencies(value: ir.Value) -> bool:
    """`value` is computed element-wise from Concat(f, f) on the last axis: its two halves are equal."""
    node = value.producer()
    while node is not None and node.domain in ("", "ai.onnx"):
        if node.op_type == "Concat":
            axis = node.attributes.get_int("axis", 0)
            rank = None if node.outputs[0].shape is None else node.outputs[0].shape.rank()
            return (len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]
                    and (axis == -1 or (rank is not None and axis == rank - 1)))
        if not (node.op_type in _UNARY or (node.op_type in _BY_SCALAR and scalar_value(node.inputs[1]) is not None)):
            return False
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return False


def _rotation_operands(add: ir.Node, x: ir.Value, half: int) -> tuple[ir.Value, ir.Value] | None:
    """(c, s) where `add` is x·c + Concat(-x[..., h:], x[..., :h])·s, or None."""
    cos = sin = None
    for m in (_producer(v, "Mul") for v in add.inputs):
        if m is None or len(m.inputs) != 2:
            return None
        for mine, other in (tuple(m.inputs), tuple(reversed(m.inputs))):
            if mine is x:
                cos = other
                break
            if _is_rotated_half(mine, x, half):
                sin = other
                break
    return (cos, sin) if cos is not None and sin is not None else None


def _is_rotated_half(value: ir.Value | None, x: ir.Value, half: int) -> bool:
    """`value` is Concat(-x[..., h:], x[..., :h]) on the last axis (transformers' rotate_half)."""
    cat = _producer(value, "Concat")
    if cat is None or len(cat.inputs) != 2 or cat.attributes.get_int("axis", 0) not in (-1, 3):
        return False
    neg = _producer(cat.inputs[0], "Neg")
    upper = _last_axis_slice(neg.inputs[0] if neg is not None else None)
    lower = _last_axis_slice(cat.inputs[1])
    return (upper is not None and lower is not None and upper[0] is x and lower[0] is x
            and upper[1] == half and upper[2] >= 2 * half and lower[1] == 0 and lower[2] == half)


def _positions_match(c: ir.Value, x: ir.Value, head_size: int) -> bool:
    """c is [1,..,1,S,D] with S x's sequence axis (x: [B,N,S,D]): a row per token, shared by batch and heads."""
    if c.shape is None or x.shape is None or c.shape.rank() < 2 or x.shape.rank() != 4:
        return False
    dims = list(c.shape)
    return (all(d == 1 for d in dims[:-2]) and dims[-1] == head_size
            and dims[-2] == x.shape[2] and dims[-2] != 1)


def find_rotation(op: ir.Node, index: int) -> Rotation | None:
    """The rotation feeding input `index` of the attention op `op`, or None where it is not of the matched form."""
    r = _producer(op.inputs[index], "Reshape")
    flat = const_array(r.inputs[1]) if r is not None else None
    if flat is None or [int(v) for v in flat.ravel()] != [0, 0, -1]:
        return None
    add = _producer(_transposed(r.inputs[0]), "Add")
    if add is None or len(add.inputs) != 2:
        return None
    muls = [_producer(v, "Mul") for v in add.inputs]
    for x in (v for m in muls if m is not None for v in m.inputs):
        if x.shape is None or x.shape.rank() != 4:
            continue
        heads, head_size = x.shape[1], x.shape[3]
        if not isinstance(heads, int) or not isinstance(head_size, int) or head_size % 2:
            continue
        operands = _rotation_operands(add, x, head_size // 2)
        if operands is not None and all(_doubled_frequencies(v) and _positions_match(v, x, head_size)
                                        for v in operands):
            return Rotation(op, index, r.inputs[1], x, _transposed(x), heads, head_size, *operands)
    return None


def fuse_rotations(model: ir.Model) -> int:
    """Replace every matched rotation feeding an attention op's query or key by ONNX Runtime's RotaryEmbedding
    (see the module docstring); returns how many.  Caches are built once per distinct cos / sin value."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    graph = model.graph
    rotations = [rot for op in graph if op.domain == DOMAIN
                 for rot in (find_rotation(op, 0), find_rotation(op, 1)) if rot is not None]
    if not rotations:
        return 0
    caches: dict[int, ir.Value] = {}
    positions = None  # one constant, registered with the first rotation's nodes
    for n, rot in enumerate(rotations):
        ops = Ops(graph, f"{NODE_PREFIX}{n}")
        if positions is None:
            positions = ops.const("position_ids", np.array([0], np.int64))
        half = rot.head_size // 2
        new_tables = [t for t in (rot.cos, rot.sin) if id(t) not in caches]
        if new_tables:
            first_rows = (ops.const("start", np.array([0], np.int64)), ops.const("end", np.array([half], np.int64)),
                          ops.const("axis", np.array([-1], np.int64)))
            rows = ops.const("rows", np.array([-1, half], np.int64))
        for table in new_tables:
            caches[id(table)] = ops("Reshape", ops("Slice", table, *first_rows), rows)
        tables = (positions, caches[id(rot.cos)], caches[id(rot.sin)])
        x0 = rot.x0 if rot.x0 is not None else ops("Transpose", rot.x, perm=list(_BNSD))
        flat = ops("Reshape", x0, rot.flat)
        rot.op.replace_input_with(rot.index, ops(ROTARY_OP, flat, *tables, domain=MS_DOMAIN, num_heads=rot.heads,
                                                 interleaved=0))
        ops.insert_before(rot.op)
    RemoveUnusedNodesPass()(model)
    if MS_DOMAIN not in model.opset_imports:
        model.opset_imports[MS_DOMAIN] = 1
    return len(rotations)


PASS = GraphPass(
    "rotary_embedding", IR,
    matches="the query and key inputs of every attention op the plain attention placement placed",
    checks="x·c + rotate_half(x)·s on [B,N,S,D], c and s one row per token from Concat(f, f) (`find_rotation`)",
    rewrite=fuse_rotations)
