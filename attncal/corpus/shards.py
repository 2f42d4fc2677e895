"""Sharded Parquet output and `manifest.json`: what makes a run restartable without losing a row.

The output is a directory (a local path or a prefix in object storage).  Every shard is written
row group by row group under a hidden temporary name (`.part-....parquet.XXXX.tmp`) and moved to
its final name (`part-....parquet`) when whole; object stores have no rename, and `storage` moves
by copy and delete there, so a final name only ever holds a whole shard.  The manifest, written the
same way and always after the shards it lists, is the commit point: a shard belongs to the output
when, and only when, the manifest lists it.  A run killed at any point therefore leaves a manifest
that lists complete shards only; shards it does not list and temporary files are left-overs, which
`--resume` deletes or rewrites, and `read_embeddings` never reads.

Two layouts, by engine:

- `sequential` (local, triton): shard k holds valid rows [k * shard_size, (k + 1) * shard_size)
  of the input in input order; the manifest is rewritten after each shard.
- `pieces` (ray): the workers write the shards of each input piece themselves, `part-PPPPPP-JJJ`
  for the J-th shard of at most shard_size rows of piece P; the manifest lists them in input order
  with their first row once every piece before them is done, so reading the listed shards in order
  gives the valid rows in input order.  The driver rewrites it as pieces complete (see the Ray
  engine for how often).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Callable

import numpy as np

from ..artifact import METADATA_FILE
from ..runtime import precision as _precision
from ..runtime.chunking import ChunkedEmbeddings
from .storage import TEMP_SUFFIX, Location, explain

MANIFEST = "manifest.json"
SKIP_FILE = "skipped.jsonl"
FORMAT = 2
SEQUENTIAL, PIECES = "sequential", "pieces"
# Options that decide the bytes of the output: a resume must use the same ones.
OUTPUT_OPTIONS = ("text_field", "id_field", "shard_size", "batch_size", "max_batch_tokens", "window", "max_length",
                  "on_error", "dimensions", "precision", "chunks")
OUTPUT_DEFAULTS = {"precision": "float32"}  # what a manifest written before an option existed meant by its absence
_READ_ATTEMPTS = 5
# Fault injection for the tests, None otherwise: called as FAULT_HOOK(stage, name) in the process that writes
# shard `name`, at the two points of its commit where a crash leaves a different state behind: "written" (the
# whole shard under its temporary name, not moved yet) and "committed" (moved, and recorded by `on_commit`:
# listed in the manifest of a sequential run).  A test stops the run there (SIGKILL, an exception, a wait),
# at exactly that shard.  The Ray engine hands it to its actors (`ray_engine`).
FAULT_HOOK: Callable[[str, str], None] | None = None


def shard_name(k: int) -> str:
    return f"part-{k:05d}.parquet"


def piece_shard_name(piece: int, j: int) -> str:
    return f"part-{piece:06d}-{j:03d}.parquet"


def config_hash(export: Location) -> str:
    """sha256 of the export's attncal.json bytes: changes whenever the calibration or the export does."""
    return "sha256:" + hashlib.sha256(export.child(METADATA_FILE).read_bytes()).hexdigest()


def load_manifest(out_dir: str | os.PathLike | Location, endpoint: str | None = None) -> dict | None:
    """The manifest of an output, or None when it has none.

    pyarrow reads an object by asking its size, then a byte range, so a read that races a rewrite of
    the manifest can see the new manifest cut at the old one's length; such a read is retried."""
    loc = Location.parse(out_dir, endpoint).child(MANIFEST)
    for attempt in range(_READ_ATTEMPTS):
        try:
            if not loc.exists():
                return None
            text = loc.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise explain(exc, "output", loc) from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            if loc.is_local or attempt == _READ_ATTEMPTS - 1:
                raise ValueError(f"{loc}: invalid JSON ({exc})") from None
            time.sleep(0.05 * (attempt + 1))
    return None


def save_manifest(out: Location, manifest: dict) -> None:
    manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    out.child(MANIFEST).write_bytes(json.dumps(manifest, indent=2).encode())


def is_temporary(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def remove_temporaries(out: Location) -> list[str]:
    """Delete the temporary files killed runs left in `out`."""
    stale = [n for n in out.names() if is_temporary(n)]
    for n in stale:
        out.child(n).delete()
    return stale


def remove_unlisted(out: Location, manifest: dict | None) -> list[str]:
    """Delete shards and temporary files the manifest does not list (left by a run that stopped)."""
    listed = {s["file"] for s in (manifest or {}).get("shards", [])}
    stale = [n for n in out.names() if is_temporary(n) or (n.startswith("part-") and n not in listed)]
    for n in stale:
        out.child(n).delete()
    return stale


def embedding_type(precision: str, width: int):
    """The Arrow type of the `embedding` column: fixed_size_list of float32 / float16 / int8 / uint8 [width]
    for those precisions and binary (int8 values, as sentence-transformers gives them), fixed_size_binary(width)
    for ubinary (the packed bits as bytes: what vector databases take).  `width` is `precision.output_width`."""
    import pyarrow as pa

    if precision == "ubinary":
        return pa.binary(width)
    item = {"float32": pa.float32(), "float16": pa.float16(), "int8": pa.int8(), "uint8": pa.uint8(),
            "binary": pa.int8()}[precision]
    return pa.list_(item, width)


def embedding_table(ids: list[str], emb: np.ndarray, precision: str = "float32"):
    """Arrow table: `id` string, `embedding` of `embedding_type` (`emb` already in `precision`)."""
    import pyarrow as pa

    emb = np.ascontiguousarray(emb, dtype=_precision.numpy_dtype(precision))
    if precision == "ubinary":
        column = pa.FixedSizeBinaryArray.from_buffers(pa.binary(emb.shape[1]), len(emb),
                                                      [None, pa.py_buffer(emb.tobytes())])
    else:
        column = pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), emb.shape[1])
    return pa.table({"id": pa.array(ids, type=pa.string()), "embedding": column})


CHUNK_COLUMNS = (("chunk", "int32"), ("window", "int32"), ("char_start", "int64"), ("char_end", "int64"))


def chunk_table(ids: list[str], chunks, emb: np.ndarray, precision: str):
    """Arrow table of chunk rows: `id` (the row's), `chunk` (its index in the row), `window` (the row's model
    call it came from), `char_start` / `char_end` (its span in the row's text), `embedding` (`embedding_table`'s).
    `chunks`: a ChunkedEmbeddings whose `text` indexes `ids`."""
    import pyarrow as pa

    table = embedding_table([ids[i] for i in chunks.text], emb, precision)
    cols = {"id": table.column("id")}
    for (name, kind), values in zip(CHUNK_COLUMNS, (chunks.chunk, chunks.window, chunks.start, chunks.end)):
        cols[name] = pa.array(np.asarray(values), type=getattr(pa, kind)())
    cols["embedding"] = table.column("embedding")
    return pa.table(cols)


def output_of(manifest: dict) -> dict:
    """The manifest's `output`: dimensions, precision, ranges and normalize (float32 at full width when absent)."""
    return manifest.get("output") or {"dimensions": None, "precision": "float32", "ranges": None}


def apply_output(emb: np.ndarray, output: dict | None) -> np.ndarray:
    """The float embeddings an engine returned, as the run stores them (`output`: the manifest's): Matryoshka
    truncation and precision, by the functions `Encoder.output` runs, so every engine writes the same bytes."""
    if not output or (output.get("dimensions") is None and output.get("precision", "float32") == "float32"):
        return emb
    emb = _precision.truncate(emb, output.get("dimensions"), bool(output.get("normalize")))
    return _precision.quantize(emb, output["precision"], output.get("ranges"))


class ShardWriter:
    """Feeds ordered (ids, embeddings) into shards of `shard_size` rows under `out`.

    Shard k is named `name(k)`, written under a temporary name and moved to its final one when it
    holds `shard_size` rows (or at `finish`); then `on_commit(name, rows)` records it.
    """

    def __init__(self, out: Location, shard_size: int, dim: int, name: Callable[[int], str],
                 on_commit: Callable[[str, int], None], first: int = 0, output: dict | None = None) -> None:
        """`dim`: the engine's embedding width; `output`: the manifest's (`output_of`), applied on write."""
        self.out, self.shard_size, self.dim = out, shard_size, dim
        self.output = output
        self.precision = (output or {}).get("precision", "float32")
        self.width = _precision.output_width(self.precision, (output or {}).get("dimensions") or dim)
        self.chunked = bool((output or {}).get("chunks"))
        # an engine returns the model's full width, or the run's dimensions where it truncates (the Triton server)
        self.widths = {dim, (output or {}).get("dimensions") or dim}
        self._chunk_rows = 0  # chunk rows in the open shard
        self._unchunked: list[dict] = []  # rows of the open shard left out of chunking (on_error skip)
        self.name, self.on_commit = name, on_commit
        self.shard = first
        self.rows_done = 0  # rows in shards this writer committed
        self._writer = None
        self._stream = None
        self._rows = 0  # rows in the open shard
        self._tmp: Location | None = None

    @property
    def rows_written(self) -> int:
        """Rows in committed shards plus rows in the open one."""
        return self.rows_done + self._rows

    def _open(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        fields = [("id", pa.string())]
        if self.chunked:
            fields += [(name, getattr(pa, kind)()) for name, kind in CHUNK_COLUMNS]
        schema = pa.schema(fields + [("embedding", embedding_type(self.precision, self.width))])
        final = self.out.child(self.name(self.shard))
        final.ensure_parent()
        self._tmp = final.temporary()
        self._stream = self._tmp.open_output_stream()
        self._writer = pq.ParquetWriter(self._stream, schema, compression={"id": "zstd", "embedding": "none"})

    def write(self, ids: list[str], emb) -> None:
        """Write the rows `ids` with their embeddings `emb` (float [len(ids), dim]), or in a chunked run their
        chunks (a ChunkedEmbeddings whose `text` indexes `ids`, and whose `errors` lists the rows left out)."""
        if self.chunked:
            self._write_chunks(ids, emb)
            return
        if emb.ndim != 2 or emb.shape[0] != len(ids) or emb.shape[1] not in self.widths:
            raise RuntimeError(f"engine returned embeddings of shape {emb.shape} for {len(ids)} rows of dimension "
                               f"{self.dim}")
        start = 0
        while start < len(ids):
            if self._writer is None:
                self._open()
            take = min(len(ids) - start, self.shard_size - self._rows)
            part = apply_output(emb[start : start + take], self.output)
            self._writer.write_table(embedding_table(ids[start : start + take], part, self.precision))
            self._rows += take
            start += take
            if self._rows == self.shard_size:
                self._commit()

    def _write_chunks(self, ids: list[str], chunks) -> None:
        if not isinstance(chunks, ChunkedEmbeddings) or chunks.vectors.ndim != 2 or \
                chunks.vectors.shape[1] not in self.widths:
            raise RuntimeError(f"engine returned {type(chunks).__name__} for a chunked run of dimension {self.dim}")
        failed = dict(chunks.errors)
        vectors = apply_output(chunks.vectors, self.output)
        start = 0
        while start < len(ids):
            if self._writer is None:
                self._open()
            take = min(len(ids) - start, self.shard_size - self._rows)
            lo, hi = np.searchsorted(chunks.text, [start, start + take])
            part = ChunkedEmbeddings(chunks.text[lo:hi], chunks.chunk[lo:hi], chunks.window[lo:hi],
                                     chunks.start[lo:hi], chunks.end[lo:hi], vectors[lo:hi])
            if hi > lo:
                self._writer.write_table(chunk_table(ids, part, part.vectors, self.precision))
            self._unchunked += [{"id": ids[i], "error": failed[i]} for i in range(start, start + take) if i in failed]
            self._chunk_rows += int(hi - lo)
            self._rows += take
            start += take
            if self._rows == self.shard_size:
                self._commit()

    def _close(self) -> None:
        try:
            self._writer.close()
        finally:
            self._stream.close()

    def _commit(self) -> None:
        self._close()
        name = self.name(self.shard)
        if self.out.is_local:
            with open(self._tmp.url, "rb") as f:
                os.fsync(f.fileno())
        if FAULT_HOOK is not None:
            FAULT_HOOK("written", name)
        self._tmp.move_to(self.out.child(name))
        rows = self._rows
        self.rows_done += rows
        self.shard += 1
        extra = {"chunk_rows": self._chunk_rows, "unchunked": self._unchunked} if self.chunked else {}
        self._writer, self._stream, self._rows, self._tmp = None, None, 0, None
        self._chunk_rows, self._unchunked = 0, []
        self.on_commit(name, rows, **extra)
        if FAULT_HOOK is not None:
            FAULT_HOOK("committed", name)

    def finish(self) -> None:
        """Commit the last, partial shard."""
        if self._writer is not None and self._rows:
            self._commit()

    def abort(self) -> None:
        """Drop the open temporary shard (committed shards stay)."""
        if self._writer is not None:
            try:
                self._close()
            finally:
                if self._tmp is not None and self._tmp.exists():
                    self._tmp.delete()
            self._writer = None


def read_embeddings(out_dir: str | os.PathLike | Location, endpoint: str | None = None) -> tuple[list[str], np.ndarray]:
    """`read_output` without the chunk columns."""
    ids, emb, _ = read_output(out_dir, endpoint)
    return ids, emb


def read_output(out_dir: str | os.PathLike | Location,
                endpoint: str | None = None) -> tuple[list[str], np.ndarray, dict[str, np.ndarray]]:
    """All ids and embeddings of a finished output (a directory or URI), in input order: the shards
    its manifest lists, and only those (for tests and small corpora).  The embeddings come in the run's
    precision (numpy float32, float16, int8 or uint8; binary / ubinary packed, [N, ceil(D / 8)]); the third
    item holds a chunked run's chunk columns (chunk, window, char_start, char_end), one row per chunk."""
    import pyarrow.parquet as pq

    out = Location.parse(out_dir, endpoint)
    manifest = load_manifest(out)
    if manifest is None:
        raise FileNotFoundError(f"{out} has no {MANIFEST}")
    if not manifest.get("complete"):
        raise ValueError(f"{out} is an unfinished encode run ({MANIFEST} is not complete): finish it with --resume")
    ids: list[str] = []
    parts = []
    chunk_cols: dict[str, list] = {name: [] for name, _ in CHUNK_COLUMNS}
    for s in manifest["shards"]:
        loc = out.child(s["file"])
        try:
            with loc.open_input_file() as fh:
                t = pq.read_table(fh)
        except OSError as exc:
            raise explain(exc, "shard", loc) from None
        ids += t.column("id").to_pylist()
        for name in chunk_cols:
            if name in t.column_names:
                chunk_cols[name].append(t.column(name).to_numpy())
        col = t.column("embedding").combine_chunks()
        if pa_binary(col.type):
            parts.append(np.frombuffer(col.buffers()[1], dtype=np.uint8, count=len(t) * col.type.byte_width,
                                       offset=col.offset * col.type.byte_width).reshape(len(t), -1))
        else:
            parts.append(col.flatten().to_numpy(zero_copy_only=False).reshape(len(t), -1))
    output = output_of(manifest)
    precision = output.get("precision", "float32")
    width = _precision.output_width(precision, output.get("dimensions") or manifest["model"]["dimension"])
    emb = np.concatenate(parts) if parts else np.zeros((0, width), _precision.numpy_dtype(precision))
    return ids, emb, {k: np.concatenate(v) for k, v in chunk_cols.items() if v}


def pa_binary(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_fixed_size_binary(arrow_type)
