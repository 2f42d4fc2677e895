"""The attncal export directory format: its layout, `attncal.json`, and its ONNX files.

One module owns what an export directory is, so every reader (the runtime, the
exporter's parity check, serving, bench, eval, the CLI) validates it the same
way and reports a damaged export the same way: one `ArtifactError` (a
`ValueError`) whose message starts with the file and says what is wrong with
it, instead of a protobuf or JSON traceback from deep inside a library.

Layout of OUT (sentence-transformers / optimum style):

    attncal.json                 metadata (this module reads, validates and writes it)
    config.json, tokenizer.json  the source model's config and tokenizer files, ...
    onnx/model.onnx              the portable graph (standard ONNX)
    onnx/model_optimized.onnx    the ORT-optimized graph (BERT family), optional
    onnx/model_inlined.onnx      the portable graph with its functions inlined (standard ONNX only), optional
    onnx/<graph>.onnx_data       a graph's weights, beside it, above 2 GiB (`model.onnx_data`, ...), and
                                 for a native graph whose feed-forward blocks run over chunks of rows

Format versions: 1 (the first exports) and 2 (adds `files`, the model files a
loader needs, and an `attncal.digest` in each graph's ONNX metadata).  The
digest is a sha256 over everything the graph file holds except its doc strings
(nodes, weights, functions, inputs, outputs, value_info, opsets, header), so a
flipped byte is caught before anything runs, while a tool that only rewrites
the model's doc string keeps it valid.  Weights in an external-data file are
covered by reference (name, offset, length) only.

An export may come from anyone (a model hub, a shared bucket), so nothing in it
is followed before it is checked (docs/threat-model.md): `check_external_data`
checks every external-data reference of a graph (a regular file inside the
graph's folder, the range within it, the declared shapes within the bytes
present) before any reader opens one, and the files read whole (attncal.json,
config and tokenizer files, graph files) are regular files inside the export
below a size limit.

Layering: this module sits below export, graphs and runtime; it imports nothing
from them (the calibration config, to validate the stored one, is below it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable

from .calibration.config import ROW_SET_POOLINGS, CalibrationConfig
from .memory import release_freed_memory

ONNX_SUBDIR = "onnx"
ONNX_FILE = "model.onnx"
OPTIMIZED_FILE = "model_optimized.onnx"  # optimum's name for the ORT-optimized graph
# The ORT-optimized graph with the calibrated attention op (attention placement): run where the attncal
# native library is loaded; the calibrated export writes it beside model_optimized.onnx (split placement,
# no custom op), which runs everywhere else.
NATIVE_FILE = "model_optimized_native.onnx"
# The portable graph with every model-local function inlined, attribute references bound (attncal.export.inline):
# standard ONNX only, for the runtimes that do not read ONNX functions (OpenVINO); `attncal export --inlined`.
INLINED_FILE = "model_inlined.onnx"
EXTERNAL_DATA_FILE = "model.onnx_data"
METADATA_FILE = "attncal.json"
EXPORT_LOG_FILE = "attncal-export.log"  # what the libraries wrote during `attncal export` (attncal.console)
CONFIG_FILE = "config.json"
PORTABLE_GRAPH = f"{ONNX_SUBDIR}/{ONNX_FILE}"
OPTIMIZED_GRAPH = f"{ONNX_SUBDIR}/{OPTIMIZED_FILE}"
NATIVE_GRAPH = f"{ONNX_SUBDIR}/{NATIVE_FILE}"
INLINED_GRAPH = f"{ONNX_SUBDIR}/{INLINED_FILE}"
GRAPH_FILES = (PORTABLE_GRAPH, OPTIMIZED_GRAPH, NATIVE_GRAPH, INLINED_GRAPH)
FORMAT_VERSION = 2
SUPPORTED_FORMATS = (1, 2)
DIGEST_KEY = "attncal.digest"
TWO_GIB = 2 * 1024**3
# Tensor bytes from which a graph is written with external data (protobuf cannot hold a 2 GiB message; the
# margin is for the graph structure itself).
INLINE_LIMIT = TWO_GIB - 64 * 1024**2
# The limits on what an export can make attncal read or allocate (docs/threat-model.md).  A graph file is one
# protobuf message, which cannot exceed 2 GiB, so a larger one is not a graph; it is refused before it is read
# into memory.
GRAPH_FILE_LIMIT = TWO_GIB - 1
# attncal.json, config.json and the tokenizer files are read whole into memory.  The largest real ones are
# tokenizer.json files of 250k-token vocabularies, about 35 MB; 256 MiB leaves seven times that and keeps a
# hostile file from filling the memory of every process that opens the export.
LOADER_FILE_LIMIT = 256 * 1024**2
# attncal.json's `max_seq_length`: tokenizers truncate to it and Triton's tokenizer model pads every batch to it.
# The longest-context text encoders take 128k tokens; 2^20 is eight times that.
MAX_SEQ_LENGTH_LIMIT = 2**20
# Layer counts (attncal.json's `num_layers`) and model dimensions (config.json's hidden size and head count, which
# size the serving configs and the parity check's batches).  The largest transformers have 16,384-wide hidden
# states and under 200 layers; 2^16 is four times the widest.
DIMENSION_LIMIT = 2**16
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
# Above this many tokens, or with no max length, an export is a long-context one: its sessions run without ONNX
# Runtime's memory pattern (attncal.runtime.encoder) and its native graph runs its feed-forward blocks over
# chunks of rows (attncal.graphs.fusions.feed_forward_chunks).
LONG_CONTEXT_TOKENS = 512
# attncal.json's "tokenizer": what runs the export's tokenizer.  "tokenizers": its tokenizer.json alone, which the
# exporter found to give transformers' ids (attncal.runtime.tokenizer); "transformers" (or no key): AutoTokenizer.
TOKENIZERS = ("tokenizers", "transformers")
REQUIRED_INPUTS = ("input_ids", "attention_mask")

OUTPUT_NAMES = ("last_hidden_state", "sentence_embedding")
# Root files a loader (tokenizer, transformers, sentence-transformers) needs; format 2 lists
# the ones an export has under `files`, and a missing one is reported.
LOADER_FILES = frozenset({
    CONFIG_FILE, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "sentencepiece.bpe.model", "spiece.model", "tokenizer.model",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
})


class ArtifactError(ValueError):
    """An export (or a file of it) is missing, unreadable, corrupted or not an attncal export.

    `path` is the offending file or directory; the message is "PATH: problem"."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")

    def __reduce__(self):  # picklable across process pools
        return (type(self), (str(self.path), self.problem))


class MissingArtifactError(ArtifactError, FileNotFoundError):
    """A file or directory of the export does not exist (also a FileNotFoundError)."""


# -- files and directories ----------------------------------------------------------------------

def check_readable(path: Path, directory: bool) -> None:
    """Raise ArtifactError if `path` cannot be read (listed and entered, for a directory).

    Both the caller's access rights (`os.access`) and the permission bits are checked: an
    export nobody may read is broken for every non-root consumer (a Triton server, a service
    account), so it is refused the same way when root, who bypasses the bits, runs the command.
    """
    try:
        mode = path.stat().st_mode
    except PermissionError:
        raise ArtifactError(path, "permission denied (cannot stat it)") from None
    need = os.R_OK | (os.X_OK if directory else 0)
    readable_bits = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
    enter_bits = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
    no_bits = not mode & readable_bits or (directory and not mode & enter_bits)
    if no_bits or not os.access(path, need):
        what = "directory" if directory else "file"
        raise ArtifactError(path, f"permission denied: the {what} is not readable "
                                  f"(mode {stat.filemode(mode)}); fix it with chmod")


def check_dir(path: str | os.PathLike, what: str = "export directory") -> Path:
    """`path` as a readable directory, or ArtifactError naming it."""
    p = Path(path)
    if not p.exists():
        raise MissingArtifactError(p, f"{what} not found")
    if not p.is_dir():
        raise ArtifactError(p, f"is a file, not an {what}")
    check_readable(p, directory=True)
    return p


def _size_text(n: int) -> str:
    return f"{n / 1024**3:,.1f} GiB" if n >= 1024**3 else f"{n / 1024**2:,.1f} MiB"


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _inside(path: Path, folder: Path) -> bool:
    """Whether `path`, every symlink followed, is in `folder` (also resolved); lstat and readlink only, so
    nothing is opened.  A path that is no path (a NUL byte) is not inside."""
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
    except ValueError:
        return False


def _check_regular(path: Path, st: os.stat_result, what: str, limit: int | None) -> None:
    """ArtifactError unless `st` (of `path`) is a regular file of at most `limit` bytes: a FIFO blocks whoever opens
    it, a device never ends, and a file above the limit is not what it claims to be."""
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError(path, f"is {_file_kind(st.st_mode)}, not a regular file ({what})")
    if limit is not None and st.st_size > limit:
        raise ArtifactError(path, f"is {_size_text(st.st_size)}, above the {_size_text(limit)} limit ({what})")


def check_export_file(path: Path, folder: Path, what: str, limit: int | None = None) -> None:
    """ArtifactError unless `path` resolves (symlinks followed) to a regular file inside `folder` of at most
    `limit` bytes; checked with stat calls only, before anything opens it."""
    if not os.path.lexists(path):
        raise MissingArtifactError(path, f"missing ({what})")
    if not _inside(path, folder):
        raise ArtifactError(path, f"resolves outside the export folder {folder} ({what})")
    try:
        st = path.stat()
    except OSError as exc:
        raise ArtifactError(path, f"cannot be read ({exc.strerror or exc}; {what})") from None
    _check_regular(path, st, what, limit)


def read_bytes(path: Path, what: str = "file", limit: int = LOADER_FILE_LIMIT) -> bytes:
    """The bytes of a file of the export, with every failure as an ArtifactError naming it; a file that is not
    a regular one, or is above `limit` bytes, is refused before it is opened."""
    if not path.exists():
        raise MissingArtifactError(path, f"missing ({what})")
    if path.is_dir():
        raise ArtifactError(path, f"is a directory, expected a {what}")
    check_readable(path, directory=False)
    _check_regular(path, path.stat(), what, limit)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ArtifactError(path, f"cannot be read ({exc.strerror or exc})") from None


def read_json(path: Path, what: str = "JSON file") -> Any:
    data = read_bytes(path, what)
    if not data.strip():
        raise ArtifactError(path, f"empty {what}")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ArtifactError(path, f"not UTF-8 text (byte {exc.start}); the file is corrupted") from None
    except json.JSONDecodeError as exc:
        raise ArtifactError(path, f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                                  "the file is truncated or corrupted") from None


def write_text_atomic(path: Path, text: str) -> None:
    """Write through a temporary name and rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.writing-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def commit_dir(tmp: Path, out: Path) -> None:
    """Move a completed `tmp` directory to `out`, replacing an old `out` only once `tmp` is complete.

    Every command that writes a directory (export, triton-repo, bench --out, eval --out) builds it
    in a temporary directory beside `out` and commits it here, so a failure leaves no half-written
    output."""
    import shutil
    import tempfile

    trash = None
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / "old")
    os.replace(tmp, out)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


# transformers config keys under their per-architecture names (DistilBERT's dim / n_heads, T5's d_model / num_heads).
_CONFIG_ALIASES = {"hidden_size": ("hidden_size", "dim", "d_model"),
                   "num_attention_heads": ("num_attention_heads", "n_heads", "num_heads", "n_head")}


def config_int(export_dir: Path, key: str) -> int:
    """An integer of the export's `config.json` by its canonical name (`_CONFIG_ALIASES`), or ArtifactError."""
    cfg = read_json(export_dir / CONFIG_FILE, "model config")
    for name in _CONFIG_ALIASES.get(key, (key,)):
        value = cfg.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            if not 1 <= value <= DIMENSION_LIMIT:
                raise ArtifactError(export_dir / CONFIG_FILE, f"{name} is {value}, outside 1 to {DIMENSION_LIMIT}")
            return value
    raise ArtifactError(export_dir / CONFIG_FILE, f"has no integer {' / '.join(_CONFIG_ALIASES.get(key, (key,)))}")


# -- attncal.json ---------------------------------------------------------------------------------

_NONE = type(None)


@dataclass
class ExportMetadata:
    """`attncal.json`: what an export holds and how it was made.  `format` is the schema version; the
    fields are written in this order, and their types are what `validate_metadata` checks."""

    calibrated: bool
    config: dict | None  # CalibrationConfig.to_dict() of a calibrated export
    calibrated_layers: list
    op_type: str | None
    op_attributes: dict | None
    source_model: str | None
    model_type: str
    architecture: str
    tested: bool  # an architecture outside modelinfo.TESTED_MODEL_TYPES exports labelled untested
    num_layers: int
    pooling: str
    normalize: bool
    max_seq_length: int | None
    padding_side: str
    inputs: list
    outputs: list
    opset: int
    exporter: str
    placement: str | None
    placement_reason: str | None
    optimizer: str | None  # why there is no ORT-optimized graph, or what its optimizer fused
    graphs: dict  # graph file -> placement, runtime, fused attention, parity, ...
    fp16: bool
    fp16_method: str | None
    quantization: dict | None
    files: list
    versions: dict
    parity: dict | None
    memory_estimate: dict
    tokenizer: str | None = None  # one of TOKENIZERS
    # Landmark / Mean@k pooling (pooling "landmark" or "mean-every"): attncal.runtime.landmarks.PoolingSpec's
    # fields, which every tokenizer of the export reads back (the runtime validates them).
    pooling_spec: dict | None = None
    export_steps: list | None = None  # written once the export's steps have run
    format: int = FORMAT_VERSION

    def to_dict(self) -> dict:
        out = {"format": self.format}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "format" and not (f.name == "export_steps" and value is None):
                out[f.name] = value
        return out


def _hint_types(hint: Any) -> tuple[type, ...]:
    return tuple(_NONE if t is None else t for t in (typing.get_args(hint) or (hint,)))


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    name: _hint_types(hint) for name, hint in typing.get_type_hints(ExportMetadata).items()}
_REQUIRED = ("format", "calibrated", "pooling", "calibrated_layers")
_REQUIRED_V2 = ("model_type", "num_layers", "inputs", "padding_side", "files")


def _type_name(types: tuple[type, ...]) -> str:
    names = {int: "an integer", bool: "true/false", str: "a string", list: "a list", dict: "an object",
             _NONE: "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _is(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False  # JSON true is not an integer here
    return isinstance(value, types)


def validate_metadata(meta: Any, path: str | os.PathLike = METADATA_FILE) -> dict:
    """Check the keys and types of an `attncal.json`; returns it, or raises ArtifactError naming `path`."""
    if not isinstance(meta, dict):
        raise ArtifactError(path, f"expected a JSON object, got {type(meta).__name__}")
    fmt = meta.get("format")
    if "format" not in meta:
        raise ArtifactError(path, "missing key 'format' (the export format version)")
    if not _is(fmt, (int,)):
        raise ArtifactError(path, f"key 'format' must be an integer, got {fmt!r}")
    if fmt not in SUPPORTED_FORMATS:
        newer = fmt > FORMAT_VERSION
        raise ArtifactError(path, f"unknown export format version {fmt}; this attncal reads formats "
                                  f"{', '.join(map(str, SUPPORTED_FORMATS))}"
                                  + ("; upgrade attncal or re-export" if newer else "; re-export the model"))
    required = _REQUIRED + (_REQUIRED_V2 if fmt >= 2 else ())
    missing = [k for k in required if k not in meta]
    if missing:
        raise ArtifactError(path, f"missing key(s) {', '.join(map(repr, missing))} (format {fmt})")
    for key, types in _FIELD_TYPES.items():
        if key in meta and not _is(meta[key], types):
            raise ArtifactError(path, f"key {key!r} must be {_type_name(types)}, got {meta[key]!r:.80}")
    if not all(_is(x, (int,)) for x in meta["calibrated_layers"]):
        raise ArtifactError(path, "key 'calibrated_layers' must be a list of integers")
    _check_sizes(meta, path)
    for key in ("inputs", "outputs", "files"):
        if key in meta and not all(isinstance(x, str) for x in meta[key]):
            raise ArtifactError(path, f"key {key!r} must be a list of strings")
    if "inputs" in meta and (set(meta["inputs"]) - set(INPUT_NAMES) or
                             any(n not in meta["inputs"] for n in REQUIRED_INPUTS)):
        raise ArtifactError(path, f"key 'inputs' must hold {', '.join(REQUIRED_INPUTS)} (and optionally "
                                  f"token_type_ids), got {meta['inputs']}")
    if meta.get("tokenizer") not in (None,) + TOKENIZERS:
        raise ArtifactError(path, f"key 'tokenizer' must be one of {', '.join(TOKENIZERS)}, got {meta['tokenizer']!r:.40}")
    # landmark (LMK, multi-CLS) and Mean@k record their parameters
    if (meta.get("pooling_spec") is not None) != (meta["pooling"] in ROW_SET_POOLINGS):
        raise ArtifactError(path, f"pooling {meta['pooling']!r} " + ("needs key 'pooling_spec'" if meta["pooling"]
                                  in ROW_SET_POOLINGS else "takes no key 'pooling_spec'"))
    if meta.get("padding_side", "right") not in ("left", "right"):
        raise ArtifactError(path, f"key 'padding_side' must be 'left' or 'right', got {meta['padding_side']!r}")
    if meta["calibrated"]:
        if not isinstance(meta.get("config"), dict):
            raise ArtifactError(path, "a calibrated export needs key 'config' (the calibration config object)")
        try:
            CalibrationConfig.from_dict(meta["config"])
        except (TypeError, ValueError) as exc:
            raise ArtifactError(path, f"key 'config': {exc}") from None
    for rel, info in (meta.get("graphs") or {}).items():
        if rel not in GRAPH_FILES:
            raise ArtifactError(path, f"key 'graphs' names {rel!r}; expected one of {', '.join(GRAPH_FILES)}")
        if not isinstance(info, dict):
            raise ArtifactError(path, f"key 'graphs' entry {rel!r} must be an object, got {info!r:.60}")
    for rel in meta.get("files", ()):
        if rel not in LOADER_FILES:
            raise ArtifactError(path, f"key 'files' names {rel!r}, which is not a model loader file")
    return meta


def _check_sizes(meta: dict, path: str | os.PathLike) -> None:
    """The sizes an `attncal.json` claims, within the limits a reader allocates for (`MAX_SEQ_LENGTH_LIMIT`,
    `DIMENSION_LIMIT`)."""
    length = meta.get("max_seq_length")
    if length is not None and not 1 <= length <= MAX_SEQ_LENGTH_LIMIT:
        raise ArtifactError(path, f"key 'max_seq_length' is {length}, outside 1 to {MAX_SEQ_LENGTH_LIMIT}")
    layers = meta.get("num_layers", DIMENSION_LIMIT)
    if not 1 <= layers <= DIMENSION_LIMIT:
        raise ArtifactError(path, f"key 'num_layers' is {layers}, outside 1 to {DIMENSION_LIMIT}")
    outside = [x for x in meta["calibrated_layers"] if not 0 <= x < layers]
    if outside:
        raise ArtifactError(path, f"key 'calibrated_layers' holds {outside[0]}, outside 0 to {layers - 1}")


def read_metadata(out_dir: str | os.PathLike) -> dict:
    """The validated `attncal.json` of export `out_dir`."""
    out = check_dir(out_dir)
    path = out / METADATA_FILE
    if not path.exists():
        raise MissingArtifactError(path, "missing: this is not an attncal export "
                                         "(create one with `attncal export MODEL -o OUT`)")
    check_export_file(path, out, "attncal metadata file", LOADER_FILE_LIMIT)
    return validate_metadata(read_json(path, "attncal metadata"), path)


def write_metadata(out_dir: str | os.PathLike, meta: dict | ExportMetadata) -> Path:
    """Validate and write `attncal.json` (atomically); `format` defaults to FORMAT_VERSION."""
    if isinstance(meta, ExportMetadata):
        meta = meta.to_dict()
    meta.setdefault("format", FORMAT_VERSION)
    path = Path(out_dir) / METADATA_FILE
    validate_metadata(meta, path)
    write_text_atomic(path, json.dumps(meta, indent=2))
    return path


def loader_files(out_dir: str | os.PathLike) -> list[str]:
    """The loader files present at the root of a directory (what format 2 records under `files`)."""
    return sorted(f.name for f in Path(out_dir).iterdir() if f.is_file() and f.name in LOADER_FILES)


def check_model_files(out_dir: str | os.PathLike, meta: dict) -> None:
    """config.json (a JSON object), the loader files `attncal.json` lists, and the onnx/ directory.  Every loader
    file present (listed or not: the tokenizers read what they find) is a regular file inside the export of at
    most `LOADER_FILE_LIMIT` bytes, checked before anything reads it."""
    out = Path(out_dir)
    for name in sorted(LOADER_FILES):
        if os.path.lexists(out / name):
            check_export_file(out / name, out, "tokenizer or config file", LOADER_FILE_LIMIT)
    cfg = read_json(out / CONFIG_FILE, "model config")
    if not isinstance(cfg, dict):
        raise ArtifactError(out / CONFIG_FILE, f"expected a JSON object, got {type(cfg).__name__}")
    for rel in meta.get("files", ()):
        f = out / rel
        if not f.is_file():
            raise MissingArtifactError(f, "missing (the tokenizer/model loader needs it; attncal.json lists it)")
        check_readable(f, directory=False)
    check_dir(out / ONNX_SUBDIR, "ONNX graph directory of the export")


def graph_files(meta: dict) -> list[str]:
    """The export's graphs, relative to OUT, portable first."""
    graphs = meta.get("graphs")
    return sorted(graphs, key=lambda g: g != PORTABLE_GRAPH) if graphs else [PORTABLE_GRAPH]


# -- ONNX files -------------------------------------------------------------------------------------

class _Digest:
    """The sha256 of `graph_digest`, fed in its order: `head` (header and the sequences before the
    initializers), then each initializer (`add`, and its external bytes as raw updates), then `tail`."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()

    def add(self, b: bytes) -> None:
        self.h.update(len(b).to_bytes(8, "little"))
        self.h.update(b)

    def head(self, model, props) -> None:
        g = model.graph
        for text in (str(model.ir_version), model.producer_name, model.producer_version, model.domain,
                     str(model.model_version), g.name):
            self.add(text.encode("utf-8", "surrogatepass"))
        self._seqs((model.opset_import, props, model.functions, model.training_info, g.input, g.output))

    def tail(self, g) -> str:
        self.h.update(b"|")  # closes the initializers
        self._seqs((g.sparse_initializer, g.node, g.value_info, g.quantization_annotation))
        return "sha256:" + self.h.hexdigest()

    def _seqs(self, seqs) -> None:
        for seq in seqs:
            for item in seq:
                self.add(item.SerializeToString(deterministic=True))
            self.h.update(b"|")


# The keys of a TensorProto's external_data that ONNX defines; attncal writes the first three.
_EXTERNAL_KEYS = ("location", "offset", "length", "checksum")


def _tensors(model):
    """(what, TensorProto) for every tensor of a graph that a runtime loads: initializers and node attributes,
    in subgraphs and functions too (ONNX Runtime follows external data wherever it is), and sparse tensors;
    for a TensorProto (what a reader of one tensor checks), that tensor."""
    import onnx

    if isinstance(model, onnx.TensorProto):
        yield f"initializer {model.name!r}", model
        return

    def graph(g):
        for t in g.initializer:
            yield f"initializer {t.name!r}", t
        for sp in g.sparse_initializer:
            yield f"sparse initializer {sp.values.name!r}", sp
        yield from nodes(g.node)

    def nodes(ns):
        for n in ns:
            for a in n.attribute:
                what = f"attribute {a.name!r} of node {n.name or n.op_type!r}"
                if a.HasField("t"):
                    yield what, a.t
                yield from ((what, t) for t in a.tensors)
                if a.HasField("sparse_tensor"):
                    yield what, a.sparse_tensor
                yield from ((what, sp) for sp in a.sparse_tensors)
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from graph(sub)

    yield from graph(model.graph)
    for f in model.functions:
        yield from nodes(f.node)


# Bits per element of the tensor types that pack several elements into a byte.
_PACKED_BITS = {"INT4": 4, "UINT4": 4, "FLOAT4E2M1": 4, "INT2": 2, "UINT2": 2, "FLOAT6E2M3": 6, "FLOAT6E3M2": 6}


def _declared_size_problem(t) -> str | None:
    """Why a tensor's declared shape is not backed by the bytes it holds (None when it is): a runtime allocates
    what the shape says, so dims whose product exceeds the bytes present are refused, not allocated."""
    import onnx

    if any(d < 0 for d in t.dims):
        return f"declares a negative dimension {list(t.dims)}"
    count = math.prod(t.dims)
    if t.data_type == onnx.TensorProto.STRING:
        need, have, unit = count, len(t.string_data), "strings"
    else:
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        except (KeyError, ValueError, TypeError):
            return f"has data type {t.data_type}, which is no ONNX tensor type"
        bits = _PACKED_BITS.get(onnx.TensorProto.DataType.Name(t.data_type))
        packed = bits is not None
        need = -(-count * bits // 8) if packed else count * itemsize
        if t.data_location == onnx.TensorProto.EXTERNAL:
            have = int({e.key: e.value for e in t.external_data}["length"])
        elif t.HasField("raw_data"):
            have = len(t.raw_data)
        else:  # typed fields: one entry per element (or per packed byte), at most `itemsize` bytes each
            entries = sum(len(getattr(t, f)) for f in ("float_data", "int32_data", "int64_data", "double_data",
                                                        "uint64_data"))
            have = entries * (1 if packed else itemsize)
        unit = "bytes"
    if need > have:
        return f"declares shape {list(t.dims)} ({need:,} {unit}) but holds {have:,} {unit}"
    return None


def _external_problem(t, folder: Path, files: dict) -> str | None:
    """Why a tensor's external-data reference may not be followed (None when it may): its keys, then its
    location (relative, inside `folder` with symlinks followed, a regular file), then its range within that
    file.  `files` caches each location's size; nothing is opened (a FIFO would block the check)."""
    keys = [e.key for e in t.external_data]
    for key in keys:
        if key not in _EXTERNAL_KEYS:
            return f"external data key {key!r:.40} is not one ONNX defines"
        if keys.count(key) > 1:
            return f"external data key {key!r} is repeated"
    info = {e.key: e.value for e in t.external_data}
    loc = info.get("location", "")
    if not loc:
        return "external data has no location"
    for key in ("offset", "length"):
        value = info.get(key, "0" if key == "offset" else None)
        if value is None:
            return f"external data has no {key}"
        if not (value.isascii() and value.isdigit()):
            return f"external data {key} {value!r:.40} is not a non-negative integer"
    offset, length = int(info.get("offset", "0")), int(info["length"])
    if os.path.isabs(loc):
        return f"external data location {loc!r:.200} is an absolute path"
    if loc not in files:
        target = folder / loc
        if not _inside(target, folder):
            return f"external data location {loc!r:.200} resolves outside the export folder"
        try:
            st = target.stat()
        except OSError as exc:
            return f"external data cannot be read (location {loc!r:.200}: {exc.strerror or exc})"
        if not stat.S_ISREG(st.st_mode):
            return f"external data location {loc!r:.200} is {_file_kind(st.st_mode)}, not a regular file"
        files[loc] = st.st_size
    if offset + length > files[loc]:
        return (f"external data (offset {offset:,}, length {length:,}) ends past the end of {loc!r:.200} "
                f"({files[loc]:,} bytes): truncated external data")
    return None


def check_external_data(model, base_dir: str | os.PathLike, graph_file: str | os.PathLike | None = None) -> None:
    """Refuse a graph whose tensors would make a reader open or allocate anything but what its folder holds;
    run by every reader of a graph's external data (`graph_digest`, `write_graph_file`, `load_onnx_checked`,
    which runs before any ONNX Runtime session, the int8 quantizer) before it reads any.

    Each external-data reference must name a relative location that resolves, symlinks followed, to a regular
    file inside `base_dir` (the graph's folder), with a non-negative integer offset and length whose range lies
    within that file; every tensor's declared shape must be backed by the bytes it holds or references; a
    sparse tensor, which ONNX Runtime expands to its dense shape and attncal never writes, is refused.  Raises
    ArtifactError naming `graph_file` (else `base_dir`) and the tensor.  Only stat calls are made: the check
    opens nothing, so a FIFO or a device named by a hostile graph is refused, not read.  `model` may also be
    one TensorProto, for a reader of one tensor."""
    import onnx

    folder = Path(base_dir)
    files: dict[str, int] = {}
    for what, t in _tensors(model):
        if isinstance(t, onnx.SparseTensorProto):
            problem = "is a sparse tensor (ONNX Runtime expands it to its dense shape; attncal writes none)"
        elif t.data_location == onnx.TensorProto.EXTERNAL:
            problem = _external_problem(t, folder, files) or _declared_size_problem(t)
        else:
            problem = _declared_size_problem(t)
        if problem:
            raise ArtifactError(graph_file if graph_file is not None else folder, f"{what} {problem}")


def graph_digest(model, base_dir: str | os.PathLike | None = None) -> str:
    """sha256 over everything a graph file says except its doc strings and this digest: header,
    opsets, inputs, outputs, weights, nodes, value_info, functions and other metadata.  A weight in an
    external data file is hashed as its reference followed by its bytes, read from `base_dir` (the graph's
    folder, whose references `check_external_data` checks first); without `base_dir`, as its reference only."""
    import onnx

    if base_dir is not None:
        check_external_data(model, base_dir)
    d = _Digest()
    d.head(model, [p for p in model.metadata_props if p.key != DIGEST_KEY])
    for t in model.graph.initializer:
        d.add(t.SerializeToString(deterministic=True))
        if base_dir is not None and t.data_location == onnx.TensorProto.EXTERNAL:
            loc, off, length = external_info(t)
            _copy_range(Path(base_dir) / loc, off, length, d.h.update)
    return d.tail(model.graph)


def _set_digest(model, base_dir: str | os.PathLike | None = None) -> None:
    digest = graph_digest(model, base_dir)
    for p in model.metadata_props:
        if p.key == DIGEST_KEY:
            p.value = digest
            return
    model.metadata_props.add(key=DIGEST_KEY, value=digest)


def stored_digest(model) -> str | None:
    return next((p.value for p in model.metadata_props if p.key == DIGEST_KEY), None)


def stamp_onnx(path: str | os.PathLike) -> str:
    """(Re)write the `attncal.digest` of a saved graph (atomically); returns the digest."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    _set_digest(model, path.parent)
    tmp = path.with_name(path.name + ".stamping")
    onnx.save(model, str(tmp))
    os.replace(tmp, path)
    return stored_digest(model)


def save_onnx_proto(model, path: str | os.PathLike) -> None:
    """Save an onnx.ModelProto (below 2 GiB) with its digest, atomically."""
    import onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _set_digest(model)
    tmp = path.with_name(path.name + ".saving")
    onnx.save(model, str(tmp))
    os.replace(tmp, path)


def external_data_name(graph_file: str | os.PathLike) -> str:
    """The external-data file of a graph: `model.onnx` -> `model.onnx_data` (optimum's name), one per graph,
    so the graphs of one export never share (or overwrite) each other's weights."""
    return Path(graph_file).name + "_data"


def stage_onnx(model, path: str | os.PathLike) -> Path:
    """Save an onnx_ir model as a working copy: every tensor above 1 KiB in `<name>_data` beside it.

    onnx_ir streams the tensors to the data file (external tensors of the source are read from their
    memory map one at a time), so staging costs no copy of the weights; the graph file itself is small, and
    whatever reads it next (`onnx.load(..., load_external_data=False)`) parses the structure only."""
    import onnx_ir as ir

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, path, external_data=external_data_name(path), size_threshold_bytes=1024)
    return path


def save_structure(proto, path: str | os.PathLike) -> None:
    """Rewrite a staged graph file from its structure-only proto (its tensors stay in their data file)."""
    import onnx

    path = Path(path)
    tmp = path.with_name(path.name + ".saving")
    onnx.save(proto, str(tmp))
    os.replace(tmp, path)


# -- protobuf fields and external-data references, written here and by the int8 quantizer (attncal.export.quantize),
# which both stream weights around the onnx package instead of holding them in a message.

def varint_bytes(n: int) -> bytes:
    """`n` (non-negative) as a protobuf varint."""
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def field_header(number: int, payload_len: int) -> bytes:
    """A length-delimited protobuf field header (wire type 2) of field `number`; the payload follows it."""
    return varint_bytes(number << 3 | 2) + varint_bytes(payload_len)


# ModelProto.graph = 7, ModelProto.metadata_props = 14, GraphProto.initializer = 5, TensorProto.raw_data = 9.
MODEL_GRAPH, MODEL_PROPS, GRAPH_INITIALIZER, TENSOR_RAW_DATA = 7, 14, 5, 9
_CHUNK = 64 * 1024**2


def external_info(tensor) -> tuple[str, int, int] | None:
    """(location, offset, length) of a tensor's external data; None for a tensor held in the graph."""
    import onnx

    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in tensor.external_data}
    return info["location"], int(info.get("offset", 0)), int(info["length"])


def set_external(tensor, location: str, offset: int, length: int) -> None:
    """Make `tensor` a reference to `length` bytes at `offset` of `location` (its own bytes dropped)."""
    import onnx

    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=k, value=v)
    tensor.data_location = onnx.TensorProto.EXTERNAL


def is_long_context(max_seq_length: int | None) -> bool:
    """Whether an export of `max_seq_length` tokens is a long-context one (`LONG_CONTEXT_TOKENS`)."""
    return max_seq_length is None or max_seq_length > LONG_CONTEXT_TOKENS


def write_graph_file(proto, base_dir: str | os.PathLike, path: str | os.PathLike, *,
                     external: bool | None = None) -> str:
    """Write the export's graph file from `proto` (a ModelProto whose large tensors are external, under
    `base_dir`), with its `attncal.digest`, atomically; returns the digest.

    Below 2 GiB of tensors the file is self-contained, as every ONNX loader expects of a small model; above,
    or with `external`, the tensors go to `<name>_data` beside it (`external_data_name`).  Either way the weights are streamed
    (64 MiB at a time) and never held in memory: the self-contained file is written as protobuf fragments
    that a parser merges (a ModelProto holding the graph without its initializers, then one ModelProto per
    initializer, whose repeated `graph.initializer` entries append in order, then the digest's metadata
    entry), and the digest is computed over the same bytes as they are written, in `graph_digest`'s order."""
    import onnx

    base_dir, path = Path(base_dir), Path(path)
    check_external_data(proto, base_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    inits = list(proto.graph.initializer)
    total = sum(external_info(t)[2] if t.data_location == onnx.TensorProto.EXTERNAL else t.ByteSize() for t in inits)
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(proto)
    del skeleton.graph.initializer[:]
    props = [p for p in skeleton.metadata_props if p.key != DIGEST_KEY]
    del skeleton.metadata_props[:]
    skeleton.metadata_props.extend(props)
    d = _Digest()
    d.head(skeleton, props)
    tmp = path.with_name(path.name + ".writing")
    data_name = external_data_name(path)
    data_tmp = path.with_name(data_name + ".writing")
    external = total >= INLINE_LIMIT if external is None else external
    try:
        with open(tmp, "wb") as f, (open(data_tmp, "wb") if external else contextlib.nullcontext()) as data:
            if external:
                out_inits = []
                for t in inits:
                    t2 = onnx.TensorProto()
                    t2.CopyFrom(t)
                    if t.data_location == onnx.TensorProto.EXTERNAL:
                        loc, off, length = external_info(t)
                        set_external(t2, data_name, data.tell(), length)
                        d.add(t2.SerializeToString(deterministic=True))

                        def sink(chunk: bytes) -> None:
                            data.write(chunk)
                            d.h.update(chunk)

                        _copy_range(base_dir / loc, off, length, sink)
                    else:
                        d.add(t2.SerializeToString(deterministic=True))
                    out_inits.append(t2)
                skeleton.graph.initializer.extend(out_inits)
                digest = d.tail(skeleton.graph)
                skeleton.metadata_props.add(key=DIGEST_KEY, value=digest)
                f.write(skeleton.SerializeToString())
            else:
                f.write(skeleton.SerializeToString())
                for t in inits:
                    _write_inline_initializer(t, base_dir, f, d)
                digest = d.tail(skeleton.graph)
                entry = onnx.StringStringEntryProto(key=DIGEST_KEY, value=digest).SerializeToString()
                f.write(field_header(MODEL_PROPS, len(entry)) + entry)
        if external:
            os.replace(data_tmp, path.with_name(data_name))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        data_tmp.unlink(missing_ok=True)
    if not external:
        path.with_name(data_name).unlink(missing_ok=True)
    return digest


def _copy_range(src: Path, offset: int, length: int, sink) -> None:
    with open(src, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                raise ArtifactError(src, f"ends before offset {offset} + {length} (truncated external data)")
            sink(chunk)
            left -= len(chunk)


def _write_inline_initializer(t, base_dir: Path, f, d: _Digest) -> None:
    """One initializer as a ModelProto fragment, its external bytes moved into `raw_data`, and its canonical
    serialization hashed as `graph_digest` hashes it (fields 1-8, raw_data, then 10 on: field order)."""
    import onnx

    if t.data_location != onnx.TensorProto.EXTERNAL:
        b = t.SerializeToString(deterministic=True)
        d.add(b)
        g = field_header(GRAPH_INITIALIZER, len(b)) + b
        f.write(field_header(MODEL_GRAPH, len(g)) + g)
        return
    loc, off, length = external_info(t)
    head, tail = onnx.TensorProto(), onnx.TensorProto()
    head.CopyFrom(t)
    del head.external_data[:]
    head.ClearField("data_location")
    head.ClearField("raw_data")
    for name in ("double_data", "uint64_data", "doc_string", "metadata_props"):
        if name == "doc_string":
            if head.doc_string:
                tail.doc_string = head.doc_string
        else:
            getattr(tail, name).extend(getattr(head, name))
        head.ClearField(name)
    hb = head.SerializeToString(deterministic=True)
    tb = tail.SerializeToString(deterministic=True)
    raw = field_header(TENSOR_RAW_DATA, length)
    tensor_len = len(hb) + len(raw) + length + len(tb)
    g_head = field_header(GRAPH_INITIALIZER, tensor_len)
    f.write(field_header(MODEL_GRAPH, len(g_head) + tensor_len) + g_head + hb + raw)
    d.h.update(tensor_len.to_bytes(8, "little"))  # `add` of the whole serialization, streamed
    d.h.update(hb + raw)

    def sink(chunk: bytes) -> None:
        f.write(chunk)
        d.h.update(chunk)

    _copy_range(base_dir / loc, off, length, sink)
    f.write(tb)
    d.h.update(tb)


def weights_on_disk(path: Path) -> Path:
    """The graph at `path` with its weights in a data file beside it (TorchScript writes them inline below
    2 GiB): every later pass loads it lazily (memory-mapped) instead of parsing the weights."""
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


def write_graph(model, path: Path, work: Path, weight_bytes: int, *, full_check: bool = False,
                passes: tuple = ()) -> dict[str, dict[str, int]]:
    """Write a graph of the export once: `model` (an onnx_ir model) staged under `work` with its weights on
    disk, `passes` run in order on its structure (`attncal.graphs.fusions.passes.STAGED`: each an `Ordered` whose
    `graph_pass` takes a ModelProto), checked, then streamed into `path` with its digest (`write_graph_file`);
    returns each pass's report by its name.

    Every pass here reads the staged graph's structure only (`load_external_data=False`), so no step holds a
    second copy of the weights.  The optimized graphs carry contrib ops: checked without full shape inference.
    `weight_bytes`: the model's float32 weights, for `release_freed_memory` after the write."""
    import onnx

    staged = stage_onnx(model, work / path.name)
    proto = onnx.load(str(staged), load_external_data=False)
    reports = {p.graph_pass.name: p.graph_pass.run(proto) for p in passes}
    if any(n for report in reports.values() for n in report.values()):
        save_structure(proto, staged)
    onnx.checker.check_model(str(staged), full_check=full_check)  # a path: external files found beside it
    # A graph that a `keeps_data_file` pass rewrote keeps its weights in a data file (the feed-forward chunks:
    # ONNX Runtime holds a self-contained graph's weights that a Scan body reads from the outer graph a second
    # time, beside the MatMuls' packed copies).
    keep = any(p.graph_pass.keeps_data_file and any(reports[p.graph_pass.name].values()) for p in passes)
    write_graph_file(proto, staged.parent, path, external=True if keep else None)
    for f in (staged, staged.with_name(staged.name + "_data")):
        f.unlink(missing_ok=True)
    del model, proto
    release_freed_memory(weight_bytes)
    return reports


def save_onnx(model, path: str | os.PathLike) -> None:
    """Save an onnx_ir model with its digest: one file below 2 GiB, else with `<name>_data` beside it
    (staged through a working copy beside `path`, so the weights are streamed, not copied in memory)."""
    import onnx

    path = Path(path)
    stage = path.with_name(path.name + ".stage")
    stage.mkdir(parents=True, exist_ok=True)
    try:
        staged = stage_onnx(model, stage / path.name)
        write_graph_file(onnx.load(str(staged), load_external_data=False), stage, path)
    finally:
        import shutil

        shutil.rmtree(stage, ignore_errors=True)


def load_onnx_checked(
    path: str | os.PathLike,
    *,
    interface: bool = True,
    require_digest: bool = False,
    expected_inputs: Iterable[str] | None = None,
):
    """Parse an ONNX file (without external weights) or raise ArtifactError naming it.

    Catches a missing, unreadable, empty, truncated or corrupted file, and one above
    `GRAPH_FILE_LIMIT` (before reading it); with `interface`, a graph that is not an attncal
    encoder (inputs input_ids/attention_mask[/token_type_ids], outputs last_hidden_state and
    sentence_embedding); a graph whose external data or declared shapes `check_external_data`
    refuses (before anything follows a reference); and a graph whose content does not match its
    `attncal.digest` (required to be present with `require_digest`, format 2)."""
    import onnx

    path = Path(path)
    data = read_bytes(path, "ONNX graph", GRAPH_FILE_LIMIT)
    if not data:
        raise ArtifactError(path, "empty file (0 bytes); re-export the model")
    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf DecodeError, onnx's parse errors: all mean a damaged file
        raise ArtifactError(path, f"not a readable ONNX model: truncated or corrupted "
                                  f"({type(exc).__name__}, {len(data)} bytes); re-export the model") from None
    del data
    if not model.HasField("graph") or not len(model.graph.node):
        raise ArtifactError(path, "holds no graph (truncated or corrupted); re-export the model")
    if interface:
        inputs = [i.name for i in model.graph.input]
        outputs = [o.name for o in model.graph.output]
        if any(n not in outputs for n in OUTPUT_NAMES) or set(inputs) - set(INPUT_NAMES) or \
                any(n not in inputs for n in REQUIRED_INPUTS):
            raise ArtifactError(path, f"not an attncal export graph: inputs {inputs}, outputs {outputs} "
                                      f"(expected inputs {', '.join(REQUIRED_INPUTS)}[, token_type_ids] and "
                                      f"outputs {', '.join(OUTPUT_NAMES)})")
        if expected_inputs is not None and sorted(inputs) != sorted(expected_inputs):
            raise ArtifactError(path, f"graph inputs {inputs} differ from attncal.json's {list(expected_inputs)}")
    check_external_data(model, path.parent, path)  # before the digest, or ONNX Runtime, follows a reference
    digest = stored_digest(model)
    if digest is None:
        if require_digest:
            raise ArtifactError(path, f"has no {DIGEST_KEY} (truncated, or not written by attncal export)")
    else:
        try:
            actual = graph_digest(model, path.parent)  # external weights read and hashed too
        except OSError as exc:
            raise ArtifactError(path, f"its external data cannot be read ({exc.strerror or exc}: "
                                      f"{Path(exc.filename or '').name}); re-export the model") from None
    if digest is not None and actual != digest:
        raise ArtifactError(path, "content does not match its attncal digest: the file is corrupted or was "
                                  "modified after export; re-export the model")
    return model


# -- a whole export -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExportDir:
    """A validated export directory."""

    path: Path
    meta: dict

    @property
    def graphs(self) -> list[str]:
        return graph_files(self.meta)

    @property
    def requires_digest(self) -> bool:
        return int(self.meta["format"]) >= 2

    def check_graph(self, rel: str, interface: bool = True):
        """Parse and verify one graph of the export; returns the ModelProto (weights not copied out)."""
        check_export_file(self.path / rel, self.path, "ONNX graph")
        return load_onnx_checked(self.path / rel, interface=interface, require_digest=self.requires_digest,
                                 expected_inputs=self.meta.get("inputs"))


def open_export(out_dir: str | os.PathLike, *, graphs: Iterable[str] | str | None = "all") -> ExportDir:
    """Validate export `out_dir`: attncal.json, model files, onnx/ and the graphs named by `graphs`
    ("all": every graph attncal.json lists, None: none). Raises ArtifactError naming what is wrong."""
    meta = read_metadata(out_dir)
    exp = ExportDir(Path(out_dir), meta)
    check_model_files(exp.path, meta)
    for rel in (exp.graphs if graphs == "all" else [graphs] if isinstance(graphs, str) else graphs or []):
        exp.check_graph(rel)
    return exp


def looks_like_export(path: str | os.PathLike) -> bool:
    """Whether `path` is meant to be an export (attncal.json or an onnx/ directory), damaged or not."""
    p = Path(path)
    try:
        if not p.is_dir():
            return False
        if not os.access(p, os.R_OK | os.X_OK) or not p.stat().st_mode & 0o444:
            return True  # unreadable: let open_export say so
        return (p / METADATA_FILE).exists() or (p / ONNX_SUBDIR).is_dir()
    except OSError:
        return False


__all__ = [
    "ArtifactError", "MissingArtifactError", "commit_dir", "ExportDir", "open_export", "read_metadata", "write_metadata",
    "validate_metadata", "check_model_files", "load_onnx_checked", "save_onnx", "save_onnx_proto", "stamp_onnx",
    "graph_digest", "graph_files", "looks_like_export", "loader_files", "check_dir", "read_json",
    "check_external_data", "check_export_file", "GRAPH_FILE_LIMIT", "LOADER_FILE_LIMIT", "MAX_SEQ_LENGTH_LIMIT",
    "DIMENSION_LIMIT",
    "ONNX_SUBDIR", "ONNX_FILE", "OPTIMIZED_FILE", "NATIVE_FILE", "NATIVE_GRAPH", "INLINED_FILE", "INLINED_GRAPH",
    "GRAPH_FILES", "EXTERNAL_DATA_FILE", "METADATA_FILE", "CONFIG_FILE",
    "PORTABLE_GRAPH", "OPTIMIZED_GRAPH", "FORMAT_VERSION", "SUPPORTED_FORMATS",
]
