"""Pooling over many tokens: landmark (LMK), multi-CLS and Mean@k.  Their parameters (`PoolingSpec`), and the one
place that says where the landmark tokens go when a text is tokenized.

* **LMK** (Doshi et al., "LMK > CLS: Landmark Pooling for Dense Embeddings", arXiv 2601.21525): a landmark
  token (the model's SEP by default) closes every chunk of the text; the embedding is the mean of the final
  states at the landmark positions.
* **multi-CLS** (the bge-m3 paper's baseline, arXiv 2402.03216): a CLS token opens every chunk; the mean of the
  CLS states.  It is LMK with another token in another place, so both are the pooling `landmark`.
* **Mean@k**: the mean of every k-th valid token's final state (`mean-every`); nothing is inserted.

The exported graph pools where `input_ids == token id` AND `attention_mask` (Mean@k: every k-th valid position),
the rows `attncal.calibration.config.ResolvedCalibration.row_mask` selects and calibration calibrates.  So the
graph takes the same inputs as any export, and the tokenization is what has to be the same everywhere: it is
made here only.  `Landmarks` turns a tokenizer's plain encodings into the landmark sequences for `Encoder`
(either tokenizer backend), the Triton tokenizer model (which loads a copy of this file: hence this module
imports nothing but the standard library and numpy), `attncal encode` and the evaluation.

The rules (docs/pooling.md gives them with their reasons): the content is cut into chunks of G tokens or of one
sentence (one chunk at least); LMK closes each chunk with the landmark, multi-CLS opens it, and where the model's
template already has the token in that place, that token is the chunk's landmark; the landmarks count against
the max length (the content is truncated on the tokenizer's truncation side); a landmark token spelled in the
text is dropped from the content; a prompt is content; padding goes on the export's side.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

STYLES = ("lmk", "multi-cls", "mean-every")
SENTENCE = "sentence"
PAPER_EVERY = (32, 64, 128, 256)  # the chunk sizes the LMK paper trains and evaluates with
DEFAULT_EVERY = 64
DEFAULT_MEAN_EVERY = 64
# The special token each style inserts when none is named: LMK the model's SEP (the paper: "as it already serves
# as a natural delimiter"), multi-CLS its CLS; models without one (decoders) fall back to EOS / BOS.
DEFAULT_TOKENS = {"lmk": ("sep_token", "eos_token"), "multi-cls": ("cls_token", "bos_token")}
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f]+[\"'\u201d\u2019)\]]*(?=\s|$)|\n[ \t]*\n")

# encode(texts, add_special_tokens, with_offsets) -> per text (ids, type_ids, offsets or None), untruncated.
EncodeFn = Callable[[Sequence[str], bool, bool], list]


def _err(message: str) -> ValueError:
    return ValueError(f"invalid pooling: {message}")


@dataclass(frozen=True)
class PoolingSpec:
    """What `--pooling lmk|multi-cls|mean-every` asks for; attncal.json's `pooling_spec`.

    `every`: the chunk size G in tokens or "sentence" (lmk, multi-cls), or k (mean-every).  `token` /
    `token_id`: the landmark token (None until resolved against the model's tokenizer, `resolve`)."""

    style: str
    every: int | str = DEFAULT_EVERY
    token: str | None = None
    token_id: int | None = None

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise _err(f"{self.style!r} is not one of {', '.join(STYLES)}")
        every = self.every
        if isinstance(every, str) and every.strip().isdigit():
            every = int(every)
        if self.style == "mean-every":
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise _err(f"mean-every needs k, a whole number of tokens >= 1, got {self.every!r}")
            if self.token is not None or self.token_id is not None:
                raise _err("mean-every inserts no token; drop the landmark token")
        elif every != SENTENCE and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise _err(f"--lmk-every must be a whole number of tokens >= 1 or 'sentence', got {self.every!r}")
        object.__setattr__(self, "every", every)
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise _err(f"the landmark token must be a non-empty string, got {self.token!r}")
        if self.token_id is not None and (isinstance(self.token_id, bool) or not isinstance(self.token_id, int)
                                          or self.token_id < 0):
            raise _err(f"the landmark token id must be an integer >= 0, got {self.token_id!r}")

    @property
    def pooling(self) -> str:
        """The pooling name of the calibration config and attncal.json: landmark or mean-every."""
        return "mean-every" if self.style == "mean-every" else "landmark"

    @property
    def inserts(self) -> bool:
        return self.style != "mean-every"

    @property
    def resolved(self) -> bool:
        return not self.inserts or self.token_id is not None

    def describe(self) -> str:
        """In words: `lmk [SEP] every 64 tokens`, `multi-cls per sentence`, `mean-every 64`."""
        if not self.inserts:
            return f"mean-every {self.every}"
        where = "per sentence" if self.every == SENTENCE else f"every {self.every} tokens"
        return " ".join(x for x in (self.style, self.token, where) if x)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data) -> "PoolingSpec":
        if not isinstance(data, dict):
            raise _err(f"expected an object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise _err(f"unknown field(s) {', '.join(unknown)}")
        if "style" not in data:
            raise _err("missing field 'style'")
        return cls(**data)

    def config_fields(self) -> dict:
        """The calibration config's fields for this pooling (`pooling`, `pool_token_id`, `pool_every`)."""
        if self.inserts:
            return {"pooling": self.pooling, "pool_token_id": self.token_id}
        return {"pooling": self.pooling, "pool_every": self.every}


def resolve(spec: PoolingSpec, tokenizer) -> PoolingSpec:
    """`spec` with its landmark token and id from a transformers tokenizer: the named token, else the style's
    default (`DEFAULT_TOKENS`).  ValueError (one line) for a model without that token, or a name that is not one
    token of the vocabulary."""
    if not spec.inserts:
        return spec
    token = spec.token
    if token is None:
        names = DEFAULT_TOKENS[spec.style]
        token = next((str(getattr(tokenizer, n)) for n in names if getattr(tokenizer, n, None)), None)
        if token is None:
            raise _err(f"the model's tokenizer has no {' or '.join(n.replace('_', ' ') for n in names)} to use as "
                       f"the {spec.style} landmark; name one with --lmk-token")
    tid = tokenizer.convert_tokens_to_ids(token)
    unk = getattr(tokenizer, "unk_token", None)
    if not isinstance(tid, int) or (tid == getattr(tokenizer, "unk_token_id", None) and token != unk):
        raise _err(f"--lmk-token {token!r} is not a token of the model's vocabulary (a special token such as "
                   f"{getattr(tokenizer, 'sep_token', None) or getattr(tokenizer, 'eos_token', None)!r} is usual)")
    if spec.token_id is not None and spec.token_id != tid:
        raise _err(f"the landmark token {token!r} has id {tid} in this tokenizer, not {spec.token_id}")
    return PoolingSpec(spec.style, spec.every, token, tid)


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

    def __init__(self, spec: PoolingSpec, encode: EncodeFn, *, max_length: int | None, pad_id: int | None,
                 padding_side: str = "right", truncation_side: str = "right") -> None:
        if spec.inserts and spec.token_id is None:
            raise _err(f"{spec.style} needs its landmark token resolved against the tokenizer (resolve)")
        self.spec = spec
        self._encode = encode
        self.template = Template.of(encode)
        self.max_length = max_length
        self.pad_id = pad_id
        self.padding_side = padding_side
        self.truncation_side = truncation_side

    def rows(self, texts: Sequence[str]) -> list[tuple[list[int], list[int]]]:
        """(ids, type ids) of each text, unpadded."""
        sentences = self.spec.every == SENTENCE
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
        if self.spec.inserts and self.spec.every == SENTENCE:  # a token's sentence: the ends at or before its start
            bounds = sentence_ends(text)
            sentence = [bisect.bisect_right(bounds, start) for start, _ in offsets]
        return place(ids, types, sentence, self.spec, self.template, self.max_length, self.truncation_side)


EMPTY_TEMPLATE = Template((), (), (), (), 0)


def place(ids: Sequence[int], types: Sequence[int], sentence: Sequence[int] | None, spec: PoolingSpec,
          template: Template = EMPTY_TEMPLATE, max_length: int | None = None,
          truncation_side: str = "right") -> tuple[list[int], list[int]]:
    """(ids, type ids) of one text's row: its content tokens `ids` (no special tokens; `sentence`: each one's
    sentence number, for sentence chunking) truncated to fit `max_length` with the template and the landmarks,
    the landmarks placed, the template around (the module docstring's rules)."""
    t, tid = template, spec.token_id
    if spec.inserts:  # a landmark spelled in the text is not a landmark
        keep = [i for i, x in enumerate(ids) if x != tid]
        ids, types = [ids[i] for i in keep], [types[i] for i in keep]
        sentence = [sentence[i] for i in keep] if sentence is not None else None
    ids, types = list(ids), list(types)
    left = truncation_side == "left"
    served = (t.suffix[:1] == (tid,)) if spec.style == "lmk" else (t.prefix[-1:] == (tid,))

    def kept(k: int) -> slice:
        return slice(len(ids) - k, len(ids)) if left else slice(0, k)

    def chunk_ends(k: int) -> list[int]:
        """Where the chunks of the `k` kept tokens end (exclusive; the last at k; one chunk at least)."""
        if sentence is None:
            g = int(spec.every)
            return list(range(g, k, g)) + [k]
        s = sentence[kept(k)]
        return [i + 1 for i in range(len(s) - 1) if s[i + 1] != s[i]] + [k]

    n = len(ids)
    if max_length is not None:  # the most content tokens that fit with their landmarks (a bisection: the
        budget = max_length - len(t.prefix) - len(t.suffix)  # total grows with every content token)
        lo, hi = 0, min(n, max(budget, 0))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mid + ((len(chunk_ends(mid)) - served) if spec.inserts else 0) <= budget:
                lo = mid
            else:
                hi = mid - 1
        n = lo
    ids, types = ids[kept(n)], types[kept(n)]
    if not spec.inserts:
        return list(t.prefix) + ids + list(t.suffix), list(t.prefix_types) + types + list(t.suffix_types)
    out_ids, out_types, start = list(t.prefix), list(t.prefix_types), 0
    ends, ct = chunk_ends(n), t.content_type
    for j, end in enumerate(ends):
        before = spec.style == "multi-cls" and not (j == 0 and served)
        after = spec.style == "lmk" and not (j == len(ends) - 1 and served)
        out_ids += [tid] * before + ids[start:end] + [tid] * after
        out_types += [ct] * before + types[start:end] + [ct] * after
        start = end
    return out_ids + list(t.suffix), out_types + list(t.suffix_types)
