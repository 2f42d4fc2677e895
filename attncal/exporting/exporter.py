"""torch -> ONNX export of a sentence-transformers / transformers encoder, with calibration.

The output directory is laid out like sentence-transformers and optimum expect:
the model's config, tokenizer and sentence-transformers module files,
`onnx/model.onnx` (with `onnx/model.onnx_data` when the model exceeds 2 GiB),
and `attncal.json` describing the calibration and the parity measured at export.

Everything is written into a temporary directory beside OUT and renamed into
place at the end, so a failure never leaves a half-written OUT behind.

Under `attncal export` the warnings and messages of the libraries the export runs
through (torch.onnx, transformers, ONNX Runtime's optimizer) are kept off the console
(attncal.console) and written to `attncal-export.log` in OUT, inside the temporary
directory before the rename; attncal's own step lines stay on stderr.  Called as a
library, the export leaves its process's output as it is and writes no log.

`export` is the pipeline; each step lives where its name says: the torch export and its model loading in
`attncal.exporting.from_torch`, the ONNX Runtime graphs in `attncal.exporting.optimized_graphs` (beside the
optimizer's child process, `attncal.exporting.ort_optimize`), graph staging in `attncal.artifact` (`write_graph`),
the graph passes in `attncal.graphs.fusions.passes`, the tokenizer attestation in `attncal.runtime.tokenizer`, the step
meter in `attncal.memory`, and the run state in `attncal.exporting.run`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import onnx_ir as ir

from .. import console
from ..artifact import (EXPORT_LOG_FILE, INLINED_GRAPH, NATIVE_GRAPH, ONNX_FILE, ONNX_SUBDIR, OPTIMIZED_GRAPH,
                        ExportMetadata, commit_dir, loader_files, stamp_onnx, write_graph, write_metadata,
                        write_text_atomic)
from ..graphs.fusions import passes
from ..graphs import placements
from ..graphs.pass_base import run_passes
from ..memory import StepMeter, available_bytes, release_freed_memory
from ..runtime import oplib
from ..runtime.chunking import CHUNK_SPANS, CHUNK_VECTORS
from ..runtime.parity import check_parity
from ..runtime.tokenizer import attest_tokenizer, load_tokenizer
from ..versions import library_versions as _installed_versions
from . import from_torch, optimized_graphs
from .chunk_vectors import add_chunk_vectors, record as chunk_vectors_record
from .inline import INLINED_RUNTIME, function_calls, inline_functions
from .errors import ExportError, ParityError  # noqa: F401  (public here)
from .fp16 import METHOD as FP16_METHOD
from .plan import (DEFAULT_OPSET, EXPORTERS, GRAPHS, PARITY, PLACEMENTS, WRITE, ExportOptions, ExportPlan)  # noqa: F401  (DEFAULT_OPSET, EXPORTERS, PLACEMENTS, ExportOptions: public here)
from .quantize import (TARGET_WEIGHTS, method, quantization_record, quantize_graph, resolve_target, sensitivity,
                       sensitivity_feeds, target_reduce_range, weight_nodes_of)
from .run import Run

# The libraries whose versions attncal.json records: those the written graphs depend on.
_VERSIONED = ("attncal", "torch", "transformers", "onnx", "onnxruntime", "onnx-ir", "sentence-transformers")


def library_versions() -> dict[str, str]:
    """Python's and the installed `_VERSIONED` libraries' versions, as attncal.json records them."""
    return _installed_versions(_VERSIONED, python=True, omit_missing=True)


def export(
    model: str | os.PathLike,
    out: str | os.PathLike,
    options: ExportOptions | None = None,
    *,
    quiet: bool = False,
    check_fn: Callable | None = None,
    watch=None,
) -> dict:
    """Export `model` to `out`; returns the `attncal.json` contents.  `watch`: see `attncal.memory.StepMeter`.

    The plan is validated first (`ExportPlan.make`: every refusal), then the steps run in a working directory
    beside `out` that is renamed into place at the end, or removed on any failure."""
    plan = ExportPlan.make(model, out, options or ExportOptions())
    _note_estimate(plan, watch)
    tmp = Path(tempfile.mkdtemp(prefix=f".{plan.out.name}.tmp-", dir=plan.out.parent))
    t_start = time.perf_counter()
    capture = console.active()
    with StepMeter(watch) as meter:
        run = Run(plan, tmp, quiet, meter, len(capture.lines()) if capture is not None else 0)
        if watch is not None:
            watch.workdir(tmp)
        try:
            torch_model = from_torch.load(run)
            from_torch.export_torch(run, torch_model)
            del torch_model
            _portable_graph(run)
            ts_raw = optimized_graphs.optimize(run)
            if ts_raw is not None:
                optimized_graphs.optimized_graph(run, ts_raw)
                optimized_graphs.native_graph(run, ts_raw)
            elif plan.opts.optimized:
                optimized_graphs.native_plain_graph(run)
            shutil.rmtree(tmp / ".raw", ignore_errors=True)
            _quantize(run)
            _chunk_vectors(run)
            meta = _metadata(run)
            _parity(run, meta, check_fn)
            _commit(run, meta, t_start)
            return meta.to_dict()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _note_estimate(plan: ExportPlan, watch) -> None:
    if watch is not None:
        avail = available_bytes()
        watch.note(f"the export was estimated at {plan.estimate.peak / 1024**3:.1f} GiB at its peak"
                   + (f", with {avail / 1024**3:.1f} GiB available at its start" if avail is not None else ""))


def _portable_graph(run: Run) -> None:
    """onnx/model.onnx: the placement on torch's export, ONNX Runtime's load-time fusions made easy (standard
    ONNX either way; values unchanged), written once."""
    plan = run.plan
    ir_model = ir.load(run.raw_path)
    run.meter.step("portable graph")
    if plan.placement is not None:
        run.progress(GRAPHS, f"portable graph: {plan.placement.portable} placement in layers {plan.layers}")
        run.result = placements.get(plan.placement.portable).place(ir_model, plan.config, plan.info.num_layers)
    else:
        run.progress(GRAPHS, "portable graph, uncalibrated")
    run_passes(ir_model, passes.PORTABLE)
    write_graph(ir_model, run.tmp / ONNX_SUBDIR / ONNX_FILE, run.tmp / ".raw" / "stage", plan.estimate.weights,
                full_check=True, passes=passes.staged(chunk_feed_forwards=False))
    result = run.result
    functions = result is not None and bool(result.op_type)
    run.graphs[f"{ONNX_SUBDIR}/{ONNX_FILE}"] = {
        "placement": plan.placement.portable if plan.placement else None,
        "runtime": "ONNX Runtime (standard ONNX with model-local functions: a runtime that does not read ONNX "
                   f"functions takes {INLINED_GRAPH})" if functions else INLINED_RUNTIME,
        "fused_attention": result.fused_attention if result else 0}
    if plan.opts.inlined:
        _inlined_graph(run, ir_model)
    del ir_model


def _inlined_graph(run: Run, ir_model) -> None:
    """onnx/model_inlined.onnx: the portable graph (`ir_model`, which the portable graph's write left as it was)
    with its functions inlined (attncal.exporting.inline), where it has any; else the portable graph is standard
    ONNX already and the log says so."""
    plan = run.plan
    if not function_calls(ir_model):
        run.log(f"note: no {INLINED_GRAPH}: {ONNX_SUBDIR}/{ONNX_FILE} calls no ONNX function (standard ONNX already)")
        return
    run.meter.step("inlined graph")
    calls = inline_functions(ir_model)
    run.progress(GRAPHS, f"inlined graph: {calls} function calls inlined into standard ONNX ({INLINED_GRAPH})")
    write_graph(ir_model, run.tmp / INLINED_GRAPH, run.tmp / ".raw" / "stage-inlined", plan.estimate.weights,
                full_check=True, passes=passes.staged(chunk_feed_forwards=False))
    run.graphs[INLINED_GRAPH] = {"placement": plan.placement.portable, "inlined": calls, "runtime": INLINED_RUNTIME,
                                 "fused_attention": run.result.fused_attention}


def _quantize(run: Run) -> None:
    """int8 exports: every graph quantized (attncal.exporting.quantize) in its target's weight format, its digest
    stamped."""
    opts = run.plan.opts
    if opts.quantize is None:
        return
    target = resolve_target(opts.int8_target)
    weights, reduce_range = TARGET_WEIGHTS[target], target_reduce_range(target)
    run.meter.step("int8 quantization")
    run.progress(GRAPHS, f"quantizing every graph to {opts.quantize} for {target} CPUs ({weights} weights per "
                 f"channel{', 7-bit' if reduce_range else ''}, streamed dynamic quantization; attention core and "
                 "calibration stay fp32)")
    chosen: list[str] = []
    if reduce_range:
        # 7-bit weights: the MatMuls that move the embeddings most stay fp32, measured once, on the graph the
        # Encoder runs on a CPU (native, else ORT-optimized, else portable); the other graphs keep the same
        # nodes where they have them (the weight MatMuls carry torch's names in every graph).
        plan = run.plan
        measured = next(g for g in (NATIVE_GRAPH, OPTIMIZED_GRAPH, *run.graphs) if g in run.graphs)
        feeds = sensitivity_feeds(load_tokenizer(run.tmp, None, plan.max_seq_length, plan.info.padding_side,
                                                 plan.pooling))
        record = sensitivity(run.tmp / measured, feeds, weights, reduce_range,
                             library=oplib.resolve_library(None, notice=False))
        chosen = record["fp32_nodes"]
        run.graphs[measured]["int8_sensitivity"] = record
        run.log(f"{measured}: {len(chosen)} of {record['candidates']} weight MatMuls kept in fp32 (cosine p1 "
                f"{record['chosen']['p1_cosine']:.4f} on {record['texts']} prose passages, "
                f"{record['all_int8']['p1_cosine']:.4f} with every one quantized)")
    for graph_file, entry in run.graphs.items():
        keep = [n for n in chosen if n in weight_nodes_of(run.tmp / graph_file)] if chosen else []
        if reduce_range and "int8_sensitivity" not in entry:
            entry["int8_sensitivity"] = {"measured_on": measured, "fp32_nodes": keep}
        entry["quantized_nodes"] = quantize_graph(run.tmp / graph_file, weights=weights, reduce_range=reduce_range,
                                                  keep_fp32=keep)
    run.quantization = {"precision": opts.quantize, "method": method(weights, reduce_range), "target": target,
                        **quantization_record(weights=weights, reduce_range=reduce_range)}
    for graph_file in run.graphs:  # the quantized graph's digest (the others carry theirs)
        stamp_onnx(run.tmp / graph_file)


def _chunk_vectors(run: Run) -> None:
    """--chunk-vectors: every graph gets the chunk-span input and the chunk-vector output
    (attncal.exporting.chunk_vectors), after quantization, which would leave them as they are."""
    if not run.plan.opts.chunk_vectors:
        return
    run.meter.step("chunk vectors")
    run.progress(GRAPHS, f"chunk vectors: input {CHUNK_SPANS}, output {CHUNK_VECTORS} in every graph")
    for graph_file in run.graphs:
        add_chunk_vectors(run.tmp / graph_file, run.plan.info.normalize)


def _metadata(run: Run) -> ExportMetadata:
    """attncal.json as the graphs left it (parity and the steps' figures are added when known)."""
    plan, info, result = run.plan, run.plan.info, run.result
    est = plan.estimate
    max_length = plan.max_seq_length
    tokenizer = attest_tokenizer(run.tmp, max_length, info.padding_side, plan.pooling, run.log)
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
        pooling=plan.pooling.to_json(),
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
        chunk_vectors=chunk_vectors_record(info.normalize) if plan.opts.chunk_vectors else None,
    )
    write_metadata(run.tmp, meta)
    return meta


def _parity(run: Run, meta: ExportMetadata, check_fn: Callable | None) -> None:
    """Every graph against the PyTorch reference (computed once for all of them); a failure stops the export."""
    if not run.plan.opts.check:
        run.progress(PARITY, "parity check skipped (--skip-check)")
        return
    run.meter.step("parity check")
    run.progress(PARITY, "checking parity against the PyTorch reference")
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


def _commit(run: Run, meta: ExportMetadata, t_start: float) -> None:
    """The steps' figures and the export log go into the export, which is then renamed into place."""
    run.meter.step("write")
    meta.export_steps = run.meter.report()
    write_metadata(run.tmp, meta)
    capture = console.active()
    if capture is not None:  # inside the export before the rename: part of it
        write_text_atomic(run.tmp / EXPORT_LOG_FILE, capture.log_text(run.log_start))
    commit_dir(run.tmp, run.plan.out)
    run.progress(WRITE, f"wrote {run.plan.out} in {time.perf_counter() - t_start:.1f} s")
