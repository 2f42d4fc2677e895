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
from .storage import TEMP_SUFFIX, Location, explain

MANIFEST = "manifest.json"
SKIP_FILE = "skipped.jsonl"
FORMAT = 2
SEQUENTIAL, PIECES = "sequential", "pieces"
# Options that decide the bytes of the output: a resume must use the same ones.
OUTPUT_OPTIONS = ("text_field", "id_field", "shard_size", "batch_size", "window", "max_length", "on_error")
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


def embedding_table(ids: list[str], emb: np.ndarray):
    """Arrow table: `id` string, `embedding` fixed_size_list<float32>[D]."""
    import pyarrow as pa

    emb = np.ascontiguousarray(emb, dtype=np.float32)
    values = pa.array(emb.reshape(-1), type=pa.float32())
    return pa.table({"id": pa.array(ids, type=pa.string()),
                     "embedding": pa.FixedSizeListArray.from_arrays(values, emb.shape[1])})


class ShardWriter:
    """Feeds ordered (ids, embeddings) into shards of `shard_size` rows under `out`.

    Shard k is named `name(k)`, written under a temporary name and moved to its final one when it
    holds `shard_size` rows (or at `finish`); then `on_commit(name, rows)` records it.
    """

    def __init__(self, out: Location, shard_size: int, dim: int, name: Callable[[int], str],
                 on_commit: Callable[[str, int], None], first: int = 0) -> None:
        self.out, self.shard_size, self.dim = out, shard_size, dim
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

        schema = pa.schema([("id", pa.string()), ("embedding", pa.list_(pa.float32(), self.dim))])
        final = self.out.child(self.name(self.shard))
        final.ensure_parent()
        self._tmp = final.temporary()
        self._stream = self._tmp.open_output_stream()
        self._writer = pq.ParquetWriter(self._stream, schema, compression={"id": "zstd", "embedding": "none"})

    def write(self, ids: list[str], emb: np.ndarray) -> None:
        if emb.shape != (len(ids), self.dim):
            raise RuntimeError(f"engine returned embeddings of shape {emb.shape} for {len(ids)} rows of dimension "
                               f"{self.dim}")
        start = 0
        while start < len(ids):
            if self._writer is None:
                self._open()
            take = min(len(ids) - start, self.shard_size - self._rows)
            self._writer.write_table(embedding_table(ids[start : start + take], emb[start : start + take]))
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
        self._writer, self._stream, self._rows, self._tmp = None, None, 0, None
        self.on_commit(name, rows)
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
    """All ids and embeddings of a finished output (a directory or URI), in input order: the shards
    its manifest lists, and only those (for tests and small corpora)."""
    import pyarrow.parquet as pq

    out = Location.parse(out_dir, endpoint)
    manifest = load_manifest(out)
    if manifest is None:
        raise FileNotFoundError(f"{out} has no {MANIFEST}")
    if not manifest.get("complete"):
        raise ValueError(f"{out} is an unfinished encode run ({MANIFEST} is not complete): finish it with --resume")
    ids: list[str] = []
    parts = []
    for s in manifest["shards"]:
        loc = out.child(s["file"])
        try:
            with loc.open_input_file() as fh:
                t = pq.read_table(fh)
        except OSError as exc:
            raise explain(exc, "shard", loc) from None
        ids += t.column("id").to_pylist()
        col = t.column("embedding").combine_chunks()
        parts.append(col.flatten().to_numpy().reshape(len(t), -1))
    dim = manifest["model"]["dimension"]
    return ids, (np.concatenate(parts) if parts else np.zeros((0, dim), np.float32))
