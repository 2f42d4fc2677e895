"""torch -> ONNX export of a sentence-transformers / transformers encoder, with calibration.

The output directory is laid out like sentence-transformers and optimum expect:
the model's config, tokenizer and sentence-transformers module files,
`onnx/model.onnx` (with `onnx/model.onnx_data` when the model exceeds 2 GiB),
and `attncal.json` describing the calibration and the parity measured at export.

Everything is written into a temporary directory beside OUT and renamed into
place at the end, so a failure never leaves a half-written OUT behind.

Warnings and messages of the libraries the export runs through (torch.onnx,
transformers, ONNX Runtime's optimizer) are kept off the console and written to
`attncal-export.log` in OUT, inside the temporary directory before the rename
(attncal.library_output); attncal's own step lines stay on stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import library_output
from ..artifact import (  # noqa: F401  (the layout names are re-exported here for compatibility)
    EXTERNAL_DATA_FILE,
    ExportMetadata,
    FORMAT_VERSION,
    METADATA_FILE,
    NATIVE_GRAPH,
    ONNX_FILE,
    ONNX_SUBDIR,
    OPTIMIZED_FILE,
    OPTIMIZED_GRAPH,
    TWO_GIB,
    commit_dir,
    is_long_context,
    loader_files,
    save_onnx,
    save_structure,
    stage_onnx,
    stamp_onnx,
    write_graph_file,
    write_metadata,
)
from ..calibration.config import CalibrationConfig
from ..memory import RELEASE_FROM_BYTES, release_freed_memory
from ..modelinfo import ModelInfo
from .fp16 import METHOD as FP16_METHOD, convert_model_to_fp16
from .plan import DEFAULT_OPSET, EXPORTERS, PLACEMENTS, ExportOptions, ExportPlan  # noqa: F401  (public here)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".onnx", ".onnx_data", ".gguf")
_SKIP_DIRS = {"onnx", "openvino", ".git", "__pycache__"}
EXPORT_LOG_FILE = "attncal-export.log"  # third-party warnings and messages of the export (attncal.library_output)


class ExportError(RuntimeError):
    """The export itself failed (not a user input problem)."""


class ParityError(RuntimeError):
    """The exported model does not match the PyTorch reference."""


def _log(msg: str, quiet: bool) -> None:
    library_output.own_line(f"attncal: {msg}")  # context for the export log
    if not quiet:
        print(f"attncal: {msg}", file=sys.stderr, flush=True)


class StepMeter:
    """Wall time and peak resident memory (this process and its children: the optimizer's) of each export step,
    recorded in `attncal.json` under `export_steps`, so a user sees what an export of this size takes.

    `watch`, where given (the CLI's `attncal.export.watch.Watch`), is told each step and the working directory,
    so an export killed by the kernel is reported with its step and leaves nothing behind."""

    def __init__(self, watch=None) -> None:
        from ..memory import TreeSampler

        self.sampler = TreeSampler(interval=0.05)
        self.watch = watch
        self.rows: list[dict] = []
        self._start = time.perf_counter()
        self._name: str | None = None

    def step(self, name: str) -> None:
        self._close()
        self._name, self._start = name, time.perf_counter()
        self.sampler.mark(name)
        if self.watch is not None:
            self.watch.step(name)

    def _close(self) -> None:
        if self._name is not None:
            from ..memory import tree_rss

            peak = max(self.sampler.peaks.get(self._name, 0), tree_rss(self.sampler.pid))  # a step shorter than a sample
            self.rows.append({"step": self._name, "seconds": round(time.perf_counter() - self._start, 2),
                              "peak_rss_mib": round(peak / 1024**2, 1)})
            self._name = None

    def __enter__(self) -> "StepMeter":
        self.sampler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.sampler.__exit__(*exc)

    def report(self) -> list[dict]:
        self._close()
        return list(self.rows)


def copy_model_files(info: ModelInfo, dest: Path) -> None:
    """Config, tokenizer and sentence-transformers module files; never the encoder's weights.  Dense modules
    keep theirs (small): sentence-transformers runs them after the ONNX graph when it loads the export."""
    dense_dirs = {d.path.resolve() for d in info.dense}
    for src_root in dict.fromkeys([info.root, info.path]):
        for src in src_root.rglob("*"):
            rel = src.relative_to(src_root)
            if any(part in _SKIP_DIRS or part.startswith(".") for part in rel.parts):
                continue
            dense_file = src.parent.resolve() in dense_dirs
            if src.is_dir() or (src.name.endswith(_WEIGHT_SUFFIXES) and not dense_file) or src.name == METADATA_FILE:
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    modules = dest / "modules.json"
    if modules.exists() and info.path != info.root:
        # The Transformer module's files now sit at the root of the export.
        entries = json.loads(modules.read_text())
        for e in entries:
            if str(e.get("type", "")).endswith("Transformer"):
                e["path"] = ""
        modules.write_text(json.dumps(entries, indent=2))


def _set_max_length(dest: Path, max_length: int) -> None:
    st_cfg = dest / "sentence_bert_config.json"
    data = json.loads(st_cfg.read_text()) if st_cfg.exists() else {}
    data["max_seq_length"] = max_length
    st_cfg.write_text(json.dumps(data, indent=2))


def _example_inputs(tokenizer, use_token_types: bool):
    texts = ["a short example", "a somewhat longer example sentence for the exporter to trace"]
    batch = tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if use_token_types else [])
    return tuple(batch[n] for n in names), names


def load_for_export(info: ModelInfo, fp16: bool = False):
    """The model with eager attention (the graph's explicit Softmax), or ExportError naming the load step."""
    import torch

    from ..modelinfo import load_transformer

    dtype = torch.float16 if fp16 else torch.float32
    try:
        return load_transformer(info.path, attn_implementation="eager", dtype=dtype).eval()
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here; one line names the cause
        raise ExportError(f"loading the {info.model_type} model from {info.path} failed: {type(exc).__name__}: "
                          f"{_first_line(exc)[:300]}") from exc


def torch_export(
    info: ModelInfo, pooling: str | tuple, onnx_path: Path, opset: int, exporter: str, fp16: bool = False, model=None
) -> list[str]:
    """Export encoder + pooling to `onnx_path` (single file, external data when needed); returns input names.
    `pooling`: `ExportPlan.pooling_head`; `model`: the already loaded model (`load_for_export`), else it is
    loaded here."""
    import torch
    import inspect

    from transformers import AutoTokenizer

    from ..modelinfo import forward_kwargs, load_dense_head
    from .wrapper import SentenceEmbeddingModule

    tokenizer = AutoTokenizer.from_pretrained(str(info.path))
    tokenizer.padding_side = info.padding_side
    if model is None:
        model = load_for_export(info, fp16)
    # Token types are an input where the tokenizer emits them and the model reads them (BERT).
    use_token_types = ("token_type_ids" in tokenizer.model_input_names
                       and "token_type_ids" in inspect.signature(model.forward).parameters)
    head = load_dense_head(info, torch.float16 if fp16 else torch.float32)
    wrapper = SentenceEmbeddingModule(model, pooling, info.normalize, extra=forward_kwargs(model), head=head).eval()
    args, names = _example_inputs(tokenizer, use_token_types)
    outputs = ["last_hidden_state", "sentence_embedding"]
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        if exporter == "dynamo":
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
            torch.onnx.export(
                wrapper, args, str(onnx_path), dynamo=True, opset_version=opset,
                input_names=names, output_names=outputs,
                dynamic_shapes={n: {0: batch, 1: seq} for n in names},
                external_data=True, optimize=True,
            )
        elif exporter == "torchscript":
            axes = {n: {0: "batch", 1: "sequence"} for n in names}
            axes["last_hidden_state"] = {0: "batch", 1: "sequence"}
            axes["sentence_embedding"] = {0: "batch"}
            torch.onnx.export(
                wrapper, args, str(onnx_path), dynamo=False, opset_version=opset,
                input_names=names, output_names=outputs, dynamic_axes=axes, do_constant_folding=True,
            )
        else:
            raise ValueError(f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    return names


def release_onnxscript_matchers() -> int:
    """Drop the graph that onnxscript's pattern matchers keep after torch.onnx's dynamo exporter optimized it.

    The rewrite rules are module-level objects, and each `SimplePatternMatcher` keeps the last graph, node and
    match it saw; that graph's initializers wrap the torch model's parameters, so without this the model's
    weights stay in memory (memory-mapped from its safetensors) for the rest of the export.  Returns how many
    matchers held a graph."""
    import gc

    try:
        from onnxscript.rewriter import _basics, _matcher
    except ImportError:  # another onnxscript layout: nothing of ours to release
        return 0
    held = 0
    for obj in gc.get_objects():
        if isinstance(obj, _matcher.SimplePatternMatcher) and getattr(obj, "_graph", None) is not None:
            obj._graph = obj._current_node = obj._tracer = None
            obj._match = _basics.MatchResult()
            held += 1
    return held


def _weights_on_disk(path: Path) -> Path:
    """The raw export at `path` with its weights in a data file beside it (TorchScript writes them inline
    below 2 GiB): every later pass loads it lazily (memory-mapped) instead of parsing the weights."""
    import onnx
    import onnx_ir as ir

    if any(t.data_location == onnx.TensorProto.EXTERNAL
           for t in onnx.load(str(path), load_external_data=False).graph.initializer):
        return path  # already (the dynamo exporter's external_data=True)
    model = ir.load(path)
    staged = stage_onnx(model, path.parent / "weights-on-disk" / path.name)
    del model
    path.unlink()
    return staged


def _write_graph(model, path: Path, work: Path, weight_bytes: int, *, full_check: bool = False,
                 chunk_feed_forwards: bool = False) -> int:
    """Write a graph of the export once: staged with its weights on disk, annotated for in-place (the
    calibration op's input shapes), its feed-forward blocks run over chunks of rows where asked
    (`attncal.graphs.feed_forward_chunks`), checked, then streamed into `path` with its digest
    (`write_graph_file`); returns how many feed-forward blocks were chunked.

    Every pass here reads the staged graph's structure only (`load_external_data=False`), so no step holds a
    second copy of the weights.  The optimized graphs carry contrib ops: checked without full shape inference."""
    import onnx

    from ..graphs import feed_forward_chunks
    from ..graphs.inplace_shapes import annotate_inplace_shapes

    staged = stage_onnx(model, work / path.name)
    proto = onnx.load(str(staged), load_external_data=False)
    changed = annotate_inplace_shapes(proto)
    chunked = feed_forward_chunks.chunk_feed_forwards(proto) if chunk_feed_forwards else 0
    if changed or chunked:
        save_structure(proto, staged)
    onnx.checker.check_model(str(staged), full_check=full_check)  # a path: external files found beside it
    # A chunked graph keeps its weights in a data file: ONNX Runtime holds a self-contained graph's weights
    # that a Scan body reads from the outer graph a second time, beside the MatMuls' packed copies.
    write_graph_file(proto, staged.parent, path, external=True if chunked else None)
    for f in (staged, staged.with_name(staged.name + "_data")):
        f.unlink(missing_ok=True)
    del model, proto
    release_freed_memory(weight_bytes)
    return chunked


def _to_fp16(model, placement: str | None, quiet: bool):
    """(the optimized graph converted to float16 with its calibration kept float32, the nodes kept float32)."""
    from ..graphs import placements

    prefix = placements.get(placement).float32_nodes if placement else None
    _log("[2/4] converting the ORT-optimized graph to fp16 (ONNX Runtime's converter"
         + (f"; {prefix}* calibration nodes stay fp32)" if prefix else ")"), quiet)
    with library_output.third_party_output():
        return convert_model_to_fp16(model, prefix)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _ort_optimize(path: Path, info: ModelInfo, cache: dict):
    """ONNX Runtime's transformer optimizer (attention and layer-norm fusions; its BERT fusions match any
    encoder whose attention has the BERT shape, from a TorchScript export), lazily loaded: its weights stay
    in the staged data file (`attncal.export.ort_optimize` runs the optimizer in a child process).  `cache`
    maps a source graph to its optimized copy, so the optimized and native graphs share one run."""
    import onnx_ir as ir

    from .ort_optimize import run
    from transformers import AutoConfig

    key = str(path)
    if key not in cache:
        cfg = AutoConfig.from_pretrained(str(info.path))
        dst = path.parent / "optimized" / f"{path.stem}.onnx"
        cache[key] = run(path, dst, int(cfg.num_attention_heads), int(cfg.hidden_size))
    return ir.load(cache[key])


# Attention features (attncal.calibration.patching.attention_features) that ORT's BERT attention fusion
# (onnxruntime.transformers FusionAttention) does not match: its pattern is Q/K/V MatMul + Add, scale, mask Add,
# Softmax, ·V.  Skipping the attempt spares a TorchScript export and an optimizer run of the whole model
# (minutes for a multi-billion-parameter embedder) that cannot fuse; every other model is tried and counted.
_FUSION_BLOCKERS = {"rotary": "rotary position embeddings", "position_bias": "a relative position bias",
                    "grouped_kv": "grouped key/value heads"}


def _fusion_blockers(features: frozenset[str]) -> str:
    return " and ".join(_FUSION_BLOCKERS[f] for f in sorted(features) if f in _FUSION_BLOCKERS)


def _optimizer_fuses(info: ModelInfo, ts_raw: Path, cache: dict) -> tuple[bool, str]:
    """Did ORT's optimizer fuse every layer's attention of the uncalibrated graph?  (ok, reason).

    The optimized graph is written only then: a partly fused graph is neither what ORT users run
    nor something the fused placements can rewrite.  The optimized graph is kept in `cache`."""
    from ..graphs.placement_base import count_fused_attention

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
    import onnx_ir as ir

    from ..graphs import placements

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


def _fusion_note(model, captured: list[str]) -> str | None:
    """In attncal's words, what a skipped optional fusion of ONNX Runtime's optimizer means (or None).

    ORT's optimizer prints "failed in shape inference" when its symbolic shape inference cannot
    handle a graph; it then leaves Add + LayerNormalization unfused.  attncal's own pooling head is
    written so that it can (attncal.export.wrapper: a ReduceL2/ReduceMin/ReduceMax output it cannot
    shape made the next Expand/Unsqueeze raise a TypeError in onnxruntime 1.32), so this is a safety
    net for graphs where it still fails; silent when the fusion happened.  The export is still
    correct either way: the parity check measures it."""
    ops = [n.op_type for n in model.graph]
    if "SkipLayerNormalization" in ops or ops.count("LayerNormalization") < 2:
        return None
    shape_inference = any("shape inference" in ln for ln in captured)
    why = ("ONNX Runtime's shape inference does not handle this graph" if shape_inference
           else "ONNX Runtime's optimizer did not match it")
    return (f"{ONNX_SUBDIR}/{OPTIMIZED_FILE} keeps Add + LayerNormalization unfused ({why}); "
            "results are unaffected, only that fusion's speed-up is missing")


def library_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("attncal", "torch", "transformers", "onnx", "onnxruntime", "onnx-ir", "sentence-transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out




@dataclass
class _Run:
    """What an export's steps pass on: the plan, the working directory, and what each step produced."""

    plan: ExportPlan
    tmp: Path
    quiet: bool
    meter: StepMeter
    capture: library_output.Capture
    features: frozenset[str] = frozenset()  # what the attention holds (attncal.calibration.patching)
    input_names: list[str] = field(default_factory=list)
    raw_path: Path | None = None  # torch's export, weights on disk
    result: object | None = None  # the portable graph's PlacementResult
    graphs: dict = field(default_factory=dict)  # graph file -> its attncal.json entry
    optimizer_note: str | None = None
    quantization: dict | None = None

    def log(self, msg: str) -> None:
        _log(msg, self.quiet)


def export(
    model: str | os.PathLike,
    out: str | os.PathLike,
    options: ExportOptions | None = None,
    *,
    quiet: bool = False,
    check_fn: Callable | None = None,
    watch=None,
) -> dict:
    """Export `model` to `out`; returns the `attncal.json` contents.  `watch`: see `StepMeter`.

    The plan is validated first (`ExportPlan.make`: every refusal), then the steps run in a working directory
    beside `out` that is renamed into place at the end, or removed on any failure."""
    plan = ExportPlan.make(model, out, options or ExportOptions())
    _note_estimate(plan, watch)
    tmp = Path(tempfile.mkdtemp(prefix=f".{plan.out.name}.tmp-", dir=plan.out.parent))
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:  # third-party chatter -> EXPORT_LOG_FILE (and --verbose), not the console
        capture = stack.enter_context(library_output.capture_third_party())
        run = _Run(plan, tmp, quiet, stack.enter_context(StepMeter(watch)), capture)
        if watch is not None:
            watch.workdir(tmp)
        try:
            torch_model = _load(run)
            _torch_export(run, torch_model)
            del torch_model
            _portable_graph(run)
            ts_raw = _optimize(run)
            if ts_raw is not None:
                _optimized_graph_step(run, ts_raw)
                _native_graph(run, ts_raw)
            elif plan.opts.optimized:
                _native_plain_graph(run)
            shutil.rmtree(tmp / ".raw", ignore_errors=True)
            _quantize(run)
            meta = _metadata(run)
            _parity(run, meta, check_fn)
            _commit(run, meta, t_start)
            return meta.to_dict()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _note_estimate(plan: ExportPlan, watch) -> None:
    if watch is not None:
        from ..memory import available_bytes

        avail = available_bytes()
        watch.note(f"the export was estimated at {plan.estimate.peak / 1024**3:.1f} GiB at its peak"
                   + (f", with {avail / 1024**3:.1f} GiB available at its start" if avail is not None else ""))


def _load(run: _Run):
    """The model files beside the graphs, and the torch model (loading is measured with the torch export: both
    hold the same weights).  Whether it can be calibrated in PyTorch (the parity reference) is probed here, before
    exporting; the probe also says what the attention holds, which decides whether ORT's optimizer is worth
    trying (`_fusion_blockers`)."""
    from ..calibration.patching import UnsupportedArchitectureError, find_attention

    plan, info = run.plan, run.plan.info
    copy_model_files(info, run.tmp)
    if plan.opts.max_length is not None:
        _set_max_length(run.tmp, plan.opts.max_length)
    run.meter.step("torch export")
    run.log(f"[1/4] exporting {info.model_type} ({info.architecture}, {info.num_layers} layers) with the "
            f"{plan.opts.exporter} exporter, opset {plan.opts.opset}")
    if not info.tested:
        run.log(f"note: {info.model_type} is not among attncal's tested architectures; the export goes ahead and "
                "is labelled untested, and the parity check guards it")
    with library_output.third_party_output():
        torch_model = load_for_export(info, plan.opts.fp16)
    try:
        with library_output.third_party_output():
            sites = find_attention(torch_model)
        run.features = sites.features
        sites.base.__dict__.pop("_attncal_sites", None)  # the probe's cache stays out of the traced module
        del sites
    except UnsupportedArchitectureError:
        if plan.config is not None:
            raise
    return torch_model


def _torch_export(run: _Run, torch_model) -> None:
    """torch.onnx's export of encoder + pooling, with its weights moved to a data file; the torch model is freed."""
    plan, info = run.plan, run.plan.info
    raw_path = run.tmp / ".raw" / ONNX_FILE
    try:
        with library_output.third_party_output():
            run.input_names = torch_export(info, plan.pooling_head, raw_path, plan.opts.opset, plan.opts.exporter,
                                           fp16=plan.opts.fp16, model=torch_model)
        del torch_model
        if plan.opts.exporter == "dynamo" and plan.estimate.weights >= RELEASE_FROM_BYTES:
            release_onnxscript_matchers()  # a scan of every Python object: worth it where the weights are large
        release_freed_memory(plan.estimate.weights)
    except Exception as exc:  # torch.onnx failures are long; report the cause in one line
        raise ExportError(f"torch.onnx ({plan.opts.exporter}) failed to export {info.model_type}: "
                          f"{type(exc).__name__}: {_first_line(exc)[:300]}") from exc
    run.raw_path = _weights_on_disk(raw_path)


def _portable_graph(run: _Run) -> None:
    """onnx/model.onnx: the placement on torch's export, ONNX Runtime's load-time fusions made easy (standard
    ONNX either way; values unchanged), written once."""
    import onnx_ir as ir

    from ..graphs import placements
    from ..graphs.load_time_fusions import prepare_for_load_time_fusions

    plan = run.plan
    ir_model = ir.load(run.raw_path)
    run.meter.step("portable graph")
    if plan.placement is not None:
        run.log(f"[2/4] portable graph: {plan.placement.portable} placement in layers {plan.layers}")
        run.result = placements.get(plan.placement.portable).place(ir_model, plan.config, plan.info.num_layers)
    else:
        run.log("[2/4] portable graph, uncalibrated")
    prepare_for_load_time_fusions(ir_model)
    _write_graph(ir_model, run.tmp / ONNX_SUBDIR / ONNX_FILE, run.tmp / ".raw" / "stage", run.plan.estimate.weights,
                 full_check=True)
    del ir_model
    result = run.result
    run.graphs[f"{ONNX_SUBDIR}/{ONNX_FILE}"] = {
        "placement": plan.placement.portable if plan.placement else None, "runtime": "any ONNX runtime (standard ONNX"
        + (", model-local function)" if result is not None and result.op_type else ")"),
        "fused_attention": result.fused_attention if result else 0}


def _optimize(run: _Run) -> Path | None:
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
        run.log(f"[2/4] {run.optimizer_note}")
        return _refuse_unfused(run)
    run.meter.step("ORT-optimized graph")
    run.log("[2/4] ORT-optimized graph (onnxruntime.transformers.optimizer)"
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
            with library_output.third_party_output():
                torch_export(info, plan.pooling_head, ts_raw, plan.opts.opset, "torchscript")
            release_freed_memory(plan.estimate.weights)
            ts_raw = _weights_on_disk(ts_raw)
            step = "ONNX Runtime's transformer optimizer"
        with library_output.third_party_output():
            fuses, run.optimizer_note = _optimizer_fuses(info, ts_raw, run.cache)
    except Exception as exc:  # noqa: BLE001 - the optimized graph is optional; say why it is missing
        run.optimizer_note = (f"{step} failed on this {info.model_type} model ({type(exc).__name__}: "
                              f"{_first_line(exc)[:200]}), so no {OPTIMIZED_GRAPH} is written")
    if fuses:
        return ts_raw
    run.log(f"[2/4] {run.optimizer_note}")
    run.cache.clear()
    shutil.rmtree(run.ts_root, ignore_errors=True)
    return _refuse_unfused(run)


def _refuse_unfused(run: _Run) -> None:
    """An explicit placement that rewrites ONNX Runtime's fused attention cannot go on without it."""
    opts = run.plan.opts
    if opts.placement in ("attention", "projected-attention") and run.plan.config is not None:
        raise ExportError(f"--placement {opts.placement} rewrites ONNX Runtime's fused attention: "
                          + (run.optimizer_note or "this export writes no optimized graph") + "; use --placement auto")
    return None


def _optimized_graph_step(run: _Run, ts_raw: Path) -> None:
    """onnx/model_optimized.onnx: the placement on ONNX Runtime's optimized graph, converted to fp16 for an
    fp16 export, written once."""
    from ..graphs.placement_base import count_fused_attention

    plan = run.plan
    placement = plan.placement.optimized if plan.placement else None
    with library_output.third_party_output():
        opt_model, _ = _optimized_graph(plan.info, ts_raw, plan.config, placement, plan.info.num_layers,
                                        run.ts_root, run.cache)
    n_fused = count_fused_attention(opt_model)
    note = _fusion_note(opt_model, run.capture.lines())
    if note:
        run.log(f"note: {note}")
    entry = run.graphs[OPTIMIZED_GRAPH] = {"placement": placement,
                                           "runtime": "ONNX Runtime (com.microsoft contrib ops)",
                                           "fused_attention": n_fused}
    if plan.opts.fp16:
        opt_model, entry["float32_nodes"] = _to_fp16(opt_model, placement, run.quiet)
    _write_graph(opt_model, run.tmp / OPTIMIZED_GRAPH, run.ts_root / "stage", run.plan.estimate.weights)


def _native_graph(run: _Run, ts_raw: Path) -> None:
    """onnx/model_optimized_native.onnx: the optimized graph with the calibrated attention op in every layer
    (strength 0 where the export does not calibrate), for the native library (fp16: converted), written
    once; then the optimizer's files go."""
    from ..graphs.placement_base import count_fused_attention
    from ..graphs.placements import NATIVE_BY_PRECISION

    plan = run.plan
    placement = plan.placement.native if plan.placement is not None else NATIVE_BY_PRECISION[plan.precision]
    if placement:
        run.meter.step("native graph")
        run.log(f"[2/4] ORT-optimized graph with {placement} placement in every layer, for the native library "
                f"({NATIVE_GRAPH})")
        with library_output.third_party_output():
            native_model, _ = _optimized_graph(plan.info, ts_raw, plan.config or plan.off_config(),
                                               placement, plan.info.num_layers, run.ts_root, run.cache)
        entry = run.graphs[NATIVE_GRAPH] = {
            "placement": placement, "fused_attention": count_fused_attention(native_model),
            "runtime": "ONNX Runtime with the attncal native library (the runtime picks it when the library "
                       f"is loaded on the CPU, else {OPTIMIZED_GRAPH})"}
        if plan.opts.fp16:
            native_model, entry["float32_nodes"] = _to_fp16(native_model, placement, run.quiet)
        _native_feed_forwards(run, entry, _write_graph(native_model, run.tmp / NATIVE_GRAPH, run.ts_root / "stage",
                                                       run.plan.estimate.weights,
                                                       chunk_feed_forwards=_chunks_feed_forwards(plan)))
        del native_model
    run.cache.clear()
    shutil.rmtree(run.ts_root, ignore_errors=True)


def _chunks_feed_forwards(plan: ExportPlan) -> bool:
    """Whether the native graph runs its feed-forward blocks over chunks of rows: float32 exports of a long
    context (`is_long_context`).  Short ones keep the plain blocks: their batches are small enough, and the
    chunking's fixed cost per block (the Scan and its shape arithmetic) is a measurable share of a short
    text's time.  int8 quantizes the graph's own MatMuls only (`attncal.export.quantize`), not those of a
    Scan's body; the float16 native graph is converted as it is."""
    return plan.precision == "fp32" and is_long_context(plan.max_seq_length)


def _native_feed_forwards(run: _Run, entry: dict, blocks: int) -> None:
    """Record the native graph's chunked feed-forward blocks in its attncal.json entry, and say so."""
    from ..graphs.feed_forward_chunks import CHUNK_ROWS

    entry["feed_forward_chunks"] = {"blocks": blocks, "rows": CHUNK_ROWS}
    if blocks:
        run.log(f"[2/4] native graph: {blocks} feed-forward blocks run over chunks of up to {CHUNK_ROWS} rows")


def _native_plain_graph(run: _Run) -> None:
    """onnx/model_optimized_native.onnx for a model without an ORT-optimized graph: torch's export with the
    calibrated attention op in every layer (`attncal.graphs.plain_attention_placement`), calibrated or not,
    for the native library.  Where the rewrite does not apply, the log says why and the export goes on
    without it (the portable graph is complete)."""
    import onnx_ir as ir

    from ..artifact import CONFIG_FILE, config_int, read_json
    from ..graphs import plain_attention_placement as pap
    from ..graphs.placement_names import ATTENTION
    from ..modelinfo import declared_attention_window

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
                f"({_first_line(exc)})")
        return
    from ..graphs import feed_forward_chunks, native_fusions
    from ..graphs.load_time_fusions import prepare_for_load_time_fusions

    fused = native_fusions.fuse_for_onnxruntime(model)  # reads the recorded shapes, which the next step drops
    feed_forward_chunks.last_axis_as_negative(model)  # so too
    prepare_for_load_time_fusions(model)  # as the portable graph, for the rest of the model
    native_fusions.describe_to_onnx_checker()
    run.log(f"[2/4] native graph: the calibrated attention op in every layer ({NATIVE_GRAPH})")
    entry = run.graphs[NATIVE_GRAPH] = {
        "placement": ATTENTION, "fused_attention": placed.result.fused_attention, "any_padding": True,
        "onnxruntime_fusions": fused.as_dict(),
        "attention_geometry": [g.attrs() for g in placed.geometries],
        "runtime": "ONNX Runtime with the attncal native library (the runtime picks it when the library is loaded "
                   f"on the CPU, else {ONNX_SUBDIR}/{ONNX_FILE})"}
    _native_feed_forwards(run, entry, _write_graph(model, run.tmp / NATIVE_GRAPH, run.tmp / ".raw" / "stage-native",
                                                   run.plan.estimate.weights,
                                                   chunk_feed_forwards=_chunks_feed_forwards(plan)))
    del model


def _quantize(run: _Run) -> None:
    """int8 exports: every graph quantized (attncal.export.quantize) in its target's weight format, its digest
    stamped."""
    opts = run.plan.opts
    if opts.quantize is None:
        return
    from .quantize import TARGET_WEIGHTS, method, quantization_record, quantize_graph, resolve_target

    target = resolve_target(opts.int8_target)
    weights = TARGET_WEIGHTS[target]
    run.meter.step("int8 quantization")
    run.log(f"[2/4] quantizing every graph to {opts.quantize} for {target} CPUs ({weights} weights per channel, "
            "streamed dynamic quantization; attention core and calibration stay fp32)")
    for graph_file, entry in run.graphs.items():
        with library_output.third_party_output():
            entry["quantized_nodes"] = quantize_graph(run.tmp / graph_file, weights=weights)
    run.quantization = {"precision": opts.quantize, "method": method(weights), "target": target,
                        **quantization_record(weights=weights)}
    for graph_file in run.graphs:  # the quantized graph's digest (the others carry theirs)
        stamp_onnx(run.tmp / graph_file)


def _tokenizer_runtime(run: _Run, max_length: int | None) -> str:
    """"tokenizers" where the export's tokenizer.json alone gives what transformers gives (the runtime then
    tokenizes without importing transformers), else "transformers", with the reason in the log."""
    from ..modelinfo import read_prompts
    from ..runtime.tokenizer import FAST, TRANSFORMERS, verify_fast_tokenizer

    prompts = (read_prompts(run.tmp)[0] or {}).values()
    why = verify_fast_tokenizer(run.tmp, max_length, run.plan.info.padding_side, list(prompts), run.plan.pooling_spec)
    if why is None:
        return FAST
    run.log(f"note: the runtime tokenizes with transformers: {why}")
    return TRANSFORMERS


def _metadata(run: _Run) -> ExportMetadata:
    """attncal.json as the graphs left it (parity and the steps' figures are added when known)."""
    plan, info, result = run.plan, run.plan.info, run.result
    est = plan.estimate
    max_length = plan.max_seq_length
    tokenizer = _tokenizer_runtime(run, max_length)
    meta = ExportMetadata(
        calibrated=plan.config is not None,
        config=plan.config.to_dict() if plan.config is not None else None,
        calibrated_layers=plan.layers,
        op_type=result.op_type if result else None,
        op_attributes=result.attrs if result else None,
        source_model=str(info.root),
        model_type=info.model_type,
        architecture=info.architecture,
        tested=info.tested,
        num_layers=info.num_layers,
        pooling=plan.pooling,
        normalize=info.normalize,
        max_seq_length=max_length,
        padding_side=info.padding_side,
        inputs=run.input_names,
        outputs=["last_hidden_state", "sentence_embedding"],
        opset=plan.opts.opset,
        exporter=plan.opts.exporter,
        placement=plan.opts.placement if plan.config is not None else None,
        placement_reason=plan.placement.reason if plan.placement else None,
        optimizer=run.optimizer_note,
        graphs=run.graphs,
        fp16=plan.opts.fp16,
        fp16_method=FP16_METHOD if plan.opts.fp16 and OPTIMIZED_GRAPH in run.graphs else None,
        quantization=run.quantization,
        files=loader_files(run.tmp),
        versions=library_versions(),
        parity=None,
        memory_estimate={"float32_weights_mib": round(est.weights / 1024**2, 1),
                         "steps_mib": {k: round(v / 1024**2, 1) for k, v in est.steps.items()}},
        tokenizer=tokenizer,
        pooling_spec=plan.pooling_spec.to_dict() if plan.pooling_spec is not None else None,
    )
    write_metadata(run.tmp, meta)
    return meta


def _parity(run: _Run, meta: ExportMetadata, check_fn: Callable | None) -> None:
    """Every graph against the PyTorch reference (computed once for all of them); a failure stops the export."""
    if not run.plan.opts.check:
        run.log("[3/4] parity check skipped (--skip-check)")
        return
    from ..runtime.parity import check_parity

    run.meter.step("parity check")
    run.log("[3/4] checking parity against the PyTorch reference")
    release_freed_memory(run.plan.estimate.weights)
    references: dict = {}
    for graph_file in run.graphs:
        report = (check_fn(run.tmp, quiet=run.quiet, graph=graph_file) if check_fn is not None
                  else check_parity(run.tmp, quiet=run.quiet, graph=graph_file, reference_cache=references))
        figures = report.to_dict()
        if run.quantization is not None:  # int8 figures hold on the CPU classes whose kernels compute these integers
            figures["cpu"] = {key: run.quantization[key] for key in ("cpu_class", "covers", "why")}
        run.graphs[graph_file]["parity"] = figures
        if graph_file.endswith(ONNX_FILE):
            meta.parity = figures
        write_metadata(run.tmp, meta)
        if not report.ok:
            raise ParityError(f"parity check of {graph_file} failed: {report.summary()}")


def _commit(run: _Run, meta: ExportMetadata, t_start: float) -> None:
    """The steps' figures and the export log go into the export, which is then renamed into place."""
    run.meter.step("write")
    meta.export_steps = run.meter.report()
    write_metadata(run.tmp, meta)
    run.capture.write_log(run.tmp / EXPORT_LOG_FILE)  # inside the export before the rename: part of it
    commit_dir(run.tmp, run.plan.out)
    run.log(f"[4/4] wrote {run.plan.out} in {time.perf_counter() - t_start:.1f} s")
