"""float16 ORT-optimized graphs, for GPU serving: ONNX Runtime's own converter, calibration kept in float32.

`onnxruntime.transformers`' `OnnxModel.convert_float_to_float16` converts the optimized graph
(weights, fused Attention, SkipLayerNormalization, GELU) and inserts Casts around the nodes it is told
to leave alone.  Those are the placement's calibration nodes (its `float32_nodes` prefix): the basket
statistics and blend coefficients need float32, as the contract computes them.

The converter inserts a Cast only where it knows the value's type, and its symbolic shape inference
cannot type every output of the contrib ops (it says "failed in shape inference" and goes on).  So the
values crossing the boundary between float32 and float16 nodes are declared float32 first; without that,
a calibration MatMul reads a float16 SkipLayerNormalization output next to its float32 weight and ONNX
Runtime refuses the graph ("bound to different types").

The converter works on a ModelProto and converts the weights it holds; a large model's weights stay on
disk instead (`convert_model_to_fp16`): the converter sees the structure, and each weight it would convert
is converted from its float32 data when the graph is saved, one tensor at a time, with the converter's own
clipping.  The converter would read every weight it converts (it declares the weight's type from its data),
so those weights go to it as float32 graph inputs, which it turns into float16 values exactly as it does a
converted weight (without reading anything), and become initializers again afterwards; which weights it
converts is its own rule, `converted_weights`: those that a node it converts reads.

The boundary declarations, the rule and the clipping rely on the converter of one ONNX Runtime release,
`MIRRORS_ORT`; with another installed, converting says so once.
"""

from __future__ import annotations

import numpy as np
import onnx

from ..versions import warn_if_not_mirrored

MIRRORS_ORT = "1.32"  # the onnxruntime release whose float16 converter this relies on
METHOD = ("onnxruntime.transformers OnnxModel.convert_float_to_float16 (keep_io_types: int64 inputs, float32 "
          "outputs; calibration nodes kept float32)")
_BLOCK = 4 * 1024 * 1024  # elements converted at once


def _boundary_values(model: onnx.ModelProto, keep: set[str]) -> set[str]:
    """Values produced on one side of the float32 / float16 boundary and read on the other."""
    producer = {out: node.name for node in model.graph.node for out in node.output if out}
    crossing = set()
    for node in model.graph.node:
        inside = node.name in keep
        for name in node.input:
            if name in producer and (producer[name] in keep) != inside:
                crossing.add(name)
    return crossing


def _kept(model: onnx.ModelProto, float32_prefix: str | None) -> set[str]:
    return {n.name for n in model.graph.node if float32_prefix and n.name.startswith(float32_prefix)}


def converted_weights(graph: onnx.GraphProto, names: set[str], keep: set[str]) -> set[str]:
    """The float32 initializers among `names` that the converter turns into float16: those read by a node it
    converts (not of an op type it blocks, not named in `keep`, not at an input its op keeps float32), in the
    graph and in the subgraphs of the nodes it converts (it does not enter a blocked node's subgraphs)."""
    from onnxruntime.transformers.float16 import ALWAYS_FLOAT_INPUTS, DEFAULT_OP_BLOCK_LIST

    blocked_ops = set(DEFAULT_OP_BLOCK_LIST)
    out: set[str] = set()

    def visit(g: onnx.GraphProto) -> None:
        for node in g.node:
            blocked = node.op_type in blocked_ops or node.name in keep
            if blocked:
                continue
            out.update(x for i, x in enumerate(node.input)
                       if x in names and i not in ALWAYS_FLOAT_INPUTS.get(node.op_type, []))
            if node.op_type not in ALWAYS_FLOAT_INPUTS:
                for attr in node.attribute:
                    for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                        visit(sub)

    visit(graph)
    return out


def convert_to_fp16(model: onnx.ModelProto, float32_prefix: str | None,
                    as_inputs: set[str] = frozenset()) -> tuple[onnx.ModelProto, int]:
    """(`model` with float16 weights and activations, the number of nodes kept float32).  Graph inputs and
    outputs keep their types, so callers feed and read the same tensors as the float32 graph.  `as_inputs`:
    float32 graph inputs that stand for weights the converter converts (`convert_model_to_fp16`); they come
    out as float16 inputs."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    warn_if_not_mirrored("onnxruntime", MIRRORS_ORT, "attncal's fp16 conversion relies on the converter")
    keep = _kept(model, float32_prefix)
    typed = {v.name for v in model.graph.value_info}
    for name in sorted(_boundary_values(model, keep) - typed):
        model.graph.value_info.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    io = [v.name for v in (*model.graph.input, *model.graph.output) if v.name not in as_inputs]
    wrapped = OnnxModel(model)
    wrapped.convert_float_to_float16(keep_io_types=io, node_block_list=sorted(keep))
    wrapped.topological_sort()  # the converter appends its Casts at the end of the node list
    return wrapped.model, len(keep)


def _to_float16(weights: np.ndarray) -> np.ndarray:
    """The converter's float32 -> float16 conversion (its clipping of tiny and huge values), a block at a
    time: elementwise, so the same values, without the converter's full-size float32 temporaries."""
    from onnxruntime.transformers.float16 import convert_np_to_float16

    flat = weights.reshape(-1)
    out = np.empty(flat.shape, np.float16)
    for i in range(0, flat.size, _BLOCK):
        out[i:i + _BLOCK] = convert_np_to_float16(flat[i:i + _BLOCK])
    return out.reshape(weights.shape)


def convert_model_to_fp16(model, float32_prefix: str | None):
    """`convert_to_fp16` of an onnx_ir model whose weights are external (memory-mapped): returns (the float16
    onnx_ir model, the number of nodes kept float32), its converted weights computed lazily when saved."""
    import onnx_ir as ir

    sources = {name: v.const_value for name, v in model.graph.initializers.items()
               if isinstance(v.const_value, ir.ExternalTensor)}
    proto = ir.to_proto(model)
    order = [t.name for t in proto.graph.initializer]
    external = {t.name for t in proto.graph.initializer
                if t.name in sources and t.data_type == onnx.TensorProto.FLOAT}
    moved = converted_weights(proto.graph, external, _kept(proto, float32_prefix))
    # The weights the converter converts go to it as float32 inputs of their shape (it converts an input's
    # type without reading anything), the rest stay initializers; afterwards they are float16 initializers
    # again, in their places, their data still the float32 file's until `_to_float16` converts it.
    weights = {t.name: t for t in proto.graph.initializer if t.name in moved}
    kept_weights = [t for t in proto.graph.initializer if t.name not in moved]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept_weights)
    proto.graph.input.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(t.dims))
                             for name, t in weights.items())
    converted, kept = convert_to_fp16(proto, float32_prefix, as_inputs=set(moved))
    inputs = [v for v in converted.graph.input if v.name not in moved]
    del converted.graph.input[:]
    converted.graph.input.extend(inputs)
    for t in weights.values():
        t.data_type = onnx.TensorProto.FLOAT16
    present = {t.name: t for t in converted.graph.initializer} | weights
    del converted.graph.initializer[:]
    converted.graph.initializer.extend(present[name] for name in order if name in present)
    out = ir.from_proto(converted)
    for name, value in out.graph.initializers.items():
        src = sources.get(name)
        if src is None:
            continue  # inline in the proto: converted there
        if value.const_value.dtype == src.dtype:
            value.const_value = src
        elif src.dtype == ir.DataType.FLOAT and value.const_value.dtype == ir.DataType.FLOAT16:
            value.const_value = ir.LazyTensor(lambda s=src: ir.tensor(_to_float16(s.numpy()), name=s.name),
                                              ir.DataType.FLOAT16, src.shape, name=name)
        else:
            raise ValueError(f"the float16 converter changed {name} from {src.dtype} to {value.const_value.dtype}")
    return out, kept
