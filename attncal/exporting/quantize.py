"""int8 exports: dynamic quantization of the written graphs, calibration kept in fp32, in bounded memory.

Each weight MatMul becomes DynamicQuantizeLinear + MatMulInteger with 8-bit weights, and ORT's fused
`Attention` becomes `QAttention`.  Only nodes that multiply by a weight are quantized (`weight_nodes`): the
attention core (Q·Kᵀ and P·V MatMuls of the plain graph, the split placement's basket attention, the
`ai.attncal` calibration and calibrated-attention ops) and every calibration scalar stay fp32, so the
calibration math is exactly the fp32 math on slightly different activations.

Per-channel weights are the default: per-tensor int8 loses far more cosine to the fp32 embeddings
(docs/quantization.md gives both on all-MiniLM-L6-v2).  The weight format depends on the CPUs the export is for
(`INT8_TARGETS`), because ONNX Runtime's integer kernels add the products differently per CPU (attncal.cpuinfo):

* "vnni": int8 weights (U8S8).  VNNI CPUs add the products exactly, in int32, with their fastest instructions;
  AVX2 CPUs and AVX-512 CPUs without VNNI add two of them in saturating int16, which 8-bit weights overflow, so
  there the same graph computes other sums and loses cosine to the fp32 embeddings.
* "portable": uint8 weights (U8U8).  Every kernel widens both operands to int16 and adds in int32, so every x86-64
  CPU with AVX2 computes the same integers, but without VNNI's instructions, so it runs slower on VNNI CPUs.
* "auto" (the default) is the exporting machine's: "vnni" on a VNNI CPU, else "portable".

7-bit int8 weights (`reduce_range`) would be exact everywhere too, but lose more to the fp32 embeddings than either
(docs/quantization.md gives the three), so no target uses them.  Each quantized graph records its weights, the CPU
class it was made and checked on and the classes its figures cover (`quantization_record`, in its ONNX metadata
under `attncal.cpuinfo.INT8_RECORD_KEY`), and `Encoder` warns on a CPU outside them.

The graph written is the one `onnxruntime.quantization.quantize_dynamic` writes for these options
(`weight_type` QUInt8 or QInt8, `per_channel`, `reduce_range`, MatMul / Gemm / Attention restricted to
`weight_nodes`, DefaultTensorType FLOAT; tests/test_quantize.py compares the two node for node and weight
for weight, the weights as numbers), built the way the rest of the exporter works: on the graph's structure,
never on its weights.  ONNX Runtime's quantizer loads the
graph with every weight, runs shape inference on it and holds the float32 weights beside their int8 copies
until it saves (4.4x the float32 weights at bge-m3's size).  Here:

* the graph is read without its weights (`_structure`): tensors in a data file stay references into it, and
  the large tensors of a self-contained graph become references into the graph file itself, so nothing is
  parsed into memory but the structure and the small tensors;
* ONNX's shape inference runs on that structure (twice, before and after the Gemm rewrite, as ONNX
  Runtime's quantizer does: its value_info and the Casts' types come from it);
* a weight's per-channel scales take one pass over it, read block by block from its file (`_blocks`);
* the int8 weights (and the transposed copies of Gemm weights, below) are computed block by block when the
  graph is written, into a working data file beside it, and `attncal.artifact.write_graph_file` streams the
  result into place (one file below 2 GiB of tensors, `<graph>.onnx_data` above; atomically, with its digest).

This copies the behaviour of one ONNX Runtime release, `MIRRORS_ORT`; with another installed, quantizing says
so once (its quantizer, and so the reference the tests compare with, may have changed).

What ONNX Runtime 1.32's quantizer does in this mode, and so what this does:

* Activations: one `DynamicQuantizeLinear` per quantized value (`<x>_QuantizeLinear`, outputs `<x>_quantized`,
  `<x>_scale`, `<x>_zero_point`: uint8, asymmetric, per tensor, at run time), emitted before its first
  consumer and shared by the others.
* Weights, per output channel (the last axis; `<w>_scale`, `<w>_zero_point`, `<w>_quantized`): the channel's
  range [min(w, 0), max(w, 0)] (made symmetric for int8) over the integer range [qmin, qmax] in float64 is
  the scale, stored as float32 (1.0 when below float32's smallest normal); the zero point is 0 for int8 and
  round(qmin - min / scale) for uint8; q = clip(round-half-even(w / scale) + zero point) in float32, to the
  type's full range.  [qmin, qmax]: uint8 [0, 255] ([0, 127] with reduce_range), int8 [-127, 127]
  ([-64, 64] with reduce_range).
* MatMul: `MatMulInteger` (`<node>_quant`) -> `Cast` to the output's type -> `Mul` by the product of the two
  scales (`<node>_quant_scales_mul`) -> `Mul` (`<node>_quant_output_scale_mul`) writing the original output.
* Attention: `QAttention` (com.microsoft, `<node>_quant`; inputs q input, q weight, bias, the two scales,
  mask, the two zero points, past; attributes copied, sorted by name).  One with `qkv_hidden_sizes` stays.
* Gemm is not quantized in dynamic mode: every Gemm with alpha = beta = 1 and transA = 0 becomes a float32
  MatMul (`<node>_MatMul`, with a transposed copy `<B>_Transposed` of a transB weight) and an Add
  (`<node>_Add`); the new MatMul's name is not among the nodes to quantize, so it stays float32.
* The float32 weights no longer used are dropped, the nodes are put in ONNX Runtime's topological order,
  the producer becomes onnx.quantize 0.1.0 and the metadata gains `onnx.infer`.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import cpuinfo
from ..artifact import (GRAPH_INITIALIZER, MODEL_GRAPH, TENSOR_RAW_DATA, check_external_data, external_info,
                        field_header, set_external, write_graph_file)
from ..runtime.encoder import length_batches
from ..runtime.parity import builtin_texts
from ..versions import warn_if_not_mirrored

QUANTIZATIONS = ("int8",)
MIRRORS_ORT = "1.32"  # the onnxruntime release whose quantize_dynamic this reproduces
WEIGHTS = ("int8", "uint8")  # quantize_dynamic's weight_type QInt8 (symmetric) / QUInt8 (asymmetric)
WEIGHT_TYPE = "uint8"  # the portable format: exact integer sums on every AVX2 / AVX-512 / VNNI kernel (module doc)
# The CPUs an int8 export is made for, and the weight format each gets (module doc).  "auto" is the target of the
# exporting machine's class (`resolve_target`): exports are most often served on the kind of machine that made them,
# and an export run elsewhere says so (attncal.cpuinfo.warn_if_uncovered).
TARGET_WEIGHTS = {"vnni": "int8", "avx2": "int8", "portable": "uint8"}
# The targets whose weights are 7-bit (reduce_range), and so whose most sensitive MatMuls are kept in fp32
# (`sensitivity`): int8 weights of |q| <= 64 add exactly in the int16 pair sums of AVX2 and AVX-512 (attncal.cpuinfo).
REDUCED_TARGETS = ("avx2",)
INT8_TARGETS = ("auto",) + tuple(TARGET_WEIGHTS)
REDUCE_RANGE = False
# The integer range each weight type's scale maps onto, full or reduced (quant_utils' ONNX_INT_TYPE_SYMMETRIC_RANGE,
# ONNX_INT_TYPE_RANGE and ONNX_INT_TYPE_REDUCED_RANGE); the quantized values are clipped to the type's full range.
_WEIGHT_RANGES = {("int8", False): (-127, 127), ("int8", True): (-64, 64),
                  ("uint8", False): (0, 255), ("uint8", True): (0, 127)}
_WEIGHT_OPS = {("", "MatMul"), ("", "Gemm"), ("com.microsoft", "Attention")}
_OP_TYPES = {"MatMul", "Attention"}  # what ONNX Runtime's dynamic quantizer rewrites of those (Gemm: see above)
_BLOCK_BYTES = 16 * 1024**2  # float32 bytes of a weight read at once
_INLINE_BELOW = 1024  # raw tensor bytes kept in the structure (shape inference reads small tensors' values)
_MS_DOMAIN = "com.microsoft"
_PRODUCER = ("onnx.quantize", "0.1.0")  # what ONNX Runtime's quantizer writes as the producer
_INFER_PROP = ("onnx.infer", "onnxruntime.quant")
# The sensitivity measurement of 7-bit targets (`sensitivity`): texts, their words, the cosine p1 the choice of
# fp32 nodes aims at on them (above the 0.99 budget on unseen prose, which runs lower), and the most nodes kept.
SENSITIVITY_TEXTS = 16
SENSITIVITY_WORDS = 256
SENSITIVITY_GOAL_P1 = 0.993
SENSITIVITY_MAX_SHARE = 0.25


def weight_nodes(model) -> list[str]:
    """Names of the nodes that multiply activations by a weight matrix (a 2-D initializer): the ones to
    quantize.  ORT's per-channel MatMulInteger takes 2-D weights only; a 3-D one (per-head weight slices the
    row placement builds) stays fp32."""
    dims = {i.name: len(i.dims) for i in model.graph.initializer}
    names = []
    for n in model.graph.node:
        if (n.domain if n.domain != "ai.onnx" else "", n.op_type) not in _WEIGHT_OPS or not n.name:
            continue
        if len(n.input) > 1 and dims.get(n.input[1]) == 2:
            names.append(n.name)
    return names


def weight_nodes_of(path: Path) -> list[str]:
    """`weight_nodes` of the graph file at `path`, read without its weights (unnamed nodes named as quantizing
    names them)."""
    model = _structure(Path(path))
    _name_unnamed(model)
    return weight_nodes(model)


def resolve_target(target: str, here: str | None = None) -> str:
    """The int8 target `target` names on a machine of class `here` (default this one's): "auto" is "vnni" on a
    VNNI CPU, where 8-bit int8 weights add exactly and run fastest, "avx2" on an AVX2 or AVX-512 CPU without
    VNNI, whose U8S8 kernels add 7-bit weights exactly, and "portable" elsewhere (ARM, x86-64 without AVX2),
    whose kernels this project has not measured."""
    if target not in INT8_TARGETS:
        raise ValueError(f"int8 target must be one of {', '.join(INT8_TARGETS)}, got {target!r}")
    if target != "auto":
        return target
    here = here or cpuinfo.cpu_class()
    if here in cpuinfo.VNNI_CLASSES:
        return "vnni"
    return "avx2" if here in cpuinfo.PAIR_SUM_CLASSES else "portable"


def target_reduce_range(target: str) -> bool:
    """Whether a (resolved) target's weights are 7-bit."""
    return target in REDUCED_TARGETS


def method(weights: str, reduce_range: bool = REDUCE_RANGE) -> str:
    """The `method` line attncal.json records for int8 graphs with these weights."""
    weight_type = {"int8": "QInt8", "uint8": "QUInt8"}[weights]
    reduced = ", reduce_range" if reduce_range else ""
    kept = "; the most sensitive MatMuls in fp32 (nodes_to_exclude, `fp32_nodes`)" if reduce_range else ""
    return (f"attncal's streamed dynamic quantization, equal to onnxruntime.quantization.quantize_dynamic's "
            f"({weight_type} weights per output channel{reduced}, uint8 activations quantized per batch{kept}); "
            "attention core and calibration in fp32")


def quantization_record(per_channel: bool = True, weights: str = WEIGHT_TYPE, reduce_range: bool = REDUCE_RANGE
                        ) -> dict:
    """What an int8 graph made here with these options records: its quantization parameters, the CPU class
    of this machine (where the export's parity check measures it) and the classes those figures cover, and
    why (attncal.cpuinfo.int8_coverage)."""
    qmin, qmax = _WEIGHT_RANGES[weights, reduce_range]
    return {"per_channel": per_channel, "weights": weights, "reduce_range": reduce_range,
            "weight_range": [qmin, qmax], "activations": "uint8, asymmetric, per tensor, at run time",
            **cpuinfo.int8_coverage(cpuinfo.cpu_class(), weights, (qmin, qmax))}


def quantize_graph(path: Path, per_channel: bool = True, weights: str = WEIGHT_TYPE,
                   reduce_range: bool = REDUCE_RANGE, keep_fp32: Sequence[str] = ()) -> int:
    """Quantize the graph at `path` in place (written beside it, then renamed); returns how many nodes were
    quantized.  The weight nodes named in `keep_fp32` stay fp32 (quantize_dynamic's nodes_to_exclude).  A
    float32 data file beside it that the int8 graph no longer needs goes.  The graph's ONNX metadata gains
    `quantization_record` under attncal.cpuinfo.INT8_RECORD_KEY."""
    warn_if_not_mirrored("onnxruntime", MIRRORS_ORT, "attncal's int8 quantizer reproduces quantize_dynamic")
    path = Path(path)
    model = _structure(path)
    _name_unnamed(model)
    nodes = weight_nodes(model)
    if not nodes:
        raise ValueError(f"{path}: no MatMul/Gemm/Attention node with a weight initializer to quantize")
    unknown = sorted(set(keep_fp32) - set(nodes))
    if unknown:
        raise ValueError(f"{path}: nodes to keep in fp32 that are not weight nodes of the graph: {unknown[:3]}")
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    q = _Quantizer(model, path.parent, set(nodes) - set(keep_fp32), per_channel, weights, reduce_range)
    model, count = q.run()
    model.metadata_props.add(key=cpuinfo.INT8_RECORD_KEY, value=json.dumps(
        quantization_record(per_channel, weights, reduce_range), sort_keys=True))
    work = path.with_name(f".{path.name}.quantized_data")
    try:
        with open(work, "wb") as f:  # the computed tensors, one at a time, in the graph's order
            for t in model.graph.initializer:
                fill = q.lazy.get(t.name)
                if fill is None:
                    continue
                offset = f.tell()
                fill(f)
                set_external(t, work.name, offset, f.tell() - offset)
        # One file below 2 GiB of tensors, else `<graph>.onnx_data`; either way it replaces the float32 one.
        write_graph_file(model, path.parent, path)
    finally:
        work.unlink(missing_ok=True)
    return count


def sensitivity_texts(count: int = SENSITIVITY_TEXTS) -> list[str]:
    """Real prose for the sensitivity measurement: windows of SENSITIVITY_WORDS words from the first Python
    Language Reference topics (pydoc_data, in every CPython; sorted by name, two windows per topic), so the
    last topics stay unseen for evaluations (benchmarks/int8_cpu_classes.py uses the last 48).  The parity
    check's built-in texts where this Python has no pydoc_data."""
    try:
        from pydoc_data.topics import topics  # lazy: stdlib data, some distributions strip it
    except ImportError:
        return builtin_texts()
    out = []
    for name in sorted(topics):
        words = topics[name].split()
        out.extend(" ".join(words[i:i + SENSITIVITY_WORDS]) for i in range(0, min(len(words), 2 * SENSITIVITY_WORDS),
                                                                            SENSITIVITY_WORDS))
        if len(out) >= count:
            break
    return out[:count]


def sensitivity_feeds(tokenizer, texts: Sequence[str] | None = None, batch: int = 16) -> list[dict]:
    """`texts` (default `sensitivity_texts()`) tokenized by `tokenizer` (attncal.runtime.tokenizer's, called
    on a list of texts) in batches of `batch`, longest first."""
    texts = list(texts) if texts is not None else sensitivity_texts()
    return [tokenizer([texts[j] for j in idx]) for idx in length_batches(tokenizer.token_lengths(texts), batch)]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)


def _drift(cos: np.ndarray) -> dict:
    return {"p1_cosine": round(float(np.percentile(cos, 1)), 6), "min_cosine": round(float(cos.min()), 6),
            "mean_drift": float(f"{float(np.mean(1.0 - cos)):.4g}")}


def sensitivity(path: Path, feeds: Sequence[dict], weights: str = "int8", reduce_range: bool = True, *,
                library: Path | None = None, goal_p1: float = SENSITIVITY_GOAL_P1,
                max_share: float = SENSITIVITY_MAX_SHARE, per_channel: bool = True) -> dict:
    """Which weight nodes of the fp32 graph at `path` to keep in fp32 when the others are quantized with these
    options, measured on `feeds` (tokenized batches of real prose), and the drift measured with that choice.

    One probe graph holds every weight node both quantized and in fp32, a bool input per node choosing
    (ONNX Runtime's own integer kernels, so what the int8 graph computes on this CPU).  Each node's
    contribution is the mean cosine drift (1 - cosine to the fp32 embeddings) it removes when it alone is
    kept in fp32; nodes are taken by that gain per weight element (the fp32 multiplies each costs) until the
    cosine p1 reaches `goal_p1` or `max_share` of the nodes are kept.  The record lists the kept nodes, the
    drift with all quantized and with the choice, and the ranking's head."""
    import onnxruntime as ort  # lazy: the exporter's runtime dependency, loaded by the step that needs it

    path = Path(path)
    model = _structure(path)
    _name_unnamed(model)
    nodes = weight_nodes(model)
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    cost = {n.name: int(np.prod(dims[n.input[1]])) for n in model.graph.node if n.name in set(nodes)}
    q = _Quantizer(model, path.parent, set(nodes), per_channel, weights, reduce_range, probe=True)
    m, _ = q.run()
    switches = q.switches
    probe, data = path.with_name(f".{path.name}.probe.onnx"), path.with_name(f".{path.name}.probe_data")
    try:
        with open(data, "wb") as f:
            for t in m.graph.initializer:
                fill = q.lazy.get(t.name)
                if fill is not None:
                    offset = f.tell()
                    fill(f)
                    set_external(t, data.name, offset, f.tell() - offset)
        probe.write_bytes(m.SerializeToString())
        so = ort.SessionOptions()
        if library is not None:
            so.register_custom_ops_library(str(library))
        session = ort.InferenceSession(str(probe), so, providers=["CPUExecutionProvider"])
        inputs = {i.name for i in session.get_inputs()}

        def embed(fp32: set[str]) -> np.ndarray:
            flags = {f"attncal_fp32_{k}": np.array(n in fp32) for k, n in enumerate(switches)}
            return np.concatenate([session.run(["sentence_embedding"], {**{k: v for k, v in feed.items()
                                                                          if k in inputs}, **flags})[0]
                                   for feed in feeds])

        reference = embed(set(switches))
        base = _cosines(embed(set()), reference)
        base_drift = float(np.mean(1.0 - base))
        gain = {n: base_drift - float(np.mean(1.0 - _cosines(embed({n}), reference))) for n in switches}
        ranking = sorted((n for n in switches if gain[n] > 0), key=lambda n: gain[n] / cost[n], reverse=True)
        limit = int(max_share * len(switches))
        kept, cos = [], base
        for n in ranking:  # one node at a time, each step measured: the gains do not simply add up
            if float(np.percentile(cos, 1)) >= goal_p1 or len(kept) >= limit:
                break
            kept.append(n)
            cos = _cosines(embed(set(kept)), reference)
    finally:
        probe.unlink(missing_ok=True)
        data.unlink(missing_ok=True)
    return {"goal_p1": goal_p1, "texts": int(len(reference)), "candidates": len(switches), "fp32_nodes": kept,
            "all_int8": _drift(base), "chosen": _drift(cos),
            "ranking": [{"node": n, "drift_removed": float(f"{gain[n]:.4g}"), "weight_elements": cost[n]}
                        for n in ranking[:8]]}


def graph_record(path: Path) -> dict | None:
    """The `quantization_record` an int8 graph file carries (None: none), read without its weights."""
    return cpuinfo.int8_record({p.key: p.value for p in _structure(Path(path)).metadata_props})


def _name_unnamed(model) -> None:
    """`nodes_to_quantize` selects by name: give every unnamed node a unique one."""
    seen = {n.name for n in model.graph.node if n.name}
    for i, n in enumerate(model.graph.node):
        if not n.name:
            name = f"{n.op_type}_{i}"
            while name in seen:
                name += "_"
            n.name = name
            seen.add(name)


# -- the graph's structure, without its weights ------------------------------------------------------------

def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, wire type, field start, payload start, payload end) of a protobuf message's fields."""
    pos = start
    while pos < end:
        first = pos
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, stop = _varint(buf, pos)
        elif wire == 1:
            stop = pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            stop = pos + n
        elif wire == 5:
            stop = pos + 4
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        if stop > end:
            raise ValueError("truncated protobuf message")
        yield number, wire, first, pos, stop
        pos = stop


def _structure(path: Path):
    """The ModelProto at `path` without its large tensors' bytes: a tensor in a data file stays a reference
    into it; one of 1 KiB or more held in the graph file becomes a reference to its bytes there (external
    data whose location is the graph file), found by walking the file's protobuf fields, so its bytes are
    skipped, never read."""
    import onnx

    pieces = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for number, wire, first, start, stop in _fields(buf, 0, len(buf)):
            if number != MODEL_GRAPH or wire != 2:
                pieces.append(buf[first:stop])
                continue
            graph = []
            for g_number, g_wire, g_first, g_start, g_stop in _fields(buf, start, stop):
                if g_number != GRAPH_INITIALIZER or g_wire != 2:
                    graph.append(buf[g_first:g_stop])
                    continue
                kept, raw = [], None
                for t_number, t_wire, t_first, t_start, t_stop in _fields(buf, g_start, g_stop):
                    if t_number == TENSOR_RAW_DATA and t_wire == 2 and t_stop - t_start >= _INLINE_BELOW:
                        raw = (t_start, t_stop - t_start)
                    else:
                        kept.append(buf[t_first:t_stop])
                tensor = b"".join(kept)
                if raw is not None:
                    t = onnx.TensorProto.FromString(tensor)
                    set_external(t, path.name, *raw)
                    tensor = t.SerializeToString()
                graph.append(field_header(GRAPH_INITIALIZER, len(tensor)) + tensor)
            body = b"".join(graph)
            pieces.append(field_header(MODEL_GRAPH, len(body)) + body)
    return onnx.ModelProto.FromString(b"".join(pieces))


def _blocks(t, base_dir: Path, columns: int):
    """A float32 tensor as [rows, columns] float32 blocks of about _BLOCK_BYTES, in order, read from its file
    (external) or from the proto (small, inline)."""
    from onnx import numpy_helper

    check_external_data(t, base_dir)
    ext = external_info(t)
    if ext is None:
        yield numpy_helper.to_array(t).reshape(-1, columns)
        return
    loc, offset, length = ext
    count = int(np.prod(t.dims, dtype=np.int64))
    if length != 4 * count:
        raise ValueError(f"{t.name}: {length} bytes of external data for {count} float32 values")
    rows = count // columns if columns else 0
    step = max(1, _BLOCK_BYTES // (4 * columns)) if columns else 1
    with open(base_dir / loc, "rb") as f:
        f.seek(offset)
        for r in range(0, rows, step):
            block = np.empty((min(step, rows - r), columns), "<f4")
            if f.readinto(memoryview(block).cast("B")) != block.nbytes:
                raise ValueError(f"{base_dir / loc}: ends inside {t.name} (truncated external data)")
            yield block


def _array(t, base_dir: Path) -> np.ndarray:
    """A whole tensor (for the rare ones needed at once: a transposed Gemm weight)."""
    from onnx import numpy_helper

    ext = external_info(t)
    if ext is None:
        return numpy_helper.to_array(t)
    import onnx

    loc, offset, length = ext
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).newbyteorder("<")
    with open(base_dir / loc, "rb") as f:
        f.seek(offset)
        data = np.frombuffer(f.read(length), dtype)
    return data.reshape(tuple(t.dims))


# -- ONNX Runtime's dynamic quantization, on the structure -----------------------------------------------

def _infer(model):
    """ONNX shape inference, then the metadata entry ONNX Runtime's quantizer adds after it (first)."""
    import onnx

    out = onnx.shape_inference.infer_shapes(model)
    props = dict([_INFER_PROP])
    props.update((p.key, p.value) for p in out.metadata_props)
    onnx.helper.set_model_props(out, props)
    return out


def _kwargs(node, graph=None) -> dict:
    """A node's attributes as onnx.helper.make_node keyword arguments, subgraphs through `graph`."""
    import onnx

    A = onnx.AttributeProto
    fields = {A.FLOAT: "f", A.INT: "i", A.STRING: "s", A.TENSOR: "t", A.GRAPH: "g", A.FLOATS: "floats",
              A.INTS: "ints", A.STRINGS: "strings", A.TENSORS: "tensors", A.GRAPHS: "graphs"}
    kwargs = {}
    for a in node.attribute:
        if a.type not in fields:
            raise ValueError(f"attribute {a.name} of {node.name or node.op_type} has unsupported type {a.type}")
        if graph is not None and a.type == A.GRAPH:
            kwargs[a.name] = graph(a.g)
        elif graph is not None and a.type == A.GRAPHS:
            kwargs[a.name] = [graph(g) for g in a.graphs]
        else:
            kwargs[a.name] = getattr(a, fields[a.type])
    return kwargs


def _has_graphs(node) -> bool:
    import onnx

    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def _remade(node, graph) -> object:
    """A node with subgraphs rebuilt with onnx.helper.make_node (its subgraphs through `graph`), as ONNX
    Runtime's passes rebuild them: attributes sorted by name; domain and doc string not carried."""
    import onnx

    return onnx.helper.make_node(node.op_type, node.input, node.output, name=node.name, **_kwargs(node, graph))


class _Quantizer:
    def __init__(self, model, base_dir: Path, nodes: set[str], per_channel: bool, weights: str,
                 reduce_range: bool, probe: bool = False) -> None:
        self.model, self.base_dir, self.nodes, self.per_channel = model, base_dir, nodes, per_channel
        self.weights, self.reduce_range = weights, reduce_range
        self.lazy: dict = {}  # initializer name -> writes its bytes to a file (computed when written)
        # probe: each quantized node's fp32 original is kept beside it and a bool scalar input per node
        # chooses between them (`sensitivity`); `switches` lists the nodes in the order of those inputs.
        self.probe, self.switches = probe, []

    def run(self):
        opset = [o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx")]
        if len(opset) != 1 or opset[0] <= 10:
            raise ValueError(f"int8 quantization needs ONNX opset 11 or later (DynamicQuantizeLinear), got {opset}")
        m = _infer(self.model)
        self._replace_gemms(m)
        m = _infer(m)
        g = m.graph
        self.value_infos = {v.name: v for v in (*g.value_info, *g.output, *g.input)}
        self.known = {v.name for v in (*g.output, *g.input)} | {o for n in g.node for o in n.output}
        self.inits: dict = {}
        for t in g.initializer:
            self.inits.setdefault(t.name, t)
        self.graph_nodes = {}
        for n in g.node:
            self.graph_nodes.setdefault(n.name, n)
        self.m, self.new, self.new_by_name, self.quantized = m, [], {}, {}
        self.generated = {i.name for i in g.input} - set(self.inits)
        count = 0
        for node in g.node:
            before = len(self.new)
            if node.name in self.nodes and node.op_type in _OP_TYPES and self._quantize(
                    self._renamed(node, "_int8") if self.probe else node):
                count += 1
                if self.probe:
                    self._switch(node)
            else:
                self._keep(node)
            for n in self.new[before:]:
                self.generated.update(n.output)
        for out in g.output:  # a graph output that is a quantized value is dequantized
            dq = self._dequantized(out.name)
            if dq is not None:
                self._add([dq])
        g.ClearField("node")
        g.node.extend(self.new)
        missing = _clean_initializers(g)
        if missing:
            raise ValueError(f"quantized graph uses tensors it does not define: {sorted(missing)}")
        m.producer_name, m.producer_version = _PRODUCER
        if not any(o.domain == _MS_DOMAIN for o in m.opset_import) and any(n.domain == _MS_DOMAIN for n in self.new):
            m.opset_import.add(domain=_MS_DOMAIN, version=1)
        _topological_sort(g)
        self.lazy = {t.name: self.lazy[t.name] for t in g.initializer if t.name in self.lazy}
        return m, count

    @staticmethod
    def _renamed(node, suffix: str):
        """A copy of `node` whose outputs (and name) carry `suffix`."""
        import onnx

        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = node.name + suffix
        del copy.output[:]
        copy.output.extend(o + suffix if o else "" for o in node.output)
        return copy

    def _switch(self, node) -> None:
        """Probe graphs: `node` in fp32 beside its quantized copy, and a Where per output choosing between them
        by the bool scalar input `attncal_fp32_<k>`."""
        import onnx
        from onnx import helper

        flag = f"attncal_fp32_{len(self.switches)}"
        self.switches.append(node.name)
        self.m.graph.input.append(helper.make_tensor_value_info(flag, onnx.TensorProto.BOOL, []))
        self._add([self._renamed(node, "_fp32")])  # on the float weight, as a node left unquantized reads it
        self._add([helper.make_node("Where", [flag, o + "_fp32", o + "_int8"], [o], f"{node.name}_switch_{i}")
                   for i, o in enumerate(node.output) if o])

    # -- the rewrite of Gemm (ONNX Runtime's dynamic mode does it to every Gemm before quantizing) -----------

    def _replace_gemms(self, m) -> None:
        import onnx

        names = set()
        stack = [m.graph]
        while stack:
            graph = stack.pop()
            names.update(t.name for t in graph.initializer)
            names.update(v.name for v in (*graph.input, *graph.output, *graph.value_info))
            for node in graph.node:
                names.update(node.input)
                names.update(node.output)
                for a in node.attribute:
                    if a.type == onnx.AttributeProto.GRAPH:
                        stack.append(a.g)
                    elif a.type == onnx.AttributeProto.GRAPHS:
                        stack.extend(a.graphs)
        self._gemms_in([m.graph], names)

    def _gemms_in(self, path: list, names: set):
        from onnx import helper

        graph = path[-1]
        new, transposed = [], {}

        def sub(g):
            return self._gemms_in(path + [g], names)

        for node in graph.node:
            if _has_graphs(node):
                node = _remade(node, sub)
            if node.op_type != "Gemm":
                new.append(node)
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if not (attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0 and attrs.get("transA", 0) == 0):
                new.append(node)
                continue
            b = node.input[1]
            if attrs.get("transB", 0) == 1:
                src = next((t for g in reversed(path) for t in g.initializer if t.name == node.input[1]), None)
                if src is not None:
                    if b not in transposed:
                        name, k = b + "_Transposed", 0
                        suffixes = ("", "_quantized", "_scale", "_zero_point")
                        while any(name + s in names for s in suffixes):
                            k += 1
                            name = f"{b}_Transposed_{k}"
                        names.update(name + s for s in suffixes)
                        graph.initializer.append(self._transposed(src, name, top=len(path) == 1))
                        transposed[b] = name
                    b = transposed[b]
                else:
                    b += "_Transposed"
                    new.append(helper.make_node("Transpose", [node.input[1]], [b],
                                                name=node.name + "_Transpose" if node.name else ""))
            bias = len(node.input) > 2
            new.append(helper.make_node("MatMul", [node.input[0], b], [node.output[0] + ("_MatMul" if bias else "")],
                                        name=node.name + "_MatMul" if node.name else ""))
            if bias:
                new.append(helper.make_node("Add", [node.output[0] + "_MatMul", node.input[2]], list(node.output),
                                            name=node.name + "_Add" if node.name else ""))
        graph.ClearField("node")
        graph.node.extend(new)
        return graph

    def _transposed(self, src, name: str, top: bool):
        """`src` transposed, as a new initializer: computed when written where `src`'s bytes are in a file and
        the new one is the main graph's (a subgraph's is computed now)."""
        import onnx
        from onnx import numpy_helper

        if external_info(src) is None or not top:
            return numpy_helper.from_array(_array(src, self.base_dir).T, name)
        t = onnx.TensorProto(name=name, data_type=src.data_type, dims=list(reversed(src.dims)))
        set_external(t, "", 0, 0)  # a placeholder until written (shape inference reads its dims only)
        base = self.base_dir

        def fill(f, src=src):  # the weight once, its transpose written a block of rows at a time
            tr = _array(src, base).T
            step = max(1, _BLOCK_BYTES // max(1, tr.itemsize * int(np.prod(tr.shape[1:], dtype=np.int64))))
            for r in range(0, tr.shape[0], step):
                f.write(np.ascontiguousarray(tr[r:r + step]).tobytes())

        self.lazy[name] = fill
        return t

    # -- quantization of one node ----------------------------------------------------------------------

    def _add(self, nodes) -> None:
        for n in nodes:
            self.new.append(n)
            self.new_by_name.setdefault(n.name, n)

    def _find_node(self, name: str):
        n = self.graph_nodes.get(name)
        return n if n is not None else self.new_by_name.get(name)

    def _keep(self, node) -> None:
        """A node not quantized, after the dequantization of any quantized value it reads."""
        for name in node.input:
            dq = self._dequantized(name)
            if dq is not None:
                self._add([dq])
        self._add([node])

    def _dequantized(self, name: str):
        from onnx import helper

        qv = self.quantized.get(name)
        if qv is None or name in self.generated:
            return None
        dq_name = name + "_DequantizeLinear"
        if self._find_node(dq_name) is not None:
            return None
        q, scale, zp, axis = qv
        return helper.make_node("DequantizeLinear", [q, scale, zp], [name], dq_name, axis=axis)

    def _is_float(self, name: str) -> bool:
        import onnx

        if name in self.inits:
            return self.inits[name].data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
        v = self.value_infos.get(name)
        return v is not None and v.type.HasField("tensor_type") and \
            v.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)

    def _quantize(self, node) -> bool:
        """Rewrite one selected MatMul / Attention; False where ONNX Runtime's quantizer keeps it."""
        import onnx
        from onnx import helper

        if node.op_type == "MatMul":
            if not (self._is_float(node.input[1]) or self._is_float(node.input[0])):
                return False
        elif any(a.name == "qkv_hidden_sizes" for a in node.attribute):
            return False  # no QAttention with separate Q, K, V sizes
        nodes = []
        a_q, a_zp, a_scale = self._activation(node.input[0], nodes)
        w_q, w_zp, w_scale = self._weight(node.input[1])
        name = node.name + "_quant" if node.name else ""
        if node.op_type == "Attention":
            inputs = [a_q, w_q, node.input[2], a_scale, w_scale, node.input[3] if len(node.input) > 3 else "",
                      a_zp, w_zp, node.input[4] if len(node.input) > 4 else ""]
            nodes.append(helper.make_node("QAttention", inputs, node.output, name, domain=_MS_DOMAIN,
                                          **_kwargs(node)))
            self._add(nodes)
            return True
        out = node.output[0] + "_output_quantized"
        nodes.append(helper.make_node("MatMulInteger", [a_q, w_q, a_zp, w_zp], [out], name))
        v = self.value_infos.get(node.output[0])
        to = v.type.tensor_type.elem_type if v is not None and v.type.HasField("tensor_type") else 0
        nodes.append(helper.make_node("Cast", [out], [out + "_cast_output"], out + "_cast",
                                      to=to or onnx.TensorProto.FLOAT))  # DefaultTensorType: FLOAT
        mul = name + "_scales_mul" if name else f"{a_scale}_{w_scale}_mul"
        scales = self.new_by_name.get(mul)
        if scales is None:
            scales = helper.make_node("Mul", [a_scale, w_scale], [mul + ":0"], mul)
            nodes.append(scales)
        nodes.append(helper.make_node("Mul", [out + "_cast_output", scales.output[0]], [node.output[0]],
                                      name + "_output_scale_mul" if name else ""))
        self._add(nodes)
        return True

    def _activation(self, name: str, nodes: list) -> tuple[str, str, str]:
        """(quantized, zero point, scale) names of an activation: its DynamicQuantizeLinear, made once."""
        from onnx import helper

        if name in self.quantized:
            q, scale, zp, _ = self.quantized[name]
            return q, zp, scale
        if name in self.inits:
            raise ValueError(f"{name}: a constant first input of a weight MatMul / Attention is not quantized here")
        if not (name in self.value_infos or name in self.known or name in self.generated):
            raise ValueError(f"invalid tensor name to quantize: {name}")
        dql = self._find_node(name + "_QuantizeLinear")
        if dql is None:
            dql = helper.make_node("DynamicQuantizeLinear", [name],
                                   [name + "_quantized", name + "_scale", name + "_zero_point"],
                                   name + "_QuantizeLinear")
            nodes.append(dql)
            self.quantized[name] = (dql.output[0], dql.output[1], dql.output[2], None)
        if dql.op_type == "QuantizeLinear":
            return dql.output[0], dql.input[2], dql.input[1]
        return dql.output[0], dql.output[2], dql.output[1]

    def _weight(self, name: str) -> tuple[str, str, str]:
        """(quantized, zero point, scale) names of a weight, of the quantizer's weight type, per output channel
        (or per tensor); scales now (one pass over the weight), the 8-bit tensor when written."""
        import onnx
        from onnx import helper, numpy_helper

        if name in self.quantized:
            q, scale, zp, _ = self.quantized[name]
            return q, zp, scale
        w = self.inits.get(name)
        if w is None:
            raise ValueError(f"{name}: the weight of a node to quantize is not an initializer")
        if w.data_type != onnx.TensorProto.FLOAT:
            raise ValueError(f"{name}: int8 quantization takes float32 weights, this one is "
                             f"{onnx.helper.tensor_dtype_to_string(w.data_type)}")
        dims = list(w.dims)
        if self.per_channel and not dims:
            raise ValueError(f"{name}: a scalar weight has no channel axis")
        columns = dims[-1] if dims else 1  # blocks of whole rows; the channels are the last axis
        lo = hi = None
        for block in _blocks(w, self.base_dir, columns):
            b_lo, b_hi = (block.min(axis=0), block.max(axis=0)) if self.per_channel else \
                (block.min(keepdims=True).reshape(1), block.max(keepdims=True).reshape(1))
            lo = b_lo if lo is None else np.minimum(lo, b_lo)
            hi = b_hi if hi is None else np.maximum(hi, b_hi)
        if lo is None:
            raise ValueError(f"{name}: an empty weight")
        scale, zero_point = _scale_zero_point(lo, hi, self.weights, self.reduce_range)
        q_name, zp_name, scale_name = name + "_quantized", name + "_zero_point", name + "_scale"
        shape = [dims[-1]] if self.per_channel else []
        q_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(self.weights))
        new = [helper.make_tensor(scale_name, w.data_type, shape, scale.tolist()),
               helper.make_tensor(zp_name, q_type, shape, zero_point.astype(np.int64).tolist())]
        if external_info(w) is None:
            new.append(numpy_helper.from_array(
                _quantized(numpy_helper.to_array(w).reshape(-1, columns), scale, zero_point).reshape(dims), q_name))
        else:
            t = onnx.TensorProto(name=q_name, data_type=q_type, dims=dims)
            set_external(t, "", 0, 0)  # a placeholder until written (shape inference reads its dims only)
            base = self.base_dir

            def fill(f, w=w, scale=scale, zero_point=zero_point, columns=columns):
                for block in _blocks(w, base, columns):
                    f.write(_quantized(block, scale, zero_point).tobytes())

            self.lazy[q_name] = fill
            new.append(t)
        for t in new:
            self.m.graph.initializer.append(t)
            self.inits.setdefault(t.name, t)
        self.quantized[name] = (q_name, scale_name, zp_name, -1 if self.per_channel else None)
        return q_name, zp_name, scale_name


def _scale_zero_point(lo: np.ndarray, hi: np.ndarray, weights: str, reduce_range: bool
                      ) -> tuple[np.ndarray, np.ndarray]:
    """ONNX Runtime's scale (float32) and zero point (of the weight type) of each channel from its float32 min
    and max (quant_utils' compute_scale_zp over `_WEIGHT_RANGES`): the range is widened to hold 0 (and made
    symmetric for int8), its width divided by the integer range's in float64 and stored in float32; the zero
    point is the middle of the range (int8: 0) or round(qmin - min / scale) (uint8); scale 1.0 and zero
    point 0 where the scale is below float32's smallest normal."""
    qmin, qmax = _WEIGHT_RANGES[weights, reduce_range]
    lo = np.minimum(lo, np.float32(0))
    hi = np.maximum(hi, np.float32(0))
    if weights == "int8":  # symmetric
        hi = np.maximum(np.abs(lo), np.abs(hi))
        lo = -hi
    scale = (hi.astype(np.float64) - lo.astype(np.float64)) / (np.float64(qmax) - np.float64(qmin))
    tiny = scale < np.finfo(np.float32).tiny
    with np.errstate(divide="ignore", invalid="ignore"):
        zero_point = (np.full(scale.shape, np.round((qmin + qmax) / np.float64(2.0))) if weights == "int8"
                      else np.round(np.float64(qmin) - lo / scale))
    return (np.where(tiny, np.float32(1.0), scale.astype(np.float32)).astype(np.float32),
            np.where(tiny, 0.0, zero_point).astype(np.dtype(weights)))


def _quantized(block: np.ndarray, scale: np.ndarray, zero_point: np.ndarray) -> np.ndarray:
    """quant_utils' quantize_nparray: float32 division, round half to even, plus the zero point, clipped to
    the weight type's full range."""
    info = np.iinfo(zero_point.dtype)
    q = np.round(block.astype(np.float32, copy=False) / scale) + zero_point.astype(np.float32)
    np.clip(q, info.min, info.max, out=q)
    return q.astype(zero_point.dtype)


def _clean_initializers(graph) -> set[str]:
    """ONNX Runtime's removal of unused initializers (and their graph inputs), subgraphs included; returns
    the names used here and defined nowhere below (the outer graph's, for a subgraph)."""
    wanted = {i for n in graph.node for i in n.input if i}
    wanted.update(o.name for o in graph.output if o.name)
    new = []
    for node in graph.node:
        if _has_graphs(node):
            def sub(g, wanted=wanted):
                wanted.update(_clean_initializers(g))
                return g
            node = _remade(node, sub)
        new.append(node)
    graph.ClearField("node")
    graph.node.extend(new)
    wanted.difference_update(o for n in graph.node for o in n.output)
    unused = []
    for t in graph.initializer:
        if t.name in wanted:
            wanted.remove(t.name)
        else:
            unused.append(t)
    inputs = {i.name: i for i in graph.input}
    for t in unused:
        graph.initializer.remove(t)
        if t.name in inputs:
            graph.input.remove(inputs[t.name])
    wanted.difference_update(i.name for i in graph.input)
    return wanted


def _topological_sort(graph) -> None:
    """ONNX Runtime's quantizer's order (ONNXModel.topological_sort): nodes without inputs first, then those
    ready from the graph inputs and initializers (in name order), then breadth first through outputs."""
    nodes = list(graph.node)
    deps = [0] * len(nodes)
    consumers: dict[str, list[int]] = {}
    order = []
    for i, node in enumerate(nodes):
        deps[i] = sum(1 for x in node.input if x)
        if deps[i] == 0:
            order.append(i)
            continue
        for x in node.input:
            if x:
                consumers.setdefault(x, []).append(i)

    def release(name: str) -> None:
        for i in consumers.get(name, ()):
            deps[i] -= 1
            if deps[i] == 0:
                order.append(i)

    for name in sorted(set([t.name for t in graph.initializer] + [v.name for v in graph.input])):
        release(name)
    k = 0
    while k < len(order):
        for out in nodes[order[k]].output:
            release(out)
        k += 1
    if len(order) != len(nodes):
        raise ValueError("the quantized graph is not a DAG (or reads a value nothing defines)")
    graph.ClearField("node")
    graph.node.extend(nodes[i] for i in order)
