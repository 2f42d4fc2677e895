"""The relative position buckets (T5's encoder, MPNet): the Python twin (`attncal.calibration.relative_position`)
and the native kernels' function (plugins/kernels/common/relative_position.h, through the library's
`attncal_relative_buckets`) against the models' own code, at every offset within ±2^20, for the bucket counts
and distances models use and the smallest valid ones.  Truncating a float32 product to an integer makes one
rounding step a different bucket, so the check is exhaustive, not sampled."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from attncal.calibration.relative_position import check_buckets, relative_bias, relative_buckets
from test_native_kernel import library  # noqa: F401  (the built-library fixture)

RANGE = 1 << 20
CONFIGS = [(32, 128), (32, 256), (8, 64), (64, 256), (128, 128), (16, 32), (320, 1024), (4, 2), (6, 5), (33, 100)]


def _offsets() -> np.ndarray:
    return np.arange(-RANGE, RANGE + 1, dtype=np.int64)


def _t5(offsets: np.ndarray, buckets: int, distance: int) -> np.ndarray:
    from transformers.models.t5.modeling_t5 import T5Attention

    return T5Attention._relative_position_bucket(torch.from_numpy(offsets), bidirectional=True, num_buckets=buckets,
                                                 max_distance=distance).numpy()


@pytest.mark.parametrize("buckets,distance", CONFIGS)
def test_python_and_native_buckets_equal_t5s_at_every_offset(library, buckets, distance):
    offsets = _offsets()
    want = _t5(offsets, buckets, distance)
    assert np.array_equal(relative_buckets(offsets, buckets, distance), want)
    fn = ctypes.CDLL(str(library)).attncal_relative_buckets
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    native = np.empty_like(offsets)
    assert fn(buckets, distance, int(offsets[0]), offsets.size, native.ctypes.data) == 0
    bad = np.nonzero(native != want)[0]
    assert bad.size == 0, f"native bucket differs at offsets {offsets[bad[:5]].tolist()}"
    assert fn(3, 10, 0, 1, native.ctypes.data) == -1  # refused, nothing written past the check


def test_mpnet_uses_the_same_function():
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    offsets = _offsets()
    got = MPNetEncoder.relative_position_bucket(torch.from_numpy(offsets), num_buckets=32, max_distance=128).numpy()
    assert np.array_equal(relative_buckets(offsets, 32, 128), got)


def test_bias_layout_and_refusals():
    table = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    bias = relative_bias(table, 5, 5, 20)
    assert bias.shape == (3, 5, 5)
    offset = np.arange(5)[None, :] - np.arange(5)[:, None]
    assert np.array_equal(bias[2], table[relative_buckets(offset, 8, 20), 2])
    with pytest.raises(ValueError, match="at least 4 buckets"):
        check_buckets(3, 10)
    with pytest.raises(ValueError, match="must exceed"):
        check_buckets(32, 8)
