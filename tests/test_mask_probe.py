"""Reading an exported attention mask as padding plus a window (attncal.graphs.placements.mask_probe): the fit on
masks of every form the op takes, the refusal of every other form, and the probe run on a real
subgraph."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from attncal.graphs.ops.contract import AttentionGeometry
from attncal.graphs.placements.mask_probe import MaskProbeError, fit_geometry, probe_batch, probe_geometry
from support.probe_graphs import position_nodes, probe_model

LOWEST = np.finfo(np.float32).min


def band_mask(valid: np.ndarray, left: int, right: int, additive: bool = True, dtype=np.float32) -> np.ndarray:
    """[B,1,L,L]: key k visible to query q when valid and q - left <= k <= q + right (-1: no bound)."""
    L = valid.shape[1]
    off = np.arange(L)[None, :] - np.arange(L)[:, None]
    band = np.ones((L, L), dtype=bool)
    if left >= 0:
        band &= off >= -left
    if right >= 0:
        band &= off <= right
    vis = (band[None] & valid[:, None, :])[:, None]
    return np.where(vis, 0, np.finfo(dtype).min).astype(dtype) if additive else vis


@pytest.mark.parametrize("length", [2, 7, 64, 301])
@pytest.mark.parametrize("left,right", [(-1, -1), (-1, 0), (5, 0), (3, 3), (0, 0), (-1, 4), (6, -1), (10, 2)])
def test_band_masks_are_read_exactly(length, left, right):
    _, valid = probe_batch(length)
    span = int(valid[0].sum())
    # A bound as wide as the valid span cannot be seen: it reads as no bound.
    want_left = left if 0 <= left < span - 1 else -1
    want_right = right if 0 <= right < span - 1 else -1
    for additive, dtype in ((True, np.float32), (True, np.float16), (False, bool)):
        fit = fit_geometry(band_mask(valid, want_left, want_right, additive, dtype), valid, "m")
        assert fit.geometry == AttentionGeometry(0, want_left, want_right), (additive, dtype)
        assert fit.span == span


def test_a_padding_only_mask_broadcast_over_queries_is_no_window():
    _, valid = probe_batch(20)
    bert = np.where(valid, 0, LOWEST).astype(np.float32)[:, None, None, :]  # [B,1,1,S]: the BERT family's
    assert fit_geometry(bert, valid, "m").geometry == AttentionGeometry()


@pytest.mark.parametrize("edit,message", [
    (lambda m: m + np.float32(0.5), "values other than 0 and float32's lowest"),  # an additive bias
    (lambda m: np.concatenate([m, m], axis=1), "one mask for every head"),
    (lambda m: np.where(np.eye(m.shape[-1], dtype=bool), LOWEST, m).astype(np.float32), "from its own query row"),
    (lambda m: chunked(m), "not padding plus a window"),
    (lambda m: m.astype(np.int64), "expected a boolean or an additive float mask"),
])
def test_other_masks_are_refused_with_the_reason(edit, message):
    _, valid = probe_batch(24)
    with pytest.raises(MaskProbeError, match=message):
        fit_geometry(edit(band_mask(valid, -1, 0)), valid, "m")


def chunked(m: np.ndarray) -> np.ndarray:
    """Chunked causal attention (chunks of 4), which no window gives."""
    L = m.shape[-1]
    q, k = np.arange(L)[:, None], np.arange(L)[None, :]
    return np.where((q // 4 == k // 4), m, LOWEST).astype(np.float32)


def _mask_model(window: int) -> ir.Model:
    """A graph whose output is a causal sliding-window mask of `window` keys built from attention_mask the way
    transformers' exports build it (Range, comparisons, And, Where), plus a reader of the mask."""
    nodes, consts = position_nodes()
    nodes += [
        helper.make_node("LessOrEqual", ["k", "q"], ["causal"]),
        helper.make_node("Sub", ["q", "w"], ["lo"]),
        helper.make_node("Greater", ["k", "lo"], ["inside"]),
        helper.make_node("Cast", ["attention_mask"], ["valid"], to=TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["valid", "ax12"], ["valid4"]),
        helper.make_node("And", ["causal", "inside"], ["band"]),
        helper.make_node("And", ["band", "valid4"], ["visible"]),
        helper.make_node("Where", ["visible", "zero_f", "lowest"], ["mask"]),
        helper.make_node("Identity", ["mask"], ["out"]),
    ]
    consts += [helper.make_tensor("w", TensorProto.INT64, [], [window]),
               helper.make_tensor("ax12", TensorProto.INT64, [2], [1, 2]),
               helper.make_tensor("zero_f", TensorProto.FLOAT, [], [0.0]),
               helper.make_tensor("lowest", TensorProto.FLOAT, [], [float(LOWEST)])]
    return probe_model(nodes, consts, "out")


def test_the_probe_runs_the_mask_subgraph():
    """transformers' causal sliding window (q - W < k <= q) is window_left W - 1, window_right 0."""
    model = _mask_model(window=9)
    mask = next(n for n in model.graph if n.op_type == "Where").outputs[0]
    assert probe_geometry(model, mask, needed=100) == AttentionGeometry(0, 8, 0)
    # Past the probe, a side the probe shows unbounded is trusted only where no wider window is declared.
    model = _mask_model(window=5000)
    mask = next(n for n in model.graph if n.op_type == "Where").outputs[0]
    assert probe_geometry(model, mask, needed=300) == AttentionGeometry(0, -1, 0)
    with pytest.raises(MaskProbeError, match="declares a window of 5000"):
        probe_geometry(model, mask, needed=8192, declared=5000)
