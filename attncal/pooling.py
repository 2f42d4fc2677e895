"""The pooling of an embedding: `Pooling`, one value from the command line to the tokenizer.

Kinds (the CLI's words, also attncal.json's and the calibration config's):

* `cls`, `last`: the state of the first / last valid token; `mean`: the mean of every valid token.
* `lmk` (landmark pooling, Doshi et al., arXiv 2601.21525): a landmark token (the model's SEP by default)
  closes every chunk of `every` tokens (or every sentence: `every="sentence"`); the mean of the landmarks' states.
* `multi-cls` (the bge-m3 paper's baseline, arXiv 2402.03216): a CLS token opens every chunk; the mean of them.
* `mean-every` (Mean@k): the mean of every `every`-th valid token's state; nothing is inserted.
* `auto`: not chosen yet; binding to a model gives its sentence-transformers pooling (`bind`).

`lmk`, `multi-cls` and `mean-every` pool a set of rows chosen from the token ids (`row_mask`): the calibrated
rows too.  `lmk` / `multi-cls` select the positions that hold `token_id`, which `resolve` finds in the model's
vocabulary (`token`: its spelling).

The Triton tokenizer model loads a copy of this file (attncal.serving.repository), so it imports nothing but
the standard library.  Old attncal.json files spell the pooling as a word with a separate `pooling_spec`, and
the landmark poolings as `landmark`: `from_json` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

KINDS = ("cls", "mean", "last", "lmk", "multi-cls", "mean-every")
AUTO = "auto"
LANDMARK_KINDS = ("lmk", "multi-cls")  # insert a landmark token and pool where it stands
ROW_SET_KINDS = LANDMARK_KINDS + ("mean-every",)  # pool (and calibrate) a set of rows chosen from the token ids
SENTENCE = "sentence"
PAPER_EVERY = (32, 64, 128, 256)  # the chunk sizes the LMK paper trains and evaluates with
DEFAULT_EVERY = 64
DEFAULT_MEAN_EVERY = 64
# The special token each landmark kind inserts when none is named: lmk the model's SEP (the paper: "as it
# already serves as a natural delimiter"), multi-cls its CLS; models without one (decoders) fall back to EOS / BOS.
DEFAULT_TOKENS = {"lmk": ("sep_token", "eos_token"), "multi-cls": ("cls_token", "bos_token")}
_FIELDS = ("kind", "every", "token", "token_id")


def _err(message: str) -> ValueError:
    return ValueError(f"invalid pooling: {message}")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Pooling:
    """A pooling and its parameters.  `every`: the chunk size in tokens or "sentence" (lmk, multi-cls; default
    `DEFAULT_EVERY`), or k (mean-every; default `DEFAULT_MEAN_EVERY`); None for the other kinds.  `token` /
    `token_id`: the landmark token (lmk, multi-cls; None until `resolve`)."""

    kind: str = AUTO
    every: int | str | None = None
    token: str | None = None
    token_id: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS + (AUTO,):
            raise _err(f"{self.kind!r} is not one of {', '.join(KINDS + (AUTO,))}")
        every = self.every
        if isinstance(every, str) and every.strip().isdigit():
            every = int(every)
        if self.kind == "mean-every":
            every = DEFAULT_MEAN_EVERY if every is None else every
            if not _whole(every) or every < 1:
                raise _err(f"mean-every needs k, a whole number of tokens >= 1, got {self.every!r}")
        elif self.inserts:
            every = DEFAULT_EVERY if every is None else every
            if every != SENTENCE and (not _whole(every) or every < 1):
                raise _err(f"--lmk-every must be a whole number of tokens >= 1 or 'sentence', got {self.every!r}")
        elif every is not None:
            raise _err(f"{self.kind} takes no chunk size, got every={self.every!r}")
        object.__setattr__(self, "every", every)
        if not self.inserts and (self.token is not None or self.token_id is not None):
            raise _err(f"{self.kind} inserts no token; drop the landmark token")
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise _err(f"the landmark token must be a non-empty string, got {self.token!r}")
        if self.token_id is not None and (not _whole(self.token_id) or self.token_id < 0):
            raise _err(f"the landmark token id must be an integer >= 0, got {self.token_id!r}")

    # ------------------------------------------------------------------ text (the CLI's form)
    @classmethod
    def parse(cls, text: str, every: int | str | None = None, token: str | None = None) -> "Pooling":
        """`--pooling TEXT` with `--lmk-every` / `--mean-every` (`every`) and `--lmk-token` (`token`); the
        parameters are ignored by the kinds that take none."""
        name = str(text).strip()
        if name == "landmark":
            raise ValueError("--pooling landmark: name its style, lmk (landmark tokens after each chunk) or "
                             "multi-cls (CLS tokens before each chunk)")
        if name not in KINDS + (AUTO,):
            raise _err(f"{name!r} is not one of {', '.join(KINDS + (AUTO,))}")
        return cls(name, every if name in ROW_SET_KINDS else None, token if name in LANDMARK_KINDS else None)

    @classmethod
    def of(cls, value: "Pooling | str | dict | None") -> "Pooling":
        """`value` itself, the pooling its text names (`parse`), its JSON (`from_json`), or None: auto."""
        if isinstance(value, Pooling):
            return value
        if isinstance(value, dict):
            return cls.from_json(value)
        return cls() if value is None else cls.parse(value)

    def __str__(self) -> str:
        return self.kind

    def describe(self) -> str:
        """In words: `lmk [SEP] every 64 tokens`, `multi-cls per sentence`, `mean-every 64`, `cls`."""
        if self.kind == "mean-every":
            return f"mean-every {self.every}"
        if not self.inserts:
            return self.kind
        where = "per sentence" if self.every == SENTENCE else f"every {self.every} tokens"
        return " ".join(x for x in (self.kind, self.token, where) if x)

    # ------------------------------------------------------------------ JSON (attncal.json, configs, caches)
    def to_json(self) -> dict:
        """`{"kind": ..., "every": ..., "token": ..., "token_id": ...}` without the fields that are None."""
        return {k: getattr(self, k) for k in _FIELDS if getattr(self, k) is not None}

    @classmethod
    def from_json(cls, data: Any, spec: Any = None) -> "Pooling":
        """Inverse of `to_json`.  Also the old form: a word (`cls`, `mean`, `last`, `auto`, and `landmark` /
        `mean-every` with their parameters in `spec`, the old `pooling_spec` {style, every, token, token_id})."""
        if isinstance(data, str):
            if data not in ("landmark", "mean-every"):
                if spec is not None:
                    raise _err(f"pooling {data!r} takes no pooling_spec")
                return cls.parse(data)
            if not isinstance(spec, dict):
                raise _err(f"pooling {data!r} needs its pooling_spec (an object), got {spec!r:.60}")
            spec = dict(spec)
            if "style" not in spec:
                raise _err("pooling_spec: missing field 'style'")
            spec["kind"] = spec.pop("style")
            pooling = cls.from_json(spec)
            if (pooling.kind == "mean-every") != (data == "mean-every"):
                raise _err(f"pooling_spec ({pooling.describe()}) does not fit pooling {data!r}")
            return pooling
        if spec is not None:
            raise _err("an object pooling takes no pooling_spec")
        if not isinstance(data, dict):
            raise _err(f"expected an object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise _err(f"unknown field(s) {', '.join(unknown)}")
        if "kind" not in data:
            raise _err("missing field 'kind'")
        return cls(**data)

    # ------------------------------------------------------------------ what the code asks of it
    @property
    def concrete(self) -> bool:
        return self.kind != AUTO

    @property
    def inserts(self) -> bool:
        """Inserts a landmark token into the text (lmk, multi-cls)."""
        return self.kind in LANDMARK_KINDS

    @property
    def row_set(self) -> bool:
        """Pools (and calibrates) the rows `row_mask` selects from the token ids."""
        return self.kind in ROW_SET_KINDS

    @property
    def all_rows(self) -> bool:
        return self.kind == "mean"

    @property
    def pool_last(self) -> bool:
        return self.kind == "last"

    @property
    def by_sentence(self) -> bool:
        return self.every == SENTENCE

    @property
    def resolved(self) -> bool:
        """Concrete, and a landmark kind knows its token's id."""
        return self.concrete and (not self.inserts or self.token_id is not None)

    def bind(self, model_pooling: "Pooling | str") -> "Pooling":
        """This pooling, or where it is `auto` the model's own."""
        return self if self.concrete else Pooling.of(model_pooling)

    def resolve(self, tokenizer) -> "Pooling":
        """This pooling with its landmark token and id from a transformers tokenizer: the named token, else the
        kind's default (`DEFAULT_TOKENS`).  ValueError (one line) for a model without that token, or a name that
        is not one token of the vocabulary.  The kinds that insert nothing are returned as they are."""
        if not self.inserts:
            return self
        token = self.token
        if token is None:
            names = DEFAULT_TOKENS[self.kind]
            token = next((str(getattr(tokenizer, n)) for n in names if getattr(tokenizer, n, None)), None)
            if token is None:
                raise _err(f"the model's tokenizer has no {' or '.join(n.replace('_', ' ') for n in names)} to use "
                           f"as the {self.kind} landmark; name one with --lmk-token")
        tid = tokenizer.convert_tokens_to_ids(token)
        unk = getattr(tokenizer, "unk_token", None)
        if not isinstance(tid, int) or (tid == getattr(tokenizer, "unk_token_id", None) and token != unk):
            raise _err(f"--lmk-token {token!r} is not a token of the model's vocabulary (a special token such as "
                       f"{getattr(tokenizer, 'sep_token', None) or getattr(tokenizer, 'eos_token', None)!r} is usual)")
        if self.token_id is not None and self.token_id != tid:
            raise _err(f"the landmark token {token!r} has id {tid} in this tokenizer, not {self.token_id}")
        return replace(self, token=token, token_id=tid)

    def row_mask(self, input_ids: Any, attention_mask: Any) -> Any:
        """The pooled (and calibrated) rows of a row-set pooling: bool [B,S] from `input_ids` and
        `attention_mask` [B,S] (torch tensors or numpy arrays; only their operators are used).  lmk / multi-cls:
        the valid positions holding `token_id`; mean-every: the valid positions whose 1-based rank among the
        valid tokens is a multiple of k (counted from the first valid token, so left and right padding pick
        alike), or, in a text of fewer than k valid tokens, its last one (else it would pool nothing)."""
        valid = attention_mask != 0
        if self.inserts:
            if self.token_id is None:
                raise _err(f"{self.kind} needs its landmark token resolved against the tokenizer (resolve)")
            return valid & (input_ids == self.token_id)
        if self.kind == "mean-every":
            # CumSum of an integer tensor: TorchScript exports a bool one as CumSum on bool, which ONNX refuses.
            rank = (valid + 0 * attention_mask).cumsum(-1)
            count = rank[..., -1:]  # the valid tokens of each item: a text shorter than k pools its last one
            return valid & ((rank % self.every == 0) | ((count < self.every) & (rank == count)))
        raise ValueError(f"{self.kind} pooling has no row mask; only {', '.join(ROW_SET_KINDS)} have one")
