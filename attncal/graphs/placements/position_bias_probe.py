"""What an exported relative position bias is, read by running it: the table, and the bucket function's max distance.

T5's encoder and MPNet add to each layer's scores a bias gathered from a small table [num_buckets, N] at the
bucket of every key-minus-query offset (`attncal.calibration.relative_position`).  The calibrated attention op
takes the table as an input and computes the buckets itself (contract: `relative_max_distance`), so a rewrite
must know that the graph's bias is exactly that function, and with which max distance.

`find_table` walks back from the value the chain adds (through the Expand / Unsqueeze / Transpose / Cast /
Identity of the [N,S,S] -> [B,N,S,S] layout) to a Gather whose data is a [num_buckets, N] initializer.
`probe_relative` then runs the bias subgraph (`mask_probe.evaluate`) with that table replaced by distinct
values, b·N + h + 1 at bucket b and head h, so that every entry of the result names the bucket and the head it
was gathered from; it checks that each head reads its own column, that the bucket depends on k - q alone, and
finds the max distance whose buckets are the probed ones.  A bias of any other form is refused with the reason.

Lengths: the probe runs `PROBE` tokens (fewer where the export takes fewer) and checks every offset it sees;
past them the bucket function of the fitted distance decides, and a distance the probe cannot tell apart from
another one within the export's longest sequence is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ...calibration.relative_position import relative_buckets
from .mask_probe import MaskProbeError, evaluate, probe_batch

PROBE = 1024  # tokens: offsets up to 1,023 each way; the bias is a [B,N,L,L] float32 tensor (48 MiB at N = 12)
MAX_DISTANCE = 1024  # the largest max distance the fit tries (models use 128); a model's hint is tried too
_LAYOUT_OPS = ("Expand", "Unsqueeze", "Transpose", "Cast", "Identity")


class PositionBiasError(ValueError):
    """The value is not a relative position bias the op computes."""


@dataclass(frozen=True)
class RelativeBias:
    table: ir.Value  # the [num_buckets, N] initializer
    max_distance: int


def find_table(value: ir.Value, num_heads: int) -> ir.Value | None:
    """The [num_buckets, num_heads] initializer that `value` is gathered from, through layout ops only; None when
    `value` is not such a gather (a mask, say)."""
    for _ in range(8):
        node = value.producer()
        if node is None:
            return None
        if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and node.attributes.get_int("axis", 0) == 0:
            table = node.inputs[0]
            tensor = ir.convenience.get_const_tensor(table) if table is not None else None
            dims = tuple(tensor.shape.numpy()) if tensor is not None else ()
            return table if len(dims) == 2 and dims[1] == num_heads else None
        if node.op_type not in _LAYOUT_OPS or node.domain not in ("", "ai.onnx") or not node.inputs:
            return None
        value = node.inputs[0]
    return None


def _offset_buckets(bias: np.ndarray, num_heads: int, name: str) -> np.ndarray:
    """[2L - 1]: the bucket at each offset k - q (index offset + L - 1) of a probed bias, after checking that it is
    one table entry per head, the head's own column, and a function of k - q alone."""
    if bias.ndim != 4 or bias.shape[1] != num_heads or bias.shape[2] != bias.shape[3]:
        raise PositionBiasError(f"the bias {name} has shape {list(bias.shape)}; expected [B or 1,{num_heads},S,S]")
    ids = bias.astype(np.float64) - 1
    if not np.array_equal(ids, np.round(ids)) or ids.min() < 0:
        raise PositionBiasError(f"the bias {name} is not a gather of its table (values that are no table entry)")
    ids = ids.astype(np.int64)
    heads = np.arange(num_heads)[None, :, None, None]
    if not np.array_equal(ids % num_heads, np.broadcast_to(heads, ids.shape)):
        raise PositionBiasError(f"the bias {name} does not read head h's column of its table for head h")
    buckets = ids // num_heads
    if not np.all(buckets == buckets[:1, :1]):
        raise PositionBiasError(f"the bias {name} differs between items or heads in its buckets")
    grid = buckets[0, 0]
    L = grid.shape[0]
    offset = np.arange(L)[None, :] - np.arange(L)[:, None]
    by_offset = np.full(2 * L - 1, -1, dtype=np.int64)
    by_offset[offset.ravel() + L - 1] = grid.ravel()
    if not np.array_equal(by_offset[offset + L - 1], grid):
        raise PositionBiasError(f"the bias {name} is not a function of the key-minus-query offset alone")
    return by_offset


def fit_max_distance(by_offset: np.ndarray, num_buckets: int, needed: int, hint: int | None = None) -> int:
    """The max distance whose buckets (`relative_buckets`) are `by_offset` at every probed offset and that no other
    matching distance contradicts at any offset within `needed` tokens; the hint where it matches."""
    L = (by_offset.size + 1) // 2
    offsets = np.arange(-(L - 1), L)
    exact = num_buckets // 4
    candidates = sorted(set(range(exact + 1, MAX_DISTANCE + 1)) | ({hint} if hint and hint > exact else set()))
    matches = [d for d in candidates if np.array_equal(relative_buckets(offsets, num_buckets, d), by_offset)]
    if not matches:
        raise PositionBiasError(f"no max distance up to {MAX_DISTANCE} gives T5's bidirectional buckets with "
                                f"{num_buckets} buckets at the probed offsets: not the bias the op computes")
    far = np.arange(-(needed - 1), needed) if needed > L else offsets
    want = relative_buckets(far, num_buckets, matches[0])
    if any(not np.array_equal(relative_buckets(far, num_buckets, d), want) for d in matches[1:]):
        raise PositionBiasError(f"max distances {matches[0]} to {matches[-1]} all give the probed buckets but differ "
                                f"within {needed} tokens; the probe cannot tell which one the model uses")
    return hint if hint in matches else matches[0]


def probe_relative(model: ir.Model, bias: ir.Value, table: ir.Value, num_heads: int, needed: int,
                   hint: int | None = None) -> RelativeBias:
    """The relative position bias that `bias` (gathered from `table`, `find_table`) is, for sequences up to `needed`
    tokens, or `PositionBiasError` with the reason."""
    buckets = int(ir.convenience.get_const_tensor(table).shape[0])
    if buckets < 4:
        raise PositionBiasError(f"the bias table {table.name} has {buckets} buckets; the op's function needs >= 4")
    length = max(2, min(needed, PROBE))
    feeds, _ = probe_batch(length)
    ids = (np.arange(buckets * num_heads, dtype=np.float32) + 1).reshape(buckets, num_heads)
    try:
        probed = evaluate(model, bias, feeds, replace={table.name: ids})
    except MaskProbeError as exc:
        raise PositionBiasError(str(exc)) from None
    by_offset = _offset_buckets(np.asarray(probed), num_heads, bias.name)
    return RelativeBias(table, fit_max_distance(by_offset, buckets, needed, hint))
