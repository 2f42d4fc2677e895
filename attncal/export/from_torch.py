"""The export's first step: the model files copied beside the graphs, the torch model loaded, and torch.onnx's
export of encoder + pooling with its weights moved to a data file.

Later steps call `torch_export` through this module (`from_torch.torch_export`), so a test that replaces it
replaces every export the run makes (the TorchScript one ONNX Runtime's optimizer takes too)."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

from ..artifact import METADATA_FILE, ONNX_FILE, weights_on_disk
from ..memory import RELEASE_FROM_BYTES, release_freed_memory
from ..messages import first_line
from ..modelinfo import ModelInfo, forward_kwargs, load_dense_head, load_transformer
from .errors import ExportError
from .plan import EXPORTERS, TORCH_EXPORT
from .run import Run

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".onnx", ".onnx_data", ".gguf")
_SKIP_DIRS = {"onnx", "openvino", ".git", "__pycache__"}


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
    import torch  # the export's own dependency: attncal's runtime installs run without it

    dtype = torch.float16 if fp16 else torch.float32
    try:
        return load_transformer(info.path, attn_implementation="eager", dtype=dtype).eval()
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here; one line names the cause
        raise ExportError(f"loading the {info.model_type} model from {info.path} failed: {type(exc).__name__}: "
                          f"{first_line(exc)[:300]}") from exc


def torch_export(
    info: ModelInfo, pooling: str | tuple, onnx_path: Path, opset: int, exporter: str, fp16: bool = False, model=None
) -> list[str]:
    """Export encoder + pooling to `onnx_path` (single file, external data when needed); returns input names.
    `pooling`: `ExportPlan.pooling_head`; `model`: the already loaded model (`load_for_export`), else it is
    loaded here."""
    import torch  # the export's own dependencies (torch, transformers): lazy, as above
    from transformers import AutoTokenizer

    from .wrapper import SentenceEmbeddingModule  # lazy: a torch module; importing the exporter loads no torch

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


def load(run: Run):
    """The model files beside the graphs, and the torch model (loading is measured with the torch export: both
    hold the same weights).  Whether it can be calibrated in PyTorch (the parity reference) is probed here, before
    exporting; the probe also says what the attention holds, which decides whether ORT's optimizer is worth
    trying (`attncal.export.optimized_graphs`)."""
    from ..calibration.patching import UnsupportedArchitectureError, find_attention  # lazy: imports torch

    plan, info = run.plan, run.plan.info
    copy_model_files(info, run.tmp)
    if plan.opts.max_length is not None:
        _set_max_length(run.tmp, plan.opts.max_length)
    run.meter.step("torch export")
    run.progress(TORCH_EXPORT, f"exporting {info.model_type} ({info.architecture}, {info.num_layers} layers) with "
                 f"the {plan.opts.exporter} exporter, opset {plan.opts.opset}")
    if not info.tested:
        run.log(f"note: {info.model_type} is not among attncal's tested architectures; the export goes ahead and "
                "is labelled untested, and the parity check guards it")
    torch_model = load_for_export(info, plan.opts.fp16)
    try:
        sites = find_attention(torch_model)
        run.features = sites.features
        sites.base.__dict__.pop("_attncal_sites", None)  # the probe's cache stays out of the traced module
        del sites
    except UnsupportedArchitectureError:
        if plan.config is not None:
            raise
    return torch_model


def export_torch(run: Run, torch_model) -> None:
    """torch.onnx's export of encoder + pooling, with its weights moved to a data file; the torch model is freed."""
    plan, info = run.plan, run.plan.info
    raw_path = run.tmp / ".raw" / ONNX_FILE
    try:
        run.input_names = torch_export(info, plan.pooling_head, raw_path, plan.opts.opset, plan.opts.exporter,
                                       fp16=plan.opts.fp16, model=torch_model)
        del torch_model
        if plan.opts.exporter == "dynamo" and plan.estimate.weights >= RELEASE_FROM_BYTES:
            release_onnxscript_matchers()  # a scan of every Python object: worth it where the weights are large
        release_freed_memory(plan.estimate.weights)
    except Exception as exc:  # torch.onnx failures are long; report the cause in one line
        raise ExportError(f"torch.onnx ({plan.opts.exporter}) failed to export {info.model_type}: "
                          f"{type(exc).__name__}: {first_line(exc)[:300]}") from exc
    run.raw_path = weights_on_disk(raw_path)
