"""Generate a Triton model repository from an `attncal export` directory.

For an export and a NAME it writes three models:

- `NAME-tokenizer`: Python backend, UTF-8 text -> the encoder's int64 inputs;
- `NAME-encoder`: the ONNX encoder, in one of three backends
  (`python`: ONNX Runtime inside the Python backend, the variant this project's
  server runs; `onnxruntime`: Triton's ORT backend; `tensorrt`: a plan the user
  builds with the attncal TensorRT plugin);
- `NAME`: an ensemble of the two; clients send text, get `sentence_embedding`.

The `python` and `onnxruntime` encoders on CPU instances serve the export's
native graph `onnx/model_optimized_native.onnx` where the attncal native op
library is configured, as `Encoder` picks it; otherwise
`onnx/model_optimized.onnx` when the export has one (same interface, ORT-only
fused graph), else `onnx/model.onnx`.  The `tensorrt` encoder gets
`onnx/model.onnx`, from which the user builds the plan.  The library is loaded
when it is built here (`attncal.runtime.oplib.resolve_library`: off with
ATTNCAL_NATIVE=0 or `RepoOptions(native=False)`; `custom_op_library` names
another path).  The Python model falls back to the function body if the
library is missing on the serving machine; Triton's ORT backend cannot.

An export with lmk, multi-cls or mean-every pooling (attncal.json's `pooling`)
gets copies of `attncal/pooling.py` and `attncal/runtime/landmarks.py` beside
its tokenizer model, and its pooling as the model's `pooling` parameter
(`Pooling.to_json()`): the landmarks are placed exactly as `Encoder` places them
(the model stays free of attncal imports).
The Python encoder gets a copy of `attncal/runtime/precision.py`, with which it
serves the request parameter `dimensions` (Matryoshka truncation, normalised
again where the model normalises) as `Encoder.encode(dimensions=)` computes it.

An export with chunk vectors (`attncal export --chunk-vectors`) gets them
served: the encoder declares the optional input `chunk_spans` and the output
`chunk_embeddings` (python and onnxruntime backends), so a client that
tokenizes and windows as attncal does (attncal.corpus.triton) sends token ids
and chunk spans to NAME-encoder and receives one vector per chunk.

Several exports (calibrated and not) share one repository under different
names.  The three models are built in a temporary directory beside REPO and
renamed in, so a failure never leaves a half-written model, and models already
in REPO are untouched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..artifact import (
    CONFIG_FILE,
    LOADER_FILE_LIMIT,
    METADATA_FILE,
    NATIVE_GRAPH,
    OPTIMIZED_FILE,
    ArtifactError,
    MissingArtifactError,
    check_dir,
    check_export_file,
    config_int,
    load_onnx_checked,
    open_export,
    pooling_of,
    read_bytes,
    read_json,
    validate_metadata,
)
from ..modelinfo import UnsupportedModelError, choose_prompt, read_prompts
from ..runtime.chunking import CHUNK_SPANS, CHUNK_VECTORS
from ..pooling import Pooling
from ..runtime.encoder import memory_pattern
from ..runtime.precision import declared_dimensions
from ..runtime.oplib import resolve_library
from . import pbtxt
from .pbtxt import Enum

BACKENDS = ("python", "onnxruntime", "tensorrt")
KINDS = ("cpu", "gpu")
TEXT_INPUT = "text"
EMBEDDING_OUTPUT = "sentence_embedding"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TEMPLATES = Path(__file__).parent / "models"
# The pooling and the landmark tokenization, copied beside the tokenizer model of an export with a row-set pooling.
POOLING_SOURCE = Path(__file__).parents[1] / "pooling.py"
POOLING_FILE = "attncal_pooling.py"
LANDMARKS_SOURCE = Path(__file__).parents[1] / "runtime" / "landmarks.py"
LANDMARKS_FILE = "attncal_landmarks.py"
# Matryoshka truncation, copied beside the Python encoder model (the `dimensions` request parameter).
PRECISION_SOURCE = Path(__file__).parents[1] / "runtime" / "precision.py"
PRECISION_FILE = "attncal_precision.py"
OPTIMIZED_ONNX_FILE = OPTIMIZED_FILE  # written by `attncal export` beside model.onnx when it optimizes


@dataclass
class RepoOptions:
    name: str | None = None  # default: the export directory's name
    max_batch: int = 64
    instances: int = 1
    backend: str = "python"
    kind: str = "cpu"
    with_tokenizer: bool = True
    max_queue_delay_us: int = 2000
    intra_op_threads: int = 0  # 0 = ONNX Runtime's default
    custom_op_library: str | None = None  # path on the serving machine; required when given
    native: bool | None = None  # None: the built attncal library when there is one; False: never; True: required
    overwrite: bool = False


def model_names(name: str, with_tokenizer: bool = True) -> dict[str, str]:
    """The repository entries one export occupies."""
    names = {"encoder": f"{name}-encoder"}
    if with_tokenizer:
        names.update(tokenizer=f"{name}-tokenizer", ensemble=name)
    return names


def _preferred(max_batch: int) -> list[int]:
    sizes = [s for s in (4, 8, 16, 32, 64, 128, 256) if s <= max_batch]
    return sizes[-3:] or [max_batch]


def _onnx_signature(onnx_file: Path, model=None) -> tuple[list[str], int | None, str]:
    """(input names, embedding dimension if static, embedding element type) of the exported graph."""
    import onnx

    graph = (model if model is not None else load_onnx_checked(onnx_file)).graph
    optional = {t.name for t in graph.initializer}  # inputs with a default: the chunk spans, declared apart
    inputs = [i.name for i in graph.input if i.name not in optional]
    out = next((o for o in graph.output if o.name == EMBEDDING_OUTPUT), None)
    if out is None:
        raise ValueError(f"{onnx_file} has no {EMBEDDING_OUTPUT!r} output; is it an attncal export?")
    dims = out.type.tensor_type.shape.dim
    dim = dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None
    etype = "TYPE_FP16" if out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else "TYPE_FP32"
    return inputs, dim, etype


def _read_export(out_dir: Path) -> dict:
    """The validated export (attncal.json, model files and every graph; ArtifactError naming a damaged file)."""
    exp = open_export(out_dir, graphs=None)
    protos = {g: exp.check_graph(g) for g in exp.graphs}
    meta = exp.meta
    onnx_file = out_dir / exp.graphs[0]
    inputs, dim, etype = _onnx_signature(onnx_file, protos[exp.graphs[0]])
    del protos
    if dim is None:
        try:
            dim = config_int(out_dir, "hidden_size")
        except ArtifactError:
            raise ArtifactError(onnx_file, "cannot tell the embedding size (no static dimension, no hidden size "
                                           "in config.json)") from None
    optimized = onnx_file.with_name(OPTIMIZED_ONNX_FILE)
    serve = optimized if optimized.is_file() else onnx_file
    try:  # the model's default prompt, put before every text as attncal.Encoder and sentence-transformers do
        prompt = choose_prompt(*read_prompts(out_dir))
    except UnsupportedModelError as exc:
        raise ArtifactError(out_dir / "config_sentence_transformers.json", str(exc)) from None
    return {"meta": meta, "onnx": onnx_file, "serve_onnx": serve, "inputs": inputs, "dim": dim, "etype": etype,
            "prompt": prompt, "pooling": pooling_of(meta),
            "chunk_vectors": meta.get("chunk_vectors") is not None, "declared": declared_dimensions(out_dir)}


def _native_library(opts: RepoOptions) -> tuple[str | None, bool]:
    """(library path for the encoder config, required?).  An explicit
    `custom_op_library` is required; otherwise the attncal library built on
    this machine, when there is one (see oplib.resolve_library)."""
    if opts.custom_op_library:
        return opts.custom_op_library, True
    if opts.backend == "tensorrt":
        return None, False
    lib = resolve_library(opts.native)
    return (str(lib.resolve()), bool(opts.native)) if lib is not None else (None, False)


def _served_graph(out_dir: Path, exp: dict, opts: RepoOptions, library: str | None) -> Path:
    """The graph the encoder model serves: the native graph (calibrated attention op) where the attncal
    library is configured for CPU instances of the ONNX Runtime or Python backend, as `Encoder` picks
    it; otherwise the ORT-optimized graph when there is one, else the portable graph (`_read_export`)."""
    native = out_dir / NATIVE_GRAPH
    if library and native.is_file() and opts.kind == "cpu" and opts.backend in ("onnxruntime", "python"):
        return native
    return exp["serve_onnx"]


def _pad_token_id(out_dir: Path) -> int:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(out_dir))
    except Exception as exc:  # a damaged tokenizer file fails deep inside tokenizers/transformers
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ArtifactError(out_dir / "tokenizer.json", f"the tokenizer cannot be loaded ({first})") from None
    return int(tok.pad_token_id if tok.pad_token_id is not None else 0)


def _params(**kv) -> list[dict]:
    return [{"key": k, "value": {"string_value": str(v)}} for k, v in kv.items() if v is not None]


def _instance_group(opts: RepoOptions) -> list[dict]:
    return [{"count": opts.instances, "kind": Enum("KIND_GPU" if opts.kind == "gpu" else "KIND_CPU")}]


def _batching(opts: RepoOptions) -> dict:
    return {"preferred_batch_size": _preferred(opts.max_batch), "max_queue_delay_microseconds": opts.max_queue_delay_us}


def encoder_config(name: str, exp: dict, opts: RepoOptions, pad_id: int,
                   library: tuple[str | None, bool] = (None, False)) -> dict:
    """The encoder's config.pbtxt as a dict; `library` is (op library path, required?)."""
    lib, required = library
    ragged = opts.backend == "python"  # only the Python model re-pads requests of different lengths
    inputs = [{"name": n, "data_type": Enum("TYPE_INT64"), "dims": [-1], "allow_ragged_batch": True if ragged else None}
              for n in exp["inputs"]]
    etype = "TYPE_FP32" if opts.backend == "python" else exp["etype"]
    outputs = [{"name": EMBEDDING_OUTPUT, "data_type": Enum(etype), "dims": [exp["dim"]]}]
    chunks = exp.get("chunk_vectors") and opts.backend != "tensorrt"
    if chunks:  # optional: the ensemble's calls do not feed it
        inputs.append({"name": CHUNK_SPANS, "data_type": Enum("TYPE_INT64"), "dims": [-1, 2], "optional": True,
                       "allow_ragged_batch": True if ragged else None})
        outputs.append({"name": CHUNK_VECTORS, "data_type": Enum("TYPE_FP32"), "dims": [-1, exp["dim"]]})
    cfg: dict = {"name": name, "max_batch_size": opts.max_batch, "input": inputs, "output": outputs,
                 "dynamic_batching": _batching(opts), "instance_group": _instance_group(opts)}
    meta = exp["meta"]
    if opts.backend == "python":
        cfg = {"name": name, "backend": "python", **{k: v for k, v in cfg.items() if k != "name"}}
        declared = exp.get("declared")
        cfg["parameters"] = _params(intra_op_threads=opts.intra_op_threads, custom_op_library=lib,
                                    custom_op_library_required=(("1" if required else "0") if lib else None),
                                    padding_side=meta.get("padding_side", "right"), pad_token_id=pad_id,
                                    onnx_file="model.onnx",
                                    memory_pattern="1" if memory_pattern(meta.get("max_seq_length")) else "0",
                                    normalize="1" if meta.get("normalize") else "0",
                                    matryoshka_dimensions=json.dumps(list(declared)) if declared else None,
                                    chunk_spans=CHUNK_SPANS if chunks else None,
                                    chunk_vectors=CHUNK_VECTORS if chunks else None)
    elif opts.backend == "onnxruntime":
        cfg = {"name": name, "platform": "onnxruntime_onnx", "default_model_filename": "model.onnx",
               **{k: v for k, v in cfg.items() if k != "name"}}
        if opts.intra_op_threads:
            cfg["parameters"] = _params(intra_op_thread_count=opts.intra_op_threads)
        if lib:
            cfg["model_operations"] = {"op_library_filename": [lib]}
    else:
        cfg = {"name": name, "platform": "tensorrt_plan", "default_model_filename": "model.plan",
               **{k: v for k, v in cfg.items() if k != "name"}}
    return cfg


def tokenizer_config(name: str, exp: dict, opts: RepoOptions) -> dict:
    meta = exp["meta"]
    max_len = meta.get("max_seq_length")
    # Backends that batch only same-shape requests get fixed-length inputs.
    padding = "longest" if opts.backend == "python" else "max_length"
    if padding == "max_length" and not max_len:
        raise ValueError("the export has no max_seq_length; the onnxruntime/tensorrt variants need one")
    return {
        "name": name, "backend": "python", "max_batch_size": opts.max_batch,
        "input": [{"name": TEXT_INPUT, "data_type": Enum("TYPE_STRING"), "dims": [1]}],
        "output": [{"name": n, "data_type": Enum("TYPE_INT64"), "dims": [-1]} for n in exp["inputs"]],
        "dynamic_batching": _batching(opts),
        "instance_group": [{"count": opts.instances, "kind": Enum("KIND_CPU")}],
        "parameters": _params(max_length=max_len, padding_side=meta.get("padding_side", "right"), padding=padding,
                              prompt=exp.get("prompt") or None, pooling=_pooling_json(exp["pooling"])),
    }


def _pooling_json(pooling: Pooling) -> str | None:
    """The tokenizer model's `pooling` parameter: set where the tokenization places landmarks (row-set poolings)."""
    return json.dumps(pooling.to_json(), sort_keys=True) if pooling.row_set else None


def ensemble_config(names: dict[str, str], exp: dict, opts: RepoOptions, etype: str) -> dict:
    return {
        "name": names["ensemble"], "platform": "ensemble", "max_batch_size": opts.max_batch,
        "input": [{"name": TEXT_INPUT, "data_type": Enum("TYPE_STRING"), "dims": [1]}],
        "output": [{"name": EMBEDDING_OUTPUT, "data_type": Enum(etype), "dims": [exp["dim"]]}],
        "ensemble_scheduling": {"step": [
            {"model_name": names["tokenizer"], "model_version": -1,
             "input_map": [{"key": TEXT_INPUT, "value": TEXT_INPUT}],
             "output_map": [{"key": n, "value": f"_{n}"} for n in exp["inputs"]]},
            {"model_name": names["encoder"], "model_version": -1,
             "input_map": [{"key": n, "value": f"_{n}"} for n in exp["inputs"]],
             "output_map": [{"key": EMBEDDING_OUTPUT, "value": EMBEDDING_OUTPUT}]},
        ]},
    }


_TENSORRT_README = """\
This encoder uses Triton's TensorRT backend; attncal does not build the plan.
Build it from the ONNX file with the attncal TensorRT plugin, for example:

  trtexec --onnx=model.onnx --saveEngine=1/model.plan --staticPlugins=/path/libattncal_trt_plugin.so \\
    --minShapes={mins} --optShapes={opts} --maxShapes={maxs}

and start Triton with the plugin loaded:

  tritonserver --model-repository=REPO --backend-config=tensorrt,plugins=/path/libattncal_trt_plugin.so

The tokenizer pads every text to {max_len} tokens, so the plan needs that length.
"""


def _write_model(root: Path, config: dict) -> Path:
    text = pbtxt.dumps(config)
    pbtxt.validate(text)  # strict schema check when tritonclient is installed
    model_dir = root / config["name"]
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(text)
    return model_dir


def _copy_onnx(exp: dict, dest: Path, key: str = "serve_onnx") -> None:
    """Copy the graph as model.onnx; an external-data file keeps its own name,
    which is what the graph's tensors reference.  The data file is copied only as a regular file inside the
    export (the graph's references were checked; a data file it does not reference was not)."""
    src = exp[key]
    shutil.copy2(src, dest / "model.onnx")
    data = src.with_name(src.name + "_data")
    if data.exists():
        check_export_file(data, src.parent, "external data file")
        shutil.copy2(data, dest / data.name)


def _copy_tokenizer(out_dir: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    for f in out_dir.iterdir():
        # Not attncal.json (the encoder's copy carries it) nor the export's log.
        if f.is_file() and f.name != METADATA_FILE and not f.name.startswith(".") and f.suffix != ".log":
            check_export_file(f, out_dir, "tokenizer file", LOADER_FILE_LIMIT)  # no copy of what is outside it
            shutil.copy2(f, dest / f.name)


def discover(repo: str | os.PathLike) -> dict[str, bool]:
    """{client-facing model name: calibrated?} for every attncal export in `repo`."""
    found = {}
    for meta_file in sorted(Path(repo).glob(f"*/{METADATA_FILE}")):
        meta = validate_metadata(read_json(meta_file, "attncal metadata"), meta_file)
        tri = meta.get("triton", {})
        if not isinstance(tri, dict):
            raise ArtifactError(meta_file, f"key 'triton' must be an object, got {tri!r:.60}")
        name = tri.get("name") if tri.get("with_tokenizer") else meta_file.parent.name
        if name:
            found[name] = bool(meta.get("calibrated"))
    return found


def build_repository(out_dir: str | os.PathLike, repo: str | os.PathLike, opts: RepoOptions | None = None) -> dict:
    """Write the models for export `out_dir` into `repo`; returns {role: model name}."""
    opts = opts or RepoOptions()
    out_dir, repo = Path(out_dir), Path(repo)
    name = opts.name or out_dir.resolve().name
    if not _NAME_RE.match(name):
        raise ValueError(f"model name {name!r}: use letters, digits, '_', '-', '.'")
    if opts.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {opts.backend!r}")
    if opts.kind not in KINDS:
        raise ValueError(f"kind must be cpu or gpu, not {opts.kind!r}")
    if not 1 <= opts.max_batch <= 4096:
        raise ValueError(f"--max-batch must be in [1, 4096], got {opts.max_batch}")
    if opts.instances < 1:
        raise ValueError(f"--instances must be >= 1, got {opts.instances}")
    if opts.backend == "tensorrt" and opts.kind != "gpu":
        raise ValueError("the tensorrt backend runs on GPU only: pass --kind gpu")
    if opts.native and opts.backend == "tensorrt":
        raise ValueError("native=True asks for the ONNX Runtime op library, which the tensorrt backend does not use")
    if opts.custom_op_library and opts.backend == "tensorrt":
        raise ValueError("--custom-op-library is an ONNX Runtime library; TensorRT takes its plugin via "
                         "--backend-config=tensorrt,plugins=... at server start")
    if repo.exists() and not repo.is_dir():
        raise FileExistsError(f"repository path {repo} exists and is a file")
    exp = _read_export(out_dir)
    names = model_names(name, opts.with_tokenizer)
    clashes = [n for n in names.values() if (repo / n).exists()]
    if clashes and not opts.overwrite:
        raise FileExistsError(f"{repo} already holds {', '.join(clashes)}; pass --overwrite or pick another --name")

    library = _native_library(opts)  # before anything is written: native=True may refuse
    exp["serve_onnx"] = _served_graph(out_dir, exp, opts, library[0])
    pad_id = _pad_token_id(out_dir)  # a damaged tokenizer is reported before anything is written
    created = not repo.exists()
    repo.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{repo.name}.attncal-", dir=repo.parent))
    try:
        enc_cfg = encoder_config(names["encoder"], exp, opts, pad_id, library)
        enc_dir = _write_model(tmp, enc_cfg)
        # Provenance for `discover`/`bench_triton`; Triton ignores extra files in a model directory.
        (enc_dir / "attncal.json").write_text(json.dumps({**exp["meta"], "triton": {
            "name": name, "backend": opts.backend, "with_tokenizer": opts.with_tokenizer,
            "graph": exp["serve_onnx"].relative_to(out_dir).as_posix()}}, indent=2))
        if opts.backend == "python":
            shutil.copy2(_TEMPLATES / "encoder_model.py", enc_dir / "1" / "model.py")
            shutil.copy2(PRECISION_SOURCE, enc_dir / "1" / PRECISION_FILE)
            _copy_onnx(exp, enc_dir / "1")
        elif opts.backend == "onnxruntime":
            _copy_onnx(exp, enc_dir / "1")
        else:
            _copy_onnx(exp, enc_dir, "onnx")  # standard ONNX: the user builds 1/model.plan from it
            L, B = exp["meta"].get("max_seq_length"), opts.max_batch
            shape = lambda b: ",".join(f"{n}:{b}x{L}" for n in exp["inputs"])  # noqa: E731
            (enc_dir / "README.txt").write_text(_TENSORRT_README.format(
                mins=shape(1), opts=shape(max(1, B // 2)), maxs=shape(B), max_len=L))
        if opts.with_tokenizer:
            tok_dir = _write_model(tmp, tokenizer_config(names["tokenizer"], exp, opts))
            shutil.copy2(_TEMPLATES / "tokenizer_model.py", tok_dir / "1" / "model.py")
            if exp["pooling"].row_set:
                shutil.copy2(POOLING_SOURCE, tok_dir / "1" / POOLING_FILE)
                shutil.copy2(LANDMARKS_SOURCE, tok_dir / "1" / LANDMARKS_FILE)
            _copy_tokenizer(out_dir, tok_dir / "1" / "tokenizer")
            _write_model(tmp, ensemble_config(names, exp, opts, enc_cfg["output"][0]["data_type"]))
        moved: list[tuple[Path, Path | None]] = []
        try:
            for n in names.values():
                target = repo / n
                old = None
                if target.exists():
                    old = tmp / f".old-{n}"
                    os.replace(target, old)
                os.replace(tmp / n, target)
                moved.append((target, old))
        except OSError:
            for target, old in reversed(moved):  # put the repository back as it was
                shutil.rmtree(target, ignore_errors=True)
                if old is not None:
                    os.replace(old, target)
            raise
    except BaseException:
        if created and repo.is_dir() and not any(repo.iterdir()):
            repo.rmdir()  # a repository this call created and could not fill is not left behind
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return names


_ATTNCAL_TEMPLATES = {"encoder_model.py", "tokenizer_model.py"}


def validate_repository(repo: str | os.PathLike) -> list[str]:
    """Check a model repository before a server is started on it; returns the model names.

    Every model needs a readable `config.pbtxt` that follows Triton's schema.  Models written by
    `attncal triton-repo` (recognised by their `attncal.json` or attncal's model.py) are checked
    like an export: `attncal.json`, the encoder's ONNX graph (parse, interface, digest) and the
    tokenizer's files.  Raises ArtifactError naming the damaged file."""
    root = check_dir(repo, "model repository")
    templates = {(_TEMPLATES / t).read_bytes(): t for t in _ATTNCAL_TEMPLATES}
    names = []
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        check_dir(model_dir, "model directory")
        cfg_file = model_dir / "config.pbtxt"
        if not cfg_file.exists():
            continue  # not a model (Triton ignores it too)
        text = read_json_free_text(cfg_file)
        try:
            pbtxt.validate(text)
        except ValueError as exc:
            raise ArtifactError(cfg_file, str(exc).splitlines()[0]) from None
        names.append(model_dir.name)
        model_py = model_dir / "1" / "model.py"
        role = templates.get(model_py.read_bytes()) if model_py.is_file() else None
        meta_file = model_dir / METADATA_FILE
        if meta_file.exists() or role == "encoder_model.py":
            if not meta_file.exists():
                raise MissingArtifactError(meta_file, "missing (attncal triton-repo writes it beside the encoder)")
            meta = validate_metadata(read_json(meta_file, "attncal metadata"), meta_file)
            onnx_file = model_dir / "1" / "model.onnx"
            if not onnx_file.exists() and (model_dir / "model.onnx").exists():
                onnx_file = model_dir / "model.onnx"  # tensorrt: the plan is built from it by the user
            load_onnx_checked(onnx_file, require_digest=int(meta["format"]) >= 2,
                              expected_inputs=meta.get("inputs"))
        if role == "encoder_model.py" and not (model_dir / "1" / PRECISION_FILE).is_file():
            raise MissingArtifactError(model_dir / "1" / PRECISION_FILE, "missing (the encoder model truncates "
                                                                       "dimensions with it)")
        if role == "tokenizer_model.py":
            for copy in (POOLING_FILE, LANDMARKS_FILE) if '"pooling"' in text else ():
                if not (model_dir / "1" / copy).is_file():
                    raise MissingArtifactError(model_dir / "1" / copy, "missing (the tokenizer model places the "
                                                                      "export's landmarks with it)")
            tok = check_dir(model_dir / "1" / "tokenizer", "tokenizer directory")
            tok_cfg = read_json(tok / CONFIG_FILE, "model config")
            if not isinstance(tok_cfg, dict):
                raise ArtifactError(tok / CONFIG_FILE, "expected a JSON object")
            # The export's loader files were copied here; its encoder's attncal.json lists them.
            sibling = root / (model_dir.name[: -len("-tokenizer")] + "-encoder") / METADATA_FILE
            listed = []
            if model_dir.name.endswith("-tokenizer") and sibling.is_file():
                listed = validate_metadata(read_json(sibling, "attncal metadata"), sibling).get("files", [])
            for f in listed or ["tokenizer.json"]:
                if not (tok / f).is_file() and (listed or not (tok / "tokenizer_config.json").exists()):
                    raise MissingArtifactError(tok / f, "missing (the tokenizer model loads it)")
            for f in ("tokenizer.json", "tokenizer_config.json"):
                if (tok / f).exists():
                    read_json(tok / f, "tokenizer file")
    if not names:
        raise ArtifactError(root, "holds no model (no */config.pbtxt); create one with `attncal triton-repo`")
    return names


def read_json_free_text(path: Path) -> str:
    """A text file of the repository (config.pbtxt), with failures as ArtifactError naming it."""
    try:
        return read_bytes(path, "Triton model config").decode("utf-8")
    except UnicodeDecodeError:
        raise ArtifactError(path, "not UTF-8 text; the file is corrupted") from None
