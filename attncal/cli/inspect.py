"""List the graphs of an export, their calibration placement, and the calibrated layers' attributes."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import cpuinfo
from ..artifact import ArtifactError, MissingArtifactError, load_onnx_checked, open_export, pooling_of
from ..graphs.ops.contract import DOMAIN, is_all_rows, is_attention, is_projected, takes_scores


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="an attncal export directory or an .onnx file")


def _describe_graph(model_file: Path, placement: str | None, model=None,
                    fallback: str = "onnx/model_optimized.onnx") -> None:
    import onnx

    if model is None:
        model = load_onnx_checked(model_file, interface=False)
    nodes = [n for n in model.graph.node if n.domain == DOMAIN]
    softmaxes = sum(1 for n in model.graph.node if n.op_type == "Softmax")
    ort_fused = sum(1 for n in model.graph.node if n.domain == "com.microsoft"
                    and n.op_type in ("Attention", "MultiHeadAttention"))
    # As attncal.json counts them: ONNX Runtime's fused attention and the calibrated attention ops that replace it.
    fused = ort_fused + sum(1 for n in nodes if is_attention(n.op_type))
    split_nodes = sum(1 for n in model.graph.node if n.name.startswith("attncal_split_"))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    functions = [f.name for f in model.functions if f.domain == DOMAIN]
    if placement is None:
        placement = ("fused-softmax" if any(takes_scores(n.op_type) for n in nodes) else "softmax") if nodes \
            else ("split" if split_nodes else None)
        if nodes and ort_fused:
            placement = "row"
        if any(is_attention(n.op_type) for n in nodes):
            placement = "projected-attention" if any(is_projected(n.op_type) for n in nodes) else "attention"
    print(f"model      {model_file}")
    print(f"opset      {opset}; attention Softmax nodes: {softmaxes}; fused attention nodes: {fused}; "
          f"function bodies: {functions or 'none'}")
    if placement is None:
        print("calibration: none (uncalibrated graph)")
        return
    print(f"calibration: placement {placement}; attncal op nodes: {len(nodes)}"
          + ("; no attncal op (plain attention ops only)" if not nodes else ""))
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        layer = attrs.pop("layer", "?")
        text = ", ".join(f"{k}={round(v, 6) if isinstance(v, float) else v}" for k, v in attrs.items())
        print(f"  layer {layer:>3}  {n.op_type:<22} {text}")
    if any(is_attention(n.op_type) for n in nodes):
        off = sum(1 for n in nodes if any(a.name == "strength" and a.f == 0.0 for a in n.attribute))
        if off:
            print(f"           strength 0 in {off} of {len(nodes)} op nodes: plain attention there (calibration off)")
        print("runs     with the attncal native library (one-pass calibrated attention kernel); `attncal.Encoder` "
              f"picks this graph only when the library is loaded, else {fallback}")
    elif any(is_all_rows(n.op_type) and any(a.name == "marked_rows" and a.i for a in n.attribute) for n in nodes):
        print("note: the rows calibrated are those marked in the mask from input_ids (landmark or every-k-th "
              "pooling), which needs the full probabilities")
    elif any(is_all_rows(n.op_type) for n in nodes):
        print("note: mean pooling calibrates every valid query row, which needs the full probabilities; "
              "--placement split avoids them")


def run(args: argparse.Namespace) -> int:
    path = Path(args.out)
    if not path.exists():
        raise MissingArtifactError(path, "not found")
    if not path.is_dir():
        if path.suffix != ".onnx":
            raise ArtifactError(path, "is a file, neither an attncal export directory nor an .onnx file")
        _describe_graph(path, None)
        return 0
    exp = open_export(path, graphs=None)  # attncal.json, model files, onnx/; each graph is checked below
    meta = exp.meta
    graphs = {g: (meta.get("graphs") or {}).get(g) or {"placement": meta.get("placement")} for g in exp.graphs}
    protos = {g: exp.check_graph(g) for g in graphs}  # every graph is checked before anything is printed
    if meta.get("model_type"):
        tested = meta.get("tested")
        label = "" if tested is None else (" (tested architecture)" if tested else
                                           " (UNTESTED architecture: exported because every step and the parity "
                                           "check passed)")
        print(f"model      {meta['model_type']} ({meta.get('architecture', '?')}, {meta.get('num_layers')} layers)"
              f"{label}")
    if meta.get("optimizer"):
        print(f"optimizer  {meta['optimizer']}")
    print("tokenizer  " + ("tokenizer.json on tokenizers alone (the exporter found it gives transformers' ids)"
                           if meta.get("tokenizer") == "tokenizers" else "transformers' AutoTokenizer"))
    quant = meta.get("quantization")
    if isinstance(quant, dict):
        target = f" for {quant['target']} CPUs" if quant.get("target") else ""
        print(f"precision  {quant.get('precision')}{target} ({quant.get('method')})")
    elif meta.get("fp16"):
        method = meta.get("fp16_method")
        print("precision  fp16 (portable graph exported in fp16" + (f"; ORT-optimized graphs: {method})" if method
                                                                     else ")"))
    if meta.get("calibrated"):
        print(f"export     {path}: layers {meta.get('calibrated_layers')}, pooling {pooling_of(meta).describe()}, "
              f"requested placement {meta.get('placement')}")
        if meta.get("placement_reason"):
            print(f"reason     {meta['placement_reason']}")
    for graph_file, info in graphs.items():
        print()
        fallback = next((g for g in ("onnx/model_optimized.onnx", "onnx/model.onnx") if g in graphs), "onnx/model.onnx")
        _describe_graph(path / graph_file, info.get("placement") if meta.get("calibrated") or info.get("any_padding")
                        else None, protos[graph_file], fallback)
        if isinstance(info.get("float32_nodes"), int):
            print(f"fp16       converted after placement; {info['float32_nodes']} calibration nodes kept float32")
        par = info.get("parity")
        if isinstance(par, dict) and isinstance(par.get("max_abs"), (int, float)):
            cos = (f", cosine min {par['min_cos']:.5f} p50 {par['p50_cos']:.5f}"
                   if isinstance(par.get("p50_cos"), (int, float)) and par.get("precision") != "fp32" else "")
            print(f"parity     max |Δ| vs PyTorch {par['max_abs']:.3g}{cos} at export ({par.get('precision', 'fp32')})")
        if isinstance(quant, dict) and quant.get("precision") == "int8":
            props = {prop.key: prop.value for prop in protos[graph_file].metadata_props}
            print(f"int8 cpu   {cpuinfo.coverage_line(cpuinfo.int8_record(props))}")
    return 0
