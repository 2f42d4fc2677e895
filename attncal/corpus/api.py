"""`encode_corpus`: re-embed a corpus with an attncal export, streaming, sharded and resumable.

The run has two passes over the input.  The scan (cheap next to encoding: it
parses, it does not embed) validates every row, counts the rows for the
progress bar, hashes the files for the manifest's input fingerprint and
collects the bad rows; so bad input with `on_error="fail"` is refused before
anything is written, and the skip list is complete from the first shard on.
The encode pass streams the rows again through an engine into the shard
writer.  Every engine parses with the readers of `inputs` (the local and
triton engines through `read_chunks`, Ray through `read_piece` on the same
byte ranges), so one error policy holds everywhere: the scan's bad rows are
exactly the rows each engine leaves out.  Calibration is an indexing-time
change, so the model must be an attncal export (`attncal export MODEL -o
OUT`): exporting is not cheap for large models and includes a parity check,
so it is never done implicitly.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from .progress import Progress
from .inputs import BadRow, CorpusInputError, InputFile, file_sha256, read_chunks, resolve_inputs
from .shards import (FORMAT, MANIFEST, OUTPUT_OPTIONS, SKIP_FILE, ShardWriter, atomic_write_text, config_hash,
                     load_manifest, remove_temporaries, save_manifest)

ENGINES = ("local", "triton", "ray")
ON_ERROR = ("fail", "skip")


@dataclass
class EncodeResult:
    out_dir: Path
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
    files: list[dict]  # path, format, size, sha256, rows (valid), bad
    bad: list[BadRow]
    rows: int
    fingerprint: str


def _export_dir(model: str | os.PathLike) -> Path:
    from ..export.exporter import METADATA_FILE

    p = Path(model).expanduser()
    if (p / METADATA_FILE).is_file():
        return p.resolve()
    what = "the embedded default model" if str(model) == "default" else (
        f"{p} is a model directory" if (p / "config.json").is_file() else f"{p} is not an attncal export")
    raise ValueError(f"{what}, not an attncal export ({METADATA_FILE} missing): run `attncal export {model} -o OUT` "
                     f"first, then `attncal encode OUT ...`")


def _dimension(export: Path, meta: dict) -> int:
    """Embedding size from the graph's output shape (no session needed), else config.json's hidden_size."""
    import onnx

    from ..export.exporter import ONNX_FILE, ONNX_SUBDIR

    graph = onnx.load(str(export / ONNX_SUBDIR / ONNX_FILE), load_external_data=False).graph
    for o in graph.output:
        if o.name == "sentence_embedding":
            dims = o.type.tensor_type.shape.dim
            if dims and dims[-1].HasField("dim_value"):
                return int(dims[-1].dim_value)
    from ..artifact import config_int

    return config_int(export, "hidden_size")


def scan(files: list[InputFile], text_field: str, id_field: str, show_progress: bool = False) -> ScanResult:
    """Validate and count every row, and fingerprint the input (see the module docstring)."""
    from tqdm.auto import tqdm

    out, bad, total = [], [], 0
    digest = hashlib.sha256()
    bar = tqdm(total=sum(f.path.stat().st_size for f in files), unit="B", unit_scale=True, desc="scan",
               disable=not show_progress)
    for f in files:
        rows, file_bad = 0, 0
        for chunk in read_chunks(f, text_field, id_field):
            rows += len(chunk.ids)
            file_bad += len(chunk.bad)
            bad += chunk.bad
        size = f.path.stat().st_size
        sha = file_sha256(f.path)
        digest.update(f"{f.path.name}\0{size}\0{sha}\n".encode())
        out.append({"path": str(f.path), "format": f.format, "size": size, "sha256": sha, "rows": rows,
                    "bad": file_bad})
        total += rows
        bar.update(size)
    bar.close()
    return ScanResult(out, bad, total, "sha256:" + digest.hexdigest())


def _windows(files: list[InputFile], text_field: str, id_field: str, skip: int, shard_size: int,
             window: int) -> Iterator[tuple[list[str], list[str]]]:
    """Valid rows after the first `skip`, in windows that never cross a shard boundary, so a shard's
    batches (hence its bytes) are the same whether or not the run was resumed."""
    pos = 0  # index of the next valid row
    buf_ids: list[str] = []
    buf_texts: list[str] = []
    start = skip  # index of the first row in the buffer
    for f in files:
        for chunk in read_chunks(f, text_field, id_field):
            ids, texts = chunk.ids, chunk.texts
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


def _check_options(opts: dict, engine: str, workers: int) -> None:
    for name in ("batch_size", "shard_size", "window"):
        if not isinstance(opts[name], int) or opts[name] < 1:
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


def _prepare_output(out: Path, resume: bool, manifest_new: dict) -> dict:
    """The manifest to continue from: a fresh one, or the existing one after checking it matches."""
    existing = load_manifest(out) if out.is_dir() else None
    if existing is None:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            what = "is a file" if not out.is_dir() else f"is not empty and has no {MANIFEST}"
            raise FileExistsError(f"output {out} {what}; choose an empty or new directory")
        return manifest_new
    if not resume:
        raise FileExistsError(f"output {out} already holds an encode run ({MANIFEST}); pass --resume to continue it "
                              "or choose another directory")
    if existing.get("format") != FORMAT:
        raise ValueError(f"{out / MANIFEST}: unknown manifest format {existing.get('format')!r}")
    if existing["config_hash"] != manifest_new["config_hash"]:
        raise ValueError(f"cannot resume {out}: it was encoded with another export (attncal.json hash differs)")
    if existing["input"]["fingerprint"] != manifest_new["input"]["fingerprint"]:
        raise ValueError(f"cannot resume {out}: the input files changed since the run started (fingerprint differs)")
    for name in OUTPUT_OPTIONS:
        if existing["options"].get(name) != manifest_new["options"][name]:
            raise ValueError(f"cannot resume {out}: {name} was {existing['options'].get(name)!r}, now "
                             f"{manifest_new['options'][name]!r}")
    for s in existing["shards"]:
        if not (out / s["file"]).is_file():
            raise ValueError(f"cannot resume {out}: complete shard {s['file']} listed in {MANIFEST} is missing")
    existing["engine"] = manifest_new["engine"]
    existing["runs"] = existing.get("runs", 1) + 1
    return existing


def encode_corpus(
    model: str | os.PathLike,
    input: str | os.PathLike | Sequence[str | os.PathLike],  # noqa: A002 - mirrors --input
    output: str | os.PathLike,
    *,
    text_field: str = "text",
    id_field: str = "id",
    batch_size: int = 32,
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
    providers: Sequence[str] | None = None,
    show_progress: bool = True,
) -> EncodeResult:
    """Encode every valid row of `input` with the export `model` into Parquet shards under `output`.

    Same options as `attncal encode` (see docs/reindexing.md).  `workers` is the number of
    worker processes (local), concurrent requests (triton) or Encoder actors (ray).  Raises
    `ValueError` / `FileNotFoundError` / `FileExistsError` (subclasses included) for bad input,
    before anything is written.
    """
    from .. import __version__

    t_start = time.perf_counter()
    opts = {"text_field": text_field, "id_field": id_field, "shard_size": shard_size, "batch_size": batch_size,
            "window": window, "max_length": max_length, "on_error": on_error}
    _check_options(opts, engine, workers)
    export = _export_dir(model)
    meta = json.loads((export / "attncal.json").read_text())
    limit = meta.get("max_seq_length")
    if max_length is not None:
        if engine == "triton":
            raise ValueError("max_length is set by the served model's tokenizer (attncal triton-repo), not by the "
                             "client; drop it with the triton engine")
        if not isinstance(max_length, int) or max_length < 2 or (limit and max_length > limit):
            raise ValueError(f"max_length must be an integer in [2, {limit}] for this export, got {max_length!r}")
    if engine == "triton" and not model_name:
        raise ValueError("the triton engine needs the served model's name (--model)")
    files = resolve_inputs(list(input) if isinstance(input, (list, tuple)) else input)
    out = Path(output).expanduser().resolve()
    if any(out == f.path.parent and f.path.name.startswith("part-") for f in files):
        raise ValueError(f"input and output overlap in {out}")

    sc = scan(files, text_field, id_field, show_progress)
    if sc.bad and on_error == "fail":
        raise CorpusInputError(f"{len(sc.bad)} bad row(s), first {sc.bad[0].describe()} "
                               "(fix them or pass --on-error skip)")
    if sc.rows == 0:
        raise CorpusInputError("the input has no valid rows" + (f" ({len(sc.bad)} bad)" if sc.bad else ""))
    dim = _dimension(export, meta)
    engine_desc = {"name": engine, "workers": workers}
    fresh = {
        "format": FORMAT, "complete": False, "attncal_version": __version__,
        "model": {"export": str(export), "source_model": meta.get("source_model"),
                  "model_type": meta.get("model_type"), "calibrated": meta.get("calibrated"),
                  "config": meta.get("config"), "dimension": dim, "max_length": max_length or limit},
        "config_hash": config_hash(export),
        "input": {"fingerprint": sc.fingerprint, "files": sc.files},
        "options": opts, "engine": engine_desc, "rows": sc.rows, "skipped": len(sc.bad),
        "skip_file": SKIP_FILE, "skip_list": [b.to_dict() for b in sc.bad], "shards": [], "runs": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    manifest = _prepare_output(out, resume, fresh)
    done_rows = sum(s["rows"] for s in manifest["shards"])
    if manifest["complete"]:
        return EncodeResult(out, engine, done_rows, 0, len(sc.bad), len(manifest["shards"]),
                            time.perf_counter() - t_start, 0, done_rows, manifest)

    if engine == "local":
        from .local import LocalEngine

        eng = LocalEngine(str(export), batch_size=batch_size, workers=workers, max_length=max_length,
                          providers=providers)
        stream = eng.encode(_windows(files, text_field, id_field, done_rows, shard_size, window))
    elif engine == "triton":
        from .triton import TritonEngine

        eng = TritonEngine(url, model_name, batch_size=batch_size, concurrency=workers)
        eng.check(dim)
        stream = eng.encode(_windows(files, text_field, id_field, done_rows, shard_size, window))
    else:
        from .ray_engine import RayEngine

        eng = RayEngine(str(export), batch_size=batch_size, window=window, workers=workers, max_length=max_length,
                        address=ray_address, num_cpus=ray_num_cpus)
        # whole files already encoded are not read again; the rest of a partly done file is dropped after encoding
        first, skip = 0, done_rows
        while first < len(files) and sc.files[first]["rows"] <= skip:
            skip -= sc.files[first]["rows"]
            first += 1
        stream = eng.encode_files(files[first:], text_field, id_field, skip)
    manifest["engine"] = eng.describe()

    out.mkdir(parents=True, exist_ok=True)
    remove_temporaries(out)
    atomic_write_text(out / SKIP_FILE, "".join(json.dumps(b.to_dict()) + "\n" for b in sc.bad))
    save_manifest(out, manifest)
    writer = ShardWriter(out, manifest, shard_size, dim)
    progress = Progress(sc.rows, done_rows, show_progress)
    try:
        for ids, emb, tokens in stream:
            writer.write(ids, emb)
            progress.update(len(ids), tokens)
        if writer.rows_written != sc.rows:
            raise RuntimeError(f"engine {engine} returned {writer.rows_written} rows, expected {sc.rows}")
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        progress.close()
    graph = None
    if engine != "triton":
        from ..runtime.encoder import planned_graph

        graph = planned_graph(export, providers)
    return EncodeResult(out, engine, writer.rows_done, progress.rows, len(sc.bad), len(manifest["shards"]),
                        progress.elapsed, progress.tokens if progress.tokens_known else None, done_rows, manifest,
                        graph)

