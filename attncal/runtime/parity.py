"""Parity: ONNX Runtime embeddings of an export against `encode_torch` with the stored config.

The built-in texts span one token to beyond the model's max length, so padding,
truncation and the calibration's span logic are all exercised.

Memory: unfused attention (ONNX Runtime's plain graphs and `Attention` op, PyTorch's
eager attention) holds a [B, H, S, S] probability tensor and its neighbours per layer,
which at 8k tokens and 16 heads is several GiB per text.  So the texts are sorted by
length and batched so that `ATTENTION_COPIES` such tensors fit an activation budget
(`activation_budget`), down to one text per batch at the longest; a text whose single
attention would not fit is checked at the longest length that does (`length_cap`, said
in the report).  Both sides encode the same batches, the PyTorch reference first (SDPA
with split calibration where the model has it, so it does not materialise [B,H,S,S]);
the reference model is freed before any ONNX Runtime session is created.

Landmark (LMK, multi-CLS) and Mean@k exports are checked against `PaperReference`, which tokenizes and pools
as the papers describe, written apart from `attncal.runtime.landmarks` (the export's tokenization) and from
the graph's pooling: each text's sequence is built from transformers' own template call, its landmark
positions are recorded as they are placed, and the embedding is the mean of the final states gathered at
those positions, text by text.  So the check covers the tokenization of the export, not only its graph.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..artifact import (INLINED_GRAPH, NATIVE_GRAPH, OPTIMIZED_GRAPH, PORTABLE_GRAPH, ArtifactError, config_int,
                        external_data_name, open_export, pooling_of)
from ..calibration.config import CalibrationConfig
from ..memory import available_bytes, float32_weight_bytes, release_freed_memory
from ..modelinfo import choose_prompt, forward_kwargs
from ..pooling import Pooling
from .encoder import Encoder, default_session_options
from .landmarks import sentence_ends

FP32_MAX_ABS = 1e-5
FP16_MAX_ABS = 2e-3
FP16_MIN_COS = 0.9995
# int8 (dynamic, per-channel weights) against the fp32 PyTorch reference: an atol says little here (a broken
# per-tensor quantization keeps every |Δ| small while the cosine falls), so the cosine is the bound, set below
# what sound int8 exports of all-MiniLM-L6-v2 measure (docs/quantization.md) and above a broken one.
INT8_MAX_ABS = 0.05
# [B,H,S,S] float32 tensors an unfused attention layer holds at once, per text: about three for one text
# (scores, probabilities, a temporary), more per text in a batch, where ONNX Runtime's planner overlaps the
# heads' work (docs/large-models.md gives the measured peaks).  The longest
# length checked is set by the first, the batch sizes by the second.
ATTENTION_COPIES = 3
BATCHED_COPIES = 7
FALLBACK_HEADS = 32
ACTIVATION_FLOOR = 256 * 1024**2  # below this the planner never goes (small models, small machines)
ACTIVATION_SHARE = 1.5  # of the weights' size: with the session's own copy, the check stays near 3x the weights
INT8_MIN_COS = 0.98
# The texts an export with chunk vectors is chunked on: the first of the built-in set, up to about four windows of
# a 256-token model.
CHUNK_TEXTS = 6
TOLERANCES: dict[str, tuple[float, float | None]] = {  # precision -> (max |Δ|, min cosine)
    "fp32": (FP32_MAX_ABS, None),
    "fp16": (FP16_MAX_ABS, FP16_MIN_COS),
    "int8": (INT8_MAX_ABS, INT8_MIN_COS),
}

_PROSE = (
    "Dense retrieval encodes every passage of a collection into a single vector and answers a query by "
    "nearest-neighbour search over those vectors. The pooling token of a transformer encoder, however, "
    "spends most of its attention on the first tokens of a passage, so facts that appear late in a long "
    "document contribute little to its embedding. Attention calibration redistributes that attention "
    "across contiguous baskets of key positions at indexing time, without retraining the model. "
)
_WORD_COUNTS = (1, 300, 3, 150, 8, 700, 20, 60, 1500, 40, 100, 4000, 220, 12)


def builtin_texts() -> list[str]:
    """Texts from one word to far beyond any max length, in mixed order."""
    words = (_PROSE * 80).split()
    return [" ".join(words[:n]) for n in _WORD_COUNTS]


@dataclass
class Bucket:
    name: str
    count: int
    max_abs: float
    min_cos: float
    p1_cos: float | None = None  # 1st percentile of the cosines (== min_cos for fewer than 100 texts)
    p50_cos: float | None = None


@dataclass
class ParityReport:
    graph: str
    precision: str
    max_abs: float
    min_cos: float
    tol_max_abs: float
    tol_min_cos: float | None
    buckets: list[Bucket] = field(default_factory=list)
    n_texts: int = 0
    p1_cos: float | None = None
    p50_cos: float | None = None
    max_tokens: int = 0  # the longest input checked, in tokens
    length_cap: int | None = None  # tokens: longer texts were checked at this length (the memory budget)
    capped_texts: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    activation_budget_mib: float | None = None
    # an export with chunk vectors: the graph's chunk vectors against the same chunks' vectors computed from its
    # token states (`chunk_vector_parity`), max |Δ| relative to the largest |value| (1 for unit vectors)
    chunk_max_abs: float | None = None
    chunk_count: int = 0

    @property
    def ok(self) -> bool:
        if not self.max_abs <= self.tol_max_abs:  # also catches NaN
            return False
        if self.chunk_max_abs is not None and not self.chunk_max_abs <= FP32_MAX_ABS:
            return False
        return self.tol_min_cos is None or self.min_cos >= self.tol_min_cos

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def summary(self) -> str:
        cos = f", cosine >= {self.tol_min_cos}" if self.tol_min_cos is not None else ""
        cap = (f"; {self.capped_texts} longer texts checked at {self.length_cap} tokens (memory budget)"
               if self.length_cap is not None and self.capped_texts else "")
        chunks = (f"; chunk vectors: max abs diff {self.chunk_max_abs:.3g} (tolerance {FP32_MAX_ABS:g}) against "
                  f"their token states' means, {self.chunk_count} chunks" if self.chunk_max_abs is not None else "")
        return (f"{self.precision}: max abs diff {self.max_abs:.3g} (tolerance {self.tol_max_abs:g}{cos}), "
                f"min cosine {self.min_cos:.7f} over {self.n_texts} texts up to {self.max_tokens} tokens{cap}"
                f"{chunks}")

    def table(self) -> str:
        lines = [f"{'length bucket':<24} {'texts':>5} {'max |Δ|':>10} {'min cosine':>12} {'p1 cosine':>12} "
                 f"{'p50 cosine':>12}"]
        for b in self.buckets:
            p1 = f"{b.p1_cos:>12.8f}" if b.p1_cos is not None else f"{'-':>12}"
            p50 = f"{b.p50_cos:>12.8f}" if b.p50_cos is not None else f"{'-':>12}"
            lines.append(f"{b.name:<24} {b.count:>5} {b.max_abs:>10.3g} {b.min_cos:>12.8f} {p1} {p50}")
        lines.append(f"{'all':<24} {self.n_texts:>5} {self.max_abs:>10.3g} {self.min_cos:>12.8f}")
        return "\n".join(lines)



class PaperReference:
    """Landmark and Mean@k embeddings of a `TorchEncoder`'s model, from the papers' description (module
    docstring): LMK puts the landmark token after every chunk of `every` tokens (or sentence), multi-CLS before
    every chunk, where the model's template does not already have it there; the landmarks count against
    `max_length`; Mean@k pools the k-th, 2k-th, ... token.  The embedding is the mean of the final hidden states
    at those positions, then the model's Dense modules and normalisation."""

    def __init__(self, encoder, pooling: Pooling, max_length: int | None) -> None:
        self.enc, self.pooling, self.max_length = encoder, pooling, max_length
        self.tok = encoder.tokenizer
        # The model's template: what its tokenizer puts before and after a one-word text.
        full, plain = self.tok("a")["input_ids"], self.tok("a", add_special_tokens=False)["input_ids"]
        start = next(i for i in range(len(full)) if full[i:i + len(plain)] == plain)
        self.prefix, self.suffix = full[:start], full[start + len(plain):]

    def _chunks(self, content: list[int], sentence: list[int] | None) -> list[list[int]]:
        """The content cut into chunks: of `every` tokens, or where the sentence number changes."""
        if sentence is not None:
            chunks: list[list[int]] = [[]]
            for j, tid in enumerate(content):
                if j and sentence[j] != sentence[j - 1]:
                    chunks.append([])
                chunks[-1].append(tid)
            return chunks
        g = int(self.pooling.every)
        return [content[i:i + g] for i in range(0, len(content), g)] or [[]]

    def _wrap(self, chunks: list[list[int]]) -> list[int]:
        lmk, body = self.pooling.token_id, []
        for chunk in chunks:
            body += [lmk] + chunk if self.pooling.kind == "multi-cls" else chunk + [lmk]
        # Where the template has the landmark at the chunk's edge already, that one is the chunk's landmark.
        if self.pooling.kind == "multi-cls" and self.prefix[-1:] == [lmk]:
            body = body[1:]
        if self.pooling.kind == "lmk" and self.suffix[:1] == [lmk]:
            body = body[:-1]
        return self.prefix + body + self.suffix

    def sequence(self, text: str) -> tuple[list[int], list[int]]:
        """(token ids, pooled positions) of one text."""
        if not self.pooling.inserts:
            ids = self.tok(text, truncation=self.max_length is not None, max_length=self.max_length)["input_ids"]
            every = int(self.pooling.every)  # the k-th, 2k-th, ... token; a text shorter than k: its last
            return ids, [i for i in range(len(ids)) if (i + 1) % every == 0] or [len(ids) - 1]
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=self.pooling.by_sentence)
        keep = [j for j, t in enumerate(enc["input_ids"]) if t != self.pooling.token_id]
        content = [enc["input_ids"][j] for j in keep]
        sentence = None
        if self.pooling.by_sentence:  # each token's sentence: the sentence ends at or before its start
            ends = sentence_ends(text)
            sentence = [bisect.bisect_right(ends, enc["offset_mapping"][j][0]) for j in keep]
        left = self.tok.truncation_side == "left"
        n = len(content) if self.max_length is None else min(len(content), self.max_length)
        while True:  # the longest content whose sequence, landmarks and template included, fits
            part = slice(len(content) - n, len(content)) if left else slice(0, n)
            ids = self._wrap(self._chunks(content[part], sentence[part] if sentence is not None else None))
            if self.max_length is None or len(ids) <= self.max_length or n == 0:
                break
            n -= 1
        return ids, [i for i, t in enumerate(ids) if t == self.pooling.token_id]

    def encode(self, texts: Sequence[str], config: CalibrationConfig | None) -> np.ndarray:
        """Embeddings of `texts` (prompts applied as the Encoder applies them), as one padded batch."""
        import torch

        from ..calibration.patching import calibrate  # lazy: imports torch, which the runtime install lacks

        info = self.enc.info
        prompt = choose_prompt(info.prompts, info.default_prompt_name)
        seqs = [self.sequence(prompt + t) for t in texts]
        width = max(len(ids) for ids, _ in seqs)
        pad = self.tok.pad_token_id
        left = info.padding_side == "left"
        rows, masks, shifts = [], [], []
        for ids, _ in seqs:
            fill = width - len(ids)
            rows.append([pad] * fill + ids if left else ids + [pad] * fill)
            masks.append([0] * fill + [1] * len(ids) if left else [1] * len(ids) + [0] * fill)
            shifts.append(fill if left else 0)
        batch = {"input_ids": torch.tensor(rows), "attention_mask": torch.tensor(masks)}
        if "token_type_ids" in self.tok.model_input_names:
            batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
        model = self.enc.model
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if config is not None:  # the pooled rows are the calibrated rows: the patch marks them from input_ids
                stack.enter_context(calibrate(model, config))
            hidden = model(**batch, **forward_kwargs(model)).last_hidden_state
            out = []
            for row, (_, positions), shift in zip(hidden, seqs, shifts):
                picked = row[[p + shift for p in positions]]
                out.append(picked.mean(0) if len(positions) else torch.zeros_like(row[0]))
            emb = torch.stack(out)
            if self.enc.head is not None:
                emb = self.enc.head(emb)
            if info.normalize:
                emb = torch.nn.functional.normalize(emb, p=2, dim=-1)
        return emb.float().numpy()


def _bucket_names(lengths: Sequence[int], basket: int, max_len: int | None) -> list[str]:
    names = []
    for n in lengths:
        if max_len is not None and n >= max_len:
            names.append(f"max length ({max_len})")
        elif n < basket:
            names.append(f"< 1 basket (<{basket})")
        else:
            k = 1
            while n >= 2 * k * basket:
                k *= 2
            names.append(f"{k}-{2 * k} baskets")
    return names


def activation_budget(weight_bytes: int, available: int | None = None) -> int:
    """Bytes of attention activations the parity check may hold at once: `ACTIVATION_SHARE` of the weights,
    at most half of what is available now, never under `ACTIVATION_FLOOR`."""
    budget = int(ACTIVATION_SHARE * weight_bytes)
    if available is not None:
        budget = min(budget, available // 2)
    return max(ACTIVATION_FLOOR, budget)


def attention_bytes(length: int, heads: int, batch: int = 1) -> int:
    """Bytes of unfused attention activations for `batch` texts of `length` tokens."""
    return (ATTENTION_COPIES if batch == 1 else BATCHED_COPIES * batch) * heads * length * length * 4


def plan_batches(lengths: Sequence[int], heads: int, budget: int, max_batch: int) -> tuple[list[list[int]], int | None]:
    """(batches of text indices, length cap or None): longest first, each batch as large as `max_batch`
    allows within `budget`; the cap is the longest length whose single text fits (None if all do)."""
    cap = int((budget / (ATTENTION_COPIES * heads * 4)) ** 0.5)
    capped = [min(n, cap) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: -capped[i])
    batches: list[list[int]] = []
    while order:
        longest = capped[order[0]]
        k = max(1, min(max_batch, budget // max(1, attention_bytes(longest, heads, 2) // 2)))
        batches.append(order[:k])
        order = order[k:]
    return batches, (cap if any(n > cap for n in lengths) else None)


def _weights_bytes(out_dir: Path, graph_file: str) -> int:
    """Bytes of the graph's file and its external data: the size of its weights, near enough."""
    f = out_dir / graph_file
    data = f.with_name(external_data_name(f))
    return f.stat().st_size + (data.stat().st_size if data.exists() else 0)


def check_parity(
    out_dir: str | os.PathLike,
    texts: Sequence[str] | None = None,
    reference: str | os.PathLike | None = None,
    *,
    batch_size: int = 4,
    quiet: bool = True,
    providers: Sequence[str] | None = ("CPUExecutionProvider",),
    custom_op_library: str | os.PathLike | None = None,
    graph: str = "auto",
    native: bool | None = None,
    reference_cache: dict | None = None,
    memory_budget: int | None = None,
) -> ParityReport:
    """Embeddings of the export's `graph` ("auto", "portable", "optimized", "native", "inlined" or a file such as
    "onnx/model_optimized.onnx") against the PyTorch reference.  `reference_cache`: a dict the caller
    keeps across calls on the same export (the exporter checks up to three graphs), so the PyTorch
    reference is computed once.  `batch_size`: the largest batch; `memory_budget`: bytes of attention
    activations per batch (default `activation_budget`).

    long: 11 parameters; the reference (computed once, cached), then each graph's comparison, then the
    report, over one set of batches."""
    from transformers import AutoTokenizer

    from ..calibration.encode import TorchEncoder  # lazy: imports torch, which the runtime install lacks

    meta = open_export(out_dir, graphs=None).meta  # the tokenizer files checked before AutoTokenizer reads them
    out = Path(out_dir)
    texts = list(texts) if texts is not None else builtin_texts()
    if not texts:
        raise ValueError("no texts to check")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    config = CalibrationConfig.from_dict(meta["config"]) if meta.get("calibrated") else None
    pooling = pooling_of(meta)
    if config is not None:
        config = config.bind(pooling)
    source = reference or meta.get("source_model")
    if source is None or not Path(str(source)).exists():
        raise FileNotFoundError(
            f"reference model {source} not found; pass --reference with the source model directory"
        )
    graph = {PORTABLE_GRAPH: "portable", OPTIMIZED_GRAPH: "optimized", NATIVE_GRAPH: "native",
             INLINED_GRAPH: "inlined"}.get(graph, graph)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    max_len = meta.get("max_seq_length")
    lengths = [len(x) for x in tokenizer(texts, truncation=True, max_length=max_len)["input_ids"]]
    try:
        heads = config_int(out, "num_attention_heads")
    except ArtifactError:  # a config that names its heads otherwise: plan as a wide model would (smaller batches)
        heads = FALLBACK_HEADS
    # The scale of the check is the float32 model's (the reference is float32, whatever the graphs' precision).
    weights = max([_weights_bytes(out, g) for g in (meta.get("graphs") or {PORTABLE_GRAPH: None})]
                  + [float32_weight_bytes(Path(str(source)))])
    budget = memory_budget if memory_budget is not None else activation_budget(weights, available_bytes())
    batches, cap = plan_batches(lengths, heads, budget, batch_size)
    check_len = min(max_len, cap) if max_len is not None and cap is not None else (cap or max_len)
    key = (str(source), check_len, repr(config), repr(pooling), tuple(texts), tuple(map(tuple, batches)))
    if reference_cache is not None and key in reference_cache:
        expected, ref_pooling = reference_cache[key]
    else:
        ref_enc = TorchEncoder(source, max_length=check_len, attn_implementation="sdpa")
        ref_pooling = ref_enc.info.pooling
        ref_config = config
        if pooling.row_set:
            paper = PaperReference(ref_enc, pooling, check_len)
            encode = lambda part: paper.encode(part, config)  # noqa: E731
        else:
            if config is None and Pooling.of(ref_pooling) != pooling:
                ref_config = CalibrationConfig(strength=0.0, pooling=pooling)  # pooling only: λ = 0 is the identity
            encode = lambda part: ref_enc.encode(part, ref_config, batch_size=len(part))  # noqa: E731
        expected = _by_batches(encode, texts, batches, "encode (torch)", quiet)
        del ref_enc
        release_freed_memory(weights)
        if reference_cache is not None:
            reference_cache[key] = (expected, ref_pooling)
    so = _unpooled_session_options()
    if meta.get("chunk_vectors"):  # the chunk spans' default is an initializer listed as an input: ORT warns (Encoder)
        so.log_severity_level = 3
    enc = Encoder(out_dir, providers=providers, custom_op_library=custom_op_library, graph=graph, native=native,
                  session_options=so)
    enc.max_length = check_len
    graph_file = enc.graph_file
    got = _by_batches(lambda part: enc.encode(part, batch_size=len(part), sort_by_length=False), texts, batches,
                      "encode (onnx)", quiet)
    chunk_figures = chunk_vector_parity(enc, texts[:CHUNK_TEXTS], batch_size) if meta.get("chunk_vectors") else None
    del enc
    release_freed_memory(weights)
    diff = np.abs(got.astype(np.float64) - expected.astype(np.float64)).max(axis=1)
    cos = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1) + 1e-30)
    checked = [min(n, check_len) if check_len is not None else n for n in lengths]
    basket = int(config.basket_size) if config is not None else 128
    names = _bucket_names(checked, basket, check_len)
    buckets = []
    for name in sorted(set(names), key=lambda nm: min(n for n, x in zip(checked, names) if x == nm)):
        sel = [i for i, n in enumerate(names) if n == name]
        buckets.append(Bucket(name, len(sel), float(diff[sel].max()), float(cos[sel].min()),
                              float(np.percentile(cos[sel], 1)), float(np.percentile(cos[sel], 50))))
    precision = precision_of(meta)
    tol_abs, tol_cos = TOLERANCES[precision]
    return ParityReport(
        graph=graph_file,
        precision=precision,
        max_abs=float(diff.max()),
        min_cos=float(cos.min()),
        tol_max_abs=tol_abs,
        tol_min_cos=tol_cos,
        buckets=buckets,
        n_texts=len(texts),
        p1_cos=float(np.percentile(cos, 1)),
        p50_cos=float(np.percentile(cos, 50)),
        max_tokens=max(checked),
        length_cap=cap,
        capped_texts=sum(1 for n in lengths if cap is not None and n > cap),
        batch_sizes=[len(b) for b in batches],
        activation_budget_mib=round(budget / 1024**2, 1),
        **(chunk_figures or {}),
    )


def chunk_vector_parity(enc: Encoder, texts: Sequence[str], batch_size: int) -> dict:
    """An export with chunk vectors (`attncal export --chunk-vectors`): the late chunks of `texts` (landmark chunks
    for a landmark export), their vectors from the graph's chunk-vector output and from its token states
    (`Encoder.encode_chunks(in_graph=...)`), which tests/test_chunks.py compares with a PyTorch reference.
    Returns the ParityReport fields: max |Δ| over the largest |value|, and the number of chunks."""
    method = "landmark" if enc.pooling.inserts else "late"
    usable = [t for t in texts if t.strip()]
    graph = enc.encode_chunks(usable, method, batch_size=batch_size, in_graph=True, errors=[])
    states = enc.encode_chunks(usable, method, batch_size=batch_size, in_graph=False, errors=[])
    if not len(graph.vectors):
        return {"chunk_max_abs": float("nan"), "chunk_count": 0}
    scale = max(1.0, float(np.abs(states.vectors).max()))
    diff = float(np.abs(graph.vectors.astype(np.float64) - states.vectors.astype(np.float64)).max()) / scale
    return {"chunk_max_abs": diff, "chunk_count": len(graph.vectors)}


check = check_parity  # the short public name, `attncal.check`


def _unpooled_session_options():
    """ONNX Runtime's CPU arena keeps every block it ever grew to, rounded up, for the session's life: with it
    the check's peak is the sum of its batches' largest blocks, not the largest batch.  A check runs each batch
    once, so it goes without the arena."""
    so = default_session_options()
    so.enable_cpu_mem_arena = False
    return so


def _by_batches(encode, texts: list[str], batches: list[list[int]], desc: str, quiet: bool) -> np.ndarray:
    """Embeddings of `texts` in input order, encoded batch by batch as planned."""
    from tqdm.auto import tqdm

    rows: dict[int, np.ndarray] = {}
    for batch in tqdm(batches, desc=desc, disable=quiet, unit="batch"):
        for i, e in zip(batch, encode([texts[i] for i in batch])):
            rows[i] = e
    return np.stack([rows[i] for i in range(len(texts))])


def precision_of(meta: dict) -> str:
    """fp32, fp16 or int8: what the export's graphs compute in (and which tolerances apply)."""
    quant = meta.get("quantization")
    if isinstance(quant, dict) and quant.get("precision") in TOLERANCES:
        return str(quant["precision"])
    return "fp16" if meta.get("fp16") else "fp32"
