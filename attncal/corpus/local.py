"""The `local` engine: the attncal `Encoder` in this process, or in N worker processes.

A window of rows (default 4096) is the unit of work: it is tokenized once to
get lengths, sorted by length (longest first, as `Encoder.encode` does) and cut
into batches, so padding stays low while memory stays bounded by the window.
Embeddings come back in input order.  With N workers, each process holds one
`Encoder` with cores // N intra-op threads and at most 2 windows per worker
are in flight, so the reader never runs ahead of the encoders by more than
that.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, Iterator

import numpy as np

from ..runtime.chunking import ChunkedEmbeddings, ChunkError, ChunkOptions
from ..runtime.encoder import Encoder, length_batches
from .inputs import CorpusInputError

Window = tuple[list[str], list[str]]  # (ids, texts)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def windows(chunks: Iterable[Window], skip: int, shard_size: int, window: int) -> Iterator[Window]:
    """The rows of `chunks` after the first `skip`, in windows of at most `window` rows that never
    cross a boundary of `shard_size` rows, so a shard's batches (hence its bytes) are the same
    whether or not the run was resumed."""
    pos = 0  # index of the next row
    buf_ids: list[str] = []
    buf_texts: list[str] = []
    start = skip  # index of the first row in the buffer
    for ids, texts in chunks:
        if pos + len(ids) <= skip:
            pos += len(ids)
            continue
        if pos < skip:
            ids, texts = ids[skip - pos :], texts[skip - pos :]
            pos = skip
        pos += len(ids)
        k = 0
        while k < len(ids):
            limit = min(window, shard_size - start % shard_size)
            take = min(limit - len(buf_ids), len(ids) - k)
            buf_ids += ids[k : k + take]
            buf_texts += texts[k : k + take]
            k += take
            if len(buf_ids) == limit:
                yield buf_ids, buf_texts
                start += len(buf_ids)
                buf_ids, buf_texts = [], []
    if buf_ids:
        yield buf_ids, buf_texts


def load_encoder(export_dir: str, threads: int | None, max_length: int | None, providers=None,
                 chunks: dict | None = None):
    """The Encoder of a run; with `chunks` (the manifest's `chunks`), its `ChunkRows`."""
    enc = Encoder(export_dir, providers=providers, intra_op_threads=threads)
    if max_length is not None:
        enc.max_length = max_length
    return enc if chunks is None else ChunkRows(enc, chunks)


class ChunkRows:
    """An Encoder that gives each row its chunks (`Encoder.encode_chunks`) for `encode_window`: `chunks` is the
    run's chunk options with `skip` (on_error skip: a row that cannot be chunked gets no chunk row and is
    listed, instead of stopping the run)."""

    def __init__(self, encoder: Encoder, chunks: dict) -> None:
        self.encoder = encoder
        self.options = ChunkOptions(**{k: chunks[k] for k in ("method", "size", "by", "overlap")})
        self.skip = bool(chunks.get("skip"))

    def __getattr__(self, name):  # dimension, graph_file, ...: the Encoder's
        return getattr(self.encoder, name)

    def encode(self, texts: list[str], batch_size: int) -> tuple[ChunkedEmbeddings, int]:
        """The chunks of one window's texts, float32 (the shard writer applies dimensions and precision);
        the result's `errors`: (index, one line) of each text left out.  A ChunkError without `skip`."""
        errors: list | None = [] if self.skip else None
        got = self.encoder.encode_chunks(texts, self.options, batch_size=batch_size, errors=errors)
        got.errors = errors or []
        return got, got.tokens


def row_error(exc: ChunkError, ids: list[str]) -> CorpusInputError:
    """A window's ChunkError as the bad row it names (by its id)."""
    return CorpusInputError(f"row {ids[exc.index]!r}: {exc.message} (pass --on-error skip to leave such rows out)")


class Cancelled(Exception):
    """The caller asked the encoding to stop (`encode_window`'s `cancelled` said so between batches)."""


def encode_window(encoder, texts: list[str], batch_size: int,
                  cancelled: Callable[[], bool] | None = None,
                  max_batch_tokens: int | None = None) -> tuple[np.ndarray, int]:
    """(embeddings [n, D] in input order, number of tokens) of one window, batches sorted by length and cut
    as `Encoder.encode` cuts them (`attncal.runtime.encoder.length_batches`).

    `cancelled` is asked before each batch, so a stop request waits for one batch, not a whole window
    (a window is thousands of texts)."""
    if isinstance(encoder, ChunkRows):
        return encoder.encode(texts, batch_size)
    lengths = encoder.token_lengths(texts)
    out = np.empty((len(texts), encoder.dimension), dtype=np.float32)
    for idx in length_batches(lengths, batch_size, max_batch_tokens):
        if cancelled is not None and cancelled():
            raise Cancelled
        _, emb = encoder.run(encoder.tokenize([texts[j] for j in idx]))
        out[idx] = emb
    return out, int(sum(lengths))


_WORKER_ENCODER = None


def tokenizer_threads(threads: int) -> None:
    """A worker's tokenizer (Rust threads, Rayon's pool) gets the worker's own share of the cores, as its
    ONNX Runtime session does; set before the tokenizer's first call.  Tokenizing is a large part of a
    small model's time, so a worker of several cores that tokenized on one was held back by it."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, threads)))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if threads > 1 else "false")


def _init_worker(export_dir: str, threads: int, max_length: int | None, providers, chunks=None) -> None:
    tokenizer_threads(threads)
    global _WORKER_ENCODER
    _WORKER_ENCODER = load_encoder(export_dir, threads, max_length, providers, chunks)


def _work(texts: list[str], batch_size: int, max_batch_tokens: int | None) -> tuple[np.ndarray, int]:
    return encode_window(_WORKER_ENCODER, texts, batch_size, max_batch_tokens=max_batch_tokens)


def _result(fut, ids: list[str]):
    try:
        return fut.result()
    except ChunkError as exc:
        raise row_error(exc, ids) from None


class LocalEngine:
    name = "local"

    def __init__(self, export_dir: str, *, batch_size: int, workers: int = 1, max_length: int | None = None,
                 providers=None, max_batch_tokens: int | None = None, chunks: dict | None = None) -> None:
        """`chunks`: the run's chunk options (`ChunkRows`), None for one vector per row."""
        self.export_dir, self.batch_size, self.workers = str(export_dir), batch_size, workers
        self.max_batch_tokens = max_batch_tokens
        self.max_length, self.providers = max_length, providers
        self.chunks = chunks
        self.threads = max(1, available_cores() // workers)

    def describe(self) -> dict:
        return {"name": self.name, "workers": self.workers, "threads_per_worker": self.threads,
                "max_batch_tokens": self.max_batch_tokens}

    def encode(self, windows: Iterable[Window]) -> Iterator[tuple[list[str], np.ndarray, int | None]]:
        if self.workers == 1:
            # ORT's default thread count (all cores), exactly like a bare Encoder
            enc = load_encoder(self.export_dir, None, self.max_length, self.providers, self.chunks)
            for ids, texts in windows:
                try:
                    emb, tokens = encode_window(enc, texts, self.batch_size, max_batch_tokens=self.max_batch_tokens)
                except ChunkError as exc:
                    raise row_error(exc, ids) from None
                yield ids, emb, tokens
            return
        with ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                                 initargs=(self.export_dir, self.threads, self.max_length, self.providers,
                                           self.chunks)) as pool:
            pending: deque = deque()
            try:
                for ids, texts in windows:
                    pending.append((ids, pool.submit(_work, texts, self.batch_size, self.max_batch_tokens)))
                    while len(pending) >= 2 * self.workers:
                        done_ids, fut = pending.popleft()
                        emb, tokens = _result(fut, done_ids)
                        yield done_ids, emb, tokens
                while pending:
                    done_ids, fut = pending.popleft()
                    emb, tokens = _result(fut, done_ids)
                    yield done_ids, emb, tokens
            finally:
                for _, fut in pending:
                    fut.cancel()
