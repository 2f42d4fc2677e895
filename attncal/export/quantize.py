"""int8 exports: ONNX Runtime's dynamic quantization of the written graphs, calibration kept in fp32.

`quantize_dynamic` (onnxruntime.quantization; nothing of our own) turns each weight MatMul into
DynamicQuantizeLinear + MatMulInteger with int8 weights, and ORT's fused `Attention` into
`QAttention`.  Only nodes that multiply by a weight are quantized (`weight_nodes`): the attention
core (Q·Kᵀ and P·V MatMuls of the plain graph, the split placement's basket attention, the
`ai.attncal` calibration and calibrated-attention ops) and every calibration scalar stay fp32, so the
calibration math is exactly the fp32 math on slightly different activations.

Per-channel weights are the default: per-tensor int8 loses far more cosine to the fp32 embeddings
(docs/quantization.md gives both on all-MiniLM-L6-v2).
"""

from __future__ import annotations

import os
from pathlib import Path

QUANTIZATIONS = ("int8",)
METHOD = ("onnxruntime.quantization.quantize_dynamic: QInt8 weights per output channel, uint8 activations "
          "quantized per batch; attention core and calibration in fp32")
_WEIGHT_OPS = {("", "MatMul"), ("", "Gemm"), ("com.microsoft", "Attention")}


def weight_nodes(model) -> list[str]:
    """Names of the nodes that multiply activations by a weight matrix (a 2-D initializer): the ones to
    quantize.  ORT's per-channel MatMulInteger takes 2-D weights only; a 3-D one (per-head weight slices the
    row placement builds) stays fp32."""
    dims = {i.name: len(i.dims) for i in model.graph.initializer}
    names = []
    for n in model.graph.node:
        if (n.domain if n.domain != "ai.onnx" else "", n.op_type) not in _WEIGHT_OPS or not n.name:
            continue
        if len(n.input) > 1 and dims.get(n.input[1]) == 2:
            names.append(n.name)
    return names


def quantize_graph(path: Path, per_channel: bool = True) -> int:
    """Quantize the graph at `path` in place (written beside it, then renamed); returns how many nodes."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(path), load_external_data=False)
    _name_unnamed(model)
    nodes = weight_nodes(model)
    if not nodes:
        raise ValueError(f"{path}: no MatMul/Gemm/Attention node with a weight initializer to quantize")
    named = path.with_name(path.name + ".named.onnx")
    out = path.with_name(path.name + ".int8.onnx")
    try:
        onnx.save(model, str(named))
        del model
        # DefaultTensorType: ONNX shape inference loses element types behind contrib and custom ops.
        quantize_dynamic(named, out, weight_type=QuantType.QInt8, per_channel=per_channel,
                         op_types_to_quantize=sorted({op for _, op in _WEIGHT_OPS}), nodes_to_quantize=nodes,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        os.replace(out, path)
        _drop_unreferenced_data(path)
    finally:
        for p in (named, out):
            p.unlink(missing_ok=True)
    return len(nodes)


def _drop_unreferenced_data(path: Path) -> None:
    """The quantizer writes int8 weights inline (a quarter of the size): the float32 graph's external-data file
    beside it is then left unreferenced, and goes."""
    import onnx

    from ..artifact import external_data_name

    data = path.with_name(external_data_name(path))
    if not data.exists():
        return  # nothing to drop: no parse of the quantized graph
    refs = {e.value for t in onnx.load(str(path), load_external_data=False).graph.initializer
            for e in t.external_data if e.key == "location"}
    if data.name not in refs:
        data.unlink()


def _name_unnamed(model) -> None:
    """`nodes_to_quantize` selects by name: give every unnamed node a unique one."""
    seen = {n.name for n in model.graph.node if n.name}
    for i, n in enumerate(model.graph.node):
        if not n.name:
            name = f"{n.op_type}_{i}"
            while name in seen:
                name += "_"
            n.name = name
            seen.add(name)
