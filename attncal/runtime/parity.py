"""Parity: ONNX Runtime embeddings of an export against `encode_torch` with the stored config.

The built-in texts span one token to beyond the model's max length, and are
encoded in mixed-length batches (no length sorting), so padding, truncation and
the calibration's span logic are all exercised.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import console
from ..artifact import NATIVE_GRAPH, OPTIMIZED_GRAPH, PORTABLE_GRAPH, read_metadata
from ..calibration.config import CalibrationConfig
from .encoder import Encoder

FP32_MAX_ABS = 1e-5
FP16_MAX_ABS = 2e-3
FP16_MIN_COS = 0.9995
# int8 (dynamic, per-channel weights) against the fp32 PyTorch reference: an atol says little here (issue 22:
# per-tensor int8 kept every |Δ| small while the cosine p1 fell to 0.921), so the cosine is the bound.  Sound
# int8 exports of all-MiniLM-L6-v2 measure min cosine 0.990 uncalibrated and 0.9897 calibrated on the built-in
# texts (one word to max length); 0.98 fails a broken quantization loudly without failing those.
INT8_MAX_ABS = 0.05
INT8_MIN_COS = 0.98
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

    @property
    def ok(self) -> bool:
        if not self.max_abs <= self.tol_max_abs:  # also catches NaN
            return False
        return self.tol_min_cos is None or self.min_cos >= self.tol_min_cos

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def summary(self) -> str:
        cos = f", cosine >= {self.tol_min_cos}" if self.tol_min_cos is not None else ""
        return (f"{self.precision}: max abs diff {self.max_abs:.3g} (tolerance {self.tol_max_abs:g}{cos}), "
                f"min cosine {self.min_cos:.7f} over {self.n_texts} texts")

    def table(self) -> str:
        lines = [f"{'length bucket':<24} {'texts':>5} {'max |Δ|':>10} {'min cosine':>12} {'p1 cosine':>12} "
                 f"{'p50 cosine':>12}"]
        for b in self.buckets:
            p1 = f"{b.p1_cos:>12.8f}" if b.p1_cos is not None else f"{'-':>12}"
            p50 = f"{b.p50_cos:>12.8f}" if b.p50_cos is not None else f"{'-':>12}"
            lines.append(f"{b.name:<24} {b.count:>5} {b.max_abs:>10.3g} {b.min_cos:>12.8f} {p1} {p50}")
        lines.append(f"{'all':<24} {self.n_texts:>5} {self.max_abs:>10.3g} {self.min_cos:>12.8f}")
        return "\n".join(lines)


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
) -> ParityReport:
    """Embeddings of the export's `graph` ("auto", "portable", "optimized", "native" or a file such as
    "onnx/model_optimized.onnx") against the PyTorch reference.  `reference_cache`: a dict the caller
    keeps across calls on the same export (the exporter checks up to three graphs), so the PyTorch
    reference is computed once."""
    from ..calibration.encode import TorchEncoder

    meta = read_metadata(out_dir)
    texts = list(texts) if texts is not None else builtin_texts()
    if not texts:
        raise ValueError("no texts to check")
    config = CalibrationConfig.from_dict(meta["config"]) if meta.get("calibrated") else None
    if config is not None and config.pooling == "auto":
        config = config.with_pooling(meta["pooling"])
    source = reference or meta.get("source_model")
    if source is None or not Path(str(source)).exists():
        raise FileNotFoundError(
            f"reference model {source} not found; pass --reference with the source model directory"
        )
    graph = {PORTABLE_GRAPH: "portable", OPTIMIZED_GRAPH: "optimized", NATIVE_GRAPH: "native"}.get(graph, graph)
    enc = Encoder(out_dir, providers=providers, custom_op_library=custom_op_library, graph=graph, native=native)
    got = enc.encode(texts, batch_size=batch_size, sort_by_length=False, show_progress=not quiet)
    key = (str(source), meta.get("max_seq_length"), repr(config), tuple(texts), batch_size)
    if reference_cache is not None and key in reference_cache:
        expected = reference_cache[key]
    else:
        with console.third_party_output():  # transformers' weight-loading bar and load-time messages
            ref_enc = TorchEncoder(source, max_length=meta.get("max_seq_length"), attn_implementation="eager")
        if config is None and ref_enc.info.pooling != meta["pooling"]:
            config = CalibrationConfig(strength=0.0, pooling=meta["pooling"])  # pooling only: λ = 0 is the identity
        expected = ref_enc.encode(texts, config, batch_size=batch_size, show_progress=not quiet)
        if reference_cache is not None:
            reference_cache[key] = expected
    diff = np.abs(got.astype(np.float64) - expected.astype(np.float64)).max(axis=1)
    cos = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1) + 1e-30)
    lengths = [len(x) for x in enc.tokenizer(texts, truncation=True, max_length=enc.max_length)["input_ids"]]
    basket = int(config.basket_size) if config is not None else 128
    names = _bucket_names(lengths, basket, enc.max_length)
    buckets = []
    for name in sorted(set(names), key=lambda nm: min(n for n, x in zip(lengths, names) if x == nm)):
        sel = [i for i, n in enumerate(names) if n == name]
        buckets.append(Bucket(name, len(sel), float(diff[sel].max()), float(cos[sel].min()),
                              float(np.percentile(cos[sel], 1)), float(np.percentile(cos[sel], 50))))
    precision = precision_of(meta)
    tol_abs, tol_cos = TOLERANCES[precision]
    return ParityReport(
        graph=enc.graph_file,
        precision=precision,
        max_abs=float(diff.max()),
        min_cos=float(cos.min()),
        tol_max_abs=tol_abs,
        tol_min_cos=tol_cos,
        buckets=buckets,
        n_texts=len(texts),
        p1_cos=float(np.percentile(cos, 1)),
        p50_cos=float(np.percentile(cos, 50)),
    )


def precision_of(meta: dict) -> str:
    """fp32, fp16 or int8: what the export's graphs compute in (and which tolerances apply)."""
    quant = meta.get("quantization")
    if isinstance(quant, dict) and quant.get("precision") in TOLERANCES:
        return str(quant["precision"])
    return "fp16" if meta.get("fp16") else "fp32"
