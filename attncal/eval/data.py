"""Position-labelled retrieval data read from local files (nothing is downloaded).

Two layouts are accepted; `load_dataset` tells them apart by file name.

FineWeb-PosQ layout (what `attncal eval --make-synthetic` writes)
    passages.jsonl   one object a line: {"id": str, "text": str}
    queries.jsonl    one object a line: {"id": str, "text": str, "passage_id": str,
                     "span_class": "beginning" | "middle" | "end"}
  or, the flat form of the published FineWeb-PosQ rows:
    posq.jsonl       {"question": str, "content": str, "span_class": str | [str, ...]}
                     (passages are deduplicated by content; a row whose span_class
                     list names more than one class is skipped and counted)

PosIR / BEIR layout
    corpus.jsonl     {"_id": str, "text": str, "title": str (optional)}
    queries.jsonl    {"_id": str, "text": str, "position": float in [0, 1] (optional here)}
    qrels/<split>.tsv  tab-separated "query-id  corpus-id  score" (a header line is allowed);
                     score > 0 is relevant (binary relevance)
    positions.tsv    optional: "query-id  position"; needed for queries without "position"
  The position is the relative position of the relevant span in its document;
  it is grouped into `n_groups` equal-width groups (default thirds: begin, middle, end).

Every problem is reported as a `DataError` naming the file and, where there is
one, the line, so that a user can fix the file instead of guessing.
"""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

SPAN_CLASSES = {"beginning": "begin", "begin": "begin", "start": "begin", "middle": "middle", "mid": "middle",
                "end": "end"}
THIRDS = ("begin", "middle", "end")


class DataError(ValueError):
    """A data file is missing or malformed; the message names the file (and line)."""


@dataclass
class Dataset:
    """Corpus, queries, binary qrels and a position group per query."""

    name: str
    layout: str
    corpus: dict[str, str]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    group: dict[str, str]  # query id -> position group name
    groups: tuple[str, ...]  # group names in display order
    notes: list[str] = field(default_factory=list)

    def fingerprint(self) -> str:
        """A hash of the corpus (ids and texts, in order): part of the encode-cache key."""
        h = hashlib.sha256()
        for did, text in self.corpus.items():
            h.update(did.encode())
            h.update(b"\0")
            h.update(text.encode())
            h.update(b"\1")
        return h.hexdigest()[:16]

    def query_ids(self) -> list[str]:
        return [q for q in self.queries if q in self.qrels and q in self.group]


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def _field(obj: dict, names: tuple[str, ...], where: str, kind: type = str) -> Any:
    for n in names:
        if n in obj and obj[n] is not None:
            value = obj[n]
            if kind is str:
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    value = str(value)
                if not isinstance(value, str):
                    raise DataError(f"{where}: field {n!r} must be a string, got {type(value).__name__}")
            return value
    raise DataError(f"{where}: missing field {' or '.join(repr(n) for n in names)}")


def _span_class(value: Any, where: str) -> str:
    key = str(value).strip().lower()
    if key not in SPAN_CLASSES:
        raise DataError(f"{where}: span_class {value!r} is not one of beginning, middle, end")
    return SPAN_CLASSES[key]


def position_group(pos: float, n_groups: int) -> int:
    """Index of the equal-width group of [0, 1] that holds `pos` (1.0 falls in the last)."""
    return min(int(pos * n_groups), n_groups - 1)


def group_names(n_groups: int) -> tuple[str, ...]:
    if n_groups == 3:
        return THIRDS
    return tuple(f"g{i + 1}of{n_groups}" for i in range(n_groups))


# --------------------------------------------------------------------------- FineWeb-PosQ
def _load_posq_split(root: Path) -> Dataset:
    corpus: dict[str, str] = {}
    p_file = root / "passages.jsonl"
    for lineno, obj in _read_jsonl(p_file):
        where = f"{p_file}:{lineno}"
        pid = _field(obj, ("id", "_id", "passage_id"), where)
        if pid in corpus:
            raise DataError(f"{where}: duplicate passage id {pid!r}")
        corpus[pid] = _field(obj, ("text", "content"), where)
    queries: dict[str, str] = {}
    qrels: dict[str, dict[str, int]] = {}
    group: dict[str, str] = {}
    q_file = root / "queries.jsonl"
    for lineno, obj in _read_jsonl(q_file):
        where = f"{q_file}:{lineno}"
        qid = _field(obj, ("id", "_id", "query_id"), where)
        if qid in queries:
            raise DataError(f"{where}: duplicate query id {qid!r}")
        queries[qid] = _field(obj, ("text", "question", "query"), where)
        pid = _field(obj, ("passage_id", "positive_id"), where)
        if pid not in corpus:
            raise DataError(f"{where}: passage_id {pid!r} is not in {p_file.name}")
        qrels[qid] = {pid: 1}
        group[qid] = _span_class(_field(obj, ("span_class",), where, kind=object), where)
    _require_nonempty(corpus, p_file, queries, q_file)
    return Dataset(root.name, "fineweb-posq", corpus, queries, qrels, group, THIRDS)


def _load_posq_flat(root: Path) -> Dataset:
    path = root / "posq.jsonl"
    corpus: dict[str, str] = {}
    by_text: dict[str, str] = {}
    queries, qrels, group = {}, {}, {}
    skipped = 0
    for lineno, obj in _read_jsonl(path):
        where = f"{path}:{lineno}"
        question = _field(obj, ("question",), where)
        content = _field(obj, ("content",), where)
        raw = _field(obj, ("span_class",), where, kind=object)
        classes = {_span_class(c, where) for c in (raw if isinstance(raw, list) else [raw])}
        if len(classes) != 1:
            skipped += 1
            continue
        pid = by_text.get(content)
        if pid is None:
            pid = by_text[content] = f"p{len(corpus)}"
            corpus[pid] = content
        qid = f"q{lineno}"
        queries[qid], qrels[qid], group[qid] = question, {pid: 1}, classes.pop()
    _require_nonempty(corpus, path, queries, path)
    notes = [f"{skipped} rows of {path.name} skipped: their span_class names more than one class"] if skipped else []
    return Dataset(root.name, "fineweb-posq-flat", corpus, queries, qrels, group, THIRDS, notes)


# --------------------------------------------------------------------------- PosIR / BEIR
def _read_tsv(path: Path, n_cols: int) -> Iterator[tuple[int, list[str]]]:
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with open(path, encoding="utf-8", newline="") as fh:
        for lineno, row in enumerate(csv.reader(fh, delimiter="\t"), 1):
            if not row or not "".join(row).strip():
                continue
            if len(row) < n_cols:
                raise DataError(f"{path}:{lineno}: expected {n_cols} tab-separated columns, got {len(row)}")
            yield lineno, [c.strip() for c in row]


def _as_position(value: Any, where: str) -> float:
    try:
        pos = float(value)
    except (TypeError, ValueError):
        raise DataError(f"{where}: position {value!r} is not a number") from None
    if not 0.0 <= pos <= 1.0:
        raise DataError(f"{where}: position {pos} is outside [0, 1]")
    return pos


def read_beir(root: Path, split: str) -> tuple[dict[str, str], dict[str, str], dict[str, float],
                                                 dict[str, dict[str, int]]]:
    """(corpus, queries, positions, qrels) of a BEIR-layout directory, every id cross-checked.

    A document's title, when present, is prefixed to its text; `positions` holds the queries that give one
    (in queries.jsonl or positions.tsv) and may be empty; `qrels` keeps the relevant (score > 0) pairs."""
    c_file = root / "corpus.jsonl"
    corpus: dict[str, str] = {}
    for lineno, obj in _read_jsonl(c_file):
        where = f"{c_file}:{lineno}"
        did = _field(obj, ("_id", "id"), where)
        if did in corpus:
            raise DataError(f"{where}: duplicate document id {did!r}")
        text = _field(obj, ("text",), where)
        title = obj.get("title") or ""
        corpus[did] = f"{title}. {text}" if title else text
    q_file = root / "queries.jsonl"
    queries: dict[str, str] = {}
    positions: dict[str, float] = {}
    for lineno, obj in _read_jsonl(q_file):
        where = f"{q_file}:{lineno}"
        qid = _field(obj, ("_id", "id"), where)
        if qid in queries:
            raise DataError(f"{where}: duplicate query id {qid!r}")
        queries[qid] = _field(obj, ("text",), where)
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        pos = obj.get("position", meta.get("position"))
        if pos is not None:
            positions[qid] = _as_position(pos, where)
    p_file = root / "positions.tsv"
    if p_file.exists():
        for lineno, (qid, pos, *_) in _read_tsv(p_file, 2):
            if lineno == 1 and pos.lower() == "position":
                continue
            if qid not in queries:
                raise DataError(f"{p_file}:{lineno}: query id {qid!r} is not in {q_file.name}")
            positions[qid] = _as_position(pos, f"{p_file}:{lineno}")
    r_file = root / "qrels" / f"{split}.tsv"
    qrels: dict[str, dict[str, int]] = {}
    for lineno, (qid, did, score, *_) in _read_tsv(r_file, 3):
        try:
            rel = int(float(score))
        except ValueError:
            if lineno == 1:  # header line
                continue
            raise DataError(f"{r_file}:{lineno}: score {score!r} is not a number") from None
        if qid not in queries:
            raise DataError(f"{r_file}:{lineno}: query id {qid!r} is not in {q_file.name}")
        if did not in corpus:
            raise DataError(f"{r_file}:{lineno}: corpus id {did!r} is not in {c_file.name}")
        if rel > 0:
            qrels.setdefault(qid, {})[did] = 1
    _require_nonempty(corpus, c_file, queries, q_file)
    if not qrels:
        raise DataError(f"{r_file}: no relevant (score > 0) query-document pairs")
    return corpus, queries, positions, qrels


def _load_beir(root: Path, split: str, n_groups: int) -> Dataset:
    corpus, queries, positions, qrels = read_beir(root, split)
    missing = [q for q in qrels if q not in positions]
    if missing:
        raise DataError(
            f"{root / 'queries.jsonl'}: {len(missing)} judged queries have no relative position "
            f"(first: {missing[0]!r}); give each a \"position\" in [0, 1] or list them in positions.tsv"
        )
    names = group_names(n_groups)
    group = {q: names[position_group(positions[q], n_groups)] for q in qrels}
    ds = Dataset(root.name, "beir", corpus, queries, qrels, group, names)
    unjudged = len(queries) - len(qrels)
    if unjudged:
        ds.notes.append(f"{unjudged} queries without relevant documents in qrels/{split}.tsv are not evaluated")
    return ds


def _require_nonempty(corpus: dict, c_file: Path, queries: dict, q_file: Path) -> None:
    if not corpus:
        raise DataError(f"{c_file}: no documents")
    if not queries:
        raise DataError(f"{q_file}: no queries")


def load_dataset(path: str | Path, *, split: str = "test", n_groups: int = 3) -> Dataset:
    """Load a dataset directory in either layout (see the module docstring)."""
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"{root}: data directory not found")
    if n_groups < 2:
        raise DataError(f"position groups must be >= 2, got {n_groups}")
    if (root / "corpus.jsonl").exists():
        return _load_beir(root, split, n_groups)
    if n_groups != 3:
        raise DataError(f"{root}: FineWeb-PosQ data has exactly three span classes; --position-groups must be 3")
    if (root / "passages.jsonl").exists():
        return _load_posq_split(root)
    if (root / "posq.jsonl").exists():
        return _load_posq_flat(root)
    raise DataError(
        f"{root}: no corpus.jsonl (PosIR/BEIR layout), passages.jsonl + queries.jsonl or posq.jsonl "
        "(FineWeb-PosQ layout)"
    )
