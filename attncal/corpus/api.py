"""`encode_corpus`: re-embed a corpus with an attncal export, streaming, sharded and resumable.

The input, the output and the export are local paths or object-storage URIs (`storage`).  What the
calling process -- the driver -- does depends on the engine:

- local and triton: this process reads the corpus anyway, so it scans it first.  The scan (cheap
  next to encoding: it parses, it does not embed) validates every row, counts the rows for the
  progress bar and collects the bad rows; so bad input with `on_error="fail"` is refused before
  anything is written, and the skip list is complete from the first shard on.  The encode pass
  streams the rows again through the engine into the shard writer (the `sequential` layout).
- ray: the driver reads no byte of the corpus and receives no embedding.  It lists the input
  (names, sizes and modification times, which make the fingerprint), plans pieces from the sizes
  (Parquet footers are read by the actors), hands the pieces out and commits the manifest; the
  actors read, validate, encode and write each piece's shards themselves (the `pieces` layout).
  Validation therefore happens as the pieces are encoded: with `on_error="fail"` the first bad row
  an actor meets stops the run, and everything the run wrote is removed again.

Every engine parses with the readers of `inputs`, so one error policy holds everywhere: the same
rows are left out and named the same way.  Calibration is an indexing-time change, so the model
must be an attncal export (`attncal export MODEL -o OUT`): exporting is not cheap for large models
and includes a parity check, so it is never done implicitly.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..artifact import METADATA_FILE, PORTABLE_GRAPH, config_int, load_onnx_checked, read_metadata
from ..runtime.chunking import ChunkOptions, check_export
from ..runtime.encoder import DEFAULT_MAX_BATCH_TOKENS, planned_graph
from ..runtime.precision import (RANGE_SAMPLE, RANGE_SEED, SCALAR, check_dimensions, check_precision, check_ranges,
                                 declared_dimensions, ranges_of, sample_rows)
from ..versions import DISTRIBUTION, installed
from .inputs import (BadRow, CorpusInputError, InputFile, Piece, fingerprint, plan_pieces, read_chunks, rebase,
                     resolve_inputs)
from .local import LocalEngine, load_encoder, windows
from .progress import Progress
from .ray_engine import RayEngine
from .shards import (FORMAT, MANIFEST, OUTPUT_DEFAULTS, OUTPUT_OPTIONS, PIECES, SEQUENTIAL, SKIP_FILE, ShardWriter,
                     config_hash, load_manifest, remove_temporaries, remove_unlisted, save_manifest, shard_name)
from .storage import Location, StorageError, check_bucket, explain, fetch_tree, is_uri
from .triton import TritonEngine

ENGINES = ("local", "triton", "ray")
ON_ERROR = ("fail", "skip")
# A Ray piece is the unit of work, of retry and of commit: large enough that the per-piece costs
# (a task round trip, a shard file, a manifest entry) vanish, small enough that a lost piece costs
# little to redo and that the pieces spread over many actors.
PIECE_BYTES = 32 << 20
# The Ray driver rewrites the manifest after every 1% of the pieces, and at least this often while
# pieces complete, so the manifest is rewritten about a hundred times per run whatever its size.
COMMIT_INTERVAL_S = 30.0


@dataclass
class EncodeResult:
    out_dir: str
    engine: str
    rows: int  # valid rows in the output (all shards)
    rows_this_run: int
    skipped: int
    shards: int
    seconds: float
    tokens: int | None
    resumed_from: int = 0  # rows already done when this run started
    manifest: dict = field(default_factory=dict, repr=False)
    graph: str | None = None  # the export's graph the local/ray engines ran (None: the Triton server's choice)

    @property
    def rows_per_s(self) -> float:
        return self.rows_this_run / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.tokens is None or self.seconds <= 0 else self.tokens / self.seconds

    def summary(self) -> str:
        tok = f", {self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s is not None else ""
        resumed = f", resumed after {self.resumed_from:,} rows" if self.resumed_from else ""
        graph = f", {self.graph}" if self.graph else ""
        return (f"encoded {self.rows_this_run:,} rows in {self.seconds:.1f} s ({self.rows_per_s:,.1f} rows/s{tok}, "
                f"{self.engine}{graph}){resumed}: {self.rows:,} rows in {self.shards} shard(s), {self.skipped:,} "
                f"skipped -> {self.out_dir}")


@dataclass
class ScanResult:
    files: list[dict]  # path, format, size, mtime_ns, rows (valid), bad
    bad: list[BadRow]
    rows: int
    fingerprint: str


def _export(model: str | os.PathLike, endpoint: str | None) -> tuple[Location, dict]:
    """Where the export is and its attncal.json (the only file the driver reads of a remote export)."""
    if is_uri(model):
        loc = Location.parse(model, endpoint)
        check_bucket(loc, "export")
        try:
            meta = loc.child(METADATA_FILE)
            if not meta.exists():
                raise ValueError(f"{loc} is not an attncal export ({METADATA_FILE} missing): upload the directory "
                                 "`attncal export MODEL -o OUT` wrote")
            return loc, json.loads(meta.read_bytes())
        except OSError as exc:
            raise explain(exc, "export", loc) from None
    p = Path(model).expanduser()
    if (p / METADATA_FILE).is_file():
        return Location.parse(p), read_metadata(p)
    what = "the embedded default model" if str(model) == "default" else (
        f"{p} is a model directory" if (p / "config.json").is_file() else f"{p} is not an attncal export")
    raise ValueError(f"{what}, not an attncal export ({METADATA_FILE} missing): run `attncal export {model} -o OUT` "
                     f"first, then `attncal encode OUT ...`")


def _local_export(export: Location, digest: str) -> Path:
    if export.is_local:
        return Path(export.url)
    return fetch_tree(export, digest)


def _dimension(export: Path, meta: dict) -> int:
    """Embedding size from the graph's output shape (no session needed), else config.json's hidden_size.  The
    graph is checked (its external data, its digest) here, before any worker opens the export."""
    graph = load_onnx_checked(export / PORTABLE_GRAPH).graph
    for o in graph.output:
        if o.name == "sentence_embedding":
            dims = o.type.tensor_type.shape.dim
            if dims and dims[-1].HasField("dim_value"):
                return int(dims[-1].dim_value)
    return config_int(export, "hidden_size")


def scan(files: list[InputFile], text_field: str, id_field: str, show_progress: bool = False) -> ScanResult:
    """Validate and count every row, and fingerprint the input (see the module docstring)."""
    from tqdm.auto import tqdm

    out, bad, total = [], [], 0
    bar = tqdm(total=sum(f.size for f in files), unit="B", unit_scale=True, desc="scan", disable=not show_progress)
    for f in files:
        rows, file_bad = 0, 0
        try:
            for chunk in read_chunks(f, text_field, id_field):
                rows += len(chunk.ids)
                file_bad += len(chunk.bad)
                bad += chunk.bad
        except OSError as exc:
            raise explain(exc, "input", f.location) from None
        out.append(_file_entry(f) | {"rows": rows, "bad": file_bad})
        total += rows
        bar.update(f.size)
    bar.close()
    return ScanResult(out, bad, total, fingerprint(files))


def _file_entry(f: InputFile) -> dict:
    return {"path": f.path, "format": f.format, "size": f.size, "mtime_ns": f.mtime_ns}


def _check_options(opts: dict, engine: str, workers: int) -> None:
    for name in ("batch_size", "shard_size", "window", "max_batch_tokens"):
        if (name != "max_batch_tokens" or opts[name] is not None) and (
                isinstance(opts[name], bool) or not isinstance(opts[name], int) or opts[name] < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {opts[name]!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if opts["on_error"] not in ON_ERROR:
        raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {opts['on_error']!r}")
    if not opts["text_field"] or not opts["id_field"] or opts["text_field"] == opts["id_field"]:
        raise ValueError(f"text and id fields must be two different non-empty names, got "
                         f"{opts['text_field']!r} and {opts['id_field']!r}")


def _prepare_output(out: Location, resume: bool, manifest_new: dict) -> tuple[dict, bool]:
    """The manifest to continue from, and whether it is a fresh one (else the existing one, checked)."""
    if out.is_local and os.path.isfile(out.url):
        raise FileExistsError(f"output {out} is a file; choose an empty or new directory")
    try:
        existing = load_manifest(out)
        entries = out.listing() if existing is None else []
    except OSError as exc:
        raise explain(exc, "output", out) from None
    if existing is None:
        if entries:
            raise FileExistsError(f"output {out} is not empty and has no {MANIFEST}; choose an empty or new directory")
        return manifest_new, True
    where = out.child(MANIFEST)
    if not resume:
        raise FileExistsError(f"output {out} already holds an encode run ({MANIFEST}); pass --resume to continue it "
                              "or choose another directory")
    if existing.get("format") != FORMAT:
        raise ValueError(f"{where}: unknown manifest format {existing.get('format')!r}")
    if existing["config_hash"] != manifest_new["config_hash"]:
        raise ValueError(f"cannot resume {out}: it was encoded with another export (attncal.json hash differs)")
    if existing["input"]["fingerprint"] != manifest_new["input"]["fingerprint"]:
        raise ValueError(f"cannot resume {out}: the input files changed since the run started (their names, sizes "
                         "or modification times differ)")
    for name in OUTPUT_OPTIONS:
        if existing["options"].get(name, OUTPUT_DEFAULTS.get(name)) != manifest_new["options"][name]:
            raise ValueError(f"cannot resume {out}: {name} was {existing['options'].get(name)!r}, now "
                             f"{manifest_new['options'][name]!r}")
    if existing.get("layout") != manifest_new["layout"]:
        engines = "--engine ray" if existing.get("layout") == PIECES else "--engine local or triton"
        raise ValueError(f"cannot resume {out}: its shards were written in the {existing.get('layout')} layout of "
                         f"another engine; resume it with {engines}")
    names = out.names()
    for s in existing["shards"]:
        if s["file"] not in names:
            raise ValueError(f"cannot resume {out}: complete shard {s['file']} listed in {MANIFEST} is missing")
    existing.setdefault("output", manifest_new["output"])  # a run of before `output`: float32 rows, same options
    existing["engine"] = manifest_new["engine"]
    existing["runs"] = existing.get("runs", 1) + 1
    return existing, False


def encode_corpus(
    model: str | os.PathLike,
    input: str | os.PathLike | Sequence[str | os.PathLike],  # noqa: A002 - mirrors --input
    output: str | os.PathLike,
    *,
    text_field: str = "text",
    id_field: str = "id",
    batch_size: int = 32,
    max_batch_tokens: int | None = DEFAULT_MAX_BATCH_TOKENS,
    max_length: int | None = None,
    workers: int = 1,
    engine: str = "local",
    resume: bool = False,
    on_error: str = "fail",
    url: str = "localhost:8001",
    model_name: str | None = None,
    ray_address: str | None = None,
    ray_num_cpus: int | None = None,
    shard_size: int = 100_000,
    window: int = 4096,
    s3_endpoint: str | None = None,
    providers: Sequence[str] | None = None,
    show_progress: bool = True,
    chunks: str | None = None,
    chunk_size: int | None = None,
    chunk_by: str = "tokens",
    chunk_overlap: int = 0,
    dimensions: int | None = None,
    precision: str = "float32",
    ranges=None,
) -> EncodeResult:
    """Encode every valid row of `input` with the export `model` into Parquet shards under `output`.

    Same options as `attncal encode` (see docs/reindexing.md).  `model`, `input` and `output` are
    local paths or URIs (s3://, gs://, abfs://, hdfs://, file://); `s3_endpoint` overrides the S3
    endpoint for all three.  `workers` is the number of worker processes (local), concurrent
    requests (triton) or Encoder actors (ray).  Raises `ValueError` / `FileNotFoundError` /
    `FileExistsError` (subclasses included: `CorpusInputError`, `storage.StorageError`) for bad
    input or an unreachable location; bad input leaves no output behind.

    `chunks` (naive, late, landmark; `chunk_size`, `chunk_by`, `chunk_overlap`) writes one row per chunk
    (`attncal.runtime.chunking`); `dimensions` and `precision` are `Encoder.output`'s.  int8 / uint8 take
    `ranges` [2, dimensions] where given, else (local, triton) the ranges of a seeded sample of the corpus
    (`attncal.runtime.precision.RANGE_SAMPLE` rows, seed `RANGE_SEED`); the manifest records them, and
    `--resume` reuses them.
    """
    t_start = time.perf_counter()
    opts = {"text_field": text_field, "id_field": id_field, "shard_size": shard_size, "batch_size": batch_size,
            "max_batch_tokens": max_batch_tokens if engine != "triton" else None, "window": window,
            "max_length": max_length, "on_error": on_error}
    _check_options(opts, engine, workers)
    stored = _output_options(chunks, chunk_size, chunk_by, chunk_overlap, dimensions, precision, ranges, engine)
    opts.update(dimensions=dimensions, precision=precision, chunks=stored["chunks"])
    export, meta = _export(model, s3_endpoint)
    stored["normalize"] = bool(meta.get("normalize"))
    limit = meta.get("max_seq_length")
    if max_length is not None:
        if engine == "triton":
            raise ValueError("max_length is set by the served model's tokenizer (attncal triton-repo), not by the "
                             "client; drop it with the triton engine")
        if not isinstance(max_length, int) or max_length < 2 or (limit and max_length > limit):
            raise ValueError(f"max_length must be an integer in [2, {limit}] for this export, got {max_length!r}")
    if engine == "triton" and not model_name:
        raise ValueError("the triton engine needs the served model's name (--model)")
    files = resolve_inputs(list(input) if isinstance(input, (list, tuple)) else input, s3_endpoint)
    out = Location.parse(output, s3_endpoint)
    check_bucket(out, "output")
    if any(f.location.parent() == out and f.name.startswith("part-") for f in files):
        raise ValueError(f"input and output overlap in {out}")
    try:
        digest = config_hash(export)
    except OSError as exc:
        raise explain(exc, "export", export) from None
    fresh = {
        "format": FORMAT, "complete": False, "attncal_version": installed(DISTRIBUTION),
        "model": {"export": str(export), "source_model": meta.get("source_model"),
                  "model_type": meta.get("model_type"), "calibrated": meta.get("calibrated"),
                  "config": meta.get("config"), "dimension": None, "max_length": max_length or limit},
        "config_hash": digest,
        "input": {"fingerprint": fingerprint(files), "files": [_file_entry(f) for f in files]},
        "options": opts, "engine": {"name": engine, "workers": workers},
        "output": stored,
        "layout": PIECES if engine == "ray" else SEQUENTIAL, "rows": None, "skipped": None,
        "skip_file": SKIP_FILE, "skip_list": [], "shards": [], "runs": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if engine == "ray":
        return _encode_pieces(export, digest, files, out, fresh, resume, opts, workers, ray_address, ray_num_cpus,
                              show_progress, t_start)
    return _encode_sequential(export, digest, meta, files, out, fresh, resume, opts, engine, workers, url,
                              model_name, providers, show_progress, t_start)


def _output_options(chunks, chunk_size, chunk_by, chunk_overlap, dimensions, precision, ranges, engine) -> dict:
    """The manifest's `output` (dimensions, precision, ranges, chunks), checked as far as it can be without the
    export (`_check_output` does the rest)."""
    check_precision(precision)
    spec = None
    if chunks is not None:
        spec = ChunkOptions(chunks, chunk_size, chunk_by, chunk_overlap).to_dict()
    elif chunk_size is not None or chunk_by != "tokens" or chunk_overlap:
        raise ValueError("--chunk-size, --chunk-by and --chunk-overlap need --chunks")
    if ranges is not None and precision not in SCALAR:
        raise ValueError(f"ranges apply to int8 / uint8, not {precision}")
    r = None if ranges is None else np.asarray(ranges, dtype=np.float32).tolist()
    return {"dimensions": dimensions, "precision": precision, "ranges": r, "ranges_sample": None, "chunks": spec}


def _check_output(output: dict, local: Path | None, dim: int) -> None:
    """`output` against the export at `local` (None: a remote export, whose declared Matryoshka dimensions the
    actors check) and its embedding width `dim`."""
    check_dimensions(output["dimensions"], dim, declared_dimensions(local) if local is not None else None)
    if output["ranges"] is not None:
        check_ranges(output["ranges"], output["dimensions"] or dim, output["precision"])


def _sample_ranges(local: Path, files, opts: dict, total: int, output: dict, providers) -> None:
    """int8 / uint8 ranges from a seeded sample of the valid rows (`attncal.runtime.precision.sample_rows`),
    encoded by the local Encoder as every engine encodes them, into `output`."""
    picked = sample_rows(total, RANGE_SAMPLE, RANGE_SEED)
    want, texts, row = set(picked.tolist()), [], 0
    for f in files:
        for c in read_chunks(f, opts["text_field"], opts["id_field"]):
            texts += [t for k, t in enumerate(c.texts, row) if k in want]
            row += len(c.ids)
    enc = load_encoder(str(local), None, opts["max_length"], providers)
    if output["chunks"] is not None:
        got = enc.encode_chunks(texts, ChunkOptions(**output["chunks"]), batch_size=opts["batch_size"], errors=[])
        emb = enc.output(got.vectors, output["dimensions"])
    else:
        emb = enc.encode(texts, opts["batch_size"], dimensions=output["dimensions"])
    output["ranges"] = ranges_of(emb).tolist()
    output["ranges_sample"] = {"rows": len(texts), "size": RANGE_SAMPLE, "seed": RANGE_SEED,
                               "vectors": int(len(emb))}


def _unchunked(manifest: dict) -> list[dict]:
    """The rows of a chunked run left out of chunking (on_error skip), as skip-list entries."""
    return [{"id": u["id"], "error": u["error"], "stage": "chunking"}
            for sh in manifest["shards"] for u in sh.get("unchunked", ())]


def _encode_sequential(export, digest, meta, files, out, fresh, resume, opts, engine, workers, url, model_name,
                       providers, show_progress, t_start) -> EncodeResult:
    """The local and triton engines: scan, then one ordered stream of windows into `sequential` shards."""
    text_field, id_field, shard_size = opts["text_field"], opts["id_field"], opts["shard_size"]
    sc = scan(files, text_field, id_field, show_progress)
    if sc.bad and opts["on_error"] == "fail":
        raise CorpusInputError(f"{len(sc.bad)} bad row(s), first {sc.bad[0].describe()} "
                               "(fix them or pass --on-error skip)")
    if sc.rows == 0:
        raise CorpusInputError("the input has no valid rows" + (f" ({len(sc.bad)} bad)" if sc.bad else ""))
    local = _local_export(export, digest)
    dim = _dimension(local, meta)
    _check_output(fresh["output"], local, dim)
    if opts["chunks"] is not None:
        check_export(ChunkOptions(**opts["chunks"]), local, meta, opts["max_length"])
    fresh["model"]["dimension"] = dim
    fresh["input"]["files"] = sc.files
    fresh.update(rows=sc.rows, skipped=len(sc.bad), skip_list=[b.to_dict() for b in sc.bad])
    manifest, _ = _prepare_output(out, resume, fresh)
    if fresh["output"]["ranges"] is not None and manifest["output"]["ranges"] != fresh["output"]["ranges"]:
        raise ValueError(f"cannot resume {out}: its int8 ranges differ from the ranges given")
    if manifest["output"]["precision"] in SCALAR and manifest["output"]["ranges"] is None:
        _sample_ranges(local, files, opts, sc.rows, manifest["output"], providers)
    done_rows = sum(s["rows"] for s in manifest["shards"])
    if manifest["complete"]:
        return EncodeResult(str(out), engine, done_rows, 0, len(sc.bad), len(manifest["shards"]),
                            time.perf_counter() - t_start, 0, done_rows, manifest)

    rows = ((c.ids, c.texts) for f in files for c in read_chunks(f, text_field, id_field))
    batches = windows(rows, done_rows, shard_size, opts["window"])
    chunk_spec = None if opts["chunks"] is None else {**opts["chunks"], "skip": opts["on_error"] == "skip"}
    if engine == "local":
        eng = LocalEngine(str(local), batch_size=opts["batch_size"], workers=workers, max_length=opts["max_length"],
                          chunks=chunk_spec,
                          providers=providers, max_batch_tokens=opts["max_batch_tokens"])
        stream = eng.encode(batches)
    else:
        eng = TritonEngine(url, model_name, batch_size=opts["batch_size"], concurrency=workers,
                           dimensions=manifest["output"]["dimensions"], chunks=chunk_spec, export_dir=str(local),
                           providers=providers)
        eng.check(dim)
        stream = eng.encode(batches)
    manifest["engine"] = eng.describe()

    def record(name: str, n: int, **extra) -> None:
        manifest["shards"].append({"file": name, "rows": n, "first_row": done_rows + writer.rows_done - n, **extra})
        save_manifest(out, manifest)

    writer = ShardWriter(out, shard_size, dim, shard_name, record, first=len(manifest["shards"]),
                         output=manifest["output"])
    progress = Progress(sc.rows, done_rows, show_progress)
    try:
        try:
            remove_temporaries(out)
            out.child(SKIP_FILE).write_bytes("".join(json.dumps(b.to_dict()) + "\n" for b in sc.bad).encode())
            save_manifest(out, manifest)
        except OSError as exc:
            raise explain(exc, "output", out) from None
        for ids, emb, tokens in stream:
            writer.write(ids, emb)
            progress.update(len(ids), tokens)
        if done_rows + writer.rows_written != sc.rows:
            raise RuntimeError(f"engine {engine} returned {done_rows + writer.rows_written} rows, expected {sc.rows}")
        writer.finish()
        unchunked = _unchunked(manifest)
        if unchunked:
            skip = manifest["skip_list"] + unchunked
            out.child(SKIP_FILE).write_bytes("".join(json.dumps(b) + "\n" for b in skip).encode())
            manifest.update(skip_list=skip, skipped=len(skip))
        manifest["complete"] = True
        save_manifest(out, manifest)
    except OSError as exc:
        writer.abort()
        raise explain(exc, "output", out) from None
    except BaseException:
        writer.abort()
        raise
    finally:
        progress.close()
    graph = None
    if engine != "triton":
        graph = planned_graph(local, providers)
    return EncodeResult(str(out), engine, done_rows + writer.rows_done, progress.rows, manifest["skipped"],
                        len(manifest["shards"]), progress.elapsed, progress.tokens if progress.tokens_known else None,
                        done_rows, manifest, graph)


# -- the ray engine: pieces ------------------------------------------------------------------------

def _plan_digest(pieces: list[Piece], piece_bytes: int) -> dict:
    text = json.dumps([[p.path, p.format, p.first, p.offset, p.length, p.row_groups] for p in pieces])
    return {"piece_bytes": piece_bytes, "pieces": len(pieces),
            "digest": "sha256:" + hashlib.sha256(text.encode()).hexdigest()}


def _listed(manifest: dict, pieces: list[Piece], done: dict[int, dict]) -> None:
    """The manifest's pieces and shards from the pieces done: every shard of a done piece, in input
    order, with its first row once every piece before it is done."""
    manifest["pieces"] = [done[i] for i in sorted(done)]
    shards, row, known = [], 0, True
    for i in range(len(pieces)):
        if i not in done:
            known = False
            continue
        for s in done[i]["shards"]:
            shards.append({"file": s["file"], "rows": s["rows"], "first_row": row if known else None, "piece": i})
            row += s["rows"]
    manifest["shards"] = shards


def _lines_before(i: int, pieces: list[Piece], done: dict[int, dict], eng) -> int:
    """Lines of piece i's file before piece i: from the pieces done, else counted by an actor."""
    earlier = [k for k in range(i) if pieces[k].file_index == pieces[i].file_index]
    if all(k in done for k in earlier):
        return sum(done[k]["lines"] for k in earlier)
    return eng.lines_before(pieces[i])


def _bad_rows_error(result: dict, pieces: list[Piece], done: dict[int, dict], eng) -> CorpusInputError:
    i = result["piece"]
    piece = pieces[i]
    bad = [BadRow.from_dict(b, piece.format) for b in result["bad"]]
    if piece.format == "jsonl" and piece.offset > 0:
        bad = rebase(bad, _lines_before(i, pieces, done, eng))
    every = len(done) + 1 == len(pieces)
    return CorpusInputError(f"{'' if every else 'at least '}{len(bad)} bad row(s), first {bad[0].describe()} "
                            "(fix them or pass --on-error skip)")


def _complete(manifest: dict, pieces: list[Piece], done: dict[int, dict]) -> list[BadRow]:
    """Fill in what is known once every piece is done: first rows, the skip list with the files' line
    numbers, row counts per file and in all."""
    skip: list[BadRow] = []
    lines: dict[int, int] = {}
    files = manifest["input"]["files"]
    for f in files:
        f["rows"], f["bad"] = 0, 0
    for i, p in enumerate(pieces):
        d = done[i]
        bad = [BadRow.from_dict(b, p.format) for b in d["bad"]]
        if p.format == "jsonl":
            bad = rebase(bad, lines.get(p.file_index, 0))
            lines[p.file_index] = lines.get(p.file_index, 0) + d["lines"]
        skip += bad
        files[p.file_index]["rows"] += d["rows"]
        files[p.file_index]["bad"] += len(bad)
    _listed(manifest, pieces, done)
    for d in manifest["pieces"]:
        d["skipped"] = len(d.pop("bad"))
    unchunked = _unchunked(manifest)
    manifest.update(rows=sum(d["rows"] for d in done.values()), skipped=len(skip) + len(unchunked),
                    skip_list=[b.to_dict() for b in skip] + unchunked)
    return skip


def _encode_pieces(export, digest, files, out, fresh, resume, opts, workers, ray_address, ray_num_cpus,
                   show_progress, t_start) -> EncodeResult:
    """The ray engine: the driver plans and commits; the actors read, encode and write (see the
    module docstring and `ray_engine`)."""
    manifest, is_new = _prepare_output(out, resume, fresh)
    if manifest["output"]["precision"] in SCALAR and manifest["output"]["ranges"] is None:
        raise ValueError(f"{manifest['output']['precision']} with the ray engine needs ranges (the driver reads no "
                         "row of the corpus): pass the ranges of an earlier run (its manifest's output.ranges) or "
                         "Encoder.quantization_ranges")
    done: dict[int, dict] = {d["piece"]: d for d in manifest.get("pieces", [])}
    done_rows = sum(d["rows"] for d in done.values())
    if manifest["complete"]:
        return EncodeResult(str(out), "ray", manifest["rows"], 0, manifest["skipped"], len(manifest["shards"]),
                            time.perf_counter() - t_start, 0, manifest["rows"], manifest)
    piece_bytes = manifest.get("plan", {}).get("piece_bytes", PIECE_BYTES)
    created_dir = out.is_local and not os.path.exists(out.url)
    eng = RayEngine(export, digest, out=out, batch_size=opts["batch_size"], window=opts["window"],
                    shard_size=opts["shard_size"], text_field=opts["text_field"], id_field=opts["id_field"],
                    on_error=opts["on_error"], workers=workers, max_length=opts["max_length"], address=ray_address,
                    num_cpus=ray_num_cpus, max_batch_tokens=opts["max_batch_tokens"], output=manifest["output"])
    written = False  # this run has written a manifest
    progress = None
    try:
        with eng:
            info = eng.start()
            layouts = eng.parquet_layouts([f for f in files if f.format == "parquet"])
            pieces = [p for k, f in enumerate(files) for p in plan_pieces(f, piece_bytes, layouts.get(f.path), k)]
            plan = _plan_digest(pieces, piece_bytes)
            if "plan" in manifest and manifest["plan"] != plan:
                raise ValueError(f"cannot resume {out}: the input's pieces differ from the interrupted run's")
            if manifest["model"]["dimension"] not in (None, info["dimension"]):
                raise ValueError(f"cannot resume {out}: the export's dimension changed")
            _check_output(manifest["output"], Path(export.url) if export.is_local else None, info["dimension"])
            manifest.update(plan=plan, engine=eng.describe())
            manifest["model"]["dimension"] = info["dimension"]
            _listed(manifest, pieces, done)
            try:
                remove_temporaries(out)
                save_manifest(out, manifest)
            except OSError as exc:
                raise explain(exc, "output", out) from None
            written = True
            progress = Progress(sum(p.nbytes for p in pieces), sum(pieces[i].nbytes for i in done), show_progress,
                                unit="B")
            every, since, last = max(1, len(pieces) // 100), 0, time.monotonic()
            for result in eng.run([(i, p) for i, p in enumerate(pieces) if i not in done]):
                if result.pop("failed"):
                    raise _bad_rows_error(result, pieces, done, eng)
                tokens = result.pop("tokens")
                done[result["piece"]] = result
                progress.update(result["rows"], tokens, pieces[result["piece"]].nbytes)
                since += 1
                if since >= every or time.monotonic() - last >= COMMIT_INTERVAL_S:
                    _listed(manifest, pieces, done)
                    save_manifest(out, manifest)
                    since, last = 0, time.monotonic()
            manifest["engine"] = eng.describe()
        # every actor is gone: nothing writes any more
        skip = _complete(manifest, pieces, done)
        if not manifest["rows"]:
            raise CorpusInputError("the input has no valid rows" + (f" ({len(skip)} bad)" if skip else ""))
        names = out.names()
        missing = [s["file"] for s in manifest["shards"] if s["file"] not in names]
        if missing:
            raise RuntimeError(f"shard {missing[0]} of a finished piece is missing from {out}")
        out.child(SKIP_FILE).write_bytes("".join(json.dumps(b) + "\n" for b in manifest["skip_list"]).encode())
        manifest["complete"] = True
        save_manifest(out, manifest)
        remove_unlisted(out, manifest)
    except BaseException as exc:
        _stopped(out, manifest, pieces if written else [], done, is_new, created_dir, written, exc)
        if isinstance(exc, OSError) and not isinstance(exc, StorageError):
            raise explain(exc, "output", out) from None
        raise
    finally:
        if progress is not None:
            progress.close()
    return EncodeResult(str(out), "ray", manifest["rows"], manifest["rows"] - done_rows, manifest["skipped"],
                        len(manifest["shards"]), progress.elapsed,
                        progress.tokens if progress.tokens_known else None, done_rows, manifest, info["graph"])


def _stopped(out: Location, manifest: dict, pieces: list[Piece], done: dict, is_new: bool, created_dir: bool,
             written: bool, exc: BaseException) -> None:
    """Leave the output of a stopped Ray run in a state the documentation promises: bad input (or a
    fresh run that finished no piece) leaves nothing behind; otherwise the pieces done are committed
    and `--resume` continues."""
    try:
        if isinstance(exc, CorpusInputError) or (is_new and not done):
            if is_new:  # the output was empty (`_prepare_output`): all of it is this run's
                out.delete_contents()
                if created_dir:
                    out.delete_dir_if_empty()
            else:
                remove_unlisted(out, load_manifest(out))
        elif written and pieces:
            _listed(manifest, pieces, done)
            save_manifest(out, manifest)
    except OSError:
        pass  # the storage itself failed: the manifest written last still lists complete shards only
