"""float16 ORT-optimized graphs, for GPU serving: ONNX Runtime's own converter, calibration kept in float32.

`onnxruntime.transformers`' `OnnxModel.convert_float_to_float16` converts the optimized graph
(weights, fused Attention, SkipLayerNormalization, GELU) and inserts Casts around the nodes it is told
to leave alone.  Those are the placement's calibration nodes (its `FLOAT32_NODES` prefix): the basket
statistics and blend coefficients need float32, as the contract computes them.

The converter inserts a Cast only where it knows the value's type, and its symbolic shape inference
cannot type every output of the contrib ops (it says "failed in shape inference" and goes on).  So the
values crossing the boundary between float32 and float16 nodes are declared float32 first; without that,
a calibration MatMul reads a float16 SkipLayerNormalization output next to its float32 weight and ONNX
Runtime refuses the graph ("bound to different types").
"""

from __future__ import annotations

import onnx

METHOD = ("onnxruntime.transformers OnnxModel.convert_float_to_float16 (keep_io_types: int64 inputs, float32 "
          "outputs; calibration nodes kept float32)")


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

    keep = {n.name for n in model.graph.node if float32_prefix and n.name.startswith(float32_prefix)}
    typed = {v.name for v in model.graph.value_info}
    for name in sorted(_boundary_values(model, keep) - typed):
        model.graph.value_info.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    wrapped = OnnxModel(model)
    wrapped.convert_float_to_float16(keep_io_types=True, node_block_list=sorted(keep))
    wrapped.topological_sort()  # the converter appends its Casts at the end of the node list
    return wrapped.model, len(keep)
