"""The relative position bias probe (attncal.graphs.placements.position_bias_probe): the table found through the
layout ops, the max distance fitted by running the bias subgraph, and the refusals of anything else.  The exports
of T5 and MPNet through it are in tests/test_export.py (their native graphs, with parity)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from attncal.calibration.relative_position import relative_buckets
from attncal.graphs.placements.position_bias_probe import (PositionBiasError, _offset_buckets, find_table,
                                                           fit_max_distance, probe_relative)
from support.probe_graphs import position_nodes, probe_model

L_MAX = 1024
N = 3


def _bias_model(lookup: np.ndarray, buckets: int = 32) -> ir.Model:
    """A graph whose `bias` [1,N,S,S] is a bias table gathered at lookup[k - q + L_MAX - 1] (the bucket of each
    offset, from a lookup initializer), through transformers' layout (Transpose, Unsqueeze)."""
    nodes, consts = position_nodes()
    nodes += [
        helper.make_node("Sub", ["k", "q"], ["offset"]),
        helper.make_node("Add", ["offset", "shift"], ["index"]),
        helper.make_node("Gather", ["lookup", "index"], ["bucket"]),
        helper.make_node("Gather", ["table", "bucket"], ["gathered"]),  # [S,S,N]
        helper.make_node("Transpose", ["gathered"], ["heads"], perm=[2, 0, 1]),
        helper.make_node("Unsqueeze", ["heads", "ax0"], ["bias"]),
    ]
    consts += [helper.make_tensor("shift", TensorProto.INT64, [], [L_MAX - 1]),
               helper.make_tensor("lookup", TensorProto.INT64, [lookup.size], lookup.tolist()),
               helper.make_tensor("table", TensorProto.FLOAT, [buckets, N],
                                  np.random.default_rng(0).normal(size=buckets * N).tolist())]
    return probe_model(nodes, consts, "bias")


def _offsets() -> np.ndarray:
    return np.arange(-(L_MAX - 1), L_MAX)


def _probe(lookup: np.ndarray, needed: int, hint: int | None = None):
    model = _bias_model(lookup)
    bias = next(n for n in model.graph if n.op_type == "Unsqueeze" and n.outputs[0].name == "bias").outputs[0]
    table = find_table(bias, N)
    assert table is not None and table.name == "table"
    return probe_relative(model, bias, table, N, needed, hint)


@pytest.mark.parametrize("distance", [128, 100, 40])
def test_the_probe_reads_the_max_distance_off_the_graph(distance):
    truth = relative_buckets(_offsets(), 32, distance)
    fitted = _probe(truth, needed=1000).max_distance
    # The fit is a distance whose buckets are the graph's at every offset the export can see.
    assert np.array_equal(relative_buckets(_offsets(), 32, fitted), truth)
    assert _probe(truth, needed=1000, hint=distance).max_distance == distance


def test_the_probe_refuses_another_bucket_function():
    linear = np.clip(_offsets() + 16, 0, 31)  # a clipped offset: not T5's buckets for any distance
    with pytest.raises(PositionBiasError, match="no max distance"):
        _probe(linear, needed=512)
    mirrored = relative_buckets(-_offsets(), 32, 128)  # q - k instead of k - q
    with pytest.raises(PositionBiasError, match="no max distance"):
        _probe(mirrored, needed=512)


def test_offset_buckets_refusals():
    L, buckets = 6, 8
    offset = np.arange(L)[None, :] - np.arange(L)[:, None]
    good = relative_buckets(offset, buckets, 20)
    ids = good[None, None] * N + np.arange(N)[None, :, None, None] + 1.0  # [1,N,L,L], entry b*N + h + 1
    assert np.array_equal(_offset_buckets(ids, N, "b")[offset + L - 1], good)
    with pytest.raises(PositionBiasError, match="head h's column"):
        _offset_buckets(ids[:, ::-1], N, "b")
    shifted = ids.copy()
    shifted[..., 0, 1] += N  # one entry off its diagonal's bucket
    with pytest.raises(PositionBiasError, match="offset alone"):
        _offset_buckets(shifted, N, "b")
    with pytest.raises(PositionBiasError, match="no table entry"):
        _offset_buckets(ids + 0.5, N, "b")


def test_a_distance_the_probe_cannot_pin_down_is_refused():
    # Seen only up to 40 offsets, distances 200 and 205 give the same buckets there and differ further out.
    near = relative_buckets(np.arange(-39, 40), 32, 200)
    assert np.array_equal(near, relative_buckets(np.arange(-39, 40), 32, 205))
    with pytest.raises(PositionBiasError, match="cannot tell"):
        fit_max_distance(near, 32, needed=4096)
    assert fit_max_distance(near, 32, needed=40) > 8


def test_find_table_ignores_masks():
    model = _bias_model(relative_buckets(_offsets(), 32, 128))
    offset = next(n for n in model.graph if n.op_type == "Sub").outputs[0]
    assert find_table(offset, N) is None
    bias = next(n for n in model.graph if n.outputs[0].name == "bias").outputs[0]
    assert find_table(bias, N + 1) is None  # a table of other heads than the layer's
