"""Long documents: retrieval effect and cost of whole-document vectors, naive, late and landmark chunks, with and
without calibration, at float32 / int8 / binary (with float rescoring) and at Matryoshka ½ and ¼ width.

The set: the Python Language Reference (`attncal.eval.realtext`, the documents of `attncal tune --example`),
packed by `attncal.eval.posq_builder.build_posq` into passages of more than twice the model's max length
(`--passage-tokens`, default 3 × max length, at least 2 × max length + 1), each with one query per third
(beginning, middle, end) made from one of its sentences: the sentence's character span is the chunk-level
answer.  A query is scored twice (MRR@10): at document level (a chunked document scores its best chunk) and at
chunk level (a chunk is relevant when its span overlaps the answer sentence's).  Documents are encoded with the
calibrated or uncalibrated export; queries always with the uncalibrated export of the same pooling (queries keep
the uncalibrated model).  Intervals: paired bootstrap over the queries, resampled within their third
(`attncal.eval.bootstrap`), 95 %, against whole-document vectors of the uncalibrated export.

Cost: `attncal bench --long-documents`'s measurement (attncal.bench.chunking), on the calibrated export: one model
call per window, timed side by side in one process on 8 documents of 512 and 2,048 tokens: whole-document vectors
(truncated), naive chunks (overlap 0 and 32) and late chunks (window overlap 0 and 32).

    python benchmarks/long_documents.py -o docs/bench/long-documents/results.json

Exports are made into --work (reused when present): all-MiniLM-L6-v2 (the embedded default) uncalibrated and
calibrated (the default config), and its LMK export every 64 tokens, uncalibrated and calibrated.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from attncal.bench.chunking import measure
from attncal.calibration.config import CalibrationConfig
from attncal.eval.bootstrap import draw_resamples, paired_mean_delta
from attncal.eval.posq_builder import PosqOptions, build_posq
from attncal.eval.realtext import python_reference_documents
from attncal.exporting.exporter import ExportOptions, export
from attncal.modelinfo import default_model_path
from attncal.pooling import Pooling
from attncal.runtime.encoder import Encoder
from attncal.runtime.precision import quantize, ranges_of, truncate

THIRDS = ("beginning", "middle", "end")
K = 10
CPU = ["CPUExecutionProvider"]


def make_exports(work: Path) -> dict[str, Path]:
    out = {}
    for name, cal, pooling in (("plain", False, Pooling()), ("cal", True, Pooling()),
                               ("lmk-plain", False, Pooling("lmk", 64)), ("lmk-cal", True, Pooling("lmk", 64))):
        d = work / name
        if not (d / "attncal.json").is_file():
            export(str(default_model_path()), d, ExportOptions(config=CalibrationConfig(pooling=pooling), calibrate=cal,
                                                               exporter="torchscript", overwrite=True), quiet=True)
        out[name] = d
    return out


def mrr(scores: np.ndarray, relevant: list[set[int]]) -> np.ndarray:
    """Per query: 1 / rank of the first relevant item in the top K, else 0."""
    top = np.argsort(-scores, axis=1, kind="stable")[:, :K]
    return np.array([next((1.0 / (r + 1) for r, j in enumerate(row) if j in rel), 0.0)
                     for row, rel in zip(top, relevant)])


def doc_scores(chunk_scores: np.ndarray, chunk_doc: np.ndarray, n_docs: int) -> np.ndarray:
    out = np.full((chunk_scores.shape[0], n_docs), -np.inf, dtype=np.float32)
    for d in range(n_docs):
        cols = chunk_doc == d
        if cols.any():
            out[:, d] = chunk_scores[:, cols].max(axis=1)
    return out


def evaluate(passages, queries, exports, size: int, overlap: int) -> dict:
    texts = [p["text"] for p in passages]
    pid = {p["id"]: i for i, p in enumerate(passages)}
    q_doc = np.array([pid[q["passage_id"]] for q in queries])
    q_span = [tuple(q["span"]) for q in queries]
    groups = [q["span_class"] for q in queries]
    qv = {pool: Encoder(exports[name], providers=CPU).encode([q["text"] for q in queries])
          for pool, name in (("mean", "plain"), ("lmk", "lmk-plain"))}
    runs: dict[str, dict] = {}

    def record(label, pool, vectors, chunk_doc, starts, ends, scorer=None):
        scores = scorer(qv[pool]) if scorer else qv[pool] @ vectors.T
        per_doc = mrr(doc_scores(scores, chunk_doc, len(texts)), [{d} for d in q_doc])
        entry = {"doc": per_doc}
        if starts is not None:
            rel = [set(np.flatnonzero((chunk_doc == d) & (starts < e) & (ends > s)).tolist())
                   for d, (s, e) in zip(q_doc, q_span)]
            entry["chunk"] = mrr(scores, rel)
            entry["vectors_per_doc"] = len(vectors) / len(texts)
        runs[label] = entry

    late_cal = None
    for cal in ("plain", "cal"):
        enc = Encoder(exports[cal], providers=CPU)
        whole = enc.encode(texts)
        record(f"whole {cal}", "mean", whole, np.arange(len(texts)), None, None)
        for method in ("naive", "late"):
            got = enc.encode_chunks(texts, method, size=size, overlap=overlap if method == "naive" else 0)
            record(f"{method} {cal}", "mean", got.vectors, got.text, got.start, got.end)
            if method == "late" and cal == "cal":
                late_cal = got
    for cal in ("lmk-plain", "lmk-cal"):
        got = Encoder(exports[cal], providers=CPU).encode_chunks(texts, "landmark")
        record(f"landmark {cal.split('-')[1]}", "lmk", got.vectors, got.text, got.start, got.end)

    # precision and Matryoshka, on the calibrated late chunks
    v = late_cal.vectors
    args = (late_cal.text, late_cal.start, late_cal.end)
    ranges = ranges_of(v)
    docs8 = quantize(v, "int8", ranges).astype(np.int32)
    record("late cal int8", "mean", v, *args, scorer=lambda q: (quantize(q, "int8", ranges).astype(np.int32)
                                                                @ docs8.T).astype(np.float32))
    bits = np.unpackbits(quantize(v, "ubinary"), axis=1).astype(np.float32)

    def binary_rescored(q):
        qb = np.unpackbits(quantize(q, "ubinary"), axis=1).astype(np.float32)
        hamming = qb @ (1 - bits).T + (1 - qb) @ bits.T
        out = np.full(hamming.shape, -np.inf, dtype=np.float32)
        for i in range(len(q)):  # the 4 K nearest by Hamming distance, rescored with the float vectors
            cand = np.argsort(hamming[i], kind="stable")[:4 * K]
            out[i, cand] = v[cand] @ q[i]
        return out

    record("late cal binary+rescore", "mean", v, *args, scorer=binary_rescored)
    for frac, dims in (("1/2", v.shape[1] // 2), ("1/4", v.shape[1] // 4)):
        tv = truncate(v, dims, True)
        record(f"late cal dims {frac}", "mean", tv, *args,
               scorer=lambda q, dims=dims, tv=tv: truncate(q, dims, True) @ tv.T)

    resamples = draw_resamples(groups, THIRDS, 2000, 0)
    base = runs["whole plain"]["doc"]
    summary = {}
    for label, e in runs.items():
        row = {"doc_mrr10": float(e["doc"].mean()),
               "doc_mrr10_by_third": {t: float(e["doc"][np.array(groups) == t].mean()) for t in THIRDS},
               "doc_delta_vs_whole_plain": paired_mean_delta(e["doc"], base, resamples)}
        if "chunk" in e:
            row["chunk_mrr10"] = float(e["chunk"].mean())
            row["vectors_per_doc"] = round(e["vectors_per_doc"], 2)
            ref = runs["naive plain"]["chunk"]
            row["chunk_delta_vs_naive_plain"] = paired_mean_delta(e["chunk"], ref, resamples)
        summary[label] = row
    return summary


def cost(exports, repeats: int) -> dict:
    """The cost of each encoding on the calibrated export: `attncal bench --long-documents`'s measurement."""
    return measure(Encoder(exports["cal"], providers=CPU), repeats)


def index_bytes(dims: int) -> dict:
    from attncal.runtime.precision import PRECISIONS, bytes_per_vector

    return {p: bytes_per_vector(p, dims) for p in PRECISIONS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--work", default="build/long-documents")
    ap.add_argument("--passage-tokens", type=int, default=None)
    ap.add_argument("--max-passages", type=int, default=120)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--overlap", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    exports = make_exports(work)
    enc = Encoder(exports["plain"], providers=CPU)
    L = enc.max_length
    budget = args.passage_tokens or 3 * L
    docs, source = python_reference_documents()
    posq = build_posq(docs, enc.tokenizer, L, PosqOptions(passage_tokens=budget, min_passage_tokens=2 * L + 1,
                                                          max_passages=args.max_passages), source=source)
    result = {
        "command": "python benchmarks/long_documents.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k not in ("out", "work")),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": {"cpu": _cpu(), "cpu_class": f"{_cpu()}, {os.cpu_count()} cores", "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d"),
        "model": "all-MiniLM-L6-v2 (embedded default)", "max_length": L,
        "set": {"passages": len(posq.passages), "queries": len(posq.queries),
                "passage_tokens": posq.manifest["passage_tokens"], "source": source["name"]},
        "chunking": {"size": args.chunk_size, "naive_overlap": args.overlap, "landmark_every": 64},
        "retrieval": evaluate(posq.passages, posq.queries, exports, args.chunk_size, args.overlap),
        "cost": cost(exports, args.repeats),
        "dimension": enc.dimension,
        "index_bytes_per_vector": index_bytes(enc.dimension),
        "matryoshka_note": "all-MiniLM-L6-v2 is not trained for Matryoshka truncation: the 1/2 and 1/4 rows measure "
                           "the loss of plain truncation on the default model",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: {"doc": round(v["doc_mrr10"], 3), "chunk": round(v.get("chunk_mrr10", float("nan")), 3)}
                      for k, v in result["retrieval"].items()}, indent=1))
    print(json.dumps(result["cost"], indent=1))


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
