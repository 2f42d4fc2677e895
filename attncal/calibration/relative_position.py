"""The relative position buckets of T5's encoder and MPNet: which row of a model's bias table scores a key.

Both models add to every score a per-head bias that depends only on the key's offset from the query,
r = k - q, through T5's bidirectional bucket function (`T5Attention._relative_position_bucket` with
bidirectional=True; MPNet's `relative_position_bucket` is the same function):

    half  = num_buckets // 2,  exact = half // 2
    bucket(r) = (half if r > 0 else 0) + (n if n < exact else
                min(half - 1, exact + trunc(log(n / exact) / log(max_distance / exact) * (half - exact))))
    with n = |r|, the logarithm's argument and the product in float32, log(max_distance / exact) in
    float64 and rounded to float32 (as torch computes it)

The calibrated attention ops take the table and `max_distance` and compute the buckets themselves
(attncal.graphs.ops.contract), so this is the one place the function is written in Python: the float64 oracle
and the export's check of a graph's bias (`attncal.graphs.placements.position_bias_probe`) both read it.  It is exact
against torch's and ONNX Runtime's float32 arithmetic for every offset below 2^20 at the bucket counts and
distances models use (tests/test_relative_position.py); the native kernels evaluate the same float32 steps
(plugins/kernels/common/relative_position.h).
"""

from __future__ import annotations

import math

import numpy as np


def check_buckets(num_buckets: int, max_distance: int) -> None:
    """Refuse a bucket count or distance the function has no value for (a log of 0, or of a ratio <= 1)."""
    if num_buckets < 4:
        raise ValueError(f"a relative position bias needs at least 4 buckets, got {num_buckets}")
    if max_distance <= num_buckets // 4:
        raise ValueError(f"relative_max_distance must exceed the exact buckets' range {num_buckets // 4} "
                         f"({num_buckets} buckets), got {max_distance}")


def relative_buckets(offset: np.ndarray, num_buckets: int, max_distance: int) -> np.ndarray:
    """int64 buckets of the key-minus-query offsets `offset` (any shape)."""
    check_buckets(num_buckets, max_distance)
    half = num_buckets // 2
    exact = half // 2
    offset = np.asarray(offset, dtype=np.int64)
    n = np.abs(offset)
    ratio = np.maximum(n, 1).astype(np.float32) / np.float32(exact)
    large = (np.log(ratio) / np.float32(math.log(max_distance / exact)) * np.float32(half - exact)).astype(np.int64)
    large = np.minimum(exact + large, half - 1)
    return np.where(offset > 0, half, 0) + np.where(n < exact, n, large)


def relative_bias(table: np.ndarray, S_q: int, S_k: int, max_distance: int) -> np.ndarray:
    """[N,S_q,S_k]: the bias of table [num_buckets, N] (float) at every query and key position (self-attention
    positions: query row q is token q)."""
    offset = np.arange(S_k)[None, :] - np.arange(S_q)[:, None]
    return np.moveaxis(np.asarray(table)[relative_buckets(offset, table.shape[0], max_distance)], -1, 0)
