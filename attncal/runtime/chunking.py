"""Chunked documents: several vectors per text, each with its chunk's character span and the window (model
call) it came from.  `Encoder.encode_chunks` runs it; `attncal encode --chunks` writes its rows.

A text is tokenized once, untruncated and without special tokens (special-token spellings inside the text are
dropped), with the tokenizer's character offsets.  Its tokens are cut into chunks of `size` tokens, or with
`by="sentence"` into whole sentences packed up to `size` tokens (a longer sentence is cut at `size`).  Nothing
is cut off: a text longer than the max length is covered by several windows.  Then, by `method`:

* **naive**: each chunk is encoded alone, as the text between its first token's start and its last token's
  end (`Encoder.encode` of that text, so exactly what encoding the chunk texts gives).  With `overlap` O, a
  chunk's text also holds the O tokens before it.  One window per chunk.
* **late** (Günther et al., "Late Chunking", arXiv 2409.04669): the text is encoded once, in windows of the
  max length; each chunk's vector is the mean of the final states of its own tokens (the template's special
  tokens, a prompt and the window's context excluded), then the model's normalisation.  A window holds whole
  chunks; each window after the first opens with the `overlap` O tokens before its first chunk, as context
  only, so each chunk is owned by exactly one window.  The rows are the export's graph's `last_hidden_state`
  output: a calibrated export gives the states of its calibrated forward.  Which rows of that forward are
  calibrated is the export's pooling's: mean pooling calibrates every valid row, so every token a chunk
  averages is a calibrated row; cls / last pooling calibrate the pooled row only (the window's first / last
  token, never inside a chunk), and the chunk's tokens see it as a key from the next layer on.
* **landmark** (an export with `--pooling lmk` or `multi-cls`): the chunks are the export's own landmark
  chunks (attncal.json's `pooling`: every G tokens, or per sentence), each window is tokenized as the landmark
  tokenizer places them, and a chunk's vector is its landmark's final state, normalised.  The landmark rows
  are exactly the rows a calibrated landmark export calibrates.

Prompts: naive chunk texts get the prompt as `Encoder.encode` gives it; late and landmark windows hold the
prompt's tokens after the template's opening tokens, as context of every window (no chunk holds them).

The windows of every text of a call are batched together, sorted by length: one model call per window, for
chunks, Matryoshka dimensions and precision alike.  Late and landmark chunk vectors are computed from the
graph's `last_hidden_state`, which every export's graph returns, or, in an export made with `--chunk-vectors`
(attncal.json's `chunk_vectors`, `attncal.exporting.chunk_vectors`), inside the graph: the call then feeds each
chunk's token span (`CHUNK_SPANS`) and reads one vector per chunk (`CHUNK_VECTORS`), already normalised, which
is how a Triton server returns chunk vectors without shipping token states (attncal.serving,
attncal.corpus.triton).  Both give the same vectors (to float32 rounding; `attncal check` compares them).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from ..artifact import pooling_of
from ..modelinfo import choose_prompt, read_prompts
from ..pooling import Pooling
from .landmarks import Template, sentence_ends
from .precision import normalise
from .tokenizer import load_tokenizer

METHODS = ("naive", "late", "landmark")
# The optional graph input and the output of an export with chunk vectors (attncal.exporting.chunk_vectors).
CHUNK_SPANS = "chunk_spans"
CHUNK_VECTORS = "chunk_embeddings"
BY = ("tokens", "sentence")
DEFAULT_SIZE = 128


class ChunkError(ValueError):
    """A text that cannot be chunked (empty, only special tokens, longer than any window): one line naming it."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"text {index}: {message}")
        self.index, self.message = index, message

    def __reduce__(self):  # raised in worker processes, received in the caller's
        return ChunkError, (self.index, self.message)


@dataclass(frozen=True)
class ChunkOptions:
    """How `encode_chunks` cuts texts: `method` (naive, late, landmark), `size` tokens per chunk (naive,
    late; landmark takes the export's), `by` tokens or sentence, `overlap` tokens (see the module docstring)."""

    method: str = "late"
    size: int | None = None
    by: str = "tokens"
    overlap: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"chunking method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.by not in BY:
            raise ValueError(f"chunks by must be one of {', '.join(BY)}, got {self.by!r}")
        if self.size is not None and (isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1):
            raise ValueError(f"chunk size must be a whole number of tokens >= 1, got {self.size!r}")
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, int) or self.overlap < 0:
            raise ValueError(f"chunk overlap must be a whole number of tokens >= 0, got {self.overlap!r}")
        if self.method == "landmark" and (self.size is not None or self.by != "tokens" or self.overlap):
            raise ValueError("landmark chunks are the export's own landmark chunks (its --lmk-every): drop the "
                             "chunk size, by and overlap")
        if self.size is not None and self.overlap >= self.size and self.method == "naive":
            raise ValueError(f"chunk overlap ({self.overlap}) must be smaller than the chunk size ({self.size})")

    def to_dict(self) -> dict:
        return {"method": self.method, "size": self.size, "by": self.by, "overlap": self.overlap}


@dataclass
class ChunkedEmbeddings:
    """The chunks of a call, one row each, texts in input order and chunks in text order: `text` (the input
    index), `chunk` (index within the text), `window` (the model call of the text it came from), `start` /
    `end` (character span in the text), `vectors` (float32 [rows, D] before `Encoder.output`)."""

    text: np.ndarray
    chunk: np.ndarray
    window: np.ndarray
    start: np.ndarray
    end: np.ndarray
    vectors: np.ndarray
    tokens: int = 0  # tokens the model ran on (windows, special tokens included)
    windows: int = 0  # model calls' rows
    errors: list = field(default_factory=list)  # (text index, one line) of the texts left out (`errors=`)

    def __len__(self) -> int:
        return len(self.text)

    def of(self, i: int) -> slice:
        """The rows of text i."""
        lo, hi = np.searchsorted(self.text, [i, i + 1])
        return slice(int(lo), int(hi))


@dataclass
class _Text:
    index: int
    text: str
    ids: list[int]
    types: list[int]
    offsets: list[tuple[int, int]]
    chunks: list[tuple[int, int]] = field(default_factory=list)  # token ranges (own tokens)


def check_options(options: ChunkOptions, budget: int | None, max_length: int | None,
                  pooling: Pooling | None) -> None:
    """ValueError (one line) for chunk options an export cannot run: `budget` content tokens per model call
    (`Chunker.budget`, None: no max length), `pooling` its pooling (an attncal.pooling.Pooling, or None)."""
    inserts = pooling is not None and pooling.inserts
    if options.method == "landmark" and not inserts:
        raise ValueError("landmark chunking needs an export with landmark pooling (attncal export --pooling lmk or "
                         "multi-cls)")
    if options.method == "late" and inserts:
        raise ValueError("this export pools landmarks: use landmark chunking (late chunking averages token states, "
                         "which a landmark export's tokenization interleaves with landmarks)")
    size = resolved_size(options, budget)
    if options.method != "landmark" and budget is not None and size + options.overlap > budget:
        raise ValueError(f"chunk size {size} + overlap {options.overlap} tokens exceed the {budget} content tokens "
                         f"of one model call (max length {max_length}, less the special tokens and the prompt)")


def resolved_size(options: ChunkOptions, budget: int | None) -> int:
    """The chunk size: the one given, else DEFAULT_SIZE or, where one model call holds fewer tokens, what it
    holds besides the overlap."""
    if options.size is not None:
        return options.size
    return DEFAULT_SIZE if budget is None else max(1, min(DEFAULT_SIZE, budget - options.overlap))


def check_export(options: ChunkOptions, export_dir, meta: dict, max_length: int | None = None) -> None:
    """`check_options` for the export at `export_dir` (attncal.json `meta`) without loading its graph: what
    `attncal encode` checks before it writes anything.  `max_length`: the run's (None: the export's)."""
    limit = max_length or meta.get("max_seq_length")
    base = load_tokenizer(Path(export_dir), meta.get("tokenizer"), limit, meta.get("padding_side", "right"))
    encode, _, _ = base.plain()
    tpl = Template.of(encode)
    prompt = choose_prompt(*read_prompts(Path(export_dir)))
    special = set(base.special_ids())
    n_prompt = len([x for x in encode([prompt], False, False)[0][0] if x not in special]) if prompt else 0
    budget = None if limit is None else limit - len(tpl.prefix) - len(tpl.suffix) - n_prompt
    check_options(options, budget, limit, pooling_of(meta))


def spans_of(positions: list[list[tuple[int, list[int]]]]) -> np.ndarray:
    """`CHUNK_SPANS` of a batch: int64 [rows, most chunks of a row, 2], each chunk's [first, last + 1) position
    in its padded row (its positions are consecutive), (0, 0) after a row's last chunk."""
    spans = np.zeros((len(positions), max((len(p) for p in positions), default=0), 2), dtype=np.int64)
    for b, row in enumerate(positions):
        for c, (_, pos) in enumerate(row):
            spans[b, c] = (pos[0], pos[-1] + 1)
    return spans


class Served(Protocol):
    """A served copy of an export that runs `Encoder.encode_chunks`' model calls (attncal.corpus.triton)."""

    def chunk_vectors(self, feeds: dict, spans: np.ndarray) -> np.ndarray:
        """`CHUNK_VECTORS` [rows, chunks, D] of one batch: its token inputs and `CHUNK_SPANS`."""

    def map(self, fn, items):
        """`fn` over `items`, results in order (several at once where the server takes them)."""

    def encode(self, texts: list[str], batch_size: int, *, prompt: str = "") -> np.ndarray:
        """`Encoder.encode` of `texts` (naive chunks), float32 [N, D]."""


class Chunker:
    """An Encoder's chunking: its tokenizer's plain encodings and template, its max length."""

    def __init__(self, encoder) -> None:
        base = getattr(encoder._tokenizer, "base", encoder._tokenizer)
        self.encoder = encoder
        self._encode, _, _ = base.plain()
        self.template = Template.of(self._encode)
        self.special = set(base.special_ids()) | set(self.template.prefix) | set(self.template.suffix)
        if base.pad_id is not None:
            self.special.add(base.pad_id)
        self.pad_id = base.pad_id

    # -- tokens and chunks -------------------------------------------------------------------------

    def _plain(self, texts: list[str], add_special_tokens: bool, offsets: bool) -> list:
        with self.encoder._tokenizer_lock:  # HF fast tokenizers are not safe to call concurrently
            return self._encode(texts, add_special_tokens, offsets)

    def _texts(self, texts: Sequence[str]) -> list[_Text]:
        out = []
        for i, (text, (ids, types, offsets)) in enumerate(zip(texts, self._plain(list(texts), False, True))):
            if not text.strip():
                raise ChunkError(i, "is empty")
            keep = [k for k, t in enumerate(ids) if t not in self.special]
            if not keep:
                raise ChunkError(i, "holds only special tokens")
            out.append(_Text(i, text, [ids[k] for k in keep], [types[k] for k in keep],
                             [tuple(offsets[k]) for k in keep]))
        return out

    def _cut(self, t: _Text, size: int | None, by: str) -> list[tuple[int, int]]:
        """Token ranges of the chunks: `size` tokens each, or whole sentences packed up to `size` tokens
        (a sentence per chunk where `size` is None)."""
        n = len(t.ids)
        if by == "tokens":
            return [(a, min(a + size, n)) for a in range(0, n, size)]
        bounds = sentence_ends(t.text)
        sent = [bisect.bisect_right(bounds, start) for start, _ in t.offsets]
        sentences, a = [], 0
        for k in range(1, n + 1):
            if k == n or sent[k] != sent[k - 1]:
                sentences.append((a, k))
                a = k
        chunks: list[tuple[int, int]] = []
        for a, b in sentences:
            if size is None:
                chunks.append((a, b))
                continue
            while b - a > size:  # a sentence longer than a chunk is cut
                chunks.append((a, a + size))
                a += size
            if chunks and chunks[-1][1] == a and b - chunks[-1][0] <= size:
                chunks[-1] = (chunks[-1][0], b)  # packed with the sentences before it
            else:
                chunks.append((a, b))
        return chunks

    def _span(self, t: _Text, a: int, b: int) -> tuple[int, int]:
        return int(t.offsets[a][0]), int(t.offsets[b - 1][1])

    def budget(self, prompt_ids: Sequence[int]) -> int | None:
        """Content tokens one window holds (None: no max length)."""
        limit = self.encoder.max_length
        if limit is None:
            return None
        return limit - len(self.template.prefix) - len(self.template.suffix) - len(prompt_ids)

    # -- running ------------------------------------------------------------------------------------

    def run(self, texts: Sequence[str], options: ChunkOptions, batch_size: int, prompt: str | None,
            errors: list | None = None, in_graph: bool | None = None, served=None) -> ChunkedEmbeddings:
        """The chunks of `texts` (see the module docstring).  A text that cannot be chunked raises its
        ChunkError, or, with `errors` given, is appended there (index, message) and left out.  `in_graph`: late
        and landmark vectors from the graph's chunk-vector output (True, refused where the export has none),
        from its token states (False), or the first where the export has it (None).  `served`: a served copy of
        the export (`Served`) that runs the model calls instead of the Encoder's session."""
        pooling = self.encoder.pooling
        prompt_ids = self._prompt_ids(prompt)
        budget = self.budget(prompt_ids)
        check_options(options, budget, self.encoder.max_length, pooling)
        if options.method == "naive":
            return self._naive(texts, options, batch_size, prompt, errors, served)
        self._check_head()
        has = self.encoder.has_chunk_vectors
        if (in_graph or served is not None) and not has:
            raise ValueError("this export has no chunk-vector output (export it with --chunk-vectors)")
        in_graph = has if in_graph is None else bool(in_graph)
        rows, owners = [], []  # rows: (ids, types) of each window; owners: (text, window, chunks, positions)
        for t in self._guarded(texts, errors):
            try:
                if options.method == "late":
                    windows = self._late_windows(t, options, budget)
                else:
                    windows = self._landmark_windows(t, pooling, budget)
            except ChunkError as exc:
                if errors is None:
                    raise
                errors.append((t.index, str(exc)))
                continue
            for w, (ids, types, chunk_positions) in enumerate(windows):
                rows.append((ids, types))
                owners.append((t, w, chunk_positions))
        return self._forward(rows, owners, batch_size, prompt_ids, options.method, in_graph, served)

    def _guarded(self, texts, errors):
        if errors is None:
            yield from self._texts(texts)
            return
        for i, text in enumerate(texts):
            try:
                (t,) = self._texts([text])
            except ChunkError as exc:
                errors.append((i, str(ChunkError(i, exc.message))))
                continue
            t.index = i
            yield t

    def _check_head(self) -> None:
        hidden = self.encoder.session.get_outputs()[0].shape[-1]
        if isinstance(hidden, int) and hidden != self.encoder.dimension:
            raise ValueError(f"this model projects its pooled embedding ({hidden} -> {self.encoder.dimension} "
                             "dimensions, a Dense head): its token states are not in the embedding space, so late "
                             "and landmark chunking do not apply; use naive chunking")

    def _prompt_ids(self, prompt: str | None) -> list[int]:
        if not prompt:
            return []
        (ids, _, _), = self._plain([prompt], False, False)
        return [x for x in ids if x not in self.special]

    def _late_windows(self, t: _Text, options: ChunkOptions, budget: int | None):
        t.chunks = chunks = self._cut(t, resolved_size(options, budget), options.by)
        out, c = [], 0
        while c < len(chunks):
            ctx = max(0, chunks[c][0] - options.overlap) if out else 0
            e = c
            while e < len(chunks) and (budget is None or chunks[e][1] - ctx <= budget):
                e += 1
            if e == c:  # cannot happen with size + overlap <= budget; kept as a guard
                raise ChunkError(t.index, f"chunk {c} does not fit a window of {budget} tokens")
            lo, hi = ctx, chunks[e - 1][1]
            positions = [(k, list(range(chunks[k][0] - lo, chunks[k][1] - lo))) for k in range(c, e)]
            out.append((t.ids[lo:hi], t.types[lo:hi], positions))
            c = e
        return out

    def _landmark_windows(self, t: _Text, pooling: Pooling, budget: int | None):
        tid = pooling.token_id
        keep = [k for k, x in enumerate(t.ids) if x != tid]
        t.ids, t.types, t.offsets = [t.ids[k] for k in keep], [t.types[k] for k in keep], [t.offsets[k] for k in keep]
        if not t.ids:
            raise ChunkError(t.index, "holds only special tokens")
        t.chunks = chunks = self._cut(t, None if pooling.by_sentence else int(pooling.every),
                                      "sentence" if pooling.by_sentence else "tokens")
        tpl = self.template
        served = (tpl.suffix[:1] == (tid,)) if pooling.kind == "lmk" else (tpl.prefix[-1:] == (tid,))
        out, c = [], 0
        while c < len(chunks):
            e, used = c, 0
            while e < len(chunks):
                cost = used + (chunks[e][1] - chunks[e][0]) + 1
                if budget is not None and cost - served > budget:
                    break
                used, e = cost, e + 1
            if e == c:
                raise ChunkError(t.index, f"landmark chunk {c} ({chunks[c][1] - chunks[c][0]} tokens) is longer "
                                          f"than a window ({budget} tokens with its landmark)")
            ids, types, positions = [], [], []
            ct = tpl.content_type
            for k in range(c, e):
                a, b = chunks[k]
                before = pooling.kind == "multi-cls" and not (k == c and served)
                after = pooling.kind == "lmk" and not (k == e - 1 and served)
                if before:
                    positions.append((k, [len(ids)]))
                    ids.append(tid)
                    types.append(ct)
                elif pooling.kind == "multi-cls":  # the template's own opening token is this chunk's landmark
                    positions.append((k, [-1]))
                ids += t.ids[a:b]
                types += t.types[a:b]
                if after:
                    positions.append((k, [len(ids)]))
                    ids.append(tid)
                    types.append(ct)
                elif pooling.kind == "lmk":  # the template's closing token is this chunk's landmark
                    positions.append((k, [len(ids)]))
            out.append((ids, types, positions))
            c = e
        return out

    def _forward(self, rows, owners, batch_size, prompt_ids, method, in_graph, served) -> ChunkedEmbeddings:
        enc, tpl = self.encoder, self.template
        pre_ids = list(tpl.prefix) + list(prompt_ids)
        pre_types = list(tpl.prefix_types) + [tpl.content_type] * len(prompt_ids)
        full = [(pre_ids + ids + list(tpl.suffix), pre_types + types + list(tpl.suffix_types)) for ids, types in rows]
        order = sorted(range(len(full)), key=lambda r: -len(full[r][0]))
        batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]

        def positions(idx, starts):
            """Each row's chunks: (chunk index, its token positions in the padded row)."""
            out = []
            for b, r in enumerate(idx):
                t, w, chunk_positions = owners[r]
                off = starts[b] + len(pre_ids)
                out.append([(k, [off - len(prompt_ids) - 1] if pos == [-1]  # multi-cls: the template's opening token
                             else [off + p for p in pos] if method == "late" else [off + pos[0]])
                            for k, pos in chunk_positions])
            return out

        def prepared():
            for idx in batches:
                feeds, starts = self._pad([full[r] for r in idx])
                yield idx, {n: feeds[n] for n in enc.input_names}, positions(idx, starts)

        records: list[tuple[int, int, int, int, int, np.ndarray]] = []  # text, chunk, window, start, end, vec
        tokens = 0
        if served is not None:  # the server takes several batches at once
            items = list(prepared())
            results = zip(items, served.map(lambda item: served.chunk_vectors(item[1], spans_of(item[2])), items))
        elif in_graph:
            results = ((item, enc.run_chunks(item[1], spans_of(item[2]))) for item in prepared())
        else:
            results = ((item, enc.run(item[1])[0]) for item in prepared())
        for (idx, feeds, pos), out in results:
            tokens += int(feeds["attention_mask"].sum())
            for b, r in enumerate(idx):
                t, w, _ = owners[r]
                for c, (k, p) in enumerate(pos[b]):
                    vec = out[b, c] if in_graph else out[b, p].astype(np.float32).mean(0)
                    a, bb = t.chunks[k]
                    records.append((t.index, k, w, *self._span(t, a, bb), vec))
        return self._collect(records, tokens, len(full), normalised=in_graph)

    def _collect(self, records, tokens: int, windows: int, normalised: bool = False) -> ChunkedEmbeddings:
        records.sort(key=lambda r: (r[0], r[1]))
        dim = self.encoder.dimension
        vectors = np.stack([r[5] for r in records]).astype(np.float32) if records else np.zeros((0, dim), np.float32)
        if self.encoder.normalize and len(vectors) and not normalised:  # the graph's chunk vectors are normalised
            vectors = normalise(vectors)
        cols = [np.array([r[j] for r in records], dtype=np.int64) for j in range(5)]
        return ChunkedEmbeddings(*cols, vectors=vectors, tokens=tokens, windows=windows)

    def _pad(self, rows):
        width = max(len(ids) for ids, _ in rows)
        left = self.encoder.padding_side == "left"
        n = len(rows)
        out = {"input_ids": np.full((n, width), self.pad_id if self.pad_id is not None else 0, dtype=np.int64),
               "token_type_ids": np.zeros((n, width), dtype=np.int64),
               "attention_mask": np.zeros((n, width), dtype=np.int64)}
        starts = []
        for i, (ids, types) in enumerate(rows):
            s = width - len(ids) if left else 0
            out["input_ids"][i, s:s + len(ids)] = ids
            out["token_type_ids"][i, s:s + len(ids)] = types
            out["attention_mask"][i, s:s + len(ids)] = 1
            starts.append(s)
        return out, starts

    def _naive(self, texts, options, batch_size, prompt, errors, served=None) -> ChunkedEmbeddings:
        size = resolved_size(options, self.budget(self._prompt_ids(prompt)))
        pieces, meta = [], []
        for t in self._guarded(texts, errors):
            t.chunks = self._cut(t, size, options.by)
            for k, (a, b) in enumerate(t.chunks):
                s, e = self._span(t, max(0, a - options.overlap), b)
                pieces.append(t.text[s:e])
                meta.append((t.index, k, k, s, e))
        if pieces and self.encoder.max_length is not None:  # a chunk's own text may tokenize otherwise
            n_prompt, limit = len(self._prompt_ids(prompt)), self.encoder.max_length
            failed: set[int] = set()
            for (ids, _, _), m in zip(self._plain(pieces, True, False), meta):
                if len(ids) + n_prompt > limit and m[0] not in failed:
                    exc = ChunkError(m[0], f"chunk {m[1]} tokenizes to {len(ids)} tokens on its own, more than the max "
                                           f"length {limit}; use a smaller chunk size")
                    if errors is None:
                        raise exc
                    errors.append((m[0], str(exc)))
                    failed.add(m[0])
            keep = [j for j, m in enumerate(meta) if m[0] not in failed]
            pieces, meta = [pieces[j] for j in keep], [meta[j] for j in keep]
        encode = served.encode if served is not None else self.encoder.encode
        vectors = (encode(pieces, batch_size, prompt=prompt or "") if pieces
                   else np.zeros((0, self.encoder.dimension), np.float32))
        lengths = self.encoder.token_lengths(pieces) if pieces else []
        cols = [np.array([m[j] for m in meta], dtype=np.int64) for j in range(5)]
        return ChunkedEmbeddings(*cols, vectors=vectors, tokens=int(sum(lengths)), windows=len(pieces))
