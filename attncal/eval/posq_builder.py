"""Turn a user's own documents into a position-labelled retrieval set (FineWeb-PosQ layout).

`attncal eval --make-posq DOCS -o DIR` reads DOCS (a directory of .txt/.md
files or a JSONL file with a text field), and:

1. keeps the prose paragraphs of each document (`text.prose_blocks`) and
   splits them into sentences;
2. drops a document when most of its sentences already occur in a longer one
   (reference manuals repeat whole sections; a duplicated passage would make
   the known-item task ambiguous);
3. packs consecutive whole sentences into passages of at most the token
   budget, counted with the model's own tokenizer (special tokens included).
   Nothing is ever truncated: a sentence longer than the budget ends the
   current passage and is left out, and is counted;
4. for each passage and each third (beginning, middle, end, by character
   position) draws one sentence lying in that third, and turns it into a
   query by dropping a fixed share of its words at random, so the query is not
   a verbatim substring of the passage.  Only sentences that occur once in the
   whole set can become queries.  Every passage gets one query per third, so
   the three groups are scored on the same passages and differ only in where
   the answer sits.

Everything is determined by the inputs, the tokenizer and the seed; the
construction is recorded in `posq.json`.  The output is written to a temporary
directory and renamed into place when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ..artifact import commit_dir, looks_like_export, read_metadata
from ..modelinfo import load_model_info
from ..versions import DISTRIBUTION, installed
from .data import DataError
from .text import prose_blocks, split_sentences, words

SPAN_CLASSES = ("beginning", "middle", "end")
MANIFEST = "posq.json"
FORMAT = 1
DOC_SUFFIXES = (".txt", ".md", ".markdown", ".rst")


@dataclass
class Document:
    id: str
    text: str
    markdown: bool = False


@dataclass
class PosqOptions:
    """How passages and queries are built; every field is recorded in the manifest."""

    passage_tokens: int | None = None  # token budget per passage; None = the model's max length
    min_passage_tokens: int | None = None  # shorter passages are dropped; None = half the budget
    min_sentences: int = 3
    drop_words: float = 0.5  # share of a sentence's words removed to make its query
    min_query_words: int = 8  # sentences with fewer alphabetic words never become queries
    max_query_words: int = 60
    duplicate_doc_share: float = 0.5  # drop a document when more than this share of its sentences occurs earlier
    max_passages: int | None = None  # keep a seeded sample of at most this many passages
    seed: int = 0

    def validate(self) -> None:
        if self.passage_tokens is not None and self.passage_tokens < 8:
            raise ValueError(f"--passage-tokens must be >= 8, got {self.passage_tokens}")
        if self.min_passage_tokens is not None and self.min_passage_tokens < 1:
            raise ValueError(f"--min-passage-tokens must be >= 1, got {self.min_passage_tokens}")
        if not 0.0 <= self.drop_words < 1.0:
            raise ValueError(f"--drop-words must be in [0, 1), got {self.drop_words}")
        if self.max_passages is not None and self.max_passages < 1:
            raise ValueError(f"--max-passages must be >= 1, got {self.max_passages}")
        if self.min_sentences < 3:
            raise ValueError(f"min_sentences must be >= 3 (one query per third), got {self.min_sentences}")


@dataclass
class PosqSet:
    passages: list[dict]
    queries: list[dict]
    manifest: dict
    warnings: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- reading documents
def read_documents(path: str | os.PathLike, text_field: str = "text") -> tuple[list[Document], dict]:
    """Documents from a directory of .txt/.md/.rst files (recursive, sorted) or a JSONL file; plus a source record."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: documents not found (expected a directory of .txt/.md files or a .jsonl file)")
    h = hashlib.sha256()
    docs: list[Document] = []
    if p.is_dir() or p.suffix.lower() in DOC_SUFFIXES:
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in DOC_SUFFIXES
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not files:
                raise DataError(f"{p}: no .txt, .md or .rst files in this directory")
        else:
            files = [p]
        for f in files:
            text = _read_text(f)
            rel = f.relative_to(p).as_posix() if p.is_dir() else f.name
            h.update(rel.encode() + b"\0" + text.encode() + b"\1")
            docs.append(Document(rel, text, markdown=f.suffix.lower() in (".md", ".markdown")))
        kind = "directory" if p.is_dir() else "file"
    else:
        for lineno, line in enumerate(_read_text(p).split("\n"), 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            text = obj.get(text_field)
            if not isinstance(text, str):
                raise DataError(f"{where}: missing string field {text_field!r} (choose it with --text-field)")
            did = str(obj.get("id", obj.get("_id", f"line{lineno}")))
            h.update(did.encode() + b"\0" + text.encode() + b"\1")
            docs.append(Document(did, text, markdown=bool(obj.get("markdown", False))))
        if not docs:
            raise DataError(f"{p}: no documents (the file is empty)")
        kind = "jsonl"
    return docs, {"path": str(p), "kind": kind, "documents": len(docs), "sha256": h.hexdigest()}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror})") from None


# --------------------------------------------------------------------------- tokenizer
def load_tokenizer(model: str | os.PathLike) -> tuple[Any, int | None, str]:
    """(tokenizer, max length in tokens or None, label) of a model directory, `default`, or an export."""
    from transformers import AutoTokenizer

    if looks_like_export(model):
        meta = read_metadata(model)
        return AutoTokenizer.from_pretrained(str(model)), meta.get("max_seq_length"), str(model)
    info = load_model_info(model)
    return AutoTokenizer.from_pretrained(str(info.path)), info.max_seq_length, str(model)


def token_counts(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Tokens of each text as the encoder sees it (special tokens included), never truncated."""
    if not texts:
        return []
    enc = tokenizer(list(texts), truncation=False, verbose=False)
    return [len(ids) for ids in enc["input_ids"]]


# --------------------------------------------------------------------------- building
def _norm(sentence: str) -> str:
    return " ".join(w.lower() for w in words(sentence))


def _doc_sentences(doc: Document) -> list[str]:
    out = []
    for block in prose_blocks(doc.text, markdown=doc.markdown):
        out.extend(block[s:e] for s, e in split_sentences(block))
    return out


def _dedupe_documents(docs: list[tuple[Document, list[str]]], share: float) -> tuple[list, list[str]]:
    """Drop documents most of whose sentences occur in a longer kept document (longest first, then input order)."""
    order = sorted(range(len(docs)), key=lambda i: (-len(docs[i][1]), i))
    seen: set[str] = set()
    keep: set[int] = set()
    dropped: list[str] = []
    for i in order:
        doc, sents = docs[i]
        keys = [_norm(s) for s in sents]
        dup = sum(1 for k in keys if k in seen)
        if sents and dup / len(sents) > share:
            dropped.append(doc.id)
            continue
        keep.add(i)
        seen.update(keys)
    return [docs[i] for i in range(len(docs)) if i in keep], dropped


def _pack(sentences: list[str], counts: list[int], budget: int, specials: int) -> tuple[list[list[str]], int]:
    """Greedy packing of whole sentences into groups of estimated size <= budget; (groups, sentences too long)."""
    groups: list[list[str]] = []
    cur: list[str] = []
    size = specials
    too_long = 0
    for s, n in zip(sentences, counts):
        if n + specials > budget:
            too_long += 1
            if cur:
                groups.append(cur)
            cur, size = [], specials
            continue
        if cur and size + n > budget:
            groups.append(cur)
            cur, size = [], specials
        cur.append(s)
        size += n
    if cur:
        groups.append(cur)
    return groups, too_long


def _fit(groups: list[list[str]], tokenizer: Any, budget: int) -> tuple[list[list[str]], list[int]]:
    """Exact check with the tokenizer: move trailing sentences to the next group until each group fits."""
    out: list[list[str]] = []
    sizes: list[int] = []
    queue = [list(g) for g in groups]
    while queue:
        batch = queue[:256]
        del queue[:256]
        counts = token_counts(tokenizer, [" ".join(g) for g in batch])
        spill: list[list[str]] = []
        for g, n in zip(batch, counts):
            if n <= budget or len(g) == 1:
                out.append(g)
                sizes.append(n)
            else:  # the sentence-by-sentence estimate was short by a few tokens
                spill.append(g[:-1])
                spill.append(g[-1:])
        queue = spill + queue
    return out, sizes


def _spans(sentences: list[str]) -> list[tuple[int, int]]:
    """Character spans of the sentences in `" ".join(sentences)`."""
    spans, pos = [], 0
    for sent in sentences:
        spans.append((pos, pos + len(sent)))
        pos += len(sent) + 1
    return spans


def _query_source(sentence: str, opts: PosqOptions, sentence_count: dict[str, int]) -> bool:
    """A whole sentence (ends in . ! or ?) of a reasonable length that occurs once in the set."""
    n = len(words(sentence))
    return (opts.min_query_words <= n <= opts.max_query_words and sentence_count.get(_norm(sentence), 0) == 1
            and sentence.rstrip("\"'”’)*").endswith((".", "!", "?")))


def _thirds(text: str, spans: list[tuple[int, int]]) -> dict[str, list[int]]:
    """Sentence indices per third: sentences lying wholly inside it, else those whose centre is inside it."""
    n = len(text)
    bounds = [(0, n / 3), (n / 3, 2 * n / 3), (2 * n / 3, n)]
    out = {}
    for name, (lo, hi) in zip(SPAN_CLASSES, bounds):
        inside = [i for i, (s, e) in enumerate(spans) if s >= lo and e <= hi]
        if not inside:
            inside = [i for i, (s, e) in enumerate(spans) if lo <= (s + e) / 2 < hi or (hi == n and (s + e) / 2 == n)]
        out[name] = inside
    return out


def make_query(sentence: str, drop: float, rng: random.Random) -> str:
    """The sentence with round(drop * n) of its words removed at random (order kept, trailing punctuation off)."""
    tokens = sentence.split()
    n_drop = min(int(round(drop * len(tokens))), len(tokens) - 1)
    gone = set(rng.sample(range(len(tokens)), n_drop)) if n_drop > 0 else set()
    kept = [t for i, t in enumerate(tokens) if i not in gone]
    return " ".join(kept).rstrip(".!?;:,")


def _length_summary(sizes: Sequence[int], budget: int) -> dict:
    if not sizes:
        return {}
    q = statistics.quantiles(sizes, n=4) if len(sizes) > 1 else [sizes[0]] * 3
    step = max(budget // 8, 1)
    edges = list(range(0, budget + step, step))
    hist = {f"{a + 1}-{min(a + step, budget)}": sum(1 for s in sizes if a < s <= a + step) for a in edges[:-1]
            if a < budget}
    over = sum(1 for s in sizes if s > budget)
    if over:
        hist[f">{budget}"] = over
    return {"min": min(sizes), "p25": round(q[0], 1), "median": statistics.median(sizes), "p75": round(q[2], 1),
            "max": max(sizes), "mean": round(statistics.fmean(sizes), 1), "histogram": hist}


def build_posq(
    docs: Iterable[Document],
    tokenizer: Any,
    max_length: int | None,
    opts: PosqOptions | None = None,
    *,
    tokenizer_label: str = "",
    source: dict | None = None,
) -> PosqSet:
    """Passages, queries and the manifest; raises DataError when no usable passage can be built.

    long: the passages, the repeated-sentence filter, the cap, the queries and the manifest, in order, each a few
    lines over the previous step's lists."""
    opts = opts or PosqOptions()
    opts.validate()
    budget = opts.passage_tokens or max_length
    if budget is None:
        raise ValueError("the model declares no max length; give --passage-tokens")
    warnings: list[str] = []
    min_tokens = opts.min_passage_tokens if opts.min_passage_tokens is not None else budget // 2
    specials = len(tokenizer("", truncation=False)["input_ids"])

    per_doc = [(d, _doc_sentences(d)) for d in docs]
    n_docs = len(per_doc)
    per_doc = [(d, s) for d, s in per_doc if s]
    no_prose = n_docs - len(per_doc)
    per_doc, dup_docs = _dedupe_documents(per_doc, opts.duplicate_doc_share)

    passages: list[dict] = []
    too_long = 0
    short = 0
    for doc, sents in per_doc:
        counts = token_counts(tokenizer, sents)
        counts = [n - specials for n in counts]
        groups, tl = _pack(sents, counts, budget, specials)
        too_long += tl
        groups, sizes = _fit(groups, tokenizer, budget)
        for g, n in zip(groups, sizes):
            if n < min_tokens or len(g) < opts.min_sentences:
                short += 1
                continue
            passages.append({"id": "", "doc": doc.id, "text": " ".join(g), "tokens": n, "_sentences": g})
    if too_long:
        warnings.append(f"{too_long} sentences are longer than the {budget}-token passage budget on their own; "
                        "they were left out rather than truncated")
    if not passages:
        raise DataError(
            f"{(source or {}).get('path', 'the documents')}: no passage of {min_tokens}-{budget} tokens with at least "
            f"{opts.min_sentences} sentences could be built (documents without prose: {no_prose}, passages too "
            f"short: {short})")

    # sentences that occur more than once anywhere cannot identify one passage
    sentence_count: dict[str, int] = {}
    for p in passages:
        for sent in p["_sentences"]:
            k = _norm(sent)
            sentence_count[k] = sentence_count.get(k, 0) + 1

    if opts.max_passages is not None and len(passages) > opts.max_passages:
        picked = sorted(random.Random(f"{opts.seed}:sample").sample(range(len(passages)), opts.max_passages))
        passages = [passages[i] for i in picked]

    queries: list[dict] = []
    missing = {c: 0 for c in SPAN_CLASSES}
    used_queries: set[str] = set()
    for i, p in enumerate(passages):
        pid = p["id"] = f"p{i:05d}"
        text = p["text"]
        spans = _spans(p.pop("_sentences"))
        rng = random.Random(f"{opts.seed}:{p['doc']}:{text}")
        for cls, cand in _thirds(text, spans).items():
            ok = [j for j in cand if _query_source(text[spans[j][0]:spans[j][1]], opts, sentence_count)]
            if not ok:
                missing[cls] += 1
                continue
            j = rng.choice(ok)
            s, e = spans[j]
            q = make_query(text[s:e], opts.drop_words, rng)
            if q in used_queries:
                missing[cls] += 1
                continue
            used_queries.add(q)
            queries.append({"id": f"q{len(queries):05d}", "text": q, "passage_id": pid, "span_class": cls,
                            "span": [s, e], "position": round((s + e) / 2 / len(text), 4)})
    if not queries:
        raise DataError("no sentence could become a query (every candidate is too short, too long or repeated)")
    for cls, n in missing.items():
        if n:
            warnings.append(f"{n} passages have no usable {cls} sentence and no {cls} query")

    sizes = [p["tokens"] for p in passages]
    over = sum(1 for n in sizes if max_length is not None and n > max_length)
    if over:
        warnings.append(f"{over} of {len(passages)} passages are longer than the model's max length ({max_length} "
                        f"tokens): attncal eval will truncate them")
    per_class = {c: sum(1 for q in queries if q["span_class"] == c) for c in SPAN_CLASSES}
    manifest = {
        "format": FORMAT,
        "built_by": "attncal eval --make-posq",
        "attncal_version": installed(DISTRIBUTION),
        "source": source or {},
        "tokenizer": {"model": tokenizer_label, "max_length": max_length, "class": type(tokenizer).__name__},
        "options": asdict(opts),
        "passage_budget_tokens": budget,
        "min_passage_tokens": min_tokens,
        "construction": {
            "prose": "paragraphs that read as prose; code, grammar rules, tables and headings dropped",
            "sentences": "rule-based splitter (attncal.eval.text.split_sentences)",
            "passages": "consecutive whole sentences of one document, packed up to the token budget counted with "
                         "the model's tokenizer (special tokens included); never truncated",
            "thirds": "by character position: a sentence lying wholly inside the third, else one whose centre is",
            "queries": f"one per third per passage: a sentence occurring once in the set with "
                       f"{opts.min_query_words}-{opts.max_query_words} words, {opts.drop_words:.0%} of its words "
                       "dropped at random (seeded)",
        },
        "counts": {
            "documents": n_docs, "documents_without_prose": no_prose, "duplicate_documents_dropped": len(dup_docs),
            "passages": len(passages), "passages_too_short_dropped": short, "sentences_over_budget_dropped": too_long,
            "queries": len(queries), "queries_per_class": per_class,
            "passages_over_model_max_length": over,
        },
        "passage_tokens": _length_summary(sizes, budget),
        "warnings": warnings,
    }
    return PosqSet(passages, queries, manifest, warnings)


def write_posq(out: str | os.PathLike, posq: PosqSet, overwrite: bool = False) -> Path:
    """passages.jsonl, queries.jsonl and posq.json, written to a temp dir and renamed into place."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise FileExistsError(f"{out} exists and is not an empty directory" + ("" if not out.is_dir() else
                              "; pass --overwrite to replace it"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for name, rows in (("passages.jsonl", posq.passages), ("queries.jsonl", posq.queries)):
            with open(tmp / name, "w", encoding="utf-8") as fh:
                for row in rows:
                    fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        (tmp / MANIFEST).write_text(json.dumps(posq.manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        tmp.chmod(0o755)
        commit_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def make_posq(
    docs_path: str | os.PathLike | tuple[list[Document], dict],
    out: str | os.PathLike,
    model: str | os.PathLike = "default",
    opts: PosqOptions | None = None,
    *,
    text_field: str = "text",
    overwrite: bool = False,
    warn: Callable[[str], None] | None = None,
) -> PosqSet:
    """Read DOCS, build the set with MODEL's tokenizer and write it to OUT (see the module docstring).  DOCS is
    a path, or (documents, source) as `read_documents` and `realtext.python_reference_documents` return them."""
    opts = opts or PosqOptions()
    opts.validate()
    out_path = Path(out)
    if out_path.exists() and (not out_path.is_dir() or (any(out_path.iterdir()) and not overwrite)):
        raise FileExistsError(f"{out_path} exists and is not an empty directory; pass --overwrite to replace it")
    docs, source = docs_path if isinstance(docs_path, tuple) else read_documents(docs_path, text_field)
    tokenizer, max_length, label = load_tokenizer(model)
    posq = build_posq(docs, tokenizer, max_length, opts, tokenizer_label=label, source=source)
    write_posq(out_path, posq, overwrite=overwrite)
    for w in posq.warnings:
        (warn or _stderr)(w)
    return posq


def _stderr(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)
