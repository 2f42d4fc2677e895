"""Standard-ONNX function bodies for the calibration ops, so that any runtime can run them.

The bodies read every attribute through attribute references (`ref_attr_name`),
so one FunctionProto serves every node: a node copied with other attribute
values computes the contract for those values.

Memory: `PooledRowCalibration` gathers the pooling row ([B,H,1,K]), calibrates
it and writes it back with ScatterElements into `probs`.  The Softmax output
has no other reader, so ONNX Runtime updates it in place and the calibrated
graph keeps no second full-size copy of the attention probabilities.

The math is the calibration core's (steps 1-10), in float32 for float16 inputs:
basket sums come from one MatMul of the rows against a per-item basket
membership matrix (see `_body`).

Rows that are not finite (contract.py): the membership MatMul also sums each
calibrated row, and `row sum * 0` (0, or NaN when the row holds a NaN or an
infinity) is added to the row's multipliers, so such a row comes back NaN at
every key; rows that are not calibrated keep multiplier 1, NaN included.  The
Softmax-fused bodies start with ONNX Softmax, which gives NaN for a row of
-inf scores: their output is exactly Softmax followed by the separate op.

The calibrated attention bodies (`_attention_body`) split the heads (repeating
each key/value head for its query heads under GQA), compute the float32 scores
scale·Q·Kᵀ (+ the relative position bias, gathered from its table at the buckets of
the key-minus-query offsets) + mask bias (padding and the window, one [B,1,S_q,S_k] bias), run the
Softmax-fused body on them (`_softmax_body`, the same nodes as the Softmax-fused
ops'), multiply by V and merge the heads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import onnx
from onnx import AttributeProto, TensorProto, helper

from ...calibration.config import ROW_MARK
from .contract import (ALL_OP_TYPES, DOMAIN, OPTIONAL_DEFAULTS, attribute_names, input_names, is_all_rows, is_attention,
                       is_projected, takes_scores)

MIN_OPSET = 18  # ReduceMin/ReduceMax take axes as an input from opset 18 on


class _Builder:
    """Appends nodes with fresh output names; a thin convenience over onnx.helper."""

    def __init__(self, parent: "_Builder | None" = None) -> None:
        """parent: the builder of the graph this one's subgraph sits in; the names continue its count, so a
        subgraph's values never shadow the outer graph's."""
        self.nodes: list[onnx.NodeProto] = []
        self._ids = parent._ids if parent is not None else itertools.count()

    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs) -> str:
        outs = [f"t{next(self._ids)}_{op_type}" for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return outs[0]

    def const_i(self, value: int) -> str:
        return self.op("Constant", value_int=value)

    def axes(self, *values: int) -> str:
        """A 1-D int64 constant (axes inputs must be vectors)."""
        return self.op("Constant", value_ints=list(values))

    def const_f(self, value: float) -> str:
        return self.op("Constant", value_float=value)

    def attr(self, name: str, kind: str) -> str:
        """A Constant whose value is the calling node's attribute `name` (a scalar)."""
        out = f"t{next(self._ids)}_attr_{name}"
        field, atype = ("value_int", AttributeProto.INT) if kind == "int" else ("value_float", AttributeProto.FLOAT)
        node = helper.make_node("Constant", [], [out])
        a = AttributeProto()
        a.name = field
        a.ref_attr_name = name
        a.type = atype
        node.attribute.append(a)
        self.nodes.append(node)
        return out


@dataclass
class _Attrs:
    """The calling node's attributes as tensors, and the constants every step uses."""

    S: str
    lam: str
    iso_f: str
    iso_l: str
    mode_f: str
    mode_l: str
    w_f: str
    w_l: str
    skip: str
    zero_i: str
    one_i: str
    two_i: str
    neg1: str
    zero_f: str
    one_f: str
    ax0: str
    ax1: str
    ax_last: str
    ax_12: str


def _attributes(b: _Builder) -> _Attrs:
    S = b.attr("basket_size", "int")
    lam = b.attr("strength", "float")
    iso_f = b.attr("isolate_first", "int")
    iso_l = b.attr("isolate_last", "int")
    mode_f = b.attr("first_mode", "int")
    mode_l = b.attr("last_mode", "int")
    w_f = b.attr("first_weight", "float")
    w_l = b.attr("last_weight", "float")
    skip = b.attr("skip_short", "int")
    zero_i, one_i, two_i, neg1 = b.const_i(0), b.const_i(1), b.const_i(2), b.const_i(-1)
    zero_f, one_f = b.const_f(0.0), b.const_f(1.0)
    ax0, ax1, _, ax_last = b.axes(0), b.axes(1), b.axes(2), b.axes(-1)
    ax_12 = b.axes(1, 2)
    return _Attrs(S, lam, iso_f, iso_l, mode_f, mode_l, w_f, w_l, skip, zero_i, one_i, two_i, neg1, zero_f, one_f,
                  ax0, ax1, ax_last, ax_12)


@dataclass
class _Geometry:
    """The batch geometry from the mask ([B,1] int64 tensors unless noted) and the basket membership."""

    K: str          # keys, a scalar
    pos: str        # [K]: 0 .. K-1
    start: str      # the first valid key
    end: str        # the last valid key
    start_c: str    # start, clamped into range for an empty item
    end_c: str      # end, likewise
    active: str     # [B,1] bool: the item is calibrated
    t: str          # [B,1] float: baskets plus isolated keys
    n_max: str      # the batch's most baskets (at least 1)
    P_read: str     # [B,1,K,n+3]: membership, one-hot first / last valid key, ones (the row sum)
    P_ext: str      # [B,K,n+1]: membership and a ones column
    P_write: str    # [B,1,n+1,K]: P_ext transposed, for the write


def _geometry(b: _Builder, a: _Attrs) -> _Geometry:
    """Steps 1-3 and 5: the valid span, the content and its baskets, whether the item is calibrated."""
    i64 = TensorProto.INT64
    f32 = TensorProto.FLOAT
    valid = b.op("Not", b.op("Equal", "attention_mask", a.zero_i))  # [B,K] bool
    K = b.op("Gather", b.op("Shape", "attention_mask"), a.one_i, axis=0)  # scalar
    pos = b.op("Range", a.zero_i, K, a.one_i)  # [K]
    start = b.op("ReduceMin", b.op("Where", valid, pos, K), a.ax1, keepdims=1)
    end = b.op("ReduceMax", b.op("Where", valid, pos, a.neg1), a.ax1, keepdims=1)
    length = b.op("Add", b.op("Sub", end, start), a.one_i)
    n_iso = b.op("Add", a.iso_f, a.iso_l)
    c0 = b.op("Add", start, a.iso_f)
    C = b.op("Sub", length, n_iso)  # <= 0 for empty or too-short items
    has = b.op("Greater", b.op("ReduceSum", b.op("Cast", valid, to=i64), a.ax1, keepdims=1), a.zero_i)
    long_enough = b.op("Or", b.op("Equal", a.skip, a.zero_i), b.op("GreaterOrEqual", C, a.S))
    active = b.op("And", b.op("And", has, b.op("Greater", C, a.zero_i)),
                  b.op("And", long_enough, b.op("Greater", a.lam, a.zero_f)))  # [B,1]
    n = b.op("Div", b.op("Sub", b.op("Add", b.op("Max", C, a.zero_i), a.S), a.one_i), a.S)  # ceil(C/S)
    t = b.op("Cast", b.op("Add", n, n_iso), to=f32)  # [B,1]
    n_max = b.op("Max", b.op("ReduceMax", b.op("Mul", n, b.op("Cast", active, to=i64)), keepdims=0), a.one_i)
    last_pos = b.op("Sub", K, a.one_i)
    start_c = b.op("Min", start, last_pos)  # empty items: any in-range index
    end_c = b.op("Max", end, a.zero_i)
    # Basket membership P[B,K,n]: key k is content (c0 <= k < c0 + C) of basket (k - c0) // S.
    rel = b.op("Sub", b.op("Unsqueeze", pos, a.ax0), c0)  # [B,K]
    # Masked keys inside the span (holes) are not content: out of the basket masses, 0 in calibrated rows.
    content = b.op("And", b.op("And", b.op("GreaterOrEqual", rel, a.zero_i), b.op("Less", rel, C)), valid)
    basket_of = b.op("Div", b.op("Max", rel, a.zero_i), a.S)  # [B,K]
    baskets = b.op("Range", a.zero_i, n_max, a.one_i)  # [n]
    member = b.op("And", b.op("Unsqueeze", content, a.ax_last),
                  b.op("Equal", b.op("Unsqueeze", basket_of, a.ax_last), baskets))  # [B,K,n]
    P = b.op("Cast", member, to=f32)
    # One-hot columns of the first and last valid token: [B,K,2]
    ends = b.op("Unsqueeze", b.op("Concat", start_c, end_c, axis=1), a.ax1)  # [B,1,2]
    E = b.op("Cast", b.op("Equal", b.op("Unsqueeze", b.op("Unsqueeze", pos, a.ax0), a.ax_last), ends), to=f32)
    ones_col = b.op("Expand", a.one_f, b.op("Concat", b.op("Shape", rel), b.axes(1), axis=0))  # [B,K,1]
    P_read = b.op("Unsqueeze", b.op("Concat", P, E, ones_col, axis=2), a.ax1)  # [B,1,K,n+3]
    P_ext = b.op("Concat", P, ones_col, axis=2)  # [B,K,n+1]
    P_write = b.op("Unsqueeze", b.op("Transpose", P_ext, perm=[0, 2, 1]), a.ax1)  # [B,1,n+1,K]
    return _Geometry(K, pos, start, end, start_c, end_c, active, t, n_max, P_read, P_ext, P_write)


def _rows(b: _Builder, a: _Attrs, g: _Geometry, all_rows: bool) -> tuple[str, str, str | None]:
    """The rows to calibrate, x [B,H,R,K] in the input's type (R = 1 for the pooling row, Q for all rows),
    whether each row is calibrated ([B,1,R|1,1]), and for the pooling row its index into `probs`."""
    if all_rows:
        pos_b = b.op("Unsqueeze", g.pos, a.ax0)  # [1,Q] (Q == K)
        in_span = b.op("And", b.op("GreaterOrEqual", pos_b, g.start), b.op("LessOrEqual", pos_b, g.end))  # [B,Q]
        # marked_rows: the rows whose mask value is ROW_MARK, else every row of the valid span.
        marked = b.op("Equal", "attention_mask", b.const_i(ROW_MARK))
        by_mark = b.op("Equal", b.attr("marked_rows", "int"), a.one_i)
        rows = b.op("Or", b.op("And", by_mark, marked), b.op("And", b.op("Not", by_mark), in_span))  # [B,Q]
        row_active = b.op("And", b.op("Unsqueeze", g.active, a.ax_12),
                          b.op("Unsqueeze", rows, b.axes(1, 3)))  # [B,1,Q,1]
        return "probs", row_active, None
    pool_last = b.attr("pool_last", "int")
    row = b.op("Where", b.op("Equal", pool_last, a.one_i), g.end_c, g.start_c)  # [B,1]
    shape_p = b.op("Shape", "probs")
    # Q == 1: the single row is the pooling row (row placement computes it separately).
    q_is_one = b.op("Equal", b.op("Gather", shape_p, a.two_i, axis=0), a.one_i)
    row = b.op("Where", q_is_one, b.op("Mul", row, a.zero_i), row)
    row_shape = b.op("Concat", b.op("Slice", shape_p, b.axes(0), b.axes(2)), b.axes(1),
                     b.op("Slice", shape_p, b.axes(3), b.axes(4)), axis=0)  # [B,H,1,K]
    row_idx = b.op("Expand", b.op("Unsqueeze", row, a.ax_12), row_shape)
    x_native = b.op("GatherElements", "probs", row_idx, axis=2)
    row_active = b.op("Unsqueeze", g.active, a.ax_12)  # [B,1,1,1]
    return x_native, row_active, row_idx


@dataclass
class _Shares:
    """What the write needs of steps 4 and 6-10: the per-basket multipliers and the isolated keys' values."""

    coef: str       # [B,H,R,n+1]: each basket's multiplier in calibrated rows, then the ones column's
    total: str      # the normaliser (1 where it is 0)
    one_minus: str  # 1 - λ
    poison: str     # 0 for a finite row, NaN for a row holding a NaN or an infinity
    s_f: str        # the first key's share
    s_l: str        # the last key's share
    s_o: str        # the own key's share (all-rows ops with isolate_self)
    z_first: str    # the first key's probability
    z_last: str     # the last key's probability
    up: str         # 2^32
    down: str       # 2^-32


def _shares(b: _Builder, a: _Attrs, g: _Geometry, own: "_OwnKey", row_active: str) -> _Shares:
    """Steps 4 and 6-10: basket masses, the isolated keys' shares, the budget rescale, the normalisation and the
    blend, as one multiplier per basket."""
    f32 = TensorProto.FLOAT
    zero_i, one_i, zero_f, one_f, lam, ax_last = a.zero_i, a.one_i, a.zero_f, a.one_f, a.lam, a.ax_last
    # --- basket masses, the isolated tokens' probabilities and the row sum in one MatMul (steps 4, 6)
    read = b.op("MatMul", own.x_mass, g.P_read)  # [B,H,R,n+3]; pads enter the row sum only
    n_1d = b.op("Unsqueeze", g.n_max, a.ax0)
    mass = b.op("Slice", read, b.axes(0), n_1d, ax_last)
    z_first = b.op("Slice", read, n_1d, b.op("Add", n_1d, b.axes(1)), ax_last)
    z_last = b.op("Slice", read, b.op("Add", n_1d, b.axes(1)), b.op("Add", n_1d, b.axes(2)), ax_last)
    row_sum = b.op("Slice", read, b.op("Add", n_1d, b.axes(2)), b.op("Add", n_1d, b.axes(3)), ax_last)
    # NaN in, NaN out (contract.py): 0 for a row of finite probabilities, NaN for a row holding a NaN
    # or an infinity at any key (pads included); added to the calibrated rows' multipliers below.
    poison = b.op("Add", b.op("Mul", row_sum, zero_f), b.op("Mul", own.z, zero_f))  # [B,H,R,1]
    t4 = b.op("Add", b.op("Unsqueeze", g.t, a.ax_12), own.extra_t)  # [B,1,R|1,1]
    nz = b.op("Not", b.op("Equal", mass, zero_f))
    # Multipliers are kept scaled by 2^-32 and x by 2^32 (powers of two: exact), so a basket whose
    # mass is subnormal (1/mass beyond the float range) still gets a finite multiplier, and the
    # membership MatMul below never meets inf * 0.
    up, down = b.const_f(2.0 ** 32), b.const_f(2.0 ** -32)
    f = b.op("Where", nz, b.op("Div", b.op("Div", one_f, b.op("Mul", b.op("Where", nz, mass, one_f), up)), t4),
             zero_f)  # f_k * 2^-32
    content_sum = b.op("Div", b.op("ReduceSum", b.op("Cast", nz, to=f32), ax_last, keepdims=1), t4)

    # --- isolated shares (step 7)
    inv_t = b.op("Div", one_f, t4)

    def share(iso: str, mode: str, w: str, z_pos: str) -> str:
        by_mode = b.op("Where", b.op("Equal", mode, zero_i), inv_t,
                       b.op("Where", b.op("Equal", mode, one_i), z_pos, w))
        return b.op("Mul", by_mode, b.op("Cast", iso, to=f32))

    # The first and last keys' shares, 0 in rows whose own key takes their place (isolate_self).
    s_f = b.op("Mul", share(a.iso_f, a.mode_f, a.w_f, z_first), own.keep_first)
    s_l = b.op("Mul", share(a.iso_l, a.mode_l, a.w_l, z_last), own.keep_last)
    s_o = share(own.on_i, own.mode, own.weight, own.z)
    # --- budget rescale (step 8), only where one of the row's isolated keys is not 'equal'
    non_eq_f = b.op("And", b.op("And", b.op("Equal", a.iso_f, one_i), b.op("Not", b.op("Equal", a.mode_f, zero_i))),
                    b.op("Cast", own.keep_first, to=TensorProto.BOOL))
    non_eq_l = b.op("And", b.op("And", b.op("Equal", a.iso_l, one_i), b.op("Not", b.op("Equal", a.mode_l, zero_i))),
                    b.op("Cast", own.keep_last, to=TensorProto.BOOL))
    non_eq_o = b.op("And", b.op("Equal", own.on_i, one_i), b.op("Not", b.op("Equal", own.mode, zero_i)))
    budget = b.op("Max", b.op("Sub", b.op("Sub", b.op("Sub", one_f, s_f), s_l), s_o), zero_f)
    cs_nz = b.op("Not", b.op("Equal", content_sum, zero_f))
    scale = b.op("Where", b.op("And", b.op("Or", b.op("Or", non_eq_f, non_eq_l), non_eq_o), cs_nz),
                 b.op("Div", budget, b.op("Where", cs_nz, content_sum, one_f)), one_f)
    # --- normalisation (step 9) and blend (step 10) as one multiplier per basket
    total = b.op("Add", b.op("Add", b.op("Add", b.op("Mul", content_sum, scale), s_f), s_l), s_o)
    tot_nz = b.op("Not", b.op("Equal", total, zero_f))
    # Divide (rather than multiply by 1/total): a tiny fixed weight can make total subnormal.
    total = b.op("Where", tot_nz, total, one_f)  # a zero total skips normalisation
    one_minus = b.op("Sub", one_f, lam)
    mult = b.op("Add", b.op("Mul", b.op("Div", b.op("Mul", f, scale), total), lam),
                b.op("Mul", one_minus, down))  # [B,H,R,n], times 2^-32
    # Calibrated rows: content gets its basket's multiplier, everything else 0 (pads; isolated tokens
    # are written below), plus the poison through the ones column (every key of a non-finite row
    # becomes NaN).  Other rows get multiplier 1 (2^-32 here) through the ones column: bit-identical,
    # NaN included.
    keep_col = b.op("Where", row_active, poison, down)  # [B,H,R,1], as poison
    coef = b.op("Concat", b.op("Where", row_active, mult, zero_f), keep_col, axis=-1)  # [B,H,R,n+1]
    return _Shares(coef, total, one_minus, poison, s_f, s_l, s_o, z_first, z_last, up, down)


def _write(b: _Builder, a: _Attrs, g: _Geometry, own: "_OwnKey", s: _Shares, x: str, row_active: str) -> str:
    """The calibrated rows: x times its basket's multiplier at every key, then the isolated keys' values (the
    first, the last, the own key) written in calibrated rows; float32."""
    lam, one_i = a.lam, a.one_i
    out = b.op("Mul", b.op("Mul", x, s.up), b.op("MatMul", s.coef, g.P_write))
    # Isolated tokens: out = λ·share/total + (1-λ)·z at their position, in calibrated rows only.
    # Each ScatterElements is the only reader of `out`, so ONNX Runtime updates it in place; the value
    # kept in other rows is recomputed from small tensors (x·M at that key, bit-identical to `out`).
    idx_shape = b.op("Concat", b.op("Shape", s.coef, end=3), b.axes(1), axis=0)
    n_ext = b.op("Gather", b.op("Shape", g.P_ext), a.two_i, axis=0)
    for iso, share, p, z_p in ((a.iso_f, s.s_f, g.start_c, s.z_first), (a.iso_l, s.s_l, g.end_c, s.z_last)):
        idx = b.op("Expand", b.op("Unsqueeze", p, a.ax_12), idx_shape)  # [B,H,R,1]
        p_row = b.op("GatherElements", g.P_ext, b.op("Expand", b.op("Unsqueeze", p, a.ax_last),
                                                       b.op("Concat", b.op("Shape", p),
                                                            b.op("Unsqueeze", n_ext, a.ax0), axis=0)),
                     axis=1)  # [B,1,n+1]
        m_at = b.op("ReduceSum", b.op("Mul", s.coef, b.op("Unsqueeze", p_row, a.ax1)), a.ax_last, keepdims=1)
        current = b.op("Mul", b.op("Mul", z_p, s.up), m_at)
        value = b.op("Add", b.op("Add", b.op("Mul", lam, b.op("Div", share, s.total)),
                                 b.op("Mul", s.one_minus, z_p)), s.poison)
        use = b.op("And", row_active, b.op("Equal", iso, one_i))
        out = b.op("ScatterElements", out, idx, b.op("Where", use, value, current), axis=3)
    own_value = b.op("Add", b.op("Add", b.op("Mul", lam, b.op("Div", s.s_o, s.total)),
                                 b.op("Mul", s.one_minus, own.z)), s.poison)
    return own.write(out, s.coef, g.P_ext, s.up, own_value)


def _body(b: _Builder, all_rows: bool) -> str:
    """Emit the body; returns the name of the output tensor. Inputs: `probs`, `attention_mask`.

    Basket sums and the per-position multiplier are two small MatMuls against a
    per-item basket membership matrix P[B,K,n] (1 where key k is content of
    basket n), so a calibrated row costs one read and one write of the row plus
    O(K·n) work, and no index tensor of the row's size is built.  The steps: the node's attributes
    (`_attributes`), the batch geometry and membership (`_geometry`), the rows (`_rows`), the multipliers
    (`_shares`), the write (`_write`).
    """
    a = _attributes(b)
    g = _geometry(b, a)
    x_native, row_active, row_idx = _rows(b, a, g, all_rows)
    x = b.op("Cast", x_native, to=TensorProto.FLOAT)
    own = _OwnKey(b, all_rows, x, g.pos, g.start, g.end, a.iso_f, a.iso_l, row_active)
    out = _write(b, a, g, own, _shares(b, a, g, own, row_active), x, row_active)
    out_native = b.op("CastLike", out, "probs")
    if all_rows:
        return out_native
    return b.op("ScatterElements", "probs", row_idx, out_native, axis=2)


class _OwnKey:
    """The own key of each calibrated row (`isolate_self`, all-rows ops; contract.py, "Marked rows"): key q of
    query row q.  Its pieces are computed for every node and switched by the attribute, so one function serves
    every node; the two that touch the whole [B,H,Q,K] tensor run in an `If` on it, so a node without the
    attribute pays nothing for them.  A pooled-row op takes the attribute at its default only: there the pieces
    are constants that change nothing.

    * `x_mass`: the rows the basket masses are read from, the own key zeroed in calibrated rows (its basket's
      mass without it); `z`: the own key's probability [B,H,R,1] (0 without the attribute);
    * `extra_t`: 1 in rows whose own key is content, so t counts it as one more isolated key;
    * `keep_first`, `keep_last`: 0 in rows whose own key is the isolated first / last key (it takes the self
      share in that key's place), else 1;
    * `on_i`, `mode`, `weight`: the attribute and the own key's share;
    * `write(out, coef, P_ext, up, value)`: `out` with the own key's output written in calibrated rows."""

    def __init__(self, b: _Builder, all_rows: bool, x: str, pos: str, start: str, end: str, iso_f: str, iso_l: str,
                 row_active: str) -> None:
        f32 = TensorProto.FLOAT
        self.b = b
        zero_i, one_i = b.const_i(0), b.const_i(1)
        self.zero_f, one_f = b.const_f(0.0), b.const_f(1.0)
        self.all_rows = all_rows
        if not all_rows:
            self.x_mass, self.z, self.extra_t = x, self.zero_f, self.zero_f
            self.keep_first = self.keep_last = one_f
            self.on_i, self.mode, self.weight = zero_i, zero_i, self.zero_f
            return
        self.on_i = b.attr("isolate_self", "int")
        self.mode, self.weight = b.attr("self_mode", "int"), b.attr("self_weight", "float")
        self.on = b.op("Equal", self.on_i, one_i)
        self.row_active = row_active
        q = b.op("Unsqueeze", pos, b.axes(0, 1, 3))  # [1,1,Q,1]: row q's own key is key q (Q == K)
        self.idx = b.op("Expand", q, b.op("Concat", b.op("Shape", x, end=3), b.axes(1), axis=0))  # [B,H,Q,1]
        self.z = b.op("Mul", b.op("GatherElements", x, self.idx, axis=3), b.op("Cast", self.on, to=f32))
        row_b = b.op("Unsqueeze", pos, b.axes(0))  # [1,Q]

        def at(iso: str, key: str) -> str:  # [B,1,Q,1]: the own key is this isolated key (with isolate_self)
            hit = b.op("And", b.op("Equal", iso, one_i), b.op("Equal", row_b, key))
            return b.op("Unsqueeze", b.op("And", hit, self.on), b.axes(1, 3))

        own_first, own_last = at(iso_f, start), at(iso_l, end)
        self.keep_first = b.op("Sub", one_f, b.op("Cast", own_first, to=f32))
        self.keep_last = b.op("Sub", one_f, b.op("Cast", own_last, to=f32))
        content = b.op("And", self.on, b.op("Not", b.op("Or", own_first, own_last)))
        self.extra_t = b.op("Cast", content, to=f32)
        # The own key zeroed in calibrated rows: [Q,K] diagonal and the calibrated rows.
        then = _Builder(b)
        diag = then.op("Equal", then.op("Unsqueeze", pos, b.axes(-1)), then.op("Unsqueeze", pos, b.axes(0)))
        zeroed = then.op("Where", then.op("And", then.op("Unsqueeze", diag, b.axes(0, 1)), row_active), self.zero_f, x)
        self.x_mass = self._if(then, zeroed, x)

    def _if(self, then: _Builder, then_out: str, else_out: str) -> str:
        """`then_out` (made by the nodes of `then`) where the attribute is set, else `else_out`."""
        b = self.b
        out_then, out_else = f"t{next(b._ids)}_then", f"t{next(b._ids)}_else"
        info = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, None)  # noqa: E731
        then.nodes.append(helper.make_node("Identity", [then_out], [out_then]))
        then_graph = helper.make_graph(then.nodes, "own_key", [], [info(out_then)])
        else_graph = helper.make_graph([helper.make_node("Identity", [else_out], [out_else])], "no_own_key", [],
                                       [info(out_else)])
        return b.op("If", self.on, then_branch=then_graph, else_branch=else_graph)

    def write(self, out: str, coef: str, P_ext: str, up: str, value: str) -> str:
        if not self.all_rows:
            return out
        b = self.b
        then = _Builder(b)
        # The value other rows keep at their own key: x·M there, M = coef·P_ext[q] (as `out` computed it).
        m_at = then.op("ReduceSum", then.op("Mul", coef, then.op("Unsqueeze", P_ext, b.axes(1))), b.axes(-1),
                       keepdims=1)
        current = then.op("Mul", then.op("Mul", self.z, up), m_at)
        written = then.op("ScatterElements", out, self.idx, then.op("Where", self.row_active, value, current), axis=3)
        return self._if(then, written, out)


def _softmax_body(b: _Builder, scores: str, all_rows: bool) -> str:
    """The Softmax-fused ops' body: `Softmax(scores, axis=-1)` (named `probs`) followed by the
    calibration body.  Returns the output tensor's name."""
    b.nodes.append(helper.make_node("Softmax", [scores], ["probs"], axis=-1))
    return _body(b, all_rows)


def _relative_bias_body(b: _Builder, offset: str) -> str:
    """[1,N,S_q,S_k] float32: the `relative_bias` table at T5's bidirectional buckets of the key-minus-query
    offsets `offset` [S_q,S_k] (attncal.calibration.relative_position: the same float32 steps)."""
    f32, i64, f64 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.DOUBLE
    table = b.op("Cast", "relative_bias", to=f32)  # [num_buckets, N]
    one, two = b.const_i(1), b.const_i(2)
    half = b.op("Div", b.op("Squeeze", b.op("Slice", b.op("Shape", table), b.axes(0), b.axes(1))), two)
    exact = b.op("Div", half, two)
    n = b.op("Abs", offset)
    side = b.op("Mul", b.op("Cast", b.op("Greater", offset, b.const_i(0)), to=i64), half)  # keys after the query
    ratio = b.op("Div", b.op("Cast", b.op("Max", n, one), to=f32), b.op("Cast", exact, to=f32))
    span = b.op("Cast", b.op("Log", b.op("Div", b.op("Cast", b.attr("relative_max_distance", "int"), to=f64),
                                          b.op("Cast", exact, to=f64))), to=f32)
    steps = b.op("Mul", b.op("Div", b.op("Log", ratio), span), b.op("Cast", b.op("Sub", half, exact), to=f32))
    large = b.op("Min", b.op("Add", exact, b.op("Cast", steps, to=i64)), b.op("Sub", half, one))
    bucket = b.op("Add", side, b.op("Where", b.op("Less", n, exact), n, large))  # [S_q,S_k]
    return b.op("Unsqueeze", b.op("Transpose", b.op("Gather", table, bucket), perm=[2, 0, 1]), b.axes(0))


def _attention_body(b: _Builder, all_rows: bool, relative_bias: bool = False) -> str:
    """The calibrated attention ops' body (contract.py).  Inputs `query` [B,S_q,N*D], `key`
    [B,S_k,N*D], `value` [B,S_k,N*D_v], `attention_mask` [B,S_k]; returns the context
    [B,S_q,N*D_v] in the inputs' type.

    Everything is float32 (float16 inputs are cast exactly): the scores scale·Q·Kᵀ plus the additive
    mask bias (float32's lowest finite value at masked keys), with the relative position bias between
    them where the op takes `relative_bias`, then `_softmax_body` on them, the product with V, and the
    heads merged; only the context is cast back to the inputs' type."""
    f32 = TensorProto.FLOAT
    N = b.op("Unsqueeze", b.attr("num_heads", "int"), b.axes(0))  # [1]
    zero_i = b.const_i(0)
    kv_attr = b.op("Unsqueeze", b.attr("num_kv_heads", "int"), b.axes(0))
    N_kv = b.op("Where", b.op("Equal", kv_attr, zero_i), N, kv_attr)  # [1]; 0 means N
    G = b.op("Div", N, N_kv)  # query heads per key/value head
    scale_attr = b.attr("scale", "float")
    q_shape = b.op("Shape", "query")  # [B, S_q, N*D]
    bs_q = b.op("Slice", q_shape, b.axes(0), b.axes(2))
    D = b.op("Div", b.op("Slice", q_shape, b.axes(2), b.axes(3)), N)  # [1]
    bs_k = b.op("Slice", b.op("Shape", "key"), b.axes(0), b.axes(2))
    v_shape = b.op("Shape", "value")
    D_v = b.op("Div", b.op("Slice", v_shape, b.axes(2), b.axes(3)), N_kv)

    def heads(x: str, bs: str, n: str, d: str, perm: list[int]) -> str:
        """[B,S,n*d] -> float32, split into n heads and transposed by `perm` from [B,S,n,d]."""
        split = b.op("Reshape", b.op("Cast", x, to=f32), b.op("Concat", bs, n, d, axis=0))
        return b.op("Transpose", split, perm=perm)

    def grouped(x: str) -> str:
        """[B,N_kv,a,c] -> [B,N,a,c]: each key/value head repeated for its G query heads (repeat_kv)."""
        shape = b.op("Shape", x)
        five = b.op("Concat", b.op("Slice", shape, b.axes(0), b.axes(2)), G, b.op("Slice", shape, b.axes(2), b.axes(4)),
                    axis=0)
        wide = b.op("Expand", b.op("Unsqueeze", x, b.axes(2)), five)  # [B,N_kv,G,a,c]
        return b.op("Reshape", wide, b.op("Concat", b.op("Slice", shape, b.axes(0), b.axes(1)), N,
                                           b.op("Slice", shape, b.axes(2), b.axes(4)), axis=0))

    q = heads("query", bs_q, N, D, [0, 2, 1, 3])  # [B,N,S_q,D]
    k_t = grouped(heads("key", bs_k, N_kv, D, [0, 2, 3, 1]))  # [B,N,D,S_k]
    v = grouped(heads("value", bs_k, N_kv, D_v, [0, 2, 1, 3]))  # [B,N,S_k,D_v]
    zero_f = b.const_f(0.0)
    default_scale = b.op("Div", b.const_f(1.0), b.op("Sqrt", b.op("Cast", b.op("Squeeze", D), to=f32)))
    scale = b.op("Where", b.op("Equal", scale_attr, zero_f), default_scale, scale_attr)
    # Visible keys: valid, and inside the query's window, [B,1,S_q,S_k]; the others get float32's lowest
    # finite value added once (transformers' additive mask).
    valid = b.op("Unsqueeze", b.op("Not", b.op("Equal", "attention_mask", zero_i)), b.axes(1, 2))
    one_i = b.const_i(1)
    S_q = b.op("Squeeze", b.op("Slice", q_shape, b.axes(1), b.axes(2)))
    S_k = b.op("Squeeze", b.op("Slice", bs_k, b.axes(1), b.axes(2)))
    offset = b.op("Sub", b.op("Unsqueeze", b.op("Range", zero_i, S_k, one_i), b.axes(0)),
                  b.op("Unsqueeze", b.op("Range", zero_i, S_q, one_i), b.axes(1)))  # [S_q,S_k]: k - q
    for name, bound in (("window_left", lambda w: b.op("Neg", w)), ("window_right", lambda w: w)):
        w = b.attr(name, "int")
        inside = (b.op("GreaterOrEqual", offset, bound(w)) if name == "window_left"
                  else b.op("LessOrEqual", offset, bound(w)))
        valid = b.op("And", valid, b.op("Or", b.op("Less", w, zero_i), inside))
    bias = b.op("Where", valid, zero_f, b.const_f(float(-3.4028234663852886e38)))
    scores = b.op("MatMul", b.op("Mul", q, scale), k_t)  # [B,N,S_q,S_k]
    if relative_bias:
        scores = b.op("Add", scores, _relative_bias_body(b, offset))
    scores = b.op("Add", scores, bias)
    probs = _softmax_body(b, scores, all_rows)  # the Softmax-fused ops' body, float32
    context = b.op("Transpose", b.op("MatMul", probs, v), perm=[0, 2, 1, 3])  # [B,S_q,N,D_v]
    out_shape = b.op("Concat", bs_q, b.op("Mul", D_v, N), axis=0)
    return b.op("CastLike", b.op("Reshape", context, out_shape), "query")


def _projected_body(b: _Builder, all_rows: bool) -> str:
    """The projected calibrated attention ops' body: `input`·`weight` + `bias` split into `query`,
    `key` and `value` (ONNX Runtime `Attention`'s packed layout), then `_attention_body`."""
    qkv = b.op("Add", b.op("MatMul", "input", "weight"), "bias")
    b.nodes.append(helper.make_node("Split", [qkv], ["query", "key", "value"], axis=-1, num_outputs=3))
    return _attention_body(b, all_rows)


def make_function(op_type: str, opset: int, relative_bias: bool = False) -> onnx.FunctionProto:
    """The model-local FunctionProto for `op_type`, using ONNX domain opset `opset`; with the fifth input
    `relative_bias` where the model's nodes of the op take it (a calibrated attention op).

    The Softmax-fused ops are `Softmax(scores, axis=-1)` followed by the same body, so a runtime
    without the native kernel runs exactly the graph of a separate Softmax and calibration op.  The
    calibrated attention ops compute their scores and run the Softmax-fused body on them."""
    if op_type not in ALL_OP_TYPES:
        raise ValueError(f"unknown calibration op {op_type!r}")
    if opset < MIN_OPSET:
        raise ValueError(f"the calibration function body needs opset >= {MIN_OPSET}, got {opset}")
    b = _Builder()
    if is_projected(op_type):
        out = _projected_body(b, all_rows=is_all_rows(op_type))
    elif is_attention(op_type):
        out = _attention_body(b, all_rows=is_all_rows(op_type), relative_bias=relative_bias)
    elif takes_scores(op_type):
        out = _softmax_body(b, "scores", all_rows=is_all_rows(op_type))
    else:
        out = _body(b, all_rows=is_all_rows(op_type))
    output = "context" if is_attention(op_type) else "calibrated"
    b.nodes.append(helper.make_node("Identity", [out], [output]))
    # The optional attributes (marked rows, geometry) carry their defaults in the function (a node may lack them).
    names = attribute_names(op_type)
    defaults = [helper.make_attribute(n, v) for n, v in OPTIONAL_DEFAULTS.items() if n in names]
    return helper.make_function(
        DOMAIN,
        op_type,
        inputs=input_names(op_type, relative_bias),
        outputs=[output],
        nodes=b.nodes,
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=[n for n in names if n not in OPTIONAL_DEFAULTS],
        attribute_protos=defaults,
        doc_string=f"attncal calibration op {op_type} (contract v1); see attncal.graphs.ops.contract",
    )
