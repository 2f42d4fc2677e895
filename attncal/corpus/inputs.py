"""Streaming corpus readers: JSON lines, CSV and Parquet, with bad rows located by file and line.

Why each reader is shaped as it is:

- JSON lines are cut into byte chunks at line ends and each chunk is parsed by
  `pyarrow.json` (fast path).  When pyarrow refuses a chunk (invalid JSON, a
  non-string text, mixed id types, invalid UTF-8) the chunk is re-parsed line
  by line with `json`, which names every bad line exactly.  Blank lines are
  skipped by both.
- CSV is parsed with Python's `csv` module: pyarrow's CSV reader cannot say on
  which line an invalid row was (its `InvalidRow.number` is unset), and a bad
  row must be named by its line.  CSV parsing is far faster than encoding anyway.
  A row's line is the line it starts on.
- Parquet is read by record batch with `pyarrow.parquet`; a bad row is
  reported by its 1-based row number in the file.

Every reader yields `Chunk`s of valid rows (ids as strings, texts) plus the bad
rows met on the way, so memory is bounded by the chunk size whatever the
corpus size.  Ids are written as strings: JSON integers become their decimal
form, CSV fields are kept verbatim.  Files are opened through `storage`, so a
local path and an object-storage URI are read by the same code.

Engines that read in parallel (Ray) cut each file into `Piece`s with
`plan_pieces` without reading it: JSON lines by byte ranges of the file's size
(a piece owns the lines that start in its range, so a worker finds its first
line by itself), Parquet by runs of row groups (from the footer, read by a
worker), CSV whole (a quoted field may hold line ends).  `read_piece` parses a
piece with the very functions `read_chunks` runs, so every engine keeps and
names the same rows; a JSON-lines piece after the first one of its file does
not know how many lines come before it, so it numbers its lines from 1 and
reports how many it owns (`Chunk.lines`), and the driver adds the lines of the
pieces before it (`rebase`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from .storage import GLOB_CHARS, Location, StorageError, check_bucket, expand, explain, is_uri

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet",
           ".pq": "parquet"}
JSON_CHUNK_BYTES = 8 << 20
CSV_CHUNK_ROWS = 8192
PARQUET_CHUNK_ROWS = 8192
_LINE_END_SCAN = 1 << 16  # bytes read at a time while looking for a piece's first or last line end


class CorpusInputError(ValueError):
    """The input cannot be read as a corpus (missing file, unknown format, missing column, bad rows)."""


@dataclass(frozen=True)
class InputFile:
    """One corpus file: where it is, its format, and the size and modification time its listing gave
    (the input fingerprint is made of these, so nothing is read to make it)."""

    location: Location
    format: str  # jsonl | csv | parquet
    size: int = -1
    mtime_ns: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.location, Location):
            object.__setattr__(self, "location", Location.parse(self.location))

    @property
    def path(self) -> str:
        """The name messages, the skip list and the manifest give the file: its absolute path or its URI."""
        return str(self.location)

    @property
    def name(self) -> str:
        return self.location.name


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

    @classmethod
    def from_dict(cls, d: dict, format: str = "jsonl") -> "BadRow":  # noqa: A002 - the field's name
        return cls(d["file"], d["line"], d["reason"], d.get("id"), format)


@dataclass
class Chunk:
    ids: list[str]
    texts: list[str]
    bad: list[BadRow] = field(default_factory=list)
    fallback: bool = False  # pyarrow could not parse it; rows came from the line-by-line parser
    lines: int = 0  # JSON lines: the lines (blank ones included) the chunk spans


def _format_of(loc: Location) -> str:
    suffix = os.path.splitext(loc.name)[1].lower()
    fmt = FORMATS.get(suffix)
    if fmt is None:
        raise CorpusInputError(f"input {loc}: unknown format {suffix!r} (expected .jsonl, .csv or .parquet)")
    return fmt


def resolve_inputs(inputs: str | os.PathLike | list, endpoint: str | None = None) -> list[InputFile]:
    """Files of `inputs` (a file, a directory of corpus files, a glob, or a list of those; local paths
    or URIs), in order, each with its size and modification time (listings only: nothing is opened)."""
    items = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    if not items:
        raise CorpusInputError("no input given")
    found: list[tuple[Location, int, int | None]] = []
    for item in items:
        if is_uri(item):
            found += _remote_files(str(item), endpoint)
            continue
        p = Path(item).expanduser()
        if p.is_dir():
            files = sorted(q for q in p.iterdir() if q.is_file() and q.suffix.lower() in FORMATS)
            if not files:
                raise CorpusInputError(f"input directory {p} holds no .jsonl, .csv or .parquet file")
        elif p.is_file():
            files = [p]
        elif any(ch in str(item) for ch in GLOB_CHARS):
            import glob

            files = sorted(Path(q) for q in glob.glob(str(p)) if Path(q).is_file())
            if not files:
                raise CorpusInputError(f"input pattern {item} matches no file")
        else:
            raise CorpusInputError(f"input {p} not found")
        for q in files:
            st = q.stat()
            found.append((Location.parse(q, endpoint), st.st_size, st.st_mtime_ns))
    out = [InputFile(loc, _format_of(loc), size, mtime) for loc, size, mtime in found]
    if len(set(f.path for f in out)) != len(out):
        raise CorpusInputError("the same input file is given twice")
    return out


def _remote_files(uri: str, endpoint: str | None) -> list[tuple[Location, int, int | None]]:
    loc = Location.parse(uri, endpoint)
    check_bucket(loc, "input")
    try:
        entries = expand(loc)
    except OSError as exc:
        raise explain(exc, "input", loc) from None
    if any(ch in loc.url for ch in GLOB_CHARS):
        if not entries:
            raise CorpusInputError(f"input pattern {uri} matches no file")
        return [(child, i.size, i.mtime_ns) for child, i in entries]
    if not entries:
        raise CorpusInputError(f"input {loc} not found")
    if len(entries) == 1 and entries[0][0] == loc:
        return [(loc, entries[0][1].size, entries[0][1].mtime_ns)]
    kept = [(child, i.size, i.mtime_ns) for child, i in entries
            if os.path.splitext(child.name)[1].lower() in FORMATS]
    if not kept:
        raise CorpusInputError(f"input directory {loc} holds no .jsonl, .csv or .parquet file")
    return kept


def fingerprint(files: list[InputFile]) -> str:
    """sha256 of every file's name, size and modification time, in order: what a resume compares.
    Made from listings, so the driver reads no input to make it; rewriting or replacing a file
    changes its modification time (an object store sets it on every upload)."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\0{f.size}\0{f.mtime_ns}\n".encode())
    return "sha256:" + digest.hexdigest()


def read_chunks(f: InputFile, text_field: str, id_field: str) -> Iterator[Chunk]:
    """Valid rows and bad rows of one file, chunk by chunk, in file order."""
    if f.format == "jsonl":
        return _read_jsonl(f.location, text_field, id_field)
    if f.format == "csv":
        return _read_csv(f.location, text_field, id_field)
    return _read_parquet(f.location, text_field, id_field)


@dataclass(frozen=True)
class Piece:
    """A part of one input file that a parallel reader parses on its own (see `plan_pieces`).

    `first` is the 1-based line (JSON lines: 1, counted from the piece's first line, see `rebase`)
    or row number (Parquet: the file's) of the piece's first row.  `offset`/`length`: the byte range
    whose lines the piece owns (JSON lines); `nbytes`: its share of the file's size, for progress.
    Plain data, so it travels as JSON.
    """

    path: str
    format: str  # jsonl | csv | parquet
    first: int = 1
    offset: int = 0
    length: int = -1  # -1: to the end of the file
    row_groups: tuple[int, ...] | None = None  # Parquet: these row groups; None: all
    nbytes: int = 0
    file_index: int = 0
    query: str = ""
    endpoint: str | None = None

    @property
    def location(self) -> Location:
        return Location(self.path, self.query, self.endpoint)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Piece":
        d = json.loads(text)
        if d["row_groups"] is not None:
            d["row_groups"] = tuple(d["row_groups"])
        return cls(**d)


def parquet_layout(loc: Location) -> list[int]:
    """Rows of each row group of a Parquet file, from its footer (the only bytes read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with loc.open_input_file() as fh:
            meta = pq.ParquetFile(fh).metadata
    except StorageError:
        raise
    except (pa.ArrowInvalid, OSError) as exc:
        if isinstance(exc, OSError) and "AWS Error" in str(exc):
            raise explain(exc, "input", loc) from None
        raise CorpusInputError(f"{loc}: not a Parquet file ({exc})") from None
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


def plan_pieces(f: InputFile, piece_bytes: int, layout: list[int] | None = None,
                file_index: int = 0) -> list[Piece]:
    """Pieces of `f` that together give exactly `read_chunks(f)`'s rows, in order, planned without
    reading the file (Parquet: from `layout`, the rows per row group of its footer).

    - JSON lines: byte ranges of `piece_bytes`; a piece owns the lines that start in its range.
    - Parquet: runs of row groups of about `piece_bytes` (by the file's bytes per row).
    - CSV: the whole file, one piece: a quoted field may hold line ends, so a row boundary is only
      known by parsing from the header on (`csv` is sequential).
    """
    loc = f.location
    common = dict(file_index=file_index, query=loc.query, endpoint=loc.endpoint)
    if f.format == "jsonl":
        spans = [(start, min(piece_bytes, f.size - start)) for start in range(0, f.size, piece_bytes)]
        return [Piece(loc.url, "jsonl", 1, start, n, nbytes=n, **common) for start, n in spans]
    if f.format == "parquet":
        layout = parquet_layout(loc) if layout is None else layout
        total = sum(layout)
        per_row = f.size / total if total else 0.0
        pieces, groups, first, row, counted = [], [], 1, 1, 0
        for g, n in enumerate(layout):
            groups.append(g)
            row += n
            if (row - first) * per_row >= piece_bytes or g == len(layout) - 1:
                nbytes = f.size - counted if g == len(layout) - 1 else round((row - first) * per_row)
                pieces.append(Piece(loc.url, "parquet", first, row_groups=tuple(groups), nbytes=nbytes, **common))
                groups, first, counted = [], row, counted + nbytes
        return pieces
    return [Piece(loc.url, f.format, nbytes=f.size, **common)]


def read_piece(piece: Piece, text_field: str, id_field: str) -> Iterator[Chunk]:
    """Valid rows and bad rows of one piece, chunk by chunk: the code `read_chunks` runs.  A JSON-lines
    piece numbers its lines from 1 (`rebase` gives the file's numbers) and each chunk says how many
    lines it spans."""
    loc = piece.location
    if piece.format == "jsonl":
        return _read_jsonl_piece(loc, piece.offset, piece.length, text_field, id_field)
    if piece.format == "csv":
        return _read_csv(loc, text_field, id_field)
    return _read_parquet(loc, text_field, id_field, piece.row_groups, piece.first)


def rebase(bad: list[BadRow], lines_before: int) -> list[BadRow]:
    """Bad rows of a JSON-lines piece numbered in the file: `lines_before` lines precede the piece."""
    return [BadRow(b.file, b.line + lines_before, b.reason, b.id, b.format) for b in bad]


def lines_before(piece: Piece) -> int:
    """Lines of the file before a JSON-lines piece's first line: the line ends in bytes [0, offset),
    plus the line that runs into the piece's range from before it, which belongs to an earlier piece."""
    n, last = 0, b"\n"
    with piece.location.open_input_stream() as fh:
        left = piece.offset
        while left > 0:
            block = fh.read(min(JSON_CHUNK_BYTES, left))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
            last = block[-1:]
    return n + (0 if last == b"\n" else 1)


# -- JSON lines -----------------------------------------------------------------------------------

def _byte_chunks(loc: Location, size: int) -> Iterator[tuple[int, int, bytes]]:
    """(first line number, byte offset, bytes) pieces of the file, each ending at a line end (the
    last one may lack its final newline)."""
    line, offset = 1, 0
    rest = b""
    with loc.open_input_stream() as fh:
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


def _read_jsonl(loc: Location, text_field: str, id_field: str) -> Iterator[Chunk]:
    for first_line, _, piece in _byte_chunks(loc, JSON_CHUNK_BYTES):
        yield _parse_jsonl_piece(loc, first_line, piece, text_field, id_field)


def _owned_bytes(fh, start: int, length: int) -> bytes:
    """The lines that start in bytes [start, start + length) of an open random-access file: from the
    first line start at or after `start` to the end of the line holding the range's last byte."""
    end = start + length
    pos = start
    if start > 0:
        fh.seek(start - 1)
        seen = start - 1
        while True:
            block = fh.read(_LINE_END_SCAN)
            if not block:
                return b""
            k = block.find(b"\n")
            if k >= 0:
                pos = seen + k + 1
                break
            seen += len(block)
        if pos >= end:
            return b""  # one line runs across the whole range: it belongs to an earlier piece
        fh.seek(pos)
    parts = [fh.read(end - pos)]
    if parts[0].endswith(b"\n") or len(parts[0]) < end - pos:
        return parts[0]
    while True:  # finish the last line, which started in the range
        block = fh.read(_LINE_END_SCAN)
        if not block:
            break
        k = block.find(b"\n")
        if k >= 0:
            parts.append(block[: k + 1])
            break
        parts.append(block)
    return b"".join(parts)


def _read_jsonl_piece(loc: Location, offset: int, length: int, text_field: str, id_field: str) -> Iterator[Chunk]:
    with loc.open_input_file() as fh:
        data = _owned_bytes(fh, offset, length if length >= 0 else fh.size() - offset)
    line, k = 1, 0
    while k < len(data):  # parsed in chunks of about JSON_CHUNK_BYTES, cut at line ends
        if k + JSON_CHUNK_BYTES >= len(data):
            stop = len(data)
        else:
            cut = data.rfind(b"\n", k, k + JSON_CHUNK_BYTES)
            if cut < 0:  # a line longer than a chunk
                cut = data.find(b"\n", k + JSON_CHUNK_BYTES)
            stop = len(data) if cut < 0 else cut + 1
        raw = data[k:stop]
        chunk = _parse_jsonl_piece(loc, line, raw, text_field, id_field)
        chunk.lines = raw.count(b"\n") + (0 if raw.endswith(b"\n") else 1)
        yield chunk
        line += chunk.lines
        k = stop


def _parse_jsonl_piece(path: Location, first_line: int, piece: bytes, text_field: str, id_field: str) -> Chunk:
    """Rows of a piece of whole lines: pyarrow first, line by line when pyarrow refuses it."""
    if not piece.endswith(b"\n"):
        piece += b"\n"  # the file's last line without its newline
    chunk = _jsonl_fast(path, first_line, piece, text_field, id_field)
    return chunk if chunk is not None else _jsonl_slow(path, first_line, piece, text_field, id_field)


def _jsonl_fast(path: Location, first_line: int, piece: bytes, text_field: str, id_field: str) -> Chunk | None:
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


def _jsonl_slow(path: Location, first_line: int, piece: bytes, text_field: str, id_field: str) -> Chunk:
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


def _read_csv(path: Location, text_field: str, id_field: str) -> Iterator[Chunk]:
    csv.field_size_limit(2**31 - 1)
    with path.open_input_stream() as raw:
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

def _read_parquet(loc: Location, text_field: str, id_field: str, row_groups: tuple[int, ...] | None = None,
                  first_row: int = 1) -> Iterator[Chunk]:
    """Rows of the file, or of its `row_groups` (whose first row is row `first_row` of the file)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        fh = loc.open_input_file()
        pf = pq.ParquetFile(fh)
    except (pa.ArrowInvalid, OSError) as exc:
        if isinstance(exc, OSError) and "AWS Error" in str(exc):
            raise explain(exc, "input", loc) from None
        raise CorpusInputError(f"{loc}: not a Parquet file ({exc})") from None
    with fh:
        schema = pf.schema_arrow
        for name in (id_field, text_field):
            if name not in schema.names:
                raise CorpusInputError(f"{loc}: Parquet file has no column {name!r} (columns: "
                                       f"{', '.join(schema.names)})")
        tt, it = schema.field(text_field).type, schema.field(id_field).type
        if not (pa.types.is_string(tt) or pa.types.is_large_string(tt)):
            raise CorpusInputError(f"{loc}: column {text_field!r} is {tt}, not a string")
        if not (pa.types.is_string(it) or pa.types.is_large_string(it) or pa.types.is_integer(it)):
            raise CorpusInputError(f"{loc}: column {id_field!r} is {it}, not a string or integer")
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
                        out.bad.append(BadRow(str(loc), row + k, f"missing field {name!r}", i, "parquet"))
                    else:
                        out.ids.append(i)
                        out.texts.append(t)
                yield out
            row += batch.num_rows
