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
disk instead (`convert_model_to_fp16`): the converter sees the structure, with the weights as external
references whose type it flips, and each flipped weight is converted from its float32 data when the
graph is saved, one tensor at a time, with the converter's own clipping.

The patch, the boundary declarations and the clipping rely on the converter of one ONNX Runtime release,
`MIRRORS_ORT`; with another installed, converting says so once.
"""

from __future__ import annotations

import sys
from unittest import mock

import numpy as np
import onnx

from ..versions import warn_if_not_mirrored

MIRRORS_ORT = "1.32"  # the onnxruntime release whose float16 converter this patches and relies on
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


def convert_to_fp16(model: onnx.ModelProto, float32_prefix: str | None) -> tuple[onnx.ModelProto, int]:
    """(`model` with float16 weights and activations, the number of nodes kept float32).  Graph inputs and
    outputs keep their types, so callers feed and read the same tensors as the float32 graph."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    warn_if_not_mirrored("onnxruntime", MIRRORS_ORT, "attncal's fp16 conversion patches and relies on the converter")
    keep = {n.name for n in model.graph.node if float32_prefix and n.name.startswith(float32_prefix)}
    typed = {v.name for v in model.graph.value_info}
    for name in sorted(_boundary_values(model, keep) - typed):
        model.graph.value_info.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    wrapped = OnnxModel(model)
    wrapped.convert_float_to_float16(keep_io_types=True, node_block_list=sorted(keep))
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


def _value_info_from_dims(tensor: onnx.TensorProto) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))


def convert_model_to_fp16(model, float32_prefix: str | None):
    """`convert_to_fp16` of an onnx_ir model whose weights are external (memory-mapped): returns (the float16
    onnx_ir model, the number of nodes kept float32), its converted weights computed lazily when saved."""
    import onnx_ir as ir

    from onnxruntime.transformers.onnx_model import OnnxModel

    float16 = sys.modules[OnnxModel.convert_float_to_float16.__globals__["convert_float_to_float16"].__module__]
    sources = {name: v.const_value for name, v in model.graph.initializers.items()
               if isinstance(v.const_value, ir.ExternalTensor)}
    # The converter declares each converted weight's value_info from `numpy_helper.to_array(tensor).shape`,
    # which would read the weight; its dims say the same without reading it.
    with mock.patch.object(float16, "make_value_info_from_tensor", _value_info_from_dims):
        converted, kept = convert_to_fp16(ir.to_proto(model), float32_prefix)
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
