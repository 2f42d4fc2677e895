"""Streaming corpus readers: JSON lines, CSV and Parquet, with bad rows located by file and line.

Why each reader is shaped as it is:

- JSON lines are cut into byte chunks at line ends and each chunk is parsed by
  `pyarrow.json` (fast path).  When pyarrow refuses a chunk (invalid JSON, a
  non-string text, mixed id types, invalid UTF-8) the chunk is re-parsed line
  by line with `json`, which names every bad line exactly.  Blank lines are
  skipped by both.
- CSV is parsed with Python's `csv` module: pyarrow's CSV reader cannot say on
  which line an invalid row was (its `InvalidRow.number` is unset), and the
  issue asks for the line.  CSV parsing is far faster than encoding anyway.
  A row's line is the line it starts on.
- Parquet is read by record batch with `pyarrow.parquet`; a bad row is
  reported by its 1-based row number in the file.

Every reader yields `Chunk`s of valid rows (ids as strings, texts) plus the bad
rows met on the way, so memory is bounded by the chunk size whatever the
corpus size.  Ids are written as strings: JSON integers become their decimal
form, CSV fields are kept verbatim.

Engines that read in parallel (Ray) cut each file into `Piece`s with
`plan_pieces` and parse each piece with `read_piece`, which runs the very
functions `read_chunks` runs on the same byte ranges (JSON lines), row groups
(Parquet) or whole file (CSV), so every engine keeps and names the same rows.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import io
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet",
           ".pq": "parquet"}
JSON_CHUNK_BYTES = 8 << 20
CSV_CHUNK_ROWS = 8192
PARQUET_CHUNK_ROWS = 8192


class CorpusInputError(ValueError):
    """The input cannot be read as a corpus (missing file, unknown format, missing column, bad rows)."""


@dataclass(frozen=True)
class InputFile:
    path: Path
    format: str  # jsonl | csv | parquet


@dataclass(frozen=True)
class BadRow:
    file: str
    line: int  # 1-based line (JSONL, CSV) or row number (Parquet)
    reason: str
    id: str | None = None
    format: str = "jsonl"

    def where(self) -> str:
        return f"{self.file}: row {self.line}" if self.format == "parquet" else f"{self.file}:{self.line}"

    def describe(self) -> str:
        return f"{self.where()}: {self.reason}"

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "id": self.id, "reason": self.reason}


@dataclass
class Chunk:
    ids: list[str]
    texts: list[str]
    bad: list[BadRow] = field(default_factory=list)
    fallback: bool = False  # pyarrow could not parse it; rows came from the line-by-line parser


def resolve_inputs(inputs: str | os.PathLike | list) -> list[InputFile]:
    """Files of `inputs` (a file, a directory of corpus files, a glob, or a list of those), in order."""
    items = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    if not items:
        raise CorpusInputError("no input given")
    files: list[Path] = []
    for item in items:
        p = Path(item).expanduser()
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.is_file() and q.suffix.lower() in FORMATS)
            if not found:
                raise CorpusInputError(f"input directory {p} holds no .jsonl, .csv or .parquet file")
            files += found
        elif p.is_file():
            files.append(p)
        elif any(ch in str(item) for ch in "*?["):
            found = sorted(Path(q) for q in glob.glob(str(p)) if Path(q).is_file())
            if not found:
                raise CorpusInputError(f"input pattern {item} matches no file")
            files += found
        else:
            raise CorpusInputError(f"input {p} not found")
    out = []
    for f in files:
        fmt = FORMATS.get(f.suffix.lower())
        if fmt is None:
            raise CorpusInputError(f"input {f}: unknown format {f.suffix!r} (expected .jsonl, .csv or .parquet)")
        out.append(InputFile(f.resolve(), fmt))
    if len(set(f.path for f in out)) != len(out):
        raise CorpusInputError("the same input file is given twice")
    return out


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_chunks(f: InputFile, text_field: str, id_field: str) -> Iterator[Chunk]:
    """Valid rows and bad rows of one file, chunk by chunk, in file order."""
    if f.format == "jsonl":
        return _read_jsonl(f.path, text_field, id_field)
    if f.format == "csv":
        return _read_csv(f.path, text_field, id_field)
    return _read_parquet(f.path, text_field, id_field)


@dataclass(frozen=True)
class Piece:
    """A part of one input file that a parallel reader parses on its own (see `plan_pieces`).

    `first` is the 1-based line (JSON lines) or row number (Parquet) of the piece's first row, so
    bad rows are named exactly as `read_chunks` names them.  Plain data, so it travels as JSON.
    """

    path: str
    format: str  # jsonl | csv | parquet
    first: int = 1
    offset: int = 0  # JSON lines: byte range [offset, offset + length) of the file
    length: int = -1  # -1: to the end of the file
    row_groups: tuple[int, ...] | None = None  # Parquet: these row groups; None: all

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Piece":
        d = json.loads(text)
        if d["row_groups"] is not None:
            d["row_groups"] = tuple(d["row_groups"])
        return cls(**d)


def plan_pieces(f: InputFile) -> list[Piece]:
    """Pieces of `f` that together give exactly `read_chunks(f)`'s rows, in order.

    - JSON lines: the byte ranges `read_chunks` itself parses one at a time (cut at line ends by
      `_byte_chunks`, so the boundaries are the same by construction); the file is read, not parsed.
    - Parquet: runs of row groups of about `JSON_CHUNK_BYTES` (from the footer; no data read).
    - CSV: the whole file, one piece: a quoted field may hold line ends, so a row boundary is only
      known by parsing from the header on (`csv` is sequential).
    """
    if f.format == "jsonl":
        return [Piece(str(f.path), "jsonl", line, offset, len(raw))
                for line, offset, raw in _byte_chunks(f.path, JSON_CHUNK_BYTES)]
    if f.format == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(f.path).metadata
        pieces, groups, first, row, size = [], [], 1, 1, 0
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            groups.append(g)
            row += rg.num_rows
            size += rg.total_byte_size
            if size >= JSON_CHUNK_BYTES or g == meta.num_row_groups - 1:
                pieces.append(Piece(str(f.path), "parquet", first, row_groups=tuple(groups)))
                groups, first, size = [], row, 0
        return pieces
    return [Piece(str(f.path), f.format)]


def read_piece(piece: Piece, text_field: str, id_field: str) -> Iterator[Chunk]:
    """Valid rows and bad rows of one piece, chunk by chunk: the code `read_chunks` runs."""
    path = Path(piece.path)
    if piece.format == "jsonl":
        with open(path, "rb") as fh:
            fh.seek(piece.offset)
            raw = fh.read(piece.length if piece.length >= 0 else -1)
        return iter([_parse_jsonl_piece(path, piece.first, raw, text_field, id_field)])
    if piece.format == "csv":
        return _read_csv(path, text_field, id_field)
    return _read_parquet(path, text_field, id_field, piece.row_groups, piece.first)


# -- JSON lines -----------------------------------------------------------------------------------

def _byte_chunks(path: Path, size: int) -> Iterator[tuple[int, int, bytes]]:
    """(first line number, byte offset, bytes) pieces of the file, each ending at a line end (the
    last one may lack its final newline)."""
    line, offset = 1, 0
    rest = b""
    with open(path, "rb") as fh:
        while True:
            block = fh.read(size)
            if not block:
                break
            buf = rest + block
            cut = buf.rfind(b"\n")
            if cut < 0:
                rest = buf
                continue
            piece, rest = buf[: cut + 1], buf[cut + 1 :]
            yield line, offset, piece
            line += piece.count(b"\n")
            offset += len(piece)
    if rest:
        yield line, offset, rest


def _read_jsonl(path: Path, text_field: str, id_field: str) -> Iterator[Chunk]:
    for first_line, _, piece in _byte_chunks(path, JSON_CHUNK_BYTES):
        yield _parse_jsonl_piece(path, first_line, piece, text_field, id_field)


def _parse_jsonl_piece(path: Path, first_line: int, piece: bytes, text_field: str, id_field: str) -> Chunk:
    """Rows of a piece of whole lines: pyarrow first, line by line when pyarrow refuses it."""
    if not piece.endswith(b"\n"):
        piece += b"\n"  # the file's last line without its newline
    chunk = _jsonl_fast(path, first_line, piece, text_field, id_field)
    return chunk if chunk is not None else _jsonl_slow(path, first_line, piece, text_field, id_field)


def _jsonl_fast(path: Path, first_line: int, piece: bytes, text_field: str, id_field: str) -> Chunk | None:
    """pyarrow parse of a chunk; None when pyarrow refuses it (the line-by-line parser then names the lines)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    try:
        # pyarrow's JSON reader does not check UTF-8: a piece with a non-UTF-8 byte would parse and
        # then fail in to_pylist with a traceback; the line parser names the line instead
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return None
    try:
        table = pj.read_json(pa.BufferReader(piece),
                             read_options=pj.ReadOptions(use_threads=False, block_size=max(len(piece), 1 << 16)),
                             parse_options=pj.ParseOptions(explicit_schema=pa.schema([(text_field, pa.string())]),
                                                           unexpected_field_behavior="infer"))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    n = table.num_rows
    if id_field in table.column_names:
        col = table.column(id_field)
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_integer(col.type)
                or pa.types.is_null(col.type)):
            return None
        ids = pc.cast(col, pa.string()).to_pylist() if not pa.types.is_null(col.type) else [None] * n
    else:
        ids = [None] * n
    texts = table.column(text_field).to_pylist()
    if all(i is not None for i in ids) and all(t is not None for t in texts):
        return Chunk(ids, texts)
    lines = [first_line + k for k, raw in enumerate(piece.split(b"\n")[:-1]) if raw.strip()]
    if len(lines) != n:  # a layout pyarrow read differently from us: let the exact parser decide
        return None
    out = Chunk([], [])
    for line, i, t in zip(lines, ids, texts):
        if t is None or i is None:
            field_name = text_field if t is None else id_field
            out.bad.append(BadRow(str(path), line, f"missing field {field_name!r}", i))
        else:
            out.ids.append(i)
            out.texts.append(t)
    return out


def _jsonl_slow(path: Path, first_line: int, piece: bytes, text_field: str, id_field: str) -> Chunk:
    out = Chunk([], [], fallback=True)
    for k, raw in enumerate(piece.split(b"\n")[:-1]):
        if not raw.strip():
            continue
        line = first_line + k
        bad = lambda reason, i=None: out.bad.append(BadRow(str(path), line, reason, i))  # noqa: E731
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad(f"not UTF-8 (byte {exc.start})")
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as exc:
            bad(f"invalid JSON ({exc.msg}, column {exc.colno})")
            continue
        if not isinstance(obj, dict):
            bad(f"not a JSON object ({type(obj).__name__})")
            continue
        i = obj.get(id_field)
        if isinstance(i, int) and not isinstance(i, bool):
            i = str(i)  # as pyarrow's int64 -> string cast writes it
        if id_field not in obj or i is None:
            bad(f"missing field {id_field!r}")
        elif not isinstance(i, str):
            bad(f"field {id_field!r} is {type(i).__name__}, not a string or integer")
        elif text_field not in obj or obj[text_field] is None:
            bad(f"missing field {text_field!r}", i)
        elif not isinstance(obj[text_field], str):
            bad(f"field {text_field!r} is {type(obj[text_field]).__name__}, not a string", i)
        elif not _utf8_ok(i) or not _utf8_ok(obj[text_field]):
            # a lone surrogate escape ("\ud800") parses but cannot be tokenized or written as UTF-8
            bad(f"field {(id_field if not _utf8_ok(i) else text_field)!r} is not valid UTF-8 (lone surrogate)",
                i if _utf8_ok(i) else None)
        else:
            out.ids.append(i)
            out.texts.append(obj[text_field])
    return out


# -- CSV ------------------------------------------------------------------------------------------

def _utf8_ok(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _read_csv(path: Path, text_field: str, id_field: str) -> Iterator[Chunk]:
    csv.field_size_limit(2**31 - 1)
    with open(path, "rb") as raw:
        fh = io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", newline="")
        reader = csv.reader(fh)
        try:
            header = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise CorpusInputError(f"{path}:1: invalid CSV header ({exc})") from None
        missing = [f for f in (id_field, text_field) if f not in header]
        if missing:
            raise CorpusInputError(f"{path}: CSV header has no column {missing[0]!r} (columns: {', '.join(header)})")
        ii, ti = header.index(id_field), header.index(text_field)
        out = Chunk([], [], fallback=False)
        prev_end = reader.line_num
        while True:
            try:
                row = next(reader)
            except StopIteration:
                break
            except csv.Error as exc:
                out.bad.append(BadRow(str(path), prev_end + 1, f"invalid CSV ({exc})", format="csv"))
                out.fallback = True
                prev_end = reader.line_num
                continue
            line, prev_end = prev_end + 1, reader.line_num
            if not row:
                continue  # blank line
            bad = lambda reason, i=None: out.bad.append(BadRow(str(path), line, reason, i, "csv"))  # noqa: E731
            if len(row) <= max(ii, ti):
                bad(f"missing field {(id_field if len(row) <= ii else text_field)!r} "
                    f"({len(row)} of {len(header)} columns)", row[ii] if len(row) > ii else None)
                out.fallback = True
            elif not _utf8_ok(row[ii]) or not _utf8_ok(row[ti]):
                bad("not UTF-8")
                out.fallback = True
            else:
                out.ids.append(row[ii])
                out.texts.append(row[ti])
            if len(out.ids) + len(out.bad) >= CSV_CHUNK_ROWS:
                yield out
                out = Chunk([], [], fallback=False)
        if out.ids or out.bad:
            yield out


# -- Parquet --------------------------------------------------------------------------------------

def _read_parquet(path: Path, text_field: str, id_field: str, row_groups: tuple[int, ...] | None = None,
                  first_row: int = 1) -> Iterator[Chunk]:
    """Rows of the file, or of its `row_groups` (whose first row is row `first_row` of the file)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise CorpusInputError(f"{path}: not a Parquet file ({exc})") from None
    schema = pf.schema_arrow
    for name in (id_field, text_field):
        if name not in schema.names:
            raise CorpusInputError(f"{path}: Parquet file has no column {name!r} (columns: {', '.join(schema.names)})")
    tt, it = schema.field(text_field).type, schema.field(id_field).type
    if not (pa.types.is_string(tt) or pa.types.is_large_string(tt)):
        raise CorpusInputError(f"{path}: column {text_field!r} is {tt}, not a string")
    if not (pa.types.is_string(it) or pa.types.is_large_string(it) or pa.types.is_integer(it)):
        raise CorpusInputError(f"{path}: column {id_field!r} is {it}, not a string or integer")
    row = first_row
    for batch in pf.iter_batches(batch_size=PARQUET_CHUNK_ROWS, row_groups=row_groups,
                                 columns=[id_field, text_field]):
        ids = pc.cast(batch.column(id_field), pa.string()).to_pylist()
        texts = batch.column(text_field).to_pylist()
        if batch.column(id_field).null_count == 0 and batch.column(text_field).null_count == 0:
            yield Chunk(ids, texts)
        else:
            out = Chunk([], [])
            for k, (i, t) in enumerate(zip(ids, texts)):
                if i is None or t is None:
                    name = id_field if i is None else text_field
                    out.bad.append(BadRow(str(path), row + k, f"missing field {name!r}", i, "parquet"))
                else:
                    out.ids.append(i)
                    out.texts.append(t)
            yield out
        row += batch.num_rows


def parquet_rows(path: Path) -> int:
    """Row count from the Parquet footer (no data read)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows
