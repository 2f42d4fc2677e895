"""What an exported attention mask means, read by running it: which keys each query row sees.

The plain graph's attention adds a mask to the scores (`attention_chain`), built from `attention_mask`
by whatever the model's code does: padding only (the BERT family), causal (decoders), sliding windows
(Gemma3, ModernBERT), or a mix per layer.  The calibrated attention op takes the padding mask and its
window as attributes instead (`contract.AttentionGeometry`), so a rewrite must know which window a
mask is.  Reading the model's config for it would mean a table of each architecture's conventions
(Gemma's window is |q - k| < W, ModernBERT's |q - k| <= W/2, a causal sliding window q - W < k <= q);
the mask itself says it exactly.

`evaluate` runs the subgraph that computes a value from the graph inputs (no weights: a mask is a
function of `attention_mask` and the shapes), with ONNX Runtime, on a probe batch; `fit_geometry` reads
the window off its result and checks that the mask is exactly "valid key and inside the window" for
every query row of every item, padding rows included.  A mask of any other form (a relative position
bias, chunked attention, values other than 0 and float32's lowest) is refused with the reason.

Lengths: the probe is `PROBE` tokens, more where the model's config declares a wider window, at most
`MAX_PROBE`; a window wider than the probe's valid span cannot be told from no window there, so past it
the declared window decides: a side that shows no window in the probe, where the model declares one at
least that wide, is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir

from ..ops.contract import AttentionGeometry

# Probe lengths: 2,048 tokens (a valid span of 1,365 keys) by default, longer where the model declares a window
# that wide, up to 4,096.  The mask and its subgraph's intermediates are a few [2,1,L,L] tensors: about
# 0.2 GiB at 2,048 tokens, 0.7 GiB at 4,096 (the export's memory plan counts the default).
PROBE = 2048
MAX_PROBE = 4096
# Leaves of a mask's subgraph that the probe can feed: the tokenizer's inputs, all of them [B,S] int64.
_PROBE_INPUTS = ("attention_mask", "input_ids", "token_type_ids")
_MAX_CONST_BYTES = 1 << 20  # a mask's subgraph holds small constants; more means it reaches a weight


class MaskProbeError(ValueError):
    """The mask is not padding plus a window, or cannot be probed."""


def _subgraph(value: ir.Value) -> tuple[list[ir.Node], list[ir.Value], list[ir.Value]]:
    """(nodes in graph order, graph inputs, initializers) that compute `value`."""
    nodes: dict[int, ir.Node] = {}
    inputs: dict[str, ir.Value] = {}
    consts: dict[str, ir.Value] = {}
    stack = [value]
    while stack:
        v = stack.pop()
        node = v.producer()
        if node is None:
            if v.const_value is not None:
                consts[v.name] = v
            elif v.is_graph_input():
                inputs[v.name] = v
            else:
                raise MaskProbeError(f"{v.name} has neither a producer nor a value")
            continue
        if id(node) in nodes:
            continue
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            raise MaskProbeError(f"the mask is computed with a subgraph ({node.op_type} node {node.name!r})")
        nodes[id(node)] = node
        stack.extend(i for i in node.inputs if i is not None)
    graph = value.producer().graph if value.producer() is not None else None
    order = {id(n): k for k, n in enumerate(graph)} if graph is not None else {}  # the graph's topological order
    return sorted(nodes.values(), key=lambda n: order.get(id(n), 0)), list(inputs.values()), list(consts.values())


def _probe_constant(c: ir.Value, nodes: list[ir.Node], mask: str) -> onnx.TensorProto:
    """An initializer of the mask's subgraph as the probe feeds it.  A mask is built from the inputs' shapes and
    the padding mask; where an export takes a shape from the token embeddings (TorchScript's masks read
    inputs_embeds), the walk reaches the embedding table through its Gather by the input ids.  The probe's ids
    are all 0, so one row of zeros gives the same shapes without reading the table."""
    tensor = c.const_value
    if tensor.nbytes > _MAX_CONST_BYTES:
        readers = [(n, i) for n in nodes for i, v in enumerate(n.inputs) if v is c]
        if not readers or any(n.op_type != "Gather" or i != 0 or n.attributes.get_int("axis", 0) != 0
                              or not (n.inputs[1] is not None and n.inputs[1].is_graph_input()) for n, i in readers):
            raise MaskProbeError(f"the mask {mask} reads the {tensor.nbytes}-byte initializer {c.name}: it is not a "
                                 "function of the inputs' shapes and the padding mask alone")
        return onnx.numpy_helper.from_array(np.zeros((1, *tensor.shape.numpy()[1:]), tensor.dtype.numpy()), c.name)
    return onnx.numpy_helper.from_array(np.asarray(tensor.numpy()), c.name)  # in the proto, not external data


def evaluate(model: ir.Model, value: ir.Value, batch: dict[str, np.ndarray],
             replace: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """`value` computed by ONNX Runtime from the graph inputs in `batch` (the ones its subgraph reads), with the
    constants named in `replace` (initializers or Constant outputs) given those values instead."""
    import onnxruntime as ort

    replace = replace or {}
    nodes, inputs, consts = _subgraph(value)
    nodes = [n for n in nodes if not (n.op_type == "Constant" and all(o.name in replace for o in n.outputs))]
    consts = [c for c in consts if c.name not in replace]
    missing = [v.name for v in inputs if v.name not in batch]
    if missing:
        raise MaskProbeError(f"the mask {value.name} reads graph input(s) {', '.join(missing)}, which the probe "
                             f"does not feed (it feeds {', '.join(_PROBE_INPUTS)})")
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes], "attncal_mask_probe",
        [onnx.helper.make_tensor_value_info(v.name, onnx.TensorProto.INT64, ["B", "S"]) for v in inputs],
        [onnx.helper.make_empty_tensor_value_info(value.name)],
        [_probe_constant(c, nodes, value.name) for c in consts]
        + [onnx.numpy_helper.from_array(np.asarray(a), name) for name, a in replace.items()])
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v)
                                                         for d, v in model.opset_imports.items()])
    proto.ir_version = model.ir_version
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    (out,) = sess.run(None, {v.name: batch[v.name] for v in inputs})
    return out


def probe_batch(length: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(feeds, valid [2,L] bool): item 0 padded on the right, item 1 on the left, a third of the keys each."""
    valid = np.ones((2, length), dtype=bool)
    pad = max(1, length // 3) if length > 2 else 0
    if pad:
        valid[0, length - pad:] = False
        valid[1, :pad] = False
    ids = np.zeros((2, length), dtype=np.int64)
    return {"attention_mask": valid.astype(np.int64), "input_ids": ids, "token_type_ids": ids}, valid


@dataclass(frozen=True)
class Fit:
    geometry: AttentionGeometry  # num_kv_heads left at 0: the mask does not say
    span: int  # the valid span the window was read in: a bound of -1 means "none below span keys"


def _visible(mask: np.ndarray, name: str) -> np.ndarray:
    """[2,L,L] bool: the keys each query row sees, from a boolean or additive (0 / the dtype's lowest) mask
    broadcastable to [2,1,L,L].  The op adds float32's lowest where the mask held its dtype's: either way
    such a key gets probability exactly 0, and a row that sees no key is uniform over all of them."""
    if mask.ndim != 4 or mask.shape[1] != 1:
        raise MaskProbeError(f"the mask {name} has shape {list(mask.shape)}; expected [B,1,S_q or 1,S_k] (one mask "
                             "for every head)")
    if mask.dtype == np.bool_:
        return mask[:, 0]
    if not np.issubdtype(mask.dtype, np.floating):
        raise MaskProbeError(f"the mask {name} is {mask.dtype}; expected a boolean or an additive float mask")
    lowest = np.finfo(mask.dtype).min  # transformers masks with its compute dtype's lowest value
    if not np.all((mask == 0) | (mask == lowest)):
        odd = mask[(mask != 0) & (mask != lowest)].ravel()[:3]
        raise MaskProbeError(f"the mask {name} holds values other than 0 and {mask.dtype}'s lowest (e.g. "
                             f"{odd.tolist()}): an additive bias (relative positions?), not a padding or window mask")
    return (mask == 0)[:, 0]


def fit_geometry(mask: np.ndarray, valid: np.ndarray, name: str) -> Fit:
    """The window of a probed mask (`evaluate` on `probe_batch`): read from item 0's valid span, then
    checked against every row of both items (visible == valid key and inside the window)."""
    B, L = valid.shape
    vis = np.broadcast_to(_visible(mask, name), (B, L, L))
    span = int(valid[0].sum())  # item 0: keys [0, span) valid
    inner = vis[0, :span, :span]
    if not inner[np.arange(span), np.arange(span)].all():
        raise MaskProbeError(f"the mask {name} hides a token from its own query row; not a window")
    q = np.arange(span)
    first = np.where(inner.any(1), inner.argmax(1), q)
    last = np.where(inner.any(1), span - 1 - inner[:, ::-1].argmax(1), q)
    left, right = int((q - first).max()), int((last - q).max())
    # A side whose bound reaches the span's edge from every row sees no window at this length.
    window_left = -1 if np.all(first == 0) else left
    window_right = -1 if np.all(last == span - 1) else right
    geometry = AttentionGeometry(0, window_left, window_right)
    offset = np.arange(L, dtype=np.int32)[None, :] - np.arange(L, dtype=np.int32)[:, None]  # k - q
    band = np.ones((L, L), dtype=bool)
    if window_left >= 0:
        band &= offset >= -window_left
    if window_right >= 0:
        band &= offset <= window_right
    expected = band[None] & valid[:, None, :]
    if not np.array_equal(vis, expected):
        b, r, k = (int(x[0]) for x in np.nonzero(vis != expected))
        raise MaskProbeError(
            f"the mask {name} is not padding plus a window (window_left={window_left}, window_right={window_right}): "
            f"item {b}, query {r}, key {k} is {'visible' if vis[b, r, k] else 'hidden'} in the mask")
    return Fit(geometry, span)


def probe_geometry(model: ir.Model, value: ir.Value, needed: int, declared: int | None = None) -> AttentionGeometry:
    """The window of mask `value` for sequences up to `needed` tokens.  Probed at up to `MAX_PROBE` tokens;
    past the probe, a side it shows no window on is taken as unbounded only when the model declares no
    window (`declared`: its config's widest, or None) that could start beyond the probe's span."""
    want = PROBE if declared is None else max(PROBE, 3 * declared // 2 + 16)  # a span wider than the window
    length = max(2, min(needed, want, MAX_PROBE))
    feeds, valid = probe_batch(length)
    fit = fit_geometry(evaluate(model, value, feeds), valid, value.name)
    unbounded = [side for side, bound in (("left", fit.geometry.window_left), ("right", fit.geometry.window_right))
                 if bound < 0]
    if unbounded and needed > fit.span and declared is not None and declared >= fit.span:
        raise MaskProbeError(
            f"the mask {value.name} shows no {' or '.join(unbounded)} window within the probe's {fit.span} keys, "
            f"but the model declares a window of {declared} and sequences go to {needed} tokens; a window that "
            "wide cannot be checked by the probe")
    return fit.geometry
