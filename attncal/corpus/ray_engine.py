"""The `ray` engine: Ray Data `read_*` -> `map_batches` on an actor pool of Encoders -> shards.

The pipeline is `read_parquet | read_csv | read_json` over the input files,
a stateless `map_batches` that keeps valid rows (drops rows without id or
text, ids cast to strings, as the local readers do), then `map_batches` with
a class: Ray starts `workers` actors, each loading one `Encoder` with its
share of cores (`num_cpus`), and each window-sized batch is sorted by length
inside the actor.  `preserve_order` keeps the output in input order, so the
driver writes the same shards (ids, order, manifest) as the other engines.
The driver writes the Parquet shards itself: one writer keeps the shard
numbering and the manifest exact, and an embedding (1.5 KB for MiniLM) is
small next to the cost of computing it.

With `--ray-address` the run joins an existing cluster; the export directory
and the input files must then be readable at the same path on every node.
Rows that Ray Data's pyarrow readers cannot parse at all (invalid JSON or
UTF-8, a CSV row with missing columns) stop a Ray read; the driver's scan
finds them first, and the engine refuses with one line rather than fail
mid-run.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .inputs import InputFile


# Ray's CPU counts are logical reservations.  Actors that reserved every CPU would leave none for
# Ray Data's file listing (a 1-CPU task) and read tasks, and the pipeline would wait forever, so the
# actors together reserve one CPU less than the instance has; each actor's ONNX Runtime still runs
# `cpus_per_worker` threads, which is what decides the physical share of cores.
READ_CPUS = 0.1


class RayEngineError(RuntimeError):
    """Ray could not run the pipeline; the message says what to change."""


def _select_valid(batch, text_field: str, id_field: str):
    """Keep rows with an id and a text; ids as strings (the same rule as the local readers)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ids = batch.column(id_field) if id_field in batch.column_names else pa.nulls(batch.num_rows)
    ids = pc.cast(ids, pa.string())
    texts = pc.cast(batch.column(text_field), pa.string())
    keep = pc.and_(pc.is_valid(ids), pc.is_valid(texts))
    return pa.table({"id": pc.filter(ids, keep), "text": pc.filter(texts, keep)})


class _EncodeActor:
    """One Encoder per actor, loaded once; encodes a window-sized batch."""

    def __init__(self, export_dir: str, threads: int, max_length: int | None, batch_size: int) -> None:
        import os

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from .local import load_encoder

        self.encoder = load_encoder(export_dir, threads, max_length)
        self.batch_size = batch_size

    def __call__(self, batch):
        import pyarrow as pa

        from .local import encode_window
        from .shards import embedding_table

        ids = batch.column("id").to_pylist()
        emb, tokens = encode_window(self.encoder, batch.column("text").to_pylist(), self.batch_size)
        table = embedding_table(ids, emb)
        return table.append_column("tokens", pa.array([tokens] + [0] * (len(ids) - 1), type=pa.int64()))


def _read(ray, files: list[InputFile], text_field: str, id_field: str):
    import pyarrow as pa

    fmt = {f.format for f in files}
    if len(fmt) > 1:
        raise RayEngineError("the ray engine reads one input format per run; got " + ", ".join(sorted(fmt)))
    paths = [str(f.path) for f in files]
    fmt = fmt.pop()
    if fmt == "parquet":
        return ray.data.read_parquet(paths, columns=[id_field, text_field], file_extensions=None, num_cpus=READ_CPUS)
    if fmt == "csv":
        import pyarrow.csv as pcsv

        return ray.data.read_csv(paths, file_extensions=None, num_cpus=READ_CPUS, convert_options=pcsv.ConvertOptions(
            column_types={id_field: pa.string(), text_field: pa.string()}, include_columns=[id_field, text_field]))
    import pyarrow.json as pj

    return ray.data.read_json(paths, file_extensions=None, num_cpus=READ_CPUS, parse_options=pj.ParseOptions(
        explicit_schema=pa.schema([(text_field, pa.string())]), unexpected_field_behavior="infer"))


class RayEngine:
    name = "ray"

    def __init__(self, export_dir: str, *, batch_size: int, window: int, workers: int = 1,
                 max_length: int | None = None, address: str | None = None, num_cpus: int | None = None,
                 cpus_per_worker: int | None = None) -> None:
        from .local import available_cores

        self.export_dir, self.batch_size, self.window, self.workers = str(export_dir), batch_size, window, workers
        self.max_length, self.address = max_length, address
        self.num_cpus = num_cpus if num_cpus is not None else (None if address else available_cores())
        self.cpus_per_worker = cpus_per_worker or max(1, (self.num_cpus or available_cores()) // workers)

    def describe(self) -> dict:
        return {"name": self.name, "workers": self.workers, "cpus_per_worker": self.cpus_per_worker,
                "address": self.address}

    def _actor_cpus(self) -> float:
        total = self.num_cpus or (self.cpus_per_worker * self.workers + 1)
        return max(0.05, min(self.cpus_per_worker, (total - 1) / self.workers))

    def encode_files(self, files: list[InputFile], text_field: str, id_field: str,
                     skip_rows: int = 0) -> Iterator[tuple[list[str], np.ndarray, int]]:
        """(ids, embeddings, tokens) in input order, starting after the first `skip_rows` valid rows
        of `files` (which the caller has already dropped whole files from)."""
        import ray

        started = False
        if not ray.is_initialized():
            try:
                if self.address:
                    ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
                else:
                    ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = self.address or "a local instance"
                raise RayEngineError(f"cannot start Ray on {where}: {str(exc).strip().splitlines()[0]}") from None
            started = True
        try:
            ctx = ray.data.DataContext.get_current()
            ctx.execution_options.preserve_order = True
            ctx.enable_progress_bars = False
            ds = _read(ray, files, text_field, id_field)
            ds = ds.map_batches(_select_valid, fn_kwargs={"text_field": text_field, "id_field": id_field},
                                batch_format="pyarrow", batch_size=None)
            ds = ds.map_batches(_EncodeActor, batch_format="pyarrow", batch_size=self.window,
                                fn_constructor_args=(self.export_dir, self.cpus_per_worker, self.max_length,
                                                     self.batch_size),
                                concurrency=self.workers, num_cpus=self._actor_cpus())
            to_skip = skip_rows
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
                ids = batch.column("id").to_pylist()
                emb = batch.column("embedding").combine_chunks().flatten().to_numpy().reshape(len(ids), -1)
                tokens = int(np.sum(batch.column("tokens").to_numpy()))
                if to_skip:
                    drop = min(to_skip, len(ids))
                    ids, emb, to_skip = ids[drop:], emb[drop:], to_skip - drop
                    if not ids:
                        continue
                yield ids, emb, tokens
        finally:
            if started:
                ray.shutdown()
