"""The export's first step: the model files copied beside the graphs, the torch model loaded, and torch.onnx's
export of encoder + pooling with its weights moved to a data file.

Later steps call `torch_export` through this module (`from_torch.torch_export`), so a test that replaces it
replaces every export the run makes (the TorchScript one ONNX Runtime's optimizer takes too).

A model of `RELEASE_FROM_BYTES` float32 weight bytes or more is exported by the dynamo exporter in a child
process (`python -m attncal.exporting.from_torch`), which loads the model itself: the exporter optimizes its graph
with onnxscript's rewrite rules, module-level objects whose pattern matchers each keep the last graph they
matched, and that graph's initializers wrap the model's parameters, so in this process the weights would stay
resident for the rest of the export.  onnxscript (0.7) offers no public way to release them; a child's memory
ends with it.  This process probes the model first and drops it before the child starts, so the two never
hold the weights at once.  A smaller model is exported here: what the matchers keep of it is below what a
child's start-up costs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import pickle
import shutil
import sys
from pathlib import Path

from ..artifact import METADATA_FILE, ONNX_FILE, weights_on_disk
from ..memory import RELEASE_FROM_BYTES, release_freed_memory
from ..messages import first_line
from ..modelinfo import ModelInfo, forward_kwargs, load_dense_head, load_transformer
from ..pooling import Pooling
from .child import run_child
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
    info: ModelInfo, pooling: Pooling, onnx_path: Path, opset: int, exporter: str, fp16: bool = False, model=None
) -> list[str]:
    """Export encoder + pooling to `onnx_path` (single file, external data when needed); returns input names.
    `pooling`: `ExportPlan.pooling`; `model`: the already loaded model (`load_for_export`), exported in this
    process.  Without one, the dynamo exporter runs in a child process that loads the model (`export_in_child`),
    and the TorchScript exporter loads it here."""
    if model is None and exporter == "dynamo":
        return export_in_child(info, pooling, onnx_path, opset, fp16)
    return _export_here(info, pooling, onnx_path, opset, exporter, fp16, model)


def _export_here(info: ModelInfo, pooling: Pooling, onnx_path: Path, opset: int, exporter: str, fp16: bool,
                 model) -> list[str]:
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


class ChildExportError(RuntimeError):
    """The dynamo export's child process failed or was killed; the message says how, in one line."""


def export_in_child(info: ModelInfo, pooling: Pooling, onnx_path: Path, opset: int, fp16: bool) -> list[str]:
    """The dynamo export of `torch_export` in a child process that loads the model (the module docstring says
    why); returns the input names, or ChildExportError.  The child's output goes to this process's file
    descriptors as the child wrote it (the export log has it under a command)."""
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    request, result = onnx_path.with_name(".export-request.pickle"), onnx_path.with_name(".export-result.json")
    request.write_bytes(pickle.dumps({"info": info, "pooling": pooling, "onnx_path": onnx_path, "opset": opset,
                                      "fp16": fp16}))
    try:
        run_child([sys.executable, "-m", __name__, str(request), str(result)], "torch.onnx's dynamo export (child)",
                  ChildExportError)
        if not result.is_file():
            raise ChildExportError("torch.onnx's dynamo export (child) wrote no result")
        return json.loads(result.read_text())
    finally:
        request.unlink(missing_ok=True)
        result.unlink(missing_ok=True)


def load(run: Run):
    """The model files beside the graphs, and the torch model (loading is measured with the torch export: both
    hold the same weights).  Whether it can be calibrated in PyTorch (the parity reference) is probed here, before
    exporting; the probe also says what the attention holds, which decides whether ORT's optimizer is worth
    trying (`attncal.exporting.optimized_graphs`)."""
    from ..calibration.attention_functions import UnsupportedArchitectureError  # lazy: imports torch
    from ..calibration.probing import find_attention  # lazy: imports torch

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
    if _exports_in_child(run):  # the child loads its own: this process holds no weights while it runs
        del torch_model
        release_freed_memory(plan.estimate.weights)
        return None
    return torch_model


def _exports_in_child(run: Run) -> bool:
    """Whether the torch export runs in a child process (the module docstring says why)."""
    return run.plan.opts.exporter == "dynamo" and run.plan.estimate.weights >= RELEASE_FROM_BYTES


def export_torch(run: Run, torch_model) -> None:
    """torch.onnx's export of encoder + pooling, with its weights moved to a data file; the torch model is freed.
    `torch_model`: what `load` returned (None where the export runs in a child process)."""
    plan, info = run.plan, run.plan.info
    raw_path = run.tmp / ".raw" / ONNX_FILE
    try:
        run.input_names = torch_export(info, plan.pooling, raw_path, plan.opts.opset, plan.opts.exporter,
                                       fp16=plan.opts.fp16, model=torch_model)
        del torch_model
        release_freed_memory(plan.estimate.weights)
    except Exception as exc:  # torch.onnx failures are long; report the cause in one line
        raise ExportError(f"torch.onnx ({plan.opts.exporter}) failed to export {info.model_type}: "
                          f"{type(exc).__name__}: {first_line(exc)[:300]}") from exc
    run.raw_path = weights_on_disk(raw_path)


def main(argv: list[str] | None = None) -> int:
    """The child of `export_in_child`: read its request, export, write the input names."""
    p = argparse.ArgumentParser(prog="python -m attncal.exporting.from_torch", description=main.__doc__)
    p.add_argument("request", type=Path)
    p.add_argument("result", type=Path)
    a = p.parse_args(argv)
    req = pickle.loads(a.request.read_bytes())  # written by this module's parent process, in its working directory
    names = _export_here(req["info"], req["pooling"], req["onnx_path"], req["opset"], "dynamo", req["fp16"], None)
    a.result.write_text(json.dumps(names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
