"""Sharded Parquet output and `manifest.json`: what makes a run restartable without losing a row.

A shard is written row group by row group into a hidden temporary file
(`.part-NNNNN.parquet.tmp`) and renamed to `part-NNNNN.parquet` when it holds
`shard_size` rows (or the input ends); the manifest, rewritten atomically after
each rename, is the only record of which shards are complete.  A run killed at
any point therefore leaves complete shards, a manifest that lists exactly
those, and at most one temporary file, which `--resume` deletes.

Shard k holds valid rows [k * shard_size, (k + 1) * shard_size) of the input
in input order, so the shards of a resumed run are those of an uninterrupted
one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
SKIP_FILE = "skipped.jsonl"
FORMAT = 1
# Options that decide the bytes of the output: a resume must use the same ones.
OUTPUT_OPTIONS = ("text_field", "id_field", "shard_size", "batch_size", "window", "max_length", "on_error")


def shard_name(k: int) -> str:
    return f"part-{k:05d}.parquet"


def config_hash(export_dir: Path) -> str:
    """sha256 of the export's attncal.json bytes: changes whenever the calibration or the export does."""
    from ..export.exporter import METADATA_FILE

    return "sha256:" + hashlib.sha256((Path(export_dir) / METADATA_FILE).read_bytes()).hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_manifest(out_dir: Path) -> dict | None:
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from None


def save_manifest(out_dir: Path, manifest: dict) -> None:
    manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    atomic_write_text(Path(out_dir) / MANIFEST, json.dumps(manifest, indent=2))


def remove_temporaries(out_dir: Path) -> list[Path]:
    """Delete temporary shard files a killed run left behind."""
    stale = [p for p in Path(out_dir).glob(".part-*.parquet.tmp")] + list(Path(out_dir).glob(f".{MANIFEST}.tmp"))
    for p in stale:
        p.unlink()
    return stale


def embedding_table(ids: list[str], emb: np.ndarray):
    """Arrow table: `id` string, `embedding` fixed_size_list<float32>[D]."""
    import pyarrow as pa

    emb = np.ascontiguousarray(emb, dtype=np.float32)
    values = pa.array(emb.reshape(-1), type=pa.float32())
    return pa.table({"id": pa.array(ids, type=pa.string()),
                     "embedding": pa.FixedSizeListArray.from_arrays(values, emb.shape[1])})


class ShardWriter:
    """Feeds ordered (ids, embeddings) into shards of `shard_size` rows and records them in the manifest."""

    def __init__(self, out_dir: Path, manifest: dict, shard_size: int, dim: int) -> None:
        self.out_dir = Path(out_dir)
        self.manifest = manifest
        self.shard_size = shard_size
        self.dim = dim
        done = manifest["shards"]
        self.shard = len(done)
        self.rows_done = sum(s["rows"] for s in done)
        self._writer = None
        self._rows = 0  # rows in the open shard
        self._tmp: Path | None = None

    @property
    def rows_written(self) -> int:
        """Rows in complete shards plus rows in the open one."""
        return self.rows_done + self._rows

    def _open(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("id", pa.string()), ("embedding", pa.list_(pa.float32(), self.dim))])
        self._tmp = self.out_dir / f".{shard_name(self.shard)}.tmp"
        self._writer = pq.ParquetWriter(self._tmp, schema, compression={"id": "zstd", "embedding": "none"})

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

    def _commit(self) -> None:
        self._writer.close()
        name = shard_name(self.shard)
        os.replace(self._tmp, self.out_dir / name)
        self.manifest["shards"].append({"file": name, "rows": self._rows, "first_row": self.rows_done})
        self.rows_done += self._rows
        save_manifest(self.out_dir, self.manifest)
        self.shard += 1
        self._writer, self._rows, self._tmp = None, 0, None

    def finish(self) -> None:
        """Commit the last, partial shard and mark the manifest complete."""
        if self._writer is not None and self._rows:
            self._commit()
        self.manifest["complete"] = True
        save_manifest(self.out_dir, self.manifest)

    def abort(self) -> None:
        """Drop the open temporary shard (complete shards and the manifest stay)."""
        if self._writer is not None:
            try:
                self._writer.close()
            finally:
                if self._tmp is not None and self._tmp.exists():
                    self._tmp.unlink()
            self._writer = None


def read_embeddings(out_dir: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """All ids and embeddings of a finished output directory, shard by shard (for tests and small corpora)."""
    import pyarrow.parquet as pq

    manifest = load_manifest(Path(out_dir))
    if manifest is None:
        raise FileNotFoundError(f"{out_dir} has no {MANIFEST}")
    ids: list[str] = []
    parts = []
    for s in manifest["shards"]:
        t = pq.read_table(Path(out_dir) / s["file"])
        ids += t.column("id").to_pylist()
        col = t.column("embedding").combine_chunks()
        parts.append(col.flatten().to_numpy().reshape(len(t), -1))
    dim = manifest["model"]["dimension"]
    return ids, (np.concatenate(parts) if parts else np.zeros((0, dim), np.float32))
