"""The export's tokenizer at run time: Hugging Face `tokenizers` on the export's `tokenizer.json`, where the
export attests that it gives the ids transformers gives, else transformers' `AutoTokenizer`.

Why: `from transformers import AutoTokenizer` costs most of an Encoder's start-up (transformers indexes every
model module on import), which every Ray actor, Triton instance and CLI call pays, while the fast tokenizer
transformers wraps is the `tokenizers.Tokenizer` of that same file.  What transformers adds on a call is its
truncation (`longest_first`, on the tokenizer's truncation side) and padding (to the longest, with the pad
token's id, type id 0 and mask 0, on the padding side); `FastTokenizer` applies the same.

What transformers may also do is change the backend when it loads it (a normaliser rebuilt from
`do_lower_case`, a post-processor from `add_bos_token`, tokens added from `tokenizer_config.json`).  So the
exporter, which has transformers, decides: `verify_fast_tokenizer` compares the backend transformers loaded
with the file, and the ids, type ids and masks of both on `probe_texts` (hard cases, the model's prompts and
every added token's text), batched and one by one, and the export records `"tokenizer": "tokenizers"` in
`attncal.json` only when everything is equal.  An export without that record (older ones, and those whose
check failed) keeps transformers.

An export with lmk, multi-cls or mean-every pooling (attncal.json's `pooling`) tokenizes through `LandmarkTokenizer`: either
backend's plain encodings, with the landmarks placed by `attncal.runtime.landmarks` (the one definition, which
the Triton tokenizer model runs too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..artifact import TOKENIZERS
from ..modelinfo import read_prompts
from ..pooling import Pooling
from .landmarks import Landmarks, tokenizers_encode, transformers_encode

FAST, TRANSFORMERS = TOKENIZERS  # attncal.json's "tokenizer" values

# Texts whose tokenization differs most between tokenizer implementations: accents and combining marks, CJK,
# emoji, right-to-left script, control characters, a text far past every max length, whitespace only, and
# special-token spellings inside text.
PROBE_TEXTS = ("Café naïve coöperate — “quotes” and ½", "e\u0301 vs é, ﬁ ligature", "東京で日本語のテキスト",
               "emoji 👩‍💻🚀 and flags 🇫🇷", "مرحبا بالعالم", "tab\tnew\nline\r\x0b", " ".join(["long"] * 6000),
               "   \n\t  ", "a", "query: what is calibration? passage: one vector per passage",
               "[CLS] <s> </s> [SEP] <pad> <|endoftext|> <eos> <bos> mid[MASK]word  double  space ",
               "One sentence. Another one! A third?\n\nA paragraph... e.g. 3.5 \u201cquoted.\u201d \u3002\u6587\u3002")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json spell it (a string or an AddedToken dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def truncation_limit(max_length: int | None, model_max_length) -> int | None:
    """The length a call truncates to: `max_length`, else the tokenizer's model_max_length (as transformers does),
    None where that is transformers' "very large" value (no limit)."""
    limit = max_length if max_length is not None else model_max_length
    if isinstance(limit, (int, float)) and not isinstance(limit, bool) and 0 < limit < 1 << 40:
        return int(limit)
    return None


class FastTokenizer:
    """`tokenizer.json` on `tokenizers`, called as the Encoder calls transformers' fast tokenizer:
    `padding=True, truncation=True, max_length=max_length`."""

    def __init__(self, path: str | Path, max_length: int | None, padding_side: str) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        cfg = _read_json(path / "tokenizer_config.json")
        specials = _read_json(path / "special_tokens_map.json")
        text = (path / "tokenizer.json").read_text(encoding="utf-8")
        # Two copies of the backend: one pads (in Rust, as transformers has it do), one counts tokens.
        self._tok, self._padded = Tokenizer.from_str(text), Tokenizer.from_str(text)
        self._tok.no_padding()  # a tokenizer.json may carry a call's settings; ours are set here
        self._model_max_length = cfg.get("model_max_length")
        self._truncation_side = cfg.get("truncation_side", "right")
        pad = _token_text(cfg.get("pad_token")) or _token_text(specials.get("pad_token"))
        self.pad_id = self._tok.token_to_id(pad) if pad is not None else None
        self._pad_token = pad
        self.padding_side = padding_side
        self.set_max_length(max_length)

    @property
    def padding_side(self) -> str:
        return self._padding_side

    @padding_side.setter
    def padding_side(self, side: str) -> None:
        self._padding_side = side
        if self.pad_id is None:
            self._padded.no_padding()
        else:  # to the longest text of the call, with type id 0 and mask 0: transformers' padding=True
            self._padded.enable_padding(direction=side, pad_id=self.pad_id, pad_type_id=0, pad_token=self._pad_token)

    def set_max_length(self, max_length: int | None) -> None:
        """Truncate to `max_length` tokens (None: the tokenizer's model_max_length, as transformers does)."""
        limit = truncation_limit(max_length, self._model_max_length)
        for tok in (self._tok, self._padded):
            if limit is not None:
                tok.enable_truncation(limit, stride=0, strategy="longest_first", direction=self._truncation_side)
            else:  # transformers' "very large" model_max_length: no limit
                tok.no_truncation()

    def plain(self) -> tuple:
        """The parts landmark tokenization needs: untruncated encodings without padding, the model_max_length
        and the truncation side (a third copy of the backend, which never truncates)."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(self._tok.to_str())
        tok.no_truncation()
        tok.no_padding()
        return tokenizers_encode(tok), self._model_max_length, self._truncation_side

    def special_ids(self) -> frozenset[int]:
        """The ids of the tokenizer's special tokens (its added tokens marked special)."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_lengths(self, texts: Sequence[str]) -> list[int]:
        """Each text's number of tokens, special tokens and truncation included."""
        return [len(e.ids) for e in self._tok.encode_batch(list(texts))]

    def __call__(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """input_ids, token_type_ids and attention_mask, int64 [N, longest], padded on the padding side."""
        if self.pad_id is None:
            raise ValueError("the tokenizer has no padding token, so a batch cannot be padded")
        encodings = self._padded.encode_batch(list(texts))
        width = len(encodings[0].ids) if encodings else 0
        return {name: np.array([getattr(e, field) for e in encodings], dtype=np.int64).reshape(len(encodings), width)
                for name, field in (("input_ids", "ids"), ("token_type_ids", "type_ids"),
                                    ("attention_mask", "attention_mask"))}


class TransformersTokenizer:
    """transformers' AutoTokenizer behind FastTokenizer's two calls (exports that are not attested)."""

    def __init__(self, path: str | Path, max_length: int | None, padding_side: str) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path))
        self.hf.padding_side = padding_side
        self.max_length = max_length

    @property
    def padding_side(self) -> str:
        return self.hf.padding_side

    @padding_side.setter
    def padding_side(self, side: str) -> None:
        self.hf.padding_side = side

    def set_max_length(self, max_length: int | None) -> None:
        self.max_length = max_length

    def plain(self):
        return transformers_encode(self.hf), self.hf.model_max_length, self.hf.truncation_side

    def special_ids(self) -> frozenset[int]:
        return frozenset(self.hf.all_special_ids)

    @property
    def pad_id(self) -> int | None:
        return self.hf.pad_token_id

    def token_lengths(self, texts: Sequence[str]) -> list[int]:
        return [len(x) for x in self.hf(list(texts), truncation=True, max_length=self.max_length)["input_ids"]]

    def __call__(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        batch = self.hf(list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="np")
        return {k: np.asarray(v, dtype=np.int64) for k, v in batch.items()}


class LandmarkTokenizer:
    """FastTokenizer or TransformersTokenizer (`base`) with a row-set pooling's tokenization (`pooling`, resolved):
    the same two calls and settings, the landmarks placed by `attncal.runtime.landmarks.Landmarks`."""

    def __init__(self, base: FastTokenizer | TransformersTokenizer, pooling: Pooling,
                 max_length: int | None) -> None:
        encode, self._model_max_length, truncation_side = base.plain()
        self.base = base
        self.landmarks = Landmarks(pooling, encode, max_length=truncation_limit(max_length, self._model_max_length),
                                   pad_id=base.pad_id, padding_side=base.padding_side, truncation_side=truncation_side)

    @property
    def padding_side(self) -> str:
        return self.landmarks.padding_side

    @padding_side.setter
    def padding_side(self, side: str) -> None:
        self.base.padding_side = self.landmarks.padding_side = side

    def set_max_length(self, max_length: int | None) -> None:
        self.base.set_max_length(max_length)
        self.landmarks.max_length = truncation_limit(max_length, self._model_max_length)

    def token_lengths(self, texts: Sequence[str]) -> list[int]:
        return self.landmarks.token_lengths(texts)

    def __call__(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        return self.landmarks(texts)


def load_tokenizer(path: str | Path, kind: str | None, max_length: int | None, padding_side: str,
                   pooling: Pooling | None = None) -> FastTokenizer | TransformersTokenizer | LandmarkTokenizer:
    """The tokenizer an export records (`kind`, attncal.json's "tokenizer"; None: transformers), with the
    landmark tokenization of its `pooling` where that is lmk, multi-cls or mean-every."""
    base = (FastTokenizer if kind == FAST else TransformersTokenizer)(path, max_length, padding_side)
    return LandmarkTokenizer(base, pooling, max_length) if pooling is not None and pooling.row_set else base


def probe_texts(hf_tokenizer, prompts: Sequence[str] = ()) -> list[str]:
    """PROBE_TEXTS, each prompt before a text, and one text holding every added token's spelling."""
    added = [t.content for t in getattr(hf_tokenizer, "added_tokens_decoder", {}).values()]
    texts = list(PROBE_TEXTS) + [p + PROBE_TEXTS[0] for p in prompts]
    if added:
        texts.append("x " + " y ".join(added) + " z")
    return texts


def _backend_state(tokenizer_json: str) -> dict:
    state = json.loads(tokenizer_json)
    state["truncation"] = state["padding"] = None  # a call's settings, not the tokenizer
    return state


def verify_fast_tokenizer(path: str | Path, max_length: int | None, padding_side: str,
                          prompts: Sequence[str] = (), pooling: Pooling | None = None) -> str | None:
    """None when FastTokenizer on `path` gives what AutoTokenizer gives (with the landmarks of a row-set
    `pooling` placed on both), else why not (one line).  Needs transformers (the exporter's environment)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        return "the export has no tokenizer.json"
    reference = TransformersTokenizer(path, max_length, padding_side)
    hf = reference.hf
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return f"{type(hf).__name__} is not a fast tokenizer"
    try:
        fast = FastTokenizer(path, max_length, padding_side)
    except Exception as exc:  # noqa: BLE001 - any failure means: keep transformers
        return f"tokenizers cannot load tokenizer.json ({type(exc).__name__}: {exc})"
    if _backend_state(backend.to_str()) != _backend_state((path / "tokenizer.json").read_text(encoding="utf-8")):
        return "transformers changes the tokenizer.json backend when it loads it"
    texts = probe_texts(hf, prompts)
    if pooling is not None and pooling.row_set:
        reference = LandmarkTokenizer(reference, pooling, max_length)
        fast = LandmarkTokenizer(fast, pooling, max_length)
    want, got = reference(texts), fast(texts)
    for name in want:
        if not np.array_equal(want[name], got[name]):
            return f"{name} differ on the probe texts"
    if reference.token_lengths(texts) != fast.token_lengths(texts):
        return "token counts differ on the probe texts"
    return None


def attest_tokenizer(path: str | Path, max_length: int | None, padding_side: str, pooling: Pooling | None,
                     log: Callable[[str], None]) -> str:
    """What attncal.json's "tokenizer" says of the export at `path`: FAST where its tokenizer.json alone gives
    what transformers gives (the runtime then tokenizes without importing transformers), else TRANSFORMERS,
    with the reason told to `log`."""
    prompts = (read_prompts(path)[0] or {}).values()
    why = verify_fast_tokenizer(path, max_length, padding_side, list(prompts), pooling)
    if why is None:
        return FAST
    log(f"note: the runtime tokenizes with transformers: {why}")
    return TRANSFORMERS
