"""`attncal bench --long-documents`: what indexing long documents costs, measured side by side in one process.

On documents of 512 and 2,048 tokens (8 of each, cut from the Python Language Reference, `attncal.eval.realtext`),
with the export given:

* one vector per document (the text truncated at the max length: what `attncal encode` writes without --chunks);
* naive chunks of 128 tokens, overlap 0 and 32 (one model call per chunk);
* late chunks of 128 tokens, window overlap 0 and 32 (one model call per max-length window); where the export has
  chunk vectors (`attncal export --chunk-vectors`), once from the graph's chunk-vector output (what the Encoder
  and a Triton server run) and once from its token states, side by side.

Each case is warmed up, then the cases run in turn, `repeats` rounds, so load on the machine falls on every case
alike; the median is reported with its ratio to late chunking.  The index bytes per document are the vectors a
case writes per document times the bytes of one vector at each precision (`attncal.runtime.precision`).
benchmarks/long_documents.py measures the retrieval effect and calls this for the cost.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..eval.realtext import python_reference_documents
from ..runtime.precision import PRECISIONS, bytes_per_vector

SHAPES = ((8, 512), (8, 2048))
CHUNK_SIZE = 128
OVERLAP = 32


def documents(enc, count: int, tokens: int) -> list[str]:
    """`count` texts of about `tokens` tokens each, consecutive stretches of the Python Language Reference."""
    docs = python_reference_documents()[0]
    ids = enc.tokenizer(" ".join(d.text for d in docs[:200]), add_special_tokens=False)["input_ids"]
    if len(ids) < count * tokens:
        raise ValueError(f"the reference text holds {len(ids)} tokens, fewer than {count} x {tokens}")
    return [enc.tokenizer.decode(ids[i * tokens:(i + 1) * tokens]) for i in range(count)]


def cases(enc, docs: list[str], size: int = CHUNK_SIZE, overlap: int = OVERLAP) -> dict[str, Callable]:
    """The encodings compared, each a call returning the number of vectors it wrote."""
    out = {"whole (truncated)": lambda: len(enc.encode(docs)),
           "naive, overlap 0": lambda: len(enc.encode_chunks(docs, "naive", size=size)),
           f"naive, overlap {overlap}": lambda: len(enc.encode_chunks(docs, "naive", size=size, overlap=overlap)),
           "late": lambda: len(enc.encode_chunks(docs, "late", size=size)),
           f"late, window overlap {overlap}": lambda: len(enc.encode_chunks(docs, "late", size=size,
                                                                               overlap=overlap))}
    if enc.has_chunk_vectors:
        out["late, from token states"] = lambda: len(enc.encode_chunks(docs, "late", size=size, in_graph=False))
    return out


def measure(enc, repeats: int = 3, shapes=SHAPES, size: int = CHUNK_SIZE, overlap: int = OVERLAP) -> dict:
    """{"8 x 512": {case: {median_s, vs_late, vectors_per_doc, index_bytes_per_doc: {precision: bytes}}}, ...}."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    out = {}
    for count, tokens in shapes:
        docs = documents(enc, count, tokens)
        run = cases(enc, docs, size, overlap)
        vectors = {k: f() for k, f in run.items()}  # warm-up, and the vectors each case writes
        times: dict[str, list[float]] = {k: [] for k in run}
        for _ in range(repeats):  # interleaved
            for k, f in run.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        med = {k: float(np.median(v)) for k, v in times.items()}
        out[f"{count} x {tokens}"] = {
            k: {"median_s": v, "vs_late": v / med["late"], "vectors_per_doc": vectors[k] / count,
                "index_bytes_per_doc": {p: vectors[k] / count * bytes_per_vector(p, enc.dimension)
                                        for p in PRECISIONS}}
            for k, v in med.items()}
    return out
