"""`compare_exports`: retrieval drift between attncal exports on one position-labelled set.

Re-indexing with a new export (calibrated, quantized, re-exported) changes
which passages are found.  This scores every export on the same queries and
corpus, side by side, and reports each export's difference from the first one
(the baseline) with a paired bootstrap interval, so that a drift can be told
apart from the noise of a small query set.

Each export is run as it would be deployed: its own ONNX graph encodes the
corpus, and its own graph encodes the queries as long as that leaves them
uncalibrated (queries are never calibrated: calibration is an indexing-time
change).  A calibrated export whose calibration would reach the queries (a
query of at least one basket, or skip_short off) borrows the query embeddings
of an uncalibrated export of the same source model in the comparison; the two
must then have the same embedding dimension.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..artifact import open_export
from .bootstrap import LEVEL, Resamples, describe, draw_resamples, paired_deltas
from .compare_report import (
    delta_table, export_labels, plot_drift, precision_of, scores_table, truncation_note,
)
from .data import Dataset
from .encoders import EncodeCache, OnnxBackend
from .metrics import per_query, require_ir_measures, score_delta, scores_from_per_query
from .output import atomic_output_dir, cache_record, check_out_dir, hash_texts, json_default, library_versions
from .runner import (
    METRICS, TOP_K, effective_max_length, exact_search, queries_left_uncalibrated, token_counts,
    truncation_stats,
)

DEFAULT_RESAMPLES = 1000
MIN_EXPORTS = 2


@dataclass
class CompareOptions:
    """How to compare: the bootstrap (resamples, seed, interval level), the search depth, the encode batch,
    the embedding cache (None: off) and whether to draw drift.png."""

    n_resamples: int = DEFAULT_RESAMPLES
    seed: int = 0
    level: float = LEVEL
    top_k: int = TOP_K
    batch_size: int = 32
    cache_dir: str | Path | None = None
    plots: bool = True


@dataclass
class Entry:
    """One export of the comparison: where it is, how it is labelled, and its encoder."""

    path: Path
    label: str
    meta: dict
    backend: OnnxBackend

    @property
    def source(self) -> str | None:
        return self.meta.get("source_model")

    @property
    def dimension(self) -> int:
        return int(self.backend.encoder.dimension)


def validate_exports(paths: Sequence[str | Path]) -> list[dict]:
    """The metadata of every export, checked before anything is loaded or written.

    Raises ValueError for fewer than two exports and ArtifactError (one line,
    naming the path) for a path that is not an intact attncal export, so that a
    mistyped path fails in a second rather than after the first encode."""
    if len(paths) < MIN_EXPORTS:
        raise ValueError(f"--compare needs at least {MIN_EXPORTS} exports (the first is the baseline), "
                         f"got {len(paths)}")
    return [open_export(p, graphs=None).meta for p in paths]


def open_entries(paths: Sequence[str | Path], batch_size: int) -> list[Entry]:
    """An Entry per path; an export listed twice shares one encoder (one ONNX session)."""
    metas = validate_exports(paths)
    labels = export_labels([Path(p).resolve().name for p in paths], [str(p) for p in paths], metas)
    sessions: dict[Path, OnnxBackend] = {}
    entries = []
    for p, label, meta in zip(paths, labels, metas):
        key = Path(p).resolve()
        if key not in sessions:
            sessions[key] = OnnxBackend(p, batch_size=batch_size)
        entries.append(Entry(Path(p), label, meta, sessions[key]))
    return entries


def _partner(entries: list[Entry], entry: Entry) -> Entry | None:
    """An uncalibrated export of the same source model, same precision first."""
    same = [e for e in entries if not e.meta.get("calibrated") and e.source is not None and e.source == entry.source]
    same.sort(key=lambda e: precision_of(e.meta) != precision_of(entry.meta))
    return same[0] if same else None


def query_encoders(entries: list[Entry], query_texts: Sequence[str]) -> tuple[list[int], list[str]]:
    """For each export, the index of the export whose graph encodes its queries; and notes saying so.

    See the module docstring: an export encodes its own queries unless its
    calibration would change them."""
    sources, notes = [], []
    for i, e in enumerate(entries):
        untouched, longest = queries_left_uncalibrated(e.backend, query_texts)
        if untouched:
            sources.append(i)
            continue
        rc = e.backend.stored.resolve()
        why = (f"the longest query has {longest} content tokens >= one basket of {rc.basket_size}"
               if rc.skip_short else "skip_short is off")
        other = _partner(entries, e)
        if other is None:
            raise ValueError(f"{e.path}: its calibration would change the queries ({why}), and no uncalibrated "
                             f"export of its source model {e.source} is in the comparison to encode them; "
                             f"add one (attncal export {e.source} -o DIR --no-calibration)")
        if other.dimension != e.dimension:
            raise ValueError(f"{e.path} and {other.path} differ in embedding dimension ({e.dimension} vs "
                             f"{other.dimension}), so the queries of one cannot be searched against the corpus of "
                             f"the other; re-export both from the same source model")
        sources.append(entries.index(other))
        notes.append(f"{e.label}: queries are encoded by {other.label} ({why}; queries are never calibrated)")
    return sources, notes


def _truncation(entry: Entry, data: Dataset, qids: list[str], dids: list[str], d_texts: list[str]) -> dict:
    """The export's truncation counts (its own tokenizer and max length); a lost end is not position bias."""
    lengths = dict(zip(dids, token_counts(entry.backend.tokenizer, d_texts)))
    t = truncation_stats(data, qids, lengths, effective_max_length(entry.backend))
    t.pop("_truncated_queries")
    return t


def _row(entry: Entry, scores: dict, truncation: dict, query_source: Entry) -> dict:
    return {
        "label": entry.label, "path": str(entry.path), "calibrated": bool(entry.meta.get("calibrated")),
        "config": entry.meta.get("config") if entry.meta.get("calibrated") else None,
        "precision": precision_of(entry.meta), "source_model": entry.source, "dimension": entry.dimension,
        "graph": entry.backend.encoder.graph_file, "queries_encoded_by": query_source.label,
        "scores": scores, "truncation": truncation,
    }


def _encode_all(entries: list[Entry], sources: list[int], data: Dataset, qids: list[str], cache: EncodeCache,
                top_k: int) -> tuple[list[dict], np.ndarray]:
    """Encode, search and score every export: (report rows, per-query nDCG@10 [exports, queries])."""
    from tqdm.auto import tqdm

    q_texts = [data.queries[q] for q in qids]
    dids = list(data.corpus)
    d_texts = [data.corpus[d] for d in dids]
    qrels = {q: data.qrels[q] for q in qids}
    fp, q_hash = data.fingerprint(), hash_texts(q_texts)
    q_embs: dict[int, np.ndarray] = {}
    rows, ndcg = [], []
    for i, e in enumerate(tqdm(entries, desc="exports", unit="export")):
        s = entries[sources[i]]
        if sources[i] not in q_embs:
            q_embs[sources[i]] = cache.get_or_encode(
                s.backend, s.backend.stored, q_hash, "queries",
                lambda s=s: s.backend.encode(q_texts, s.backend.stored, desc=f"encode queries {s.path.name}"))
        emb = cache.get_or_encode(e.backend, e.backend.stored, fp, "corpus",
                                  lambda e=e: e.backend.encode(d_texts, e.backend.stored,
                                                               desc=f"encode corpus {e.path.name}"))
        pq = per_query(qrels, exact_search(q_embs[sources[i]], emb, qids, dids, top_k))
        scores = scores_from_per_query(pq, data.group, data.groups).to_dict()
        rows.append(_row(e, scores, _truncation(e, data, qids, dids, d_texts), s))
        ndcg.append([pq[q]["ndcg10"] for q in qids])
    return rows, np.asarray(ndcg, dtype=np.float64)


def _add_deltas(rows: list[dict], ndcg: np.ndarray, resamples: Resamples, level: float) -> None:
    """Each non-baseline row's differences from the baseline, with paired bootstrap intervals."""
    base = rows[0]["scores"]
    rows[0]["delta"] = None
    for i, row in enumerate(rows[1:], 1):
        point = score_delta(row["scores"], base)
        row["delta"] = paired_deltas(ndcg[i], ndcg[0], point, resamples, level)


def compare_exports(paths: Sequence[str | Path], data: Dataset, opts: CompareOptions,
                    out: str | Path | None = None, overwrite: bool = False) -> dict:
    """Score every export on `data`, the deltas against the first; write the report to `out` (atomically)
    when given.  Returns results.json's content."""
    require_ir_measures()
    t0 = time.perf_counter()
    if opts.top_k < 10:
        raise ValueError(f"top-k must be >= 10 for nDCG@10, got {opts.top_k}")
    out_path = check_out_dir(out, overwrite)
    qids = data.query_ids()
    if not qids:
        raise ValueError(f"{data.name}: no query has both a relevant document and a position group")
    resamples = draw_resamples([data.group[q] for q in qids], data.groups, opts.n_resamples, opts.seed)
    entries = open_entries(paths, opts.batch_size)
    sources, notes = query_encoders(entries, [data.queries[q] for q in qids])
    cache = EncodeCache(opts.cache_dir)
    rows, ndcg = _encode_all(entries, sources, data, qids, cache, opts.top_k)
    _add_deltas(rows, ndcg, resamples, opts.level)
    notes = list(data.notes) + notes + [truncation_note(r["label"], r["truncation"])
                                        for r in rows if r["truncation"]["passages_truncated"]] + cache.repaired
    results = {
        "mode": "compare",
        "baseline": rows[0]["label"],
        "dataset": {"name": data.name, "layout": data.layout, "passages": len(data.corpus), "queries": len(qids),
                    "queries_per_group": {g: sum(1 for q in qids if data.group[q] == g) for g in data.groups}},
        "groups": list(data.groups),
        "top_k": opts.top_k,
        "metrics": METRICS,
        "bootstrap": describe(opts.n_resamples, opts.seed, opts.level, "every export"),
        "rows": rows,
        "cache": cache_record(cache),
        "notes": notes,
        "versions": library_versions(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if out_path is not None:
        _write(out_path, results, data, opts)
    return results


def summary(results: dict) -> str:
    """The two tables of the report (what the CLI prints)."""
    groups = tuple(results["groups"])
    return (scores_table(results["rows"], groups) + "\n"
            + delta_table(results["rows"], groups, results["bootstrap"]["level"]))


def _exports_section(rows: list[dict]) -> str:
    """Which graph ran for each export and who encoded its queries: what a reader needs to reproduce a row."""
    lines = ["\n## Exports\n"]
    for r in rows:
        by = "itself" if r["queries_encoded_by"] == r["label"] else r["queries_encoded_by"]
        lines.append(f"- {r['label']}: `{r['path']}`, graph `{r['graph']}`, {r['dimension']}-dimensional, "
                     f"queries encoded by {by}")
    if not any(r["truncation"]["passages_truncated"] for r in rows):
        lines.append("\nNo export truncates any passage: the tables measure position, not truncation.")
    return "\n".join(lines) + "\n"


def _write(out: Path, results: dict, data: Dataset, opts: CompareOptions) -> None:
    ds = results["dataset"]
    b = results["bootstrap"]
    text = [f"# attncal eval --compare: {data.name} ({data.layout}, {ds['passages']} passages, {ds['queries']} "
            "queries)\n\n",
            f"Baseline: `{results['rows'][0]['path']}`. Every export encodes the corpus with its own ONNX graph; "
            f"exact top-{opts.top_k} search; nDCG@10 per position group (binary relevance), HM = harmonic mean of "
            "the groups, PSI = 1 - min/max. Intervals: paired bootstrap over queries (resampled within their "
            f"position group), {b['resamples']} resamples, seed {b['seed']}.\n\n",
            summary(results), _exports_section(results["rows"])]
    if results["notes"]:
        text.append("\n" + "\n".join(f"- {n}" for n in results["notes"]) + "\n")
    with atomic_output_dir(out) as tmp:
        results["plots"] = {}
        if opts.plots:
            plot_drift(results["rows"], tuple(results["groups"]), opts.level, tmp / "drift.png")
            results["plots"]["drift"] = "drift.png"
        (tmp / "results.md").write_text("".join(text), encoding="utf-8")
        (tmp / "results.json").write_text(json.dumps(results, indent=2, default=json_default), encoding="utf-8")
