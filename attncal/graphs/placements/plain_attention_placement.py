"""The calibrated attention op in every layer of a plain graph: the native graph of the models that ONNX
Runtime's optimizer does not fuse (Qwen3, Gemma3 / EmbeddingGemma, ModernBERT, T5's encoder, MPNet, and any
plain graph of the same shape).

Glossary: B batch, S sequence, N query heads, N_kv key/value heads, D head size, D_v value head size.

Each layer's explicit attention (`attention_chain`: Q·Kᵀ MatMul -> scale and mask chain -> Softmax ->
·V MatMul) becomes

    query [B,S,N*D]   = Reshape(Transpose(Q [B,N,S,D]))
    key   [B,S,N_kv*D] = Reshape(Transpose(K)), K taken before transformers' repeat_kv where the graph
                        repeats it (GQA: Unsqueeze -> Expand -> Reshape), else Kᵀ as the MatMul reads it
    value [B,S,N_kv*D_v] likewise
    context = <calibrated attention op>(query, key, value, attention_mask)   (heads merged)
    [B,N,S,D_v] = Transpose(Reshape(context)) in place of the ·V MatMul's output

with the chain's constant scale as `scale` (1 where the chain has none), its mask read as padding
plus a window (`mask_probe`: the mask subgraph is run, and must be exactly that), and a relative position
bias added to the scores (T5, MPNet) passed as its table, the op's fifth input, with the max distance
`position_bias_probe` reads off the bias subgraph: the op computes the buckets, so the [B,N,S,S] bias the
graph built is gone with the rest of the chain.  Calibrated layers get
the calibration's attributes; every other layer the same op with strength 0, which is plain attention.

Why every layer: on these graphs every layer otherwise writes its [B,N,S,S] probabilities (and the
[B,1,S,S] mask), which is what limits them at long context; the op keeps a block of query rows in cache
(`plugins/kernels/cpu/calibrated_attention.h`), skips key tiles that padding or the window hide, and
reads each key/value head once for its query heads.  The Transposes around it are O(B·S·N·D) copies.

The op's function body materialises the probabilities, so this graph is written beside the portable one
and run where the native library is loaded (`attncal.runtime.encoder.select_graph`); the exporter's
parity check runs it against PyTorch like every graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ...calibration.config import CalibrationConfig, ResolvedCalibration
from ...pooling import Pooling
from . import row_marks
from .attention_chain import PlainAttention, walk_layer
from ..builder import Ops, const_array, graph_input, scalar_value
from ..ops.contract import DOMAIN, VERSION, AttentionGeometry, attention_op_spec
from ..ops.function_body import make_function
from .mask_probe import MaskProbeError, probe_geometry
from .placement_base import PlacementResult, count_fused_attention
from .position_bias_probe import PositionBiasError, find_table, probe_relative
from .rewrite import model_opset
from .softmax_pattern import SoftmaxPatternError, find_attention_softmaxes

NODE_PREFIX = "attncal_attention_layer"


class PlainAttentionError(ValueError):
    """The plain graph's attention cannot be replaced by the calibrated attention op."""


@dataclass(frozen=True)
class ModelShape:
    """What the rewrite needs from the model beyond the graph."""

    num_heads: int
    num_kv_heads: int  # = num_heads without GQA
    max_length: int  # the longest sequence the export takes: how far the mask's window must be known
    declared_window: int | None = None  # the config's widest window, or None (see `mask_probe.probe_geometry`)
    # The config's relative position max distance, tried first by the bias probe (`probe_relative`), or None.
    relative_max_distance: int | None = None


@dataclass(frozen=True)
class LayerEdit:
    walk: PlainAttention
    scale: float
    geometry: AttentionGeometry
    query: ir.Value  # [B,N,S,D]
    key: tuple[ir.Value, tuple[int, ...]]  # the value, and the Transpose to [B,S,heads,D]
    value: ir.Value  # [B,heads,S,D_v]
    table: ir.Value | None = None  # the relative position bias table [num_buckets,N], or None


@dataclass(frozen=True)
class PlainAttentionEdits:
    rc: ResolvedCalibration
    selected: list[int]
    layers: list[LayerEdit]
    mask: ir.Value
    shape: ModelShape
    ids: ir.Value | None = None  # the token ids the calibrated rows are marked from (row-set poolings)


@dataclass(frozen=True)
class ChainParts:
    scale: float
    mask: ir.Value
    bias: ir.Value | None = None  # the relative position bias added to the scores, or None
    table: ir.Value | None = None  # its table (`position_bias_probe.find_table`)


def _chain_parts(walk: PlainAttention, num_heads: int) -> ChainParts:
    """The scale, mask and relative position bias of a layer's scale/mask chain; refuses anything else in it."""
    scale: float | None = None
    mask: ir.Value | None = None
    bias: ir.Value | None = None
    table: ir.Value | None = None
    prev = walk.scores_mm.outputs[0]
    for node in walk.chain:
        others = [v for v in node.inputs if v is not prev]
        where = f"layer {walk.layer}: {node.op_type} node {node.name!r}"
        if node.op_type in ("Cast", "Identity"):
            if node.op_type == "Cast" and node.attributes.get_int("to", ir.DataType.FLOAT) != ir.DataType.FLOAT:
                raise PlainAttentionError(f"{where} casts the scores to another type than float32")
        elif node.op_type in ("Mul", "Div") and len(others) == 1 and (c := scalar_value(others[0])) is not None:
            if scale is not None:
                raise PlainAttentionError(f"{where}: a second scale in the chain")
            if node.op_type == "Div" and node.inputs[0] is not prev:
                raise PlainAttentionError(f"{where} divides a constant by the scores")
            scale = c if node.op_type == "Mul" else 1.0 / c
        elif node.op_type == "Add" and len(others) == 1 and const_array(others[0]) is None:
            t = find_table(others[0], num_heads)  # a relative position bias, else a mask
            if (bias if t is not None else mask) is not None:
                raise PlainAttentionError(f"{where}: a second {'position bias' if t is not None else 'mask'} in the "
                                          "chain")
            if t is not None:
                bias, table = others[0], t
            else:
                mask = others[0]
        else:
            raise PlainAttentionError(
                f"{where}: the op takes a constant scale, one padding/window mask and a relative position bias in "
                "the chain, not this (a soft-cap is not in the op yet)")
        prev = node.outputs[0]
    if mask is None:
        raise PlainAttentionError(f"layer {walk.layer}: no mask is added to the scores; the op always masks padding")
    if scale is not None and not (np.isfinite(scale) and scale > 0):
        raise PlainAttentionError(f"layer {walk.layer}: score scale {scale} is not a finite positive number")
    return ChainParts(1.0 if scale is None else scale, mask, bias, table)


def _before_repeat(x: ir.Value) -> ir.Value | None:
    """transformers' repeat_kv (Unsqueeze(axis 2) -> Expand -> Reshape) undone: its input [B,N_kv,S,d], or None."""
    r = x.producer()
    if r is None or r.op_type != "Reshape":
        return None
    e = r.inputs[0].producer() if r.inputs[0] is not None else None
    if e is None or e.op_type != "Expand":
        return None
    u = e.inputs[0].producer() if e.inputs[0] is not None else None
    if u is None or u.op_type != "Unsqueeze" or len(u.inputs) < 2:
        return None
    axes = const_array(u.inputs[1])
    if axes is None or [int(a) for a in axes.ravel()] != [2]:
        return None
    return u.inputs[0]


def _key_value(walk: PlainAttention, shape: ModelShape) -> tuple[tuple[ir.Value, tuple[int, ...]], ir.Value, int]:
    """(key and its Transpose to [B,S,heads,D], value [B,heads,S,D_v], key/value heads) of one layer."""
    k_t, v = walk.scores_mm.inputs[1], walk.value_mm.inputs[1]
    t = k_t.producer()
    k_rep = t.inputs[0] if t is not None and t.op_type == "Transpose" and tuple(
        t.attributes.get_ints("perm", ())) == (0, 1, 3, 2) else None
    if shape.num_kv_heads != shape.num_heads and k_rep is not None:
        k_kv, v_kv = _before_repeat(k_rep), _before_repeat(v)
        if k_kv is not None and v_kv is not None:
            return (k_kv, (0, 2, 1, 3)), v_kv, shape.num_kv_heads
    return (k_t, (0, 3, 1, 2)), v, shape.num_heads


def find(model: ir.Model, config: CalibrationConfig | None, pooling: Pooling, num_layers: int,
         shape: ModelShape) -> PlainAttentionEdits:
    """Every refusal, for every layer, as `PlainAttentionError` (or the softmax search's error); no edit.
    `config` None: an uncalibrated export (every layer strength 0, the op of `pooling`)."""
    graph = model.graph
    if any(n.domain == DOMAIN for n in graph):
        raise PlainAttentionError("the graph already contains attncal nodes; the rewrite takes the plain export")
    rc = (config or CalibrationConfig.off(pooling)).resolve()
    selected = config.layer_indices(num_layers) if config is not None and rc.strength != 0.0 else []
    mask_input = graph_input(graph, "attention_mask", PlainAttentionError)
    ids = row_marks.find_ids(graph, rc, PlainAttentionError)
    geometries: dict[int, AttentionGeometry] = {}
    distances: dict[int, int] = {}
    layers = []
    for att in find_attention_softmaxes(graph, num_layers):
        walk = walk_layer(att, PlainAttentionError)
        parts = _chain_parts(walk, shape.num_heads)
        mask = parts.mask
        if id(mask) not in geometries:
            try:
                geometries[id(mask)] = probe_geometry(model, mask, shape.max_length, shape.declared_window)
            except MaskProbeError as exc:
                raise PlainAttentionError(f"layer {walk.layer}: {exc}") from None
        distance = 0
        if parts.bias is not None:
            if id(parts.bias) not in distances:
                try:
                    distances[id(parts.bias)] = probe_relative(model, parts.bias, parts.table, shape.num_heads,
                                                               shape.max_length, shape.relative_max_distance).max_distance
                except PositionBiasError as exc:
                    raise PlainAttentionError(f"layer {walk.layer}: {exc}") from None
            distance = distances[id(parts.bias)]
        key, value, heads = _key_value(walk, shape)
        geometry = dataclasses.replace(geometries[id(mask)], num_kv_heads=0 if heads == shape.num_heads else heads,
                                       relative_max_distance=distance)
        layers.append(LayerEdit(walk, parts.scale, geometry, walk.scores_mm.inputs[0], key, value, parts.table))
    if len({e.table is None for e in layers}) > 1:
        raise PlainAttentionError("some layers add a relative position bias and others do not; the op's function "
                                  "takes it in every layer or in none")
    return PlainAttentionEdits(rc, selected, layers, mask_input, shape, ids)


@dataclass(frozen=True)
class PlainAttentionResult:
    result: PlacementResult
    geometries: list[AttentionGeometry]  # per layer


def rewrite(model: ir.Model, edits: PlainAttentionEdits) -> PlainAttentionResult:
    """Each layer's attention becomes the op (see the module docstring); the replaced nodes and the masks
    nothing reads any more are removed."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    graph, rc, N = model.graph, edits.rc, edits.shape.num_heads
    off = dataclasses.replace(rc, strength=0.0)
    mask = row_marks.insert(graph, rc, edits.mask, edits.ids)
    op_type = None
    for e in edits.layers:
        layer = e.walk.layer
        ops = Ops(graph, f"{NODE_PREFIX}{layer}")
        flat = ops.const("flat", np.array([0, 0, -1], dtype=np.int64))
        split = ops.const("split", np.array([0, 0, N, -1], dtype=np.int64))
        q = ops("Reshape", ops("Transpose", e.query, perm=[0, 2, 1, 3]), flat)
        k = ops("Reshape", ops("Transpose", e.key[0], perm=list(e.key[1])), flat)
        v = ops("Reshape", ops("Transpose", e.value, perm=[0, 2, 1, 3]), flat)
        spec = attention_op_spec(rc if layer in edits.selected else off, layer, num_heads=N, scale=e.scale,
                                 geometry=e.geometry)
        op_type = spec.op_type
        inputs = (q, k, v, mask) + ((e.table,) if e.table is not None else ())
        context = ops(spec.op_type, *inputs, domain=DOMAIN, **spec.attrs)
        context.name = f"{ops.prefix}/context"
        heads = ops("Transpose", ops("Reshape", context, split), perm=[0, 2, 1, 3])  # [B,N,S,D_v]
        old = e.walk.value_mm.outputs[0]
        heads.type, heads.shape = old.type, old.shape
        old.replace_all_uses_with(heads)
        ops.insert_after(e.walk.value_mm)
    RemoveUnusedNodesPass()(model)
    relative = any(e.table is not None for e in edits.layers)
    function = ir.serde.deserialize_function(make_function(op_type, model_opset(model), relative))
    model.functions[function.identifier()] = function
    model.opset_imports[DOMAIN] = VERSION
    common = {k: v for k, v in attention_op_spec(rc, 0, N).attrs.items() if k not in ("layer", "num_heads", "scale")}
    return PlainAttentionResult(PlacementResult(edits.selected, op_type, common, count_fused_attention(model)),
                                [e.geometry for e in edits.layers])


def place(model: ir.Model, config: CalibrationConfig | None, pooling: Pooling, num_layers: int,
          shape: ModelShape) -> PlainAttentionResult:
    """`find`, then `rewrite`: the op in every layer of `model`, or `PlainAttentionError` /
    `SoftmaxPatternError` and the model untouched."""
    return rewrite(model, find(model, config, pooling, num_layers, shape))


REFUSALS = (PlainAttentionError, SoftmaxPatternError)
