"""The export's ONNX files: their digest, and their reading and writing with the weights streamed.

The digest (`attncal.digest` in a graph's ONNX metadata, format 2) is a sha256 over everything the graph file
holds except its doc strings (nodes, weights, functions, inputs, outputs, value_info, opsets, header), so a
flipped byte is caught before anything runs, while a tool that only rewrites the model's doc string keeps it
valid.  Weights in an external-data file are covered by reference (name, offset, length) and by their bytes
where the graph's folder is given.

A graph is written once, from a staged copy whose weights are on disk (`write_graph`, `write_graph_file`): the
weights are streamed as protobuf fragments (`varint_bytes`, `field_header`, also the int8 quantizer's,
`attncal.exporting.quantize`) or into an external-data file, never held in a message.  `load_onnx_checked` parses
a graph and verifies its interface, its external data (`attncal.artifact.checks`) and its digest.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Iterable

from ..memory import release_freed_memory
from .checks import check_external_data, read_bytes
from .layout import (DIGEST_KEY, GRAPH_FILE_LIMIT, INPUT_NAMES, OUTPUT_NAMES, REQUIRED_INPUTS, TWO_GIB,
                     ArtifactError)

# Tensor bytes from which a graph is written with external data (protobuf cannot hold a 2 GiB message; the
# margin is for the graph structure itself).
INLINE_LIMIT = TWO_GIB - 64 * 1024**2


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
        # An input with an initializer of its name is optional (its default is the initializer): the chunk spans
        # of an export with chunk vectors.  The interface is the inputs every call feeds.
        optional = {t.name for t in model.graph.initializer}
        inputs = [i.name for i in model.graph.input if i.name not in optional]
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
