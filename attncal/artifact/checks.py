"""Checks on untrusted input: an export may come from anyone (a model hub, a shared bucket), so nothing in it
is followed before it is checked (docs/threat-model.md).

The files read whole (attncal.json, config and tokenizer files, graph files) are regular files inside the
export below a size limit (`check_export_file`, `read_bytes`), and `check_external_data` checks every
external-data reference of a graph (a regular file inside the graph's folder, the range within it, the
declared shapes within the bytes present) before any reader opens one.  Each check makes stat calls only:
nothing is opened before it passes, so a FIFO or a device named by a hostile export is refused, not read.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from .layout import (CONFIG_FILE, DIMENSION_LIMIT, LOADER_FILE_LIMIT, LOADER_FILES, ONNX_SUBDIR, ArtifactError,
                     MissingArtifactError)


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
