"""What an index stores of an embedding: its Matryoshka dimensions and its precision.

`truncate` cuts the vectors to their first N dimensions and, where the model normalises its embeddings,
normalises them again (a Matryoshka-trained model's leading dimensions are an embedding of their own; cut
and not renormalised they would not be unit vectors, and dot products would stop being cosines).

`quantize` writes them in one of `PRECISIONS`.  Apart from float16 (a plain cast), each precision has the
meaning sentence-transformers' `quantize_embeddings` gives it (mirrored from sentence-transformers 6.3.0,
`sentence_transformers/util/quantization.py`), so a vector database that takes its output takes ours:

* int8 / uint8: per dimension, `ranges` [2, D] holds the minimum and maximum; the step is
  (max - min) / 255 (1 where max == min), the value floor((x - min) / step) clipped to [0, 255], minus 128
  for int8.  The arithmetic is float32, as there.
* binary / ubinary: one bit per dimension, 1 where x > 0, packed eight to a byte with the first dimension in
  the most significant bit (`numpy.packbits`); binary is the packed byte minus 128 as int8, ubinary the byte.

int8 / uint8 need ranges.  sentence-transformers takes them from the batch at hand when none are given,
which gives each batch its own scale; here they are required: `ranges_of` computes them from a sample of
the corpus (`Encoder.quantization_ranges` draws a seeded one), and the same ranges are then used for every
document and query of that index.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

PRECISIONS = ("float32", "float16", "int8", "uint8", "binary", "ubinary")
SCALAR = ("int8", "uint8")  # the precisions that need ranges
PACKED = ("binary", "ubinary")  # one bit per dimension
MIRRORS = "sentence-transformers 6.3.0 quantize_embeddings"
# A corpus sample for int8 / uint8 ranges: rows drawn without replacement with this seed (`sample_rows`).
RANGE_SAMPLE = 10_000
RANGE_SEED = 0
_NORM_EPS = 1e-12  # F.normalize's eps, as the exported graph normalises


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def declared_dimensions(export_dir: str | Path) -> tuple[int, ...] | None:
    """The Matryoshka dimensions a model declares (config.json's `matryoshka_dimensions`, as Jina's and
    other Matryoshka-trained models write it), None when it declares none."""
    path = Path(export_dir) / "config.json"
    if not path.is_file():
        return None
    dims = json.loads(path.read_text(encoding="utf-8")).get("matryoshka_dimensions")
    if not isinstance(dims, list) or not dims or not all(isinstance(d, int) and not isinstance(d, bool)
                                                         for d in dims):
        return None
    return tuple(sorted(set(dims)))


def check_dimensions(dimensions: int | None, width: int, declared: Sequence[int] | None = None) -> int | None:
    """`dimensions` checked against the embedding `width` and the model's declared Matryoshka dimensions
    (None: the full width); ValueError, one line, for anything else."""
    if dimensions is None:
        return None
    if isinstance(dimensions, bool) or not isinstance(dimensions, (int, np.integer)):
        raise ValueError(f"dimensions must be a whole number, got {dimensions!r}")
    dimensions = int(dimensions)
    if not 1 <= dimensions <= width:
        raise ValueError(f"dimensions must be in [1, {width}] (the model's embedding width), got {dimensions}")
    if declared and dimensions not in declared:
        raise ValueError(f"dimensions {dimensions} is not one of the model's Matryoshka dimensions "
                         f"({', '.join(map(str, declared))})")
    return dimensions


def truncate(emb: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The first `dimensions` of each row (all of them for None), normalised again where the model
    normalises (emb / max(||emb||, 1e-12), in float32, as the graph does)."""
    emb = np.asarray(emb, dtype=np.float32)
    if dimensions is None or dimensions == emb.shape[-1]:
        return emb
    out = np.ascontiguousarray(emb[..., :dimensions])
    return normalise(out) if normalize else out


def normalise(x: np.ndarray) -> np.ndarray:
    """Each row over max(its L2 norm, 1e-12), in float32: the exported graph's normalisation."""
    norm = np.sqrt((x * x).sum(-1, keepdims=True, dtype=np.float32))
    return x / np.maximum(norm, np.float32(_NORM_EPS))


def check_ranges(ranges, width: int, precision: str) -> np.ndarray:
    """`ranges` as float32 [2, width]: minimum row, maximum row; ValueError naming what is wrong."""
    if ranges is None:
        raise ValueError(f"{precision} needs ranges (per-dimension minimum and maximum, [2, {width}]): compute "
                         "them once from a sample of the corpus (Encoder.quantization_ranges) and pass the same "
                         "ones for documents and queries")
    r = np.asarray(ranges, dtype=np.float32)
    if r.ndim != 2 or r.shape[0] != 2:
        raise ValueError(f"{precision} ranges must have shape [2, {width}] (minimum and maximum rows), got "
                         f"{list(r.shape)}")
    if r.shape[1] != width:
        raise ValueError(f"{precision} ranges have width {r.shape[1]}, the embeddings {width} (compute the ranges "
                         "with the same dimensions)")
    if not np.isfinite(r).all():
        raise ValueError(f"{precision} ranges hold a value that is not finite")
    if (r[0] > r[1]).any():
        raise ValueError(f"{precision} ranges have a minimum above its maximum at dimension "
                         f"{int(np.argmax(r[0] > r[1]))}")
    return r


def ranges_of(emb: np.ndarray) -> np.ndarray:
    """Per-dimension minimum and maximum of `emb` [N, D], float32 [2, D] (sentence-transformers' ranges)."""
    emb = np.asarray(emb, dtype=np.float32)
    if emb.ndim != 2 or emb.shape[0] == 0:
        raise ValueError("ranges need at least one embedding")
    return np.vstack((np.min(emb, axis=0), np.max(emb, axis=0)))


def sample_rows(n: int, size: int = RANGE_SAMPLE, seed: int = RANGE_SEED) -> np.ndarray:
    """Sorted indices of min(size, n) rows of n, drawn without replacement with `seed`."""
    if n <= size:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))


def quantize(emb: np.ndarray, precision: str, ranges=None) -> np.ndarray:
    """`emb` [N, D] (float) in `precision` (see the module docstring); int8 / uint8 need `ranges`."""
    check_precision(precision)
    emb = np.asarray(emb, dtype=np.float32)
    if precision == "float32":
        return emb
    if precision == "float16":
        return emb.astype(np.float16)
    if precision in SCALAR:
        r = check_ranges(ranges, emb.shape[-1], precision)
        starts = r[0, :]
        steps = (r[1, :] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        q = np.clip(np.floor((emb - starts) / steps), 0, 255)
        return q.astype(np.uint8) if precision == "uint8" else (q - 128).astype(np.int8)
    packed = np.packbits(emb > 0, axis=-1)
    return packed if precision == "ubinary" else (packed - 128).astype(np.int8)


def output_width(precision: str, dimensions: int) -> int:
    """Values per vector in `precision`: bytes for the packed precisions, else `dimensions`."""
    return (dimensions + 7) // 8 if precision in PACKED else dimensions


def bytes_per_vector(precision: str, dimensions: int) -> int:
    item = {"float32": 4, "float16": 2}.get(precision, 1)
    return output_width(precision, dimensions) * item


def numpy_dtype(precision: str):
    return {"float32": np.float32, "float16": np.float16, "int8": np.int8, "uint8": np.uint8,
            "binary": np.int8, "ubinary": np.uint8}[check_precision(precision)]
