"""Embedding precision and Matryoshka dimensions: `attncal.runtime.precision.quantize` gives what
sentence-transformers' `quantize_embeddings` gives on the same float vectors and ranges (bit for bit; the version
the module mirrors is named in it), `Encoder.encode` / `encode_chunks` apply them after one forward pass, and
dimensions are refused outside the width or the model's declared Matryoshka dimensions."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from attncal.runtime import precision as P
from attncal.runtime.encoder import Encoder
from attncal.synthetic import synthetic_text
from support.chunk_exports import chunk_export

CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def st_quantize():
    from sentence_transformers import quantize_embeddings

    return quantize_embeddings


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return Encoder(chunk_export(tmp_path_factory)[0], providers=CPU)


def _vectors(n=257, d=37, seed=0):
    """Float vectors with the awkward values: exact zeros (binary's x > 0), a constant dimension (int8's step 0),
    values at and past the ranges, a width that is not a multiple of 8 (binary's last byte)."""
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    x[:, 3] = 0.25
    x[::7, 5] = 0.0
    return x


@pytest.mark.parametrize("precision", ["float32", "int8", "uint8", "binary", "ubinary"])
def test_quantize_equals_sentence_transformers(st_quantize, precision):
    x = _vectors()
    ranges = P.ranges_of(x[:100])  # a sample's ranges: later rows fall outside them (clipped)
    want = st_quantize(x, precision, ranges=ranges if precision in P.SCALAR else None)
    got = P.quantize(x, precision, ranges if precision in P.SCALAR else None)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)
    if precision in P.SCALAR:  # and on ranges computed by sentence-transformers from calibration embeddings
        r = st_quantize(x[:100], precision, calibration_embeddings=x[:100])
        assert np.array_equal(r, P.quantize(x[:100], precision, P.ranges_of(x[:100])))


def test_encoder_precisions_and_ranges(st_quantize, encoder):
    texts = [synthetic_text(20 + 7 * i, seed=i) for i in range(40)]
    full = encoder.encode(texts)
    ranges = encoder.quantization_ranges(texts, sample=25, seed=3)
    sample = P.sample_rows(len(texts), 25, 3)
    assert np.array_equal(ranges, P.ranges_of(full[sample]))  # the seeded sample's min / max
    for precision in ("int8", "uint8"):
        got = encoder.encode(texts, precision=precision, ranges=ranges)
        assert np.array_equal(got, st_quantize(full, precision, ranges=ranges))
    for precision in ("binary", "ubinary"):
        got = encoder.encode(texts, precision=precision)
        assert got.shape == (40, 4) and np.array_equal(got, st_quantize(full, precision))
    assert np.array_equal(encoder.encode(texts, precision="float16"), full.astype(np.float16))
    chunks = encoder.encode_chunks(texts[:3], "late", size=8, precision="ubinary")
    floats = encoder.encode_chunks(texts[:3], "late", size=8)
    assert np.array_equal(chunks.vectors, st_quantize(floats.vectors, "ubinary"))


def test_dimensions_truncate_then_renormalise(encoder):
    texts = ["a short text", synthetic_text(200, seed=1)]
    full = encoder.encode(texts)
    got = encoder.encode(texts, dimensions=8)
    want = full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)
    r = encoder.quantization_ranges(texts, dimensions=8)
    assert r.shape == (2, 8) and encoder.encode(texts, dimensions=8, precision="int8", ranges=r).shape == (2, 8)
    c = encoder.encode_chunks(texts, "late", size=8, dimensions=8)
    f = encoder.encode_chunks(texts, "late", size=8)
    np.testing.assert_allclose(c.vectors, P.truncate(f.vectors, 8, True), atol=1e-7)


def test_declared_matryoshka_dimensions_are_enforced(tmp_path_factory, tmp_path):
    src = chunk_export(tmp_path_factory)[0]
    out = tmp_path / "export"
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["matryoshka_dimensions"] = [8, 16, 32]
    (out / "config.json").write_text(json.dumps(cfg))
    enc = Encoder(out, providers=CPU)
    assert enc.encode(["x y"], dimensions=16).shape == (1, 16)
    with pytest.raises(ValueError, match=r"^dimensions 12 is not one of the model's Matryoshka dimensions \(8, 16, "
                                         r"32\)$"):
        enc.encode(["x y"], dimensions=12)
