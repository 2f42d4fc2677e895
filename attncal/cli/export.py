"""Export a transformers / sentence-transformers encoder to ONNX with the calibration op."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..artifact import EXPORT_LOG_FILE, pooling_of
from ..exporting.errors import ExportError, ParityError
from ..exporting.plan import DEFAULT_OPSET, EXPORTERS, ExportOptions
from ..exporting.quantize import INT8_TARGETS, QUANTIZATIONS
from ..exporting.watch import Watch
from ..graphs.placements.placement_names import CHOICES as PLACEMENT_CHOICES
from ..modelinfo import TESTED_MODEL_TYPES
from .common import CLIError, add_calibration_args, config_from_args
from .pooling import pooling_choices

LOG_FILE_HELP = f"they are written to OUT/{EXPORT_LOG_FILE}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "Tested architectures (CI, every graph and placement, parity <= 1e-5): "
        + ", ".join(f"{v} ({k})" for k, v in TESTED_MODEL_TYPES.items())
        + ". Any other architecture is exported when its attention can be calibrated in PyTorch (through "
        "transformers' AttentionInterface, or one softmax per layer), its graph has one attention Softmax per "
        "layer and the parity check passes; it is labelled untested in attncal.json and by `attncal inspect`. "
        "Known to fail, with the reason: attention sinks; sentence-transformers modules other than Transformer, "
        "Pooling, Dense and Normalize; --exporter torchscript on Gemma3.")

    p.add_argument("model", help="model directory, a hub id already in the local HF cache, or 'default'")
    p.add_argument("-o", "--out", required=True, help="output directory (sentence-transformers/optimum layout)")
    add_calibration_args(p, landmarks=True)
    p.add_argument("--no-calibration", action="store_true", help="export the uncalibrated model")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset, >= 18 (default %(default)s)")
    p.add_argument("--fp16", action="store_true", help="export weights and activations in float16")
    p.add_argument("--quantize", choices=QUANTIZATIONS, default=None,
                   help="int8: quantize every graph with attncal's streamed dynamic quantizer (weights per channel, "
                        "activations per batch; attention core and calibration stay fp32), for CPU serving; parity "
                        "is then judged by cosine to the fp32 PyTorch reference (see attncal check). Excludes --fp16")
    p.add_argument("--int8-target", choices=INT8_TARGETS, default="auto",
                   help="the CPUs an int8 export is for: vnni (8-bit int8 weights: exact and fastest on AVX-512 VNNI "
                        "and AVX-VNNI CPUs, saturating on others), avx2 (7-bit int8 weights, exact on every x86-64 "
                        "CPU with AVX2; the MatMuls that move the embeddings most, measured at export, stay fp32), "
                        "portable (uint8 weights: exact everywhere, slower), auto (default: vnni on a VNNI CPU, avx2 "
                        "on other AVX2 CPUs, else portable)")
    p.add_argument("--max-length", type=int, default=None, help="override the model's max sequence length")
    p.add_argument("--exporter", choices=EXPORTERS, default="dynamo",
                   help="torch.onnx exporter (default %(default)s; torchscript is faster and suits ORT's fusions)")
    p.add_argument("--placement", choices=PLACEMENT_CHOICES, default="auto",
                   help="where calibration goes (default auto: row for cls/last pooling; for mean pooling split "
                        "on the ORT-optimized graph and fused-softmax on the portable graph; plus, beside the "
                        "ORT-optimized graph, onnx/model_optimized_native.onnx with the projected-attention "
                        "placement (fp32; attention for --fp16 and --quantize), which the runtime picks where the "
                        "attncal native library is loaded; models without an ORT-optimized graph get a native graph "
                        "with the op in every layer). "
                        "softmax: op after each calibrated Softmax; fused-softmax: one op computes the Softmax and "
                        "the calibration; row: the pooling row is recomputed beside the attention; split: "
                        "calibration as attention over baskets, no probabilities, no custom op; attention: every "
                        "layer of the ORT-optimized graph becomes its Q/K/V projections and one calibrated attention "
                        "op (strength 0 where the config does not calibrate); projected-attention: one op per layer "
                        "that also computes the projections (float32 only)")
    p.add_argument("--no-optimized", dest="optimized", action="store_false",
                   help="do not write onnx/model_optimized.onnx (the ORT-optimized graph; written where ONNX "
                        "Runtime's transformer optimizer fuses every layer's attention) nor the native graph "
                        "onnx/model_optimized_native.onnx, which is made from it or, for a model without it, in its "
                        "place")
    p.add_argument("--inlined", action="store_true",
                   help="also write onnx/model_inlined.onnx: the portable graph with its ai.attncal functions inlined "
                        "into standard ONNX, for runtimes that do not read ONNX functions (OpenVINO); checked like "
                        "every graph; one more copy of the weights on disk")
    p.add_argument("--chunk-vectors", action="store_true",
                   help="every graph also takes an optional input chunk_spans (int64 [batch, chunks, 2], token "
                        "positions [start, end) in the row) and returns chunk_embeddings (each span's mean of final "
                        "token states, normalised as the model normalises): late and landmark chunk vectors "
                        "computed in the graph, which a Triton server returns without shipping token states "
                        "(docs/long-documents.md)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is not empty")
    p.add_argument("--skip-check", action="store_true", help="do not run the parity check at export")
    p.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help="export even when the estimated peak memory (or disk) exceeds what is available; by default "
                        "such an export is refused before it starts, with the estimate (docs: Export large models)")


def run(args: argparse.Namespace) -> int:
    pooling, = pooling_choices(args)
    opts = ExportOptions(
        config=config_from_args(args, pooling),
        calibrate=not args.no_calibration,
        opset=args.opset,
        fp16=args.fp16,
        max_length=args.max_length,
        exporter=args.exporter,
        overwrite=args.overwrite,
        check=not args.skip_check,
        placement=args.placement,
        optimized=args.optimized,
        inlined=args.inlined,
        quantize=args.quantize,
        int8_target=args.int8_target,
        memory_check=args.memory_check,
        chunk_vectors=args.chunk_vectors,
    )
    from ..exporting.exporter import export  # lazy: onnx_ir and sympy, not loaded at start-up

    try:
        with Watch() as watch:  # a kill (out of memory) is reported with its step, and leaves nothing behind
            meta = export(args.model, args.out, opts, watch=watch)
    except ParityError as exc:
        raise CLIError(f"{exc}; nothing was written", code=1) from None
    except ExportError as exc:
        raise CLIError(str(exc), code=1) from None
    print(f"exported {meta['model_type']} -> {args.out}")
    pooling = pooling_of(meta)
    if pooling.row_set:
        print(f"pooling {pooling.describe()}")
    if meta["calibrated"]:
        print(f"calibrated layers {meta['calibrated_layers']}: {meta['placement_reason']}")
    else:
        print("uncalibrated")
    for graph_file, g in meta["graphs"].items():
        line = f"  {graph_file}: placement {g['placement'] or 'none'}, fused attention nodes {g['fused_attention']}"
        if g.get("quantized_nodes"):
            line += f", {g['quantized_nodes']} weight nodes int8"
        if isinstance(g.get("float32_nodes"), int):
            line += f", fp16 with {g['float32_nodes']} calibration nodes float32"
        par = g.get("parity")
        if par:
            line += f", parity vs PyTorch max abs {par['max_abs']:.3g}"
            if par.get("precision") not in (None, "fp32"):
                line += f", cosine min {par['min_cos']:.5f} p50 {par.get('p50_cos') or float('nan'):.5f} " \
                        f"({par['precision']})"
        print(line)
    print(f"third-party warnings and messages (torch, transformers, ONNX Runtime): {Path(args.out) / EXPORT_LOG_FILE}")
    return 0
