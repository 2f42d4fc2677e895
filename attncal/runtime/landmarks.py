"""Where the landmark tokens of lmk / multi-cls pooling go when a text is tokenized: the one place that says it.

* **lmk** (Doshi et al., "LMK > CLS: Landmark Pooling for Dense Embeddings", arXiv 2601.21525): a landmark
  token (the model's SEP by default) closes every chunk of the text; the embedding is the mean of the final
  states at the landmark positions.
* **multi-cls** (the bge-m3 paper's baseline, arXiv 2402.03216): a CLS token opens every chunk; the mean of the
  CLS states.
* **mean-every** (Mean@k): the mean of every k-th valid token's final state; nothing is inserted.

The pooling and its parameters are an `attncal.pooling.Pooling`.  The exported graph pools where
`input_ids == token id` AND `attention_mask` (mean-every: every k-th valid position), the rows
`Pooling.row_mask` selects and calibration calibrates.  So the graph takes the same inputs as any export, and
the tokenization is what has to be the same everywhere: it is made here only.  `Landmarks` turns a tokenizer's
plain encodings into the landmark sequences for `Encoder` (either tokenizer backend), the Triton tokenizer model
(which loads a copy of this file and of attncal/pooling.py: hence this module imports nothing but the standard
library and numpy, and reads the pooling through its attributes only), `attncal encode` and the evaluation.

The rules (docs/pooling.md gives them with their reasons): the content is cut into chunks of G tokens or of one
sentence (one chunk at least); lmk closes each chunk with the landmark, multi-cls opens it, and where the model's
template already has the token in that place, that token is the chunk's landmark; the landmarks count against
the max length (the content is truncated on the tokenizer's truncation side); a landmark token spelled in the
text is dropped from the content; a prompt is content; padding goes on the export's side.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

if TYPE_CHECKING:  # the Triton tokenizer model's copy runs without the attncal package
    from ..pooling import Pooling

_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f]+[\"'\u201d\u2019)\]]*(?=\s|$)|\n[ \t]*\n")

# encode(texts, add_special_tokens, with_offsets) -> per text (ids, type_ids, offsets or None), untruncated.
EncodeFn = Callable[[Sequence[str], bool, bool], list]


def _err(message: str) -> ValueError:
    return ValueError(f"invalid pooling: {message}")


def sentence_ends(text: str) -> list[int]:
    """Character offsets where a sentence of `text` ends (the heuristic splitter of sentence chunking)."""
    return [m.end() for m in _SENTENCE_END.finditer(text)]


def tokenizers_encode(tokenizer) -> EncodeFn:
    """`EncodeFn` of a `tokenizers.Tokenizer` that neither truncates nor pads."""
    def encode(texts, add_special_tokens, with_offsets):
        return [(e.ids, e.type_ids, e.offsets if with_offsets else None)
                for e in tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
    return encode


def transformers_encode(tokenizer) -> EncodeFn:
    """`EncodeFn` of a transformers tokenizer (offsets, for sentence chunking, need a fast one)."""
    def encode(texts, add_special_tokens, with_offsets):
        out = tokenizer(list(texts), add_special_tokens=add_special_tokens, truncation=False, padding=False,
                        return_token_type_ids=True, return_offsets_mapping=with_offsets, verbose=False)
        types = out.get("token_type_ids") or [[0] * len(ids) for ids in out["input_ids"]]
        offsets = out["offset_mapping"] if with_offsets else [None] * len(out["input_ids"])
        return list(zip(out["input_ids"], types, offsets))
    return encode


@dataclass(frozen=True)
class Template:
    """The special tokens a tokenizer puts around one text (BERT: [CLS] before, [SEP] after)."""

    prefix: tuple[int, ...]
    prefix_types: tuple[int, ...]
    suffix: tuple[int, ...]
    suffix_types: tuple[int, ...]
    content_type: int

    @classmethod
    def of(cls, encode: EncodeFn) -> "Template":
        (full, full_types, _), = encode(["a"], True, False)
        (plain, _, _), = encode(["a"], False, False)
        n = len(plain)
        for i in range(len(full) - n + 1):
            if list(full[i:i + n]) == list(plain):
                return cls(tuple(full[:i]), tuple(full_types[:i]), tuple(full[i + n:]), tuple(full_types[i + n:]),
                           int(full_types[i]) if n else 0)
        raise _err("the tokenizer's template does not hold the text's own tokens; landmarks cannot be placed")


class Landmarks:
    """A tokenizer with landmark insertion (or, for mean-every, plain tokenization): `__call__` gives the int64
    input_ids, token_type_ids and attention_mask of a batch, padded on `padding_side` to the longest row (or
    `pad_to`); `token_lengths` each text's row length.  `max_length` (None: no limit) and `padding_side` may be
    changed between calls."""

    def __init__(self, pooling: Pooling, encode: EncodeFn, *, max_length: int | None, pad_id: int | None,
                 padding_side: str = "right", truncation_side: str = "right") -> None:
        if not pooling.resolved or not pooling.row_set:
            raise _err(f"{pooling.kind} is not a row-set pooling with its landmark token resolved (Pooling.resolve)")
        self.pooling = pooling
        self._encode = encode
        self.template = Template.of(encode)
        self.max_length = max_length
        self.pad_id = pad_id
        self.padding_side = padding_side
        self.truncation_side = truncation_side

    def rows(self, texts: Sequence[str]) -> list[tuple[list[int], list[int]]]:
        """(ids, type ids) of each text, unpadded."""
        sentences = self.pooling.by_sentence
        return [self._place(ids, types, offsets, text)
                for (ids, types, offsets), text in zip(self._encode(list(texts), False, sentences), texts)]

    def token_lengths(self, texts: Sequence[str]) -> list[int]:
        return [len(ids) for ids, _ in self.rows(texts)]

    def __call__(self, texts: Sequence[str], pad_to: int | None = None) -> dict[str, np.ndarray]:
        if self.pad_id is None:
            raise ValueError("the tokenizer has no padding token, so a batch cannot be padded")
        rows = self.rows(texts)
        width = max([len(ids) for ids, _ in rows] + [pad_to or 0])
        out = {n: np.zeros((len(rows), width), dtype=np.int64) for n in ("input_ids", "token_type_ids",
                                                                         "attention_mask")}
        out["input_ids"].fill(self.pad_id)
        for i, (ids, types) in enumerate(rows):
            cols = slice(width - len(ids), width) if self.padding_side == "left" else slice(0, len(ids))
            out["input_ids"][i, cols] = ids
            out["token_type_ids"][i, cols] = types
            out["attention_mask"][i, cols] = 1
        return out

    def _place(self, ids, types, offsets, text: str) -> tuple[list[int], list[int]]:
        sentence = None
        if self.pooling.inserts and self.pooling.by_sentence:  # a token's sentence: the ends at or before its start
            bounds = sentence_ends(text)
            sentence = [bisect.bisect_right(bounds, start) for start, _ in offsets]
        return place(ids, types, sentence, self.pooling, self.template, self.max_length, self.truncation_side)


EMPTY_TEMPLATE = Template((), (), (), (), 0)


def place(ids: Sequence[int], types: Sequence[int], sentence: Sequence[int] | None, pooling: Pooling,
          template: Template = EMPTY_TEMPLATE, max_length: int | None = None,
          truncation_side: str = "right") -> tuple[list[int], list[int]]:
    """(ids, type ids) of one text's row: its content tokens `ids` (no special tokens; `sentence`: each one's
    sentence number, for sentence chunking) truncated to fit `max_length` with the template and the landmarks,
    the landmarks placed, the template around (the module docstring's rules)."""
    t, tid = template, pooling.token_id
    if pooling.inserts:  # a landmark spelled in the text is not a landmark
        keep = [i for i, x in enumerate(ids) if x != tid]
        ids, types = [ids[i] for i in keep], [types[i] for i in keep]
        sentence = [sentence[i] for i in keep] if sentence is not None else None
    ids, types = list(ids), list(types)
    left = truncation_side == "left"
    served = (t.suffix[:1] == (tid,)) if pooling.kind == "lmk" else (t.prefix[-1:] == (tid,))

    def kept(k: int) -> slice:
        return slice(len(ids) - k, len(ids)) if left else slice(0, k)

    def chunk_ends(k: int) -> list[int]:
        """Where the chunks of the `k` kept tokens end (exclusive; the last at k; one chunk at least)."""
        if sentence is None:
            g = int(pooling.every)
            return list(range(g, k, g)) + [k]
        s = sentence[kept(k)]
        return [i + 1 for i in range(len(s) - 1) if s[i + 1] != s[i]] + [k]

    n = len(ids)
    if max_length is not None:  # the most content tokens that fit with their landmarks (a bisection: the
        budget = max_length - len(t.prefix) - len(t.suffix)  # total grows with every content token)
        lo, hi = 0, min(n, max(budget, 0))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mid + ((len(chunk_ends(mid)) - served) if pooling.inserts else 0) <= budget:
                lo = mid
            else:
                hi = mid - 1
        n = lo
    ids, types = ids[kept(n)], types[kept(n)]
    if not pooling.inserts:
        return list(t.prefix) + ids + list(t.suffix), list(t.prefix_types) + types + list(t.suffix_types)
    out_ids, out_types, start = list(t.prefix), list(t.prefix_types), 0
    ends, ct = chunk_ends(n), t.content_type
    for j, end in enumerate(ends):
        before = pooling.kind == "multi-cls" and not (j == 0 and served)
        after = pooling.kind == "lmk" and not (j == len(ends) - 1 and served)
        out_ids += [tid] * before + ids[start:end] + [tid] * after
        out_types += [ct] * before + types[start:end] + [ct] * after
        start = end
    return out_ids + list(t.suffix), out_types + list(t.suffix_types)
