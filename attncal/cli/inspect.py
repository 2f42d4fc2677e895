"""List the calibrated layers of an exported model and the attributes of their calibration nodes."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..modelinfo import ModelNotFoundError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="an attncal export directory or an .onnx file")


def run(args: argparse.Namespace) -> int:
    import onnx

    from ..graphs.contract import ALL_ROWS_OP, DOMAIN

    path = Path(args.out)
    model_file = path / "onnx" / "model.onnx" if path.is_dir() else path
    if not model_file.is_file():
        raise ModelNotFoundError(f"{model_file} not found")
    model = onnx.load(str(model_file), load_external_data=False)
    nodes = [n for n in model.graph.node if n.domain == DOMAIN]
    softmaxes = sum(1 for n in model.graph.node if n.op_type == "Softmax")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    functions = [f.name for f in model.functions if f.domain == DOMAIN]
    print(f"model      {model_file}")
    print(f"opset      {opset}; attention Softmax nodes: {softmaxes}; function bodies: {functions or 'none'}")
    if not nodes:
        print("calibration: none (uncalibrated export)")
        return 0
    fused = sum(1 for n in model.graph.node if n.op_type == "Attention" and n.domain == "com.microsoft")
    placement = "row (beside fused attention)" if fused else "softmax"
    meta_file = path / "attncal.json" if path.is_dir() else None
    if meta_file is not None and meta_file.exists():
        import json

        if json.loads(meta_file.read_text()).get("placement") == "row" and not fused:
            placement = "row (pooling row recomputed beside the unfused attention)"
    print(f"calibration: {len(nodes)} node(s), placement {placement}; fused Attention nodes: {fused}")
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        layer = attrs.pop("layer", "?")
        text = ", ".join(f"{k}={round(v, 6) if isinstance(v, float) else v}" for k, v in attrs.items())
        print(f"  layer {layer:>3}  {n.op_type:<22} {text}")
    if any(n.op_type == ALL_ROWS_OP for n in nodes):
        print("note: mean pooling calibrates every valid query row (AllRowsCalibration); it runs after the "
              "attention Softmax and needs the full probabilities")
    return 0
