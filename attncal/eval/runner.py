"""`evaluate`: encode, search, score and write the report for a list of calibration configs.

Queries are never calibrated (calibration is an indexing-time change), so they
are encoded once with the uncalibrated model and reused for every config.
The uncalibrated corpus is always evaluated too: every config is reported as
a delta against it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from ..artifact import ArtifactError, looks_like_export
from ..calibration.config import CalibrationConfig
from .data import Dataset
from .encoders import (Backend, EncodeCache, OnnxBackend, TorchBackend, chunker_id, content_lengths,
                       segment_embed_average)
from .metrics import group_scores, require_ir_measures, score_delta
from .output import atomic_output_dir, cache_record, check_out_dir, hash_texts, json_default, library_versions
from .report import config_label, markdown_table, plot_groups_vs_strength, plot_hm_psi_vs_strength, truncation_section

BASELINES = ("sea",)
TOP_K = 100
# What results.json records about the measures (every report that scores position groups writes it).
METRICS = {"library": "ir-measures", "measures": ["nDCG@10", "R@10"], "relevance": "binary",
           "hm": "harmonic mean of group nDCG@10", "psi": "1 - min/max of group nDCG@10"}


@dataclass
class EvalOptions:
    configs: list[CalibrationConfig] = field(default_factory=list)
    labels: list[str] | None = None
    baselines: Sequence[str] = ()
    top_k: int = TOP_K
    batch_size: int = 32
    max_length: int | None = None
    cache_dir: str | Path | None = None
    length_buckets: Sequence[int] | None = None
    sea_chunk_tokens: int = 128
    plots: bool = True


def exact_search(
    q: np.ndarray, c: np.ndarray, qids: Sequence[str], dids: Sequence[str], k: int
) -> dict[str, dict[str, float]]:
    """Top-k documents per query by dot product of L2-normalised embeddings (cosine), exact."""
    def norm(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32)
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    scores = norm(q) @ norm(c).T
    k = min(k, scores.shape[1])
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    return {qid: {dids[j]: float(scores[i, j]) for j in top[i]} for i, qid in enumerate(qids)}


def is_export(path: str | Path) -> bool:
    """An export directory, intact or damaged (attncal.json or onnx/ present): it is then opened as
    one, so a damaged export is reported as such rather than as a model directory without weights."""
    return looks_like_export(path)


def open_backends(
    model: str, opts: EvalOptions, query_texts: Sequence[str]
) -> tuple[Backend, Backend | None, list[str]]:
    """(corpus backend, uncalibrated backend or None, notes).

    For an export the uncalibrated side comes from its source model when that is
    still on disk; otherwise a calibrated export may encode the queries only if
    calibration provably leaves them unchanged (all shorter than one basket with
    skip_short), and no uncalibrated row can be reported.
    """
    notes: list[str] = []
    if Path(model).is_file():
        raise ArtifactError(model, "is a file; expected a model directory, an attncal export or 'default'")
    if not is_export(model):
        b = TorchBackend(model, batch_size=opts.batch_size, max_length=opts.max_length)
        return b, b, notes
    onnx = OnnxBackend(model, batch_size=opts.batch_size)
    if onnx.stored is None:
        return onnx, onnx, notes
    src = onnx.meta.get("source_model")
    if src and Path(src).is_dir():
        notes.append(f"queries and the uncalibrated row are encoded in PyTorch from the export's source model {src}")
        return onnx, TorchBackend(src, batch_size=opts.batch_size, max_length=onnx.max_length), notes
    untouched, longest = queries_left_uncalibrated(onnx, query_texts)
    rc = onnx.stored.resolve()
    if untouched:
        notes.append(f"the export's source model is not on disk; queries (at most {longest} content tokens, less than "
                     f"one basket of {rc.basket_size}) are encoded by the export, which leaves them uncalibrated; "
                     "no uncalibrated corpus row")
        return onnx, None, notes
    raise ValueError(
        f"{model}: the export is calibrated and its source model {src!r} is not on disk, so queries cannot be "
        f"encoded uncalibrated (the longest query has {longest} content tokens >= one basket of {rc.basket_size}); "
        "pass the model directory instead"
    )


def queries_left_uncalibrated(onnx: OnnxBackend, query_texts: Sequence[str]) -> tuple[bool, int]:
    """(whether the export's stored calibration provably leaves every query unchanged, longest query's
    content tokens).

    Queries are never calibrated (calibration is an indexing-time change); a
    calibrated export may still encode them itself when every query is shorter
    than one basket and skip_short is on, because the calibrated rows are then
    skipped and the graph computes the uncalibrated embedding.
    """
    if onnx.stored is None:
        return True, 0
    rc = onnx.stored.resolve()
    longest = max(content_lengths(onnx, query_texts), default=0) - rc.n_isolated
    return bool(rc.skip_short and longest < rc.basket_size), longest


def _length_bucket_of(lengths: dict[str, int], edges: Sequence[int]) -> dict[str, str]:
    names = [f"<{edges[0]}"] + [f"{a}-{b - 1}" for a, b in zip(edges, edges[1:])] + [f">={edges[-1]}"]
    return {d: names[int(np.searchsorted(edges, n, side="right"))] for d, n in lengths.items()}


def _scores_dict(data: Dataset, run: dict, qids: Sequence[str], bucket_of_query: dict[str, str] | None) -> dict:
    qrels = {q: data.qrels[q] for q in qids}
    out = {"scores": group_scores(qrels, run, data.group, data.groups).to_dict()}
    if bucket_of_query:
        by = {}
        for b in dict.fromkeys(bucket_of_query[q] for q in qids):
            sub = [q for q in qids if bucket_of_query[q] == b]
            by[b] = group_scores({q: qrels[q] for q in sub}, run, data.group, data.groups).to_dict()
        out["by_length"] = by
    return out


def evaluate(model: str, data: Dataset, opts: EvalOptions, out: str | Path | None = None,
             overwrite: bool = False) -> dict:
    """Run the evaluation; write the report to `out` (atomically) when given. Returns results.json's content.

    long: the evaluation's steps in order (the options, the data, the jobs, one encode per configuration, the
    rows, the report), sharing the run's state."""
    from tqdm.auto import tqdm

    require_ir_measures()
    t0 = time.perf_counter()
    unknown = sorted(set(opts.baselines) - set(BASELINES))
    if unknown:
        raise ValueError(f"unknown baseline(s) {', '.join(unknown)}; available: {', '.join(BASELINES)}")
    if opts.top_k < 10:
        raise ValueError(f"top-k must be >= 10 for nDCG@10, got {opts.top_k}")
    if opts.length_buckets is not None:
        edges = list(opts.length_buckets)
        if not edges or edges != sorted(set(edges)) or edges[0] < 1:
            raise ValueError(f"length buckets must be increasing positive token counts, got {edges}")
    out_path = check_out_dir(out, overwrite)
    qids = data.query_ids()
    if not qids:
        raise ValueError(f"{data.name}: no query has both a relevant document and a position group")
    q_texts = [data.queries[q] for q in qids]
    dids = list(data.corpus)
    d_texts = [data.corpus[d] for d in dids]
    backend, plain, notes = open_backends(model, opts, q_texts)
    notes = list(data.notes) + notes
    configs = list(opts.configs)
    labels = list(opts.labels) if opts.labels else [config_label(c) for c in configs]
    if isinstance(backend, OnnxBackend):
        if not configs:
            configs = [backend.stored] if backend.stored is not None else []
            labels = [config_label(CalibrationConfig.from_dict(backend.meta["config"]))] if configs else []
        notes.append("an export evaluates its stored calibration only; pass the model directory to sweep configs")
    if plain is None and "sea" in opts.baselines:
        raise ValueError("the SEA baseline needs an uncalibrated encoder; pass the model directory instead")
    cache = EncodeCache(opts.cache_dir)
    fp = data.fingerprint()
    q_enc = plain if plain is not None else backend
    q_emb = cache.get_or_encode(q_enc, None, hash_texts(q_texts), "queries",
                                lambda: q_enc.encode(q_texts, None, desc="encode queries"))
    lengths = dict(zip(dids, token_counts(q_enc.tokenizer, d_texts)))
    truncation = truncation_stats(data, qids, lengths, effective_max_length(backend))
    if truncation["passages_truncated"]:
        notes.append(truncation_note(truncation))
    cut = set(truncation.pop("_truncated_queries"))
    untruncated = [q for q in qids if q not in cut]
    bucket_of_query = None
    if opts.length_buckets:
        rel_doc = {q: next(iter(data.qrels[q])) for q in qids}
        bucket_doc = _length_bucket_of(lengths, list(opts.length_buckets))
        bucket_of_query = {q: bucket_doc[rel_doc[q]] for q in qids}

    rows: list[dict] = []
    jobs: list[tuple[str, str, CalibrationConfig | None, Backend]] = []
    if plain is not None:
        jobs.append(("uncalibrated", "uncalibrated", None, plain))
    jobs += [("calibrated", lab, cfg, backend) for lab, cfg in zip(labels, configs)]
    if "sea" in opts.baselines:
        jobs.append(("baseline", f"SEA ({opts.sea_chunk_tokens}-token chunks)", None, plain))
    chunker = None
    for kind, label, cfg, b in tqdm(jobs, desc="configs", unit="config"):
        if kind == "baseline":
            emb, chunker = sea_embeddings(cache, b, d_texts, fp, opts.sea_chunk_tokens)
        else:
            def encode_corpus(b=b, cfg=cfg, label=label) -> np.ndarray:
                return b.encode(d_texts, cfg, desc=f"encode corpus {label}")

            emb = cache.get_or_encode(b, cfg, fp, "corpus", encode_corpus)
        queries = q_emb
        if cfg is not None and cfg.pooling.row_set:  # queries pooled as the passages are (landmarks), uncalibrated
            q_cfg = replace(cfg, strength=0.0)
            queries = cache.get_or_encode(b, q_cfg, hash_texts(q_texts), "queries",
                                          lambda b=b, q_cfg=q_cfg: b.encode(q_texts, q_cfg, desc="encode queries"))
        run = exact_search(queries, emb, qids, dids, opts.top_k)
        row = {"label": label, "kind": kind, "config": None if cfg is None else b.bind(cfg).to_dict()}
        row.update(_scores_dict(data, run, qids, bucket_of_query))
        if truncation["passages_truncated"]:
            row["untruncated"] = (_scores_dict(data, run, untruncated, None)["scores"] if untruncated else None)
        rows.append(row)
    notes += cache.repaired
    base = next((r["scores"] for r in rows if r["kind"] == "uncalibrated"), None)
    for r in rows:
        r["delta"] = None if r["kind"] == "uncalibrated" or base is None else score_delta(r["scores"], base)
    results = {
        "model": str(model),
        "backend": backend.kind,
        "dataset": {
            "name": data.name, "layout": data.layout, "passages": len(dids), "queries": len(qids),
            "queries_per_group": {g: sum(1 for q in qids if data.group[q] == g) for g in data.groups},
            "truncation": truncation,
        },
        "groups": list(data.groups),
        "top_k": opts.top_k,
        "metrics": METRICS,
        "rows": rows,
        "sea_chunker": chunker,
        "cache": cache_record(cache),
        "notes": notes,
        "versions": library_versions(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if out_path is not None:
        _write(out_path, results, data, backend, plain, configs, labels, opts)
    return results


def sea_embeddings(cache: EncodeCache, backend: Backend, texts: Sequence[str], data_fp: str,
                   chunk_tokens: int) -> tuple[np.ndarray, str]:
    """The SEA baseline's corpus embeddings (through the cache) and the chunker that made them."""
    holder: dict = {}

    def compute() -> np.ndarray:
        emb, holder["chunker"] = segment_embed_average(backend, texts, chunk_tokens)
        return emb

    emb = cache.get_or_encode(backend, None, data_fp, f"sea-{chunker_id()}-{chunk_tokens}", compute)
    return emb, holder.get("chunker", f"{chunker_id()} ({chunk_tokens} tokens, cached)")


def token_counts(tokenizer, texts: Sequence[str]) -> list[int]:
    """Tokens of each text, special tokens included, without truncation."""
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(list(texts), truncation=False, verbose=False)["input_ids"]]


def effective_max_length(backend: Backend) -> int | None:
    """The length the corpus encoder truncates to: its max length, else the tokenizer's (None = unbounded)."""
    if backend.max_length:
        return int(backend.max_length)
    limit = getattr(backend.tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < 1_000_000 else None


def truncation_stats(data: Dataset, qids: Sequence[str], lengths: dict[str, int], max_length: int | None) -> dict:
    """How many passages the encoder truncates, and which queries' relevant passages lose their end.

    A truncated passage's end is never seen by the encoder, so an end-group
    query on it fails whatever the model's position bias; the report keeps
    these apart (the `untruncated` scores leave them out).
    """
    too_long = {d for d, n in lengths.items() if max_length is not None and n > max_length}
    hit = [q for q in qids if any(d in too_long for d in data.qrels[q])]
    values = sorted(lengths.values())
    return {
        "max_length": max_length,
        "passages": len(lengths),
        "passages_truncated": len(too_long),
        "queries_on_truncated_passages": {g: sum(1 for q in hit if data.group[q] == g) for g in data.groups},
        "passage_tokens": {"min": values[0], "median": float(np.median(values)),
                           "mean": round(float(np.mean(values)), 1), "max": values[-1]} if values else {},
        "_truncated_queries": hit,
    }


def truncation_note(t: dict) -> str:
    share = 100.0 * t["passages_truncated"] / max(t["passages"], 1)
    return (f"{t['passages_truncated']} of {t['passages']} passages ({share:.1f} %) are longer than the model's max "
            f"length ({t['max_length']} tokens) and were truncated; a lost end is not position bias: see "
            "'Length and truncation' in results.md for the scores without them")


_hash_texts = hash_texts  # the name docs/eval/bootstrap_ci.py imports


def _example_passage(data: Dataset) -> str:
    last = data.groups[-1]
    docs = [d for q, g in data.group.items() if g == last and q in data.qrels for d in data.qrels[q]]
    docs = docs or list(data.corpus)
    return max((data.corpus[d] for d in docs), key=len)


def _write(out: Path, results: dict, data: Dataset, backend: Backend, plain: Backend | None,
           configs: list[CalibrationConfig], labels: list[str], opts: EvalOptions) -> None:
    with atomic_output_dir(out) as tmp:
        rows = results["rows"]
        text = [f"# attncal eval: {data.name} ({data.layout}, {results['dataset']['passages']} passages, "
                f"{results['dataset']['queries']} queries)\n\n",
                f"Model `{results['model']}` ({backend.kind}); exact top-{opts.top_k} search; nDCG@10 per position "
                "group (binary relevance), HM = harmonic mean of the groups, PSI = 1 - min/max, "
                "ΔHM against the uncalibrated model.\n\n",
                markdown_table(rows, data.groups)]
        if rows and "by_length" in rows[0]:
            for b in rows[0]["by_length"]:
                sub = [dict(r, scores=r["by_length"].get(b)) for r in rows]
                text += [f"\n## Relevant document length {b} tokens\n\n", markdown_table(sub, data.groups)]
        text.append(truncation_section(results["dataset"]["truncation"], rows, data.groups))
        if results["notes"]:
            text.append("\n" + "\n".join(f"- {n}" for n in results["notes"]) + "\n")
        results["plots"] = {}
        if opts.plots:
            if any(r["kind"] == "calibrated" for r in rows):
                plot_groups_vs_strength(rows, data.groups, tmp / "ndcg_vs_strength.png")
                results["plots"]["ndcg_vs_strength"] = "ndcg_vs_strength.png"
                plot_hm_psi_vs_strength(rows, tmp / "hm_psi_vs_strength.png")
                results["plots"]["hm_psi_vs_strength"] = "hm_psi_vs_strength.png"
            torch_enc = plain if isinstance(plain, TorchBackend) else None
            # The baskets of one passage's pooled row: the example passage is tokenized without landmarks, so
            # landmark and Mean@k configs have no plot.
            shown = [j for j, c in enumerate(configs) if not c.pooling.row_set]
            if torch_enc is not None and shown:
                from .attention import basket_mass, plot_basket_mass  # lazy: imports torch (the export extra)

                i = max(shown, key=lambda j: configs[j].strength)
                mass = basket_mass(torch_enc.encoder, _example_passage(data), configs[i])
                plot_basket_mass(mass, labels[i], tmp / "attention_baskets.png")
                results["plots"]["attention_baskets"] = "attention_baskets.png"
                results["attention_example"] = dict(mass.to_dict(), config=labels[i])
        (tmp / "results.md").write_text("".join(text), encoding="utf-8")
        (tmp / "results.json").write_text(json.dumps(results, indent=2, default=json_default), encoding="utf-8")


