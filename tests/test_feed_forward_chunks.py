"""The native graph's feed-forward blocks over chunks of rows (attncal.graphs.fusions.feed_forward_chunks): which
blocks are rewritten, and that the rewritten graph computes what the original does, padding and all."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from attncal.graphs.fusions.feed_forward_chunks import chunk_feed_forwards

H, I = 8, 24


def _weight(name: str, *shape: int, seed: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.3, name)


def _model(nodes, initializers, outputs=("y",)) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", H])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, [None] * 3) for o in outputs],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _erf_gelu_block() -> onnx.ModelProto:
    """LayerNorm-free BERT feed-forward as torch exports it: MatMul, bias, exact GELU, MatMul, bias."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Div", ["hb", "sqrt2"], ["hd"]),
        helper.make_node("Erf", ["hd"], ["he"]),
        helper.make_node("Add", ["he", "one"], ["h1"]),
        helper.make_node("Mul", ["hb", "half"], ["hh"]),
        helper.make_node("Mul", ["hh", "h1"], ["g"]),
        helper.make_node("MatMul", ["g", "w2"], ["o"]),
        helper.make_node("Add", ["o", "b2"], ["y"]),
    ]
    scalars = [numpy_helper.from_array(np.array(v, np.float32), n)
               for n, v in (("sqrt2", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]
    return _model(nodes, [_weight("w1", H, I, seed=1), _weight("b1", I, seed=2), _weight("w2", I, H, seed=3),
                          _weight("b2", 1, 1, H, seed=4), *scalars])


def _gated_silu_block() -> onnx.ModelProto:
    """Qwen3's: SiLU of the gate projection times the up projection, then the down projection."""
    nodes = [
        helper.make_node("MatMul", ["x", "wg"], ["gate"]),
        helper.make_node("Sigmoid", ["gate"], ["sig"]),
        helper.make_node("Mul", ["gate", "sig"], ["silu"]),
        helper.make_node("MatMul", ["x", "wu"], ["up"]),
        helper.make_node("Mul", ["silu", "up"], ["prod"]),
        helper.make_node("MatMul", ["prod", "wd"], ["y"]),
    ]
    return _model(nodes, [_weight("wg", H, I, seed=5), _weight("wu", H, I, seed=6), _weight("wd", I, H, seed=7)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


@pytest.mark.parametrize("make", [_erf_gelu_block, _gated_silu_block])
def test_chunked_block_computes_what_the_block_does(make):
    """Rows over several chunks, with padding (10 rows in chunks of 4), exactly divided (12), one short chunk
    (1 row) and no row at all: the rewritten graph gives the original's output."""
    model = make()
    chunked = onnx.ModelProto()
    chunked.CopyFrom(model)
    assert chunk_feed_forwards(chunked, rows=4) == 1
    onnx.checker.check_model(chunked)
    ops = [n.op_type for n in chunked.graph.node]
    assert ops.count("Scan") == 1 and ops.count("MatMul") == 0
    for batch, seq in ((2, 5), (3, 4), (1, 1), (2, 0)):
        x = np.random.default_rng(batch * 10 + seq).standard_normal((batch, seq, H)).astype(np.float32)
        (want,), (got,) = _run(model, x), _run(chunked, x)
        assert got.shape == want.shape == (batch, seq, H)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_blocks_that_are_not_row_wise_stay():
    """An intermediate read outside the block, a constant that differs by row, a single MatMul, or an input
    that no MatMul reads itself: nothing is rewritten."""
    escaping = _erf_gelu_block()
    escaping.graph.output.append(helper.make_tensor_value_info("g", TensorProto.FLOAT, [None] * 3))
    by_position = _gated_silu_block()
    by_position.graph.initializer.append(_weight("pos", 5, I, seed=8))
    for n in by_position.graph.node:
        if n.op_type == "Sigmoid":
            n.input[0] = "gate_pos"
    by_position.graph.node.insert(1, helper.make_node("Add", ["gate", "pos"], ["gate_pos"]))
    single = _model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                    [_weight("w", H, H, seed=9)])
    # Row-wise, but no MatMul reads the input itself (its width is taken from an input projection's weight)
    scaled = _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["h"]),
                     helper.make_node("Relu", ["h"], ["g"]), helper.make_node("MatMul", ["g", "w"], ["y"])],
                    [_weight("w", H, H, seed=10)])
    for model in (escaping, by_position, single, scaled):
        before = model.SerializeToString()
        assert chunk_feed_forwards(model, rows=4) == 0
        assert model.SerializeToString() == before


def test_chunk_rows_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        chunk_feed_forwards(_gated_silu_block(), rows=0)
