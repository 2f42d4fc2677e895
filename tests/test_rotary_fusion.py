"""The native graph's rotations fused into ONNX Runtime's RotaryEmbedding (attncal.graphs.fusions.rotary_fusion): which
rotations are matched, and that the fused graph feeds the attention op what the unfused one does."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from attncal.graphs.ops.contract import DOMAIN
from attncal.graphs.fusions.rotary_fusion import ROTARY_OP, fuse_rotations

N, NK, D = 4, 2, 8
H = D // 2


def _rotation(prefix: str, x: str, c: str, s: str, lower_end: int = H, upper_start: int = H) -> list:
    """transformers' x·c + rotate_half(x)·s, named `prefix`*; output `prefix`_r."""
    return [
        helper.make_node("Mul", [x, c], [f"{prefix}_xc"]),
        helper.make_node("Slice", [x, "zero", f"end{lower_end}", "last"], [f"{prefix}_lo"]),
        helper.make_node("Slice", [x, f"start{upper_start}", "big", "last"], [f"{prefix}_hi"]),
        helper.make_node("Neg", [f"{prefix}_hi"], [f"{prefix}_nhi"]),
        helper.make_node("Concat", [f"{prefix}_nhi", f"{prefix}_lo"], [f"{prefix}_rh"], axis=-1),
        helper.make_node("Mul", [f"{prefix}_rh", s], [f"{prefix}_rs"]),
        helper.make_node("Add", [f"{prefix}_xc", f"{prefix}_rs"], [f"{prefix}_r"]),
    ]


def _model(*, scaled_query: bool = False, batch_positions: bool = False, unequal_halves: bool = False,
           upper_start: int = H) -> onnx.ModelProto:
    """A layer's rotations as torch exports them, feeding a stand-in attention op of attncal's domain the way the
    placement does: the query as Reshape(Transpose(R)), the key through Kᵀ's Transpose (no GQA).  The query is
    x = Transpose(q0) (the 3-D form applies), or with `scaled_query` a product of it (the 4-D form)."""
    f_batch = "b" if batch_positions else 1
    nodes = [
        helper.make_node("Concat", ["f", "g" if unequal_halves else "f"], ["emb"], axis=-1),
        helper.make_node("Cos", ["emb"], ["cos"]), helper.make_node("Sin", ["emb"], ["sin"]),
        helper.make_node("Unsqueeze", ["cos", "one_axis"], ["c"]),
        helper.make_node("Unsqueeze", ["sin", "one_axis"], ["s"]),
        helper.make_node("Transpose", ["q0"], ["qt"], perm=[0, 2, 1, 3]),
        *([helper.make_node("Mul", ["qt", "half"], ["q"])] if scaled_query else []),
        helper.make_node("Transpose", ["k0"], ["k"], perm=[0, 2, 1, 3]),
        *_rotation("q", "q" if scaled_query else "qt", "c", "s", upper_start=upper_start),
        *_rotation("k", "k", "c", "s", upper_start=upper_start),
        helper.make_node("Transpose", ["q_r"], ["q_bsnd"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["q_bsnd", "flat"], ["q_in"]),
        helper.make_node("Transpose", ["k_r"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("Transpose", ["k_t"], ["k_bsnd"], perm=[0, 3, 1, 2]),
        helper.make_node("Reshape", ["k_bsnd", "flat"], ["k_in"]),
        helper.make_node("Probe", ["q_in", "k_in"], ["y"], domain=DOMAIN),
    ]
    ints = {"zero": [0], "big": [2 ** 62], "last": [-1], "one_axis": [1], "flat": [0, 0, -1],
            f"end{H}": [H], f"start{upper_start}": [upper_start]}
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()]
    inits.append(numpy_helper.from_array(np.array(0.5, np.float32), "half"))
    value = helper.make_tensor_value_info
    bnsd = {"qt": N, "q": N, "k": NK, "q_r": N, "k_r": NK}
    shapes = [value(n, TensorProto.FLOAT, ["b", h, "s", D]) for n, h in bnsd.items()]
    shapes += [value(n, TensorProto.FLOAT, [f_batch, "s", D]) for n in ("emb", "cos", "sin")]
    shapes += [value(n, TensorProto.FLOAT, [f_batch, 1, "s", D]) for n in ("c", "s")]
    inputs = [value("q0", TensorProto.FLOAT, ["b", "s", N, D]), value("k0", TensorProto.FLOAT, ["b", "s", NK, D]),
              value("f", TensorProto.FLOAT, [f_batch, "s", H]), value("g", TensorProto.FLOAT, [f_batch, "s", H])]
    graph = helper.make_graph(nodes, "rotary", inputs, [value("y", TensorProto.FLOAT, None)], inits,
                              value_info=shapes)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])


def _fused(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    ir_model = ir.serde.deserialize_model(model)
    count = fuse_rotations(ir_model)
    return ir.serde.serialize_model(ir_model), count


def _op_inputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """What `model` feeds its stand-in op: the op replaced by Identities whose outputs are the graph's."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    op = next(n for n in probe.graph.node if n.domain == DOMAIN)
    probe.graph.node.remove(op)
    probe.graph.node.extend(helper.make_node("Identity", [v], [f"seen{i}"]) for i, v in enumerate(op.input))
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_tensor_value_info(f"seen{i}", TensorProto.FLOAT, None)
                              for i in range(len(op.input)))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: feeds[i.name] for i in probe.graph.input})


def _feeds(batch: int, seq: int, batch_positions: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * 100 + seq)
    angles = np.arange(seq)[:, None] * (10000.0 ** (-np.arange(H) / H))[None]
    f = np.broadcast_to(angles, (batch if batch_positions else 1, seq, H)).astype(np.float32)
    return {"q0": rng.standard_normal((batch, seq, N, D)).astype(np.float32),
            "k0": rng.standard_normal((batch, seq, NK, D)).astype(np.float32),
            "f": f, "g": (f * 0.5).astype(np.float32)}


@pytest.mark.parametrize("scaled_query", [False, True])
def test_fused_rotations_feed_the_op_what_the_graph_did(scaled_query):
    """Both rotations are fused into the 3-D form that feeds the op [B,S,N·D] (a query computed in [B,N,S,D] is
    transposed back first), the unfused chain is gone, and at several lengths the op gets the same values to
    float32 rounding: the caches are the graph's own cos and sin rows."""
    model = _model(scaled_query=scaled_query)
    fused, count = _fused(model)
    assert count == 2
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count(ROTARY_OP) == 2 and "Neg" not in ops and ops.count("Cos") == ops.count("Sin") == 1
    assert ops.count("Transpose") == 2 * scaled_query  # the graph's own and its inverse, for ORT to cancel
    rotary = [n for n in fused.graph.node if n.op_type == ROTARY_OP]
    assert {n.domain for n in rotary} == {"com.microsoft"}
    assert [next(a.i for a in n.attribute if a.name == "num_heads") for n in rotary] == [N, NK]
    for batch, seq in ((2, 7), (1, 1), (3, 33)):
        feeds = _feeds(batch, seq)
        for want, got in zip(_op_inputs(model, feeds), _op_inputs(fused, feeds)):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", [{"batch_positions": True}, {"unequal_halves": True}, {"upper_start": H - 1}])
def test_other_rotations_are_left_as_they_are(variant):
    """Positions per batch item, halves of c and s that differ, a rotation that is not rotate_half: not fused,
    the graph unchanged."""
    model = _model(**variant)
    fused, count = _fused(model)
    assert count == 0
    assert [n.op_type for n in fused.graph.node] == [n.op_type for n in model.graph.node]
