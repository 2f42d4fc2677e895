"""`attncal.json`: what an export holds and how it was made (`ExportMetadata`), its validation
(`validate_metadata`: keys, types and the sizes a reader allocates for), and its reading and writing.
"""

from __future__ import annotations

import json
import os
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..calibration.config import CalibrationConfig
from ..pooling import Pooling
from .checks import check_dir, check_export_file, read_json
from .layout import (DIMENSION_LIMIT, FORMAT_VERSION, GRAPH_FILES, INPUT_NAMES, LOADER_FILE_LIMIT, LOADER_FILES,
                     MAX_SEQ_LENGTH_LIMIT, METADATA_FILE, REQUIRED_INPUTS, SUPPORTED_FORMATS, TOKENIZERS,
                     ArtifactError, MissingArtifactError, write_text_atomic)

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
    pooling: dict  # attncal.pooling.Pooling.to_json(), concrete, a landmark kind's token resolved
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
    # `attncal export --chunk-vectors`: every graph also takes the optional input of chunk token spans and returns
    # the chunk vectors (attncal.exporting.chunk_vectors writes it; absent in exports made without it, and before it)
    chunk_vectors: dict | None = None
    export_steps: list | None = None  # written once the export's steps have run
    format: int = FORMAT_VERSION

    def to_dict(self) -> dict:
        out = {"format": self.format}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "format" and not (f.name in ("export_steps", "chunk_vectors") and value is None):
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
    if fmt < 3:
        meta = _upgrade_pooling(meta, path)
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
    try:
        pooling = Pooling.from_json(meta["pooling"])
    except ValueError as exc:
        raise ArtifactError(path, f"key 'pooling': {exc}") from None
    if not pooling.resolved:
        raise ArtifactError(path, f"key 'pooling' ({pooling.describe()}) must be concrete, with a landmark kind's "
                                  "token_id")
    if meta.get("padding_side", "right") not in ("left", "right"):
        raise ArtifactError(path, f"key 'padding_side' must be 'left' or 'right', got {meta['padding_side']!r}")
    if meta["calibrated"]:
        if not isinstance(meta.get("config"), dict):
            raise ArtifactError(path, "a calibrated export needs key 'config' (the calibration config object)")
        try:
            config = CalibrationConfig.from_dict(meta["config"])
        except (TypeError, ValueError) as exc:
            raise ArtifactError(path, f"key 'config': {exc}") from None
        if config.pooling != pooling:
            raise ArtifactError(path, f"key 'config' pools {config.pooling.describe()}, key 'pooling' "
                                      f"{pooling.describe()}")
    for rel, info in (meta.get("graphs") or {}).items():
        if rel not in GRAPH_FILES:
            raise ArtifactError(path, f"key 'graphs' names {rel!r}; expected one of {', '.join(GRAPH_FILES)}")
        if not isinstance(info, dict):
            raise ArtifactError(path, f"key 'graphs' entry {rel!r} must be an object, got {info!r:.60}")
    for rel in meta.get("files", ()):
        if rel not in LOADER_FILES:
            raise ArtifactError(path, f"key 'files' names {rel!r}, which is not a model loader file")
    return meta


def _upgrade_pooling(meta: dict, path: str | os.PathLike) -> dict:
    """A copy of a format 1 / 2 `attncal.json` with its pooling in format 3's form: the word and `pooling_spec`
    become one `pooling` object (landmark: the spec's lmk or multi-cls), and so does the calibration config's."""
    meta = dict(meta)
    try:
        pooling = Pooling.from_json(meta["pooling"], meta.pop("pooling_spec", None))
    except ValueError as exc:
        raise ArtifactError(path, f"key 'pooling': {exc}") from None
    meta["pooling"] = pooling.to_json()
    if isinstance(meta.get("config"), dict) and not isinstance(meta["config"].get("pooling"), dict):
        try:
            config = CalibrationConfig.from_dict(meta["config"])
        except (TypeError, ValueError) as exc:
            raise ArtifactError(path, f"key 'config': {exc}") from None
        keep = config.pooling.concrete and not config.pooling.row_set  # landmark: the spec says lmk or multi-cls
        meta["config"] = config.with_pooling(config.pooling if keep else pooling).to_dict()
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


def pooling_of(meta: dict) -> Pooling:
    """The export's pooling: `pooling` of an `attncal.json` that `validate_metadata` returned (old forms read)."""
    return Pooling.from_json(meta["pooling"])


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
