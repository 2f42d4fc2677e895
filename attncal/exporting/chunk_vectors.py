"""`attncal export --chunk-vectors`: chunk vectors in the graph, so a server returns one vector per chunk and
never ships every token state.

Every graph of the export gets an optional input and an output:

* `chunk_spans`, int64 [batch, chunks, 2]: per row of the batch, the token positions [start, end) of each chunk
  in that (padded) row.  A row with fewer chunks than the batch's widest pads with empty spans, (0, 0); any span
  with end <= start is empty and its vector is zeros.  The input has a default (an empty [1, 0, 2]), so a call
  that does not feed it is the export's ordinary call, and its inputs stay input_ids, attention_mask (and
  token_type_ids).
* `chunk_embeddings`, float32 [batch, chunks, hidden]: the mean of the final token states (`last_hidden_state`)
  of each span, then the model's own normalisation (x / max(||x||, 1e-12), as its `sentence_embedding`) where it
  normalises.  The caller puts in a span the chunk's own tokens (`attncal.runtime.chunking.Chunker`: special
  tokens, a prompt and the window's context are never inside one); a span of one token is that token's state,
  which is a landmark chunk's vector.

The nodes are appended to each written graph (after quantization, which leaves them as they are) and read
nothing but `last_hidden_state`, so every placement, precision and runtime has them alike.  A model with a Dense
head after pooling has token states outside its embedding space and is refused (`check_model`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..artifact import stamp_onnx
from ..runtime.chunking import CHUNK_SPANS, CHUNK_VECTORS

HIDDEN = "last_hidden_state"
_NORM_EPS = 1e-12  # F.normalize's eps, as the graph's sentence_embedding is normalised
_PREFIX = "attncal_chunk_"


def record(normalize: bool) -> dict:
    """attncal.json's `chunk_vectors`: what the graphs take and give."""
    return {"input": CHUNK_SPANS, "output": CHUNK_VECTORS, "span": "token positions [start, end) in the padded "
            "row; (0, 0) pads", "pooling": "mean", "normalize": bool(normalize)}


def check_model(info) -> None:
    """ValueError (one line) for a model whose token states are not in its embedding space (a Dense head)."""
    if getattr(info, "dense", ()):
        raise ValueError("--chunk-vectors: this model projects its pooled embedding with a Dense head, so its token "
                         "states are not in the embedding space and a chunk's mean of them is no embedding; export "
                         "without it (naive chunking encodes chunk texts)")


def add_chunk_vectors(path: str | os.PathLike, normalize: bool) -> str:
    """Append the chunk-vector input and output (see the module docstring) to the graph file `path` (its weights
    stay where they are: external data is not read) and stamp its digest again; returns the digest."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    names = {o.name for o in graph.output}
    if HIDDEN not in names:
        raise ValueError(f"{path}: no {HIDDEN!r} output to take chunk vectors from")
    if CHUNK_VECTORS in names:
        raise ValueError(f"{path}: already has a {CHUNK_VECTORS!r} output")
    out = next(o for o in graph.output if o.name == HIDDEN)
    hidden_type = out.type.tensor_type.elem_type
    width = out.type.tensor_type.shape.dim[-1]
    width = width.dim_value if width.HasField("dim_value") else "hidden"
    n = lambda name: _PREFIX + name  # noqa: E731

    def const(name, value, dtype):
        graph.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), n(name)))
        return n(name)

    # the optional input: an initializer of the input's name is its default (an empty set of spans)
    graph.initializer.append(numpy_helper.from_array(np.zeros((1, 0, 2), np.int64), CHUNK_SPANS))
    graph.input.append(helper.make_tensor_value_info(CHUNK_SPANS, TensorProto.INT64, ["batch", "chunks", 2]))
    zero, one, two = const("i0", [0], np.int64), const("i1", [1], np.int64), const("i2", [2], np.int64)
    axis2, last = const("axis2", [2], np.int64), const("last", [-1], np.int64)
    nodes = []
    hidden = HIDDEN
    if hidden_type != TensorProto.FLOAT:  # an fp16 graph: the means in float32
        nodes.append(helper.make_node("Cast", [HIDDEN], [n("hidden")], to=TensorProto.FLOAT, name=n("cast")))
        hidden = n("hidden")
    nodes += [
        helper.make_node("Slice", [CHUNK_SPANS, zero, one, axis2], [n("start")], name=n("start")),  # [B, C, 1]
        helper.make_node("Slice", [CHUNK_SPANS, one, two, axis2], [n("end")], name=n("end")),
        helper.make_node("Shape", [hidden], [n("len")], start=1, end=2, name=n("len")),  # [1]: S
        helper.make_node("Squeeze", [n("len")], [n("len0")], name=n("len0")),
        helper.make_node("Range", [const("s0", 0, np.int64), n("len0"), const("s1", 1, np.int64)], [n("pos")],
                         name=n("pos")),  # [S]
        helper.make_node("GreaterOrEqual", [n("pos"), n("start")], [n("after")], name=n("after")),  # [B, C, S]
        helper.make_node("Less", [n("pos"), n("end")], [n("before")], name=n("before")),
        helper.make_node("And", [n("after"), n("before")], [n("in")], name=n("in")),
        helper.make_node("Cast", [n("in")], [n("weights")], to=TensorProto.FLOAT, name=n("weights")),
        helper.make_node("MatMul", [n("weights"), hidden], [n("sum")], name=n("sum")),  # [B, C, D]
        helper.make_node("ReduceSum", [n("weights"), last], [n("count")], keepdims=1, name=n("count")),
        helper.make_node("Max", [n("count"), const("f1", 1.0, np.float32)], [n("count1")], name=n("count1")),
    ]
    if normalize:
        nodes += [
            helper.make_node("Div", [n("sum"), n("count1")], [n("mean")], name=n("mean")),
            helper.make_node("Mul", [n("mean"), n("mean")], [n("sq")], name=n("sq")),
            helper.make_node("ReduceSum", [n("sq"), last], [n("sqsum")], keepdims=1, name=n("sqsum")),
            helper.make_node("Sqrt", [n("sqsum")], [n("norm")], name=n("norm")),
            helper.make_node("Max", [n("norm"), const("eps", _NORM_EPS, np.float32)], [n("norm1")],
                             name=n("norm1")),
            helper.make_node("Div", [n("mean"), n("norm1")], [CHUNK_VECTORS], name=n("normalised")),
        ]
    else:
        nodes.append(helper.make_node("Div", [n("sum"), n("count1")], [CHUNK_VECTORS], name=n("mean")))
    graph.node.extend(nodes)
    graph.output.append(helper.make_tensor_value_info(CHUNK_VECTORS, TensorProto.FLOAT, ["batch", "chunks", width]))
    tmp = path.with_name(path.name + ".chunks")
    onnx.save(model, str(tmp))
    os.replace(tmp, path)
    return stamp_onnx(path)
