"""The `ray` engine: input pieces -> `map_batches` parsing them -> an actor pool of Encoders -> shards.

The pipeline is `from_items` over the input's `Piece`s (`inputs.plan_pieces`:
byte ranges of JSON lines cut at line ends, runs of Parquet row groups, whole
CSV files), a stateless `map_batches` that parses each piece with
`inputs.read_piece` -- the parser and validation of the local readers, run on
the same byte ranges -- and keeps its valid rows, then `map_batches` with a
class: Ray starts `workers` actors, each loading one `Encoder` with its share
of cores (`num_cpus`), and each window-sized batch is sorted by length inside
the actor.  `preserve_order` keeps the output in input order, so the driver
writes the same shards (ids, order, manifest) as the other engines.  The
driver writes the Parquet shards itself: one writer keeps the shard numbering
and the manifest exact, and an embedding (1.5 KB for MiniLM) is small next to
the cost of computing it.

Why not Ray Data's `read_json` / `read_csv` / `read_text`: their pyarrow
readers stop the whole read at the first invalid JSON line, non-UTF-8 byte or
short CSV row, and they keep no line numbers, so `--on-error skip` could not
skip and name the rows the local engine skips; `read_text` also decodes a
whole file at once and splits on every Unicode line break (a JSON string may
hold U+2028), not on the newlines that number the lines.  Parsing the local
readers' own pieces in the map step gives every engine the same rows, and the
skip list (from the driver's scan, which runs the same code) names them the
same way.  Parquet is binary, so "read as text" does not apply: a piece is a
run of row groups, read with `pyarrow.parquet` by the local reader's code,
which checks the column types and reports a null id or text by its row number
in the file, as the local engine does.  A CSV file is one piece because a
quoted field may span lines; CSV files are still read in parallel with each
other and with encoding.

With `--ray-address` the run joins an existing cluster; the export directory
and the input files must then be readable at the same path on every node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import numpy as np

from .inputs import InputFile, plan_pieces

if TYPE_CHECKING:
    import pyarrow as pa


# Ray's CPU counts are logical reservations.  Actors that reserved every CPU would leave none for
# the piece-parsing tasks (and Ray Data's own small tasks), and the pipeline would wait forever, so
# the actors together reserve one CPU less than the instance has; each actor's ONNX Runtime still
# runs `cpus_per_worker` threads, which is what decides the physical share of cores.
READ_CPUS = 0.1


class RayEngineError(RuntimeError):
    """Ray could not run the pipeline; the message says what to change."""


def _parse_pieces(batch: "pa.Table", text_field: str, id_field: str) -> Iterator["pa.Table"]:
    """Valid rows of each piece in `batch`, one table per reader chunk (so memory stays at a chunk).

    Bad rows are dropped here; the driver's scan, which ran the same code, has already named them.
    """
    import pyarrow as pa

    from .inputs import Piece, read_piece

    for spec in batch.column("piece").to_pylist():
        for chunk in read_piece(Piece.from_json(spec), text_field, id_field):
            if chunk.ids:
                yield pa.table({"id": pa.array(chunk.ids, pa.string()), "text": pa.array(chunk.texts, pa.string())})


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
        pieces = [p for f in files for p in plan_pieces(f)]
        if not pieces:  # every file is already written (a resumed run)
            return
        from .. import console

        # Ray talks a lot (its logger, the C++ core worker, deprecation notes): under the CLI that goes
        # to the capture (shown with --verbose), and attncal's own bar writes to console.terminal().
        with console.third_party_output():
            yield from self._encode_files(pieces, text_field, id_field, skip_rows)

    def _encode_files(self, pieces: list, text_field: str, id_field: str,
                      skip_rows: int) -> Iterator[tuple[list[str], np.ndarray, int]]:
        import ray

        from .. import console

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
        console.adopt_loggers()  # the handler Ray installed on its logger when imported
        try:
            ctx = ray.data.DataContext.get_current()
            ctx.execution_options.preserve_order = True
            ctx.enable_progress_bars = False
            ds = ray.data.from_items([{"piece": p.to_json()} for p in pieces], override_num_blocks=len(pieces))
            ds = ds.map_batches(_parse_pieces, fn_kwargs={"text_field": text_field, "id_field": id_field},
                                batch_format="pyarrow", batch_size=1, num_cpus=READ_CPUS)
            ds = ds.map_batches(_EncodeActor, batch_format="pyarrow", batch_size=self.window,
                                fn_constructor_args=(self.export_dir, self.cpus_per_worker, self.max_length,
                                                     self.batch_size),
                                compute=ray.data.ActorPoolStrategy(size=self.workers), num_cpus=self._actor_cpus())
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
