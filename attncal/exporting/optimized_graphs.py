"""The export's ONNX Runtime graphs: `onnx/model_optimized.onnx` (the placement on ONNX Runtime's transformer
optimizer's graph, `attncal.exporting.ort_optimize`) and `onnx/model_optimized_native.onnx` (the calibrated
attention op in every layer, for the native library), and the glue between them and the optimizer: whether it
is worth trying, whether it fused every layer, the placements before or after it, and its cached runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx_ir as ir

from ..artifact import (CONFIG_FILE, NATIVE_GRAPH, ONNX_FILE, ONNX_SUBDIR, OPTIMIZED_FILE, OPTIMIZED_GRAPH, config_int,
                        is_long_context, read_json, stage_onnx, weights_on_disk, write_graph)
from ..calibration.config import CalibrationConfig
from ..graphs.fusions import native_fusions, passes
from ..graphs import placements
from ..graphs.placements import plain_attention_placement as pap
from ..graphs.fusions.feed_forward_chunks import CHUNK_ROWS, PASS
from ..graphs.pass_base import run_passes
from ..graphs.fusions.passes import staged
from ..graphs.placements.placement_base import count_fused_attention
from ..graphs.placements.placement_names import ATTENTION
from ..graphs.placements import NATIVE_BY_PRECISION
from ..memory import release_freed_memory
from ..messages import first_line
from ..modelinfo import ModelInfo, declared_attention_window
from . import from_torch
from .errors import ExportError
from .fp16 import convert_model_to_fp16
from .ort_optimize import run as run_optimizer
from .plan import GRAPHS, ExportPlan
from .run import Run

# Attention features (attncal.calibration.probing.attention_features) that ORT's BERT attention fusion
# (onnxruntime.transformers FusionAttention) does not match: its pattern is Q/K/V MatMul + Add, scale, mask Add,
# Softmax, ·V.  Skipping the attempt spares a TorchScript export and an optimizer run of the whole model
# (minutes for a multi-billion-parameter embedder) that cannot fuse; every other model is tried and counted.
_FUSION_BLOCKERS = {"rotary": "rotary position embeddings", "position_bias": "a relative position bias",
                    "grouped_kv": "grouped key/value heads"}


def _fusion_blockers(features: frozenset[str]) -> str:
    return " and ".join(_FUSION_BLOCKERS[f] for f in sorted(features) if f in _FUSION_BLOCKERS)


def _ort_optimize(path: Path, info: ModelInfo, cache: dict):
    """ONNX Runtime's transformer optimizer (attention and layer-norm fusions; its BERT fusions match any
    encoder whose attention has the BERT shape, from a TorchScript export), lazily loaded: its weights stay
    in the staged data file (`attncal.exporting.ort_optimize` runs the optimizer in a child process).  `cache`
    maps a source graph to its optimized copy and the optimizer's messages, so the optimized and native graphs
    share one run."""
    from transformers import AutoConfig  # the export's own dependency; its attribute maps name the heads

    key = str(path)
    if key not in cache:
        cfg = AutoConfig.from_pretrained(str(info.path))
        dst = path.parent / "optimized" / f"{path.stem}.onnx"
        cache[key] = run_optimizer(path, dst, int(cfg.num_attention_heads), int(cfg.hidden_size))
    return ir.load(cache[key][0])


def _optimizer_fuses(info: ModelInfo, ts_raw: Path, cache: dict) -> tuple[bool, str]:
    """Did ORT's optimizer fuse every layer's attention of the uncalibrated graph?  (ok, reason).

    The optimized graph is written only then: a partly fused graph is neither what ORT users run
    nor something the fused placements can rewrite.  The optimized graph is kept in `cache`."""

    n = count_fused_attention(_ort_optimize(ts_raw, info, cache))
    if n == info.num_layers:
        return True, f"ONNX Runtime's optimizer fused attention in all {n} layers"
    return False, (f"ONNX Runtime's transformer optimizer fused attention in {n} of {info.num_layers} layers of "
                   f"this {info.model_type} graph, so no {OPTIMIZED_GRAPH} is written")


def _optimized_graph(info: ModelInfo, ts_raw: Path, config: CalibrationConfig | None, placement: str | None,
                     num_layers: int, work: Path, cache: dict):
    """The ORT-optimized graph: optimize then place (row, split, attention: fusions kept), or place then
    optimize.  `cache` keeps ORT's optimized graphs on disk between calls (the native graph is the same
    optimized graph with another placement)."""

    if config is None:
        return _ort_optimize(ts_raw, info, cache), None
    module = placements.get(placement)
    if module.optimize_first:
        model = _ort_optimize(ts_raw, info, cache)
        fused_before = sum(1 for n in model.graph if n.domain == "com.microsoft" and n.op_type == "Attention")
        result = module.place(model, config, num_layers)
        if result.fused_attention < fused_before:
            raise ExportError(f"{placement} placement lost fused attention ({fused_before} -> {result.fused_attention})")
        return model, result
    model = ir.load(ts_raw)
    result = module.place(model, config, num_layers)
    placed = stage_onnx(model, work / f"placed-{placement}" / "model.onnx")
    del model
    return _ort_optimize(placed, info, cache), result


def _fusion_note(model, messages: list[str]) -> str | None:
    """In attncal's words, what a skipped optional fusion of ONNX Runtime's optimizer means (or None).

    ORT's optimizer prints "failed in shape inference" when its symbolic shape inference cannot
    handle a graph; it then leaves Add + LayerNormalization unfused.  attncal's own pooling head is
    written so that it can (attncal.exporting.wrapper: a ReduceL2/ReduceMin/ReduceMax output it cannot
    shape made the next Expand/Unsqueeze raise a TypeError in onnxruntime 1.32), so this is a safety
    net for graphs where it still fails; silent when the fusion happened.  The export is still
    correct either way: the parity check measures it."""
    ops = [n.op_type for n in model.graph]
    if "SkipLayerNormalization" in ops or ops.count("LayerNormalization") < 2:
        return None
    shape_inference = any("shape inference" in text for text in messages)
    why = ("ONNX Runtime's shape inference does not handle this graph" if shape_inference
           else "ONNX Runtime's optimizer did not match it")
    return (f"{ONNX_SUBDIR}/{OPTIMIZED_FILE} keeps Add + LayerNormalization unfused ({why}); "
            "results are unaffected, only that fusion's speed-up is missing")


def _to_fp16(run: Run, model, placement: str | None):
    """(the optimized graph converted to float16 with its calibration kept float32, the nodes kept float32)."""

    prefix = placements.get(placement).float32_nodes if placement else None
    run.progress(GRAPHS, "converting the ORT-optimized graph to fp16 (ONNX Runtime's converter"
                 + (f"; {prefix}* calibration nodes stay fp32)" if prefix else ")"))
    return convert_model_to_fp16(model, prefix)


def optimize(run: Run) -> Path | None:
    """ONNX Runtime's transformer optimizer on an fp32 TorchScript export, where it can fuse every layer's
    attention: returns the TorchScript export it fused (its optimized copy cached beside it), or None, with
    the reason in `run.optimizer_note`."""
    plan, info = run.plan, run.plan.info
    if not plan.opts.optimized:
        return None
    blockers = _fusion_blockers(run.features)
    if blockers:
        run.optimizer_note = (f"ONNX Runtime's transformer optimizer fuses BERT-shaped attention only; this "
                              f"{info.model_type} attention has {blockers}, so it was not tried and no "
                              f"{OPTIMIZED_GRAPH} is written")
        run.progress(GRAPHS, run.optimizer_note)
        return _refuse_unfused(run)
    run.meter.step("ORT-optimized graph")
    run.progress(GRAPHS, "ORT-optimized graph (onnxruntime.transformers.optimizer)"
                 + (f" with {plan.placement.optimized} placement" if plan.placement else ""))
    ts_raw, run.ts_root = run.raw_path, run.raw_path.parent
    run.cache = {}
    step = "ONNX Runtime's transformer optimizer"
    fuses = False
    try:
        if plan.opts.exporter != "torchscript" or plan.opts.fp16:  # the optimizer works on fp32 (fp16 comes after)
            run.ts_root = run.tmp / ".raw-ts"
            ts_raw = run.ts_root / ONNX_FILE
            step = "the TorchScript export ONNX Runtime's optimizer needs"
            from_torch.torch_export(info, plan.pooling, ts_raw, plan.opts.opset, "torchscript")
            release_freed_memory(plan.estimate.weights)
            ts_raw = weights_on_disk(ts_raw)
            step = "ONNX Runtime's transformer optimizer"
        fuses, run.optimizer_note = _optimizer_fuses(info, ts_raw, run.cache)
    except Exception as exc:  # noqa: BLE001 - the optimized graph is optional; say why it is missing
        run.optimizer_note = (f"{step} failed on this {info.model_type} model ({type(exc).__name__}: "
                              f"{first_line(exc)[:200]}), so no {OPTIMIZED_GRAPH} is written")
    if fuses:
        return ts_raw
    run.progress(GRAPHS, run.optimizer_note)
    run.cache.clear()
    shutil.rmtree(run.ts_root, ignore_errors=True)
    return _refuse_unfused(run)


def _refuse_unfused(run: Run) -> None:
    """An explicit placement that rewrites ONNX Runtime's fused attention cannot go on without it."""
    opts = run.plan.opts
    if opts.placement in ("attention", "projected-attention") and run.plan.config is not None:
        raise ExportError(f"--placement {opts.placement} rewrites ONNX Runtime's fused attention: "
                          + (run.optimizer_note or "this export writes no optimized graph") + "; use --placement auto")
    return None


def optimized_graph(run: Run, ts_raw: Path) -> None:
    """onnx/model_optimized.onnx: the placement on ONNX Runtime's optimized graph, converted to fp16 for an
    fp16 export, written once."""

    plan = run.plan
    placement = plan.placement.optimized if plan.placement else None
    opt_model, _ = _optimized_graph(plan.info, ts_raw, plan.config, placement, plan.info.num_layers,
                                    run.ts_root, run.cache)
    n_fused = count_fused_attention(opt_model)
    note = _fusion_note(opt_model, [messages for _, messages in run.cache.values()])
    if note:
        run.log(f"note: {note}")
    entry = run.graphs[OPTIMIZED_GRAPH] = {"placement": placement,
                                           "runtime": "ONNX Runtime (com.microsoft contrib ops)",
                                           "fused_attention": n_fused}
    if plan.opts.fp16:
        opt_model, entry["float32_nodes"] = _to_fp16(run, opt_model, placement)
    write_graph(opt_model, run.tmp / OPTIMIZED_GRAPH, run.ts_root / "stage", plan.estimate.weights,
                passes=staged(chunk_feed_forwards=False))


def native_graph(run: Run, ts_raw: Path) -> None:
    """onnx/model_optimized_native.onnx: the optimized graph with the calibrated attention op in every layer
    (strength 0 where the export does not calibrate), for the native library (fp16: converted), written
    once; then the optimizer's files go."""

    plan = run.plan
    placement = plan.placement.native if plan.placement is not None else NATIVE_BY_PRECISION[plan.precision]
    if placement:
        run.meter.step("native graph")
        run.progress(GRAPHS, f"ORT-optimized graph with {placement} placement in every layer, for the native "
                     f"library ({NATIVE_GRAPH})")
        native_model, _ = _optimized_graph(plan.info, ts_raw, plan.config or plan.off_config(),
                                           placement, plan.info.num_layers, run.ts_root, run.cache)
        entry = run.graphs[NATIVE_GRAPH] = {
            "placement": placement, "fused_attention": count_fused_attention(native_model),
            "runtime": "ONNX Runtime with the attncal native library (the runtime picks it when the library "
                       f"is loaded on the CPU, else {OPTIMIZED_GRAPH})"}
        if plan.opts.fp16:
            native_model, entry["float32_nodes"] = _to_fp16(run, native_model, placement)
        report = write_graph(native_model, run.tmp / NATIVE_GRAPH, run.ts_root / "stage", plan.estimate.weights,
                             passes=staged(_chunks_feed_forwards(plan)))
        _native_feed_forwards(run, entry, report)
        del native_model
    run.cache.clear()
    shutil.rmtree(run.ts_root, ignore_errors=True)


def _chunks_feed_forwards(plan: ExportPlan) -> bool:
    """Whether the native graph runs its feed-forward blocks over chunks of rows: float32 exports of a long
    context (`is_long_context`).  Short ones keep the plain blocks: their batches are small enough, and the
    chunking's fixed cost per block (the Scan and its shape arithmetic) is a measurable share of a short
    text's time.  int8 quantizes the graph's own MatMuls only (`attncal.exporting.quantize`), not those of a
    Scan's body; the float16 native graph is converted as it is."""
    return plan.precision == "fp32" and is_long_context(plan.max_seq_length)


def _native_feed_forwards(run: Run, entry: dict, report: dict) -> None:
    """Record the native graph's chunked feed-forward blocks (from `write_graph`'s report) in its attncal.json
    entry, and say so."""

    blocks = report.get(PASS.name, {}).get(PASS.name, 0)
    entry["feed_forward_chunks"] = {"blocks": blocks, "rows": CHUNK_ROWS}
    if blocks:
        run.progress(GRAPHS, f"native graph: {blocks} feed-forward blocks run over chunks of up to {CHUNK_ROWS} rows")


def native_plain_graph(run: Run) -> None:
    """onnx/model_optimized_native.onnx for a model without an ORT-optimized graph: torch's export with the
    calibrated attention op in every layer (`attncal.graphs.placements.plain_attention_placement`), calibrated or not,
    for the native library.  Where the rewrite does not apply, the log says why and the export goes on
    without it (the portable graph is complete)."""

    plan, info = run.plan, run.plan.info
    cfg = read_json(info.path / CONFIG_FILE, "model config")
    heads = config_int(info.path, "num_attention_heads")
    shape = pap.ModelShape(heads, int(cfg.get("num_key_value_heads") or heads),
                           plan.max_seq_length or int(cfg.get("max_position_embeddings") or 512),
                           declared_attention_window(cfg), cfg.get("relative_attention_max_distance"))
    run.meter.step("native graph")
    model = ir.load(run.raw_path)
    try:
        placed = pap.place(model, plan.config or plan.off_config(), plan.pooling, info.num_layers, shape)
    except pap.REFUSALS as exc:
        run.log(f"note: no {NATIVE_GRAPH}: the calibrated attention op does not replace this model's attention "
                f"({first_line(exc)})")
        return
    fused = passes.onnxruntime_fusions(run_passes(model, passes.NATIVE_PLAIN))
    native_fusions.describe_to_onnx_checker()
    run.progress(GRAPHS, f"native graph: the calibrated attention op in every layer ({NATIVE_GRAPH})")
    entry = run.graphs[NATIVE_GRAPH] = {
        "placement": ATTENTION, "fused_attention": placed.result.fused_attention, "any_padding": True,
        "onnxruntime_fusions": fused,
        "attention_geometry": [g.attrs() for g in placed.geometries],
        "runtime": "ONNX Runtime with the attncal native library (the runtime picks it when the library is loaded "
                   f"on the CPU, else {ONNX_SUBDIR}/{ONNX_FILE})"}
    report = write_graph(model, run.tmp / NATIVE_GRAPH, run.tmp / ".raw" / "stage-native", plan.estimate.weights,
                         passes=passes.staged(_chunks_feed_forwards(plan)))
    _native_feed_forwards(run, entry, report)
    del model
