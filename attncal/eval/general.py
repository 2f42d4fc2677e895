"""Do no harm on general retrieval: a calibration checked on a BEIR-layout set without position labels.

Calibration is chosen on position-labelled queries; a deployment also serves every other query.  Before
re-indexing, `attncal tune --general DATA` scores the chosen configuration and the uncalibrated model on
any BEIR-layout set (corpus.jsonl, queries.jsonl, qrels/<split>.tsv; no positions needed): nDCG@10 and
Recall@10 with paired bootstrap intervals over the queries.  A configuration whose nDCG@10 interval lies
below 0 is flagged.  `--shuffled` adds the paper's robustness check: every document re-encoded with its
sentences in a seeded random order, the same two models compared on it.

`EXAMPLE` is a small set shipped with attncal for the demo and the tests (see its README.md): the
sections of the Python Language Reference that CPython ships (`pydoc_data.topics`), each section's
heading as the query for its text; `build_reference_sections` rebuilds it from the running Python.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from ..calibration.config import CalibrationConfig
from .bootstrap import LEVEL, draw_resamples, paired_mean_delta
from .data import Dataset, DataError, read_beir
from .encoders import EncodeCache, TorchBackend
from .metrics import per_query
from .output import hash_texts
from .prefix_cache import HiddenCache
from .realtext import LICENSE, URL, python_reference_documents
from .runner import exact_search
from .sweep import encode_sweep
from .text import prose_blocks, split_sentences, words

EXAMPLE = Path(__file__).parent / "sets" / "pyref-sections"
EXAMPLE_NAME = "example"  # what --general takes for the shipped set
ALL = "all"  # the one group of a set without positions


# --------------------------------------------------------------------------- loading
def load_general(path: str | Path, split: str = "test") -> Dataset:
    """A BEIR-layout set as a Dataset with one group ("all"), read as `read_beir` reads it (any positions are
    ignored); `example` is the shipped set."""
    root = EXAMPLE if str(path) == EXAMPLE_NAME else Path(path)
    if not (root / "corpus.jsonl").is_file():
        raise DataError(f"{root}: no corpus.jsonl (--general takes a BEIR-layout directory: corpus.jsonl, "
                        f"queries.jsonl, qrels/{split}.tsv)")
    corpus, queries, _, qrels = read_beir(root, split)
    name = "pyref-sections (shipped)" if root == EXAMPLE else root.name
    return Dataset(name, "beir", corpus, queries, qrels, {q: ALL for q in qrels}, (ALL,))


# --------------------------------------------------------------------------- the shuffled-sentence check
def shuffle_sentences(text: str, rng: random.Random) -> str:
    """The text's sentences (rule-based split) in a random order, joined by single spaces."""
    flat = " ".join(text.split())
    sents = [flat[s:e] for s, e in split_sentences(flat)]
    rng.shuffle(sents)
    return " ".join(sents)


def shuffled(data: Dataset, seed: int) -> Dataset:
    corpus = {d: shuffle_sentences(t, random.Random(f"{seed}:{d}")) for d, t in data.corpus.items()}
    return Dataset(f"{data.name}, sentences shuffled", data.layout, corpus, data.queries, data.qrels, data.group,
                   data.groups)


# --------------------------------------------------------------------------- scoring
def _score(backend: TorchBackend, data: Dataset, label: str, config: CalibrationConfig | None, *,
           cache: EncodeCache, hidden: HiddenCache, budget: int, n_resamples: int, seed: int, level: float,
           top_k: int, progress: bool) -> dict:
    qids = [q for q in data.queries if q in data.qrels]
    q_texts = [data.queries[q] for q in qids]
    dids = list(data.corpus)
    q_emb = cache.get_or_encode(backend, None, hash_texts(q_texts), "queries",
                                lambda: backend.encode(q_texts, None, desc="encode general queries"))
    configs = [] if config is None else [config]
    sweep = encode_sweep(backend, [data.corpus[d] for d in dids], configs, [label][:len(configs)], cache=cache,
                         hidden=hidden, data_fp=data.fingerprint(), budget_bytes=budget, progress=progress)
    qrels = {q: data.qrels[q] for q in qids}
    per = {lab: per_query(qrels, exact_search(q_emb, emb, qids, dids, top_k)) for lab, emb in sweep.embeddings.items()}
    resamples = draw_resamples([ALL] * len(qids), (ALL,), n_resamples, seed)
    rows = []
    for lab in per:
        vals = {m: np.array([per[lab][q][m] for q in qids]) for m in ("ndcg10", "recall10")}
        base = {m: np.array([per["uncalibrated"][q][m] for q in qids]) for m in ("ndcg10", "recall10")}
        row = {"label": lab, "scores": {m: float(v.mean()) for m, v in vals.items()},
               "passages_calibrated": sweep.runs[lab]["passages_calibrated"]}
        row["delta"] = None if lab == "uncalibrated" else {
            m: paired_mean_delta(vals[m], base[m], resamples, level) for m in ("ndcg10", "recall10")}
        rows.append(row)
    lengths = sorted(len(t) for t in data.corpus.values())
    return {"dataset": {"name": data.name, "passages": len(dids), "queries": len(qids),
                        "median_characters": lengths[len(lengths) // 2]},
            "rows": rows, "notes": sweep.notes}


def _flag(result: dict) -> tuple[bool, str]:
    row = result["rows"][-1]
    if row["delta"] is None:
        return False, "nothing calibrated to compare"
    d = row["delta"]["ndcg10"]
    ci = d["ci"] or [None, None]
    calibrated = row["passages_calibrated"]
    if not calibrated:
        return False, (f"{row['label']} changes none of these passages (all shorter than one basket): general "
                       "retrieval is unchanged by construction")
    where = f"ΔnDCG@10 {d['delta']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}] ({calibrated} of " \
            f"{result['dataset']['passages']} passages calibrated)"
    if ci[1] is not None and ci[1] < 0:
        return True, f"{row['label']} loses general retrieval significantly: {where}"
    return False, f"{row['label']} does no significant harm to general retrieval: {where}"


def general_check(backend: TorchBackend, data: Dataset, label: str, config: CalibrationConfig, *,
                  cache: EncodeCache, hidden: HiddenCache, budget: int, n_resamples: int, seed: int = 0,
                  level: float = LEVEL, top_k: int = 100, with_shuffled: bool = False, progress: bool = True) -> dict:
    """`config` and the uncalibrated model on `data` (and its shuffled copy): scores, paired intervals, a flag."""
    kw = dict(cache=cache, hidden=hidden, budget=budget, n_resamples=n_resamples, seed=seed, level=level,
              top_k=top_k, progress=progress)
    out = _score(backend, data, label, config, **kw)
    out["flagged"], out["verdict"] = _flag(out)
    if with_shuffled:
        sh = _score(backend, shuffled(data, seed), label, config, **kw)
        sh["flagged"], sh["verdict"] = _flag(sh)
        out["shuffled"] = sh
    return out


# --------------------------------------------------------------------------- building the shipped set
_UNDERLINE = re.compile(r"^([*=\-~^])\1{2,}$")
MIN_WORDS = 60  # a section shorter than this is not a passage worth retrieving
MAX_WORDS = 300  # whole sentences up to this many words: long enough to calibrate, small enough to ship
GENERIC_HEADINGS = {"overview", "examples", "example", "notes", "note", "see also", "details"}


def _sections(name: str, text: str) -> list[tuple[str, str]]:
    """(heading, prose) of every underlined section of one pydoc topic."""
    lines = text.split("\n")
    heads = [i for i in range(1, len(lines)) if _UNDERLINE.match(lines[i].strip()) and lines[i - 1].strip()]
    out = []
    for j, i in enumerate(heads):
        end = heads[j + 1] - 1 if j + 1 < len(heads) else len(lines)
        body = "\n".join(lines[i + 1:end])
        out.append((lines[i - 1].strip(), " ".join(prose_blocks(body))))
    return out


def _cap(prose: str) -> str:
    kept, n = [], 0
    for s, e in split_sentences(prose):
        k = len(words(prose[s:e]))
        if kept and n + k > MAX_WORDS:
            break
        kept.append(prose[s:e])
        n += k
    return " ".join(kept)


def build_reference_sections() -> tuple[list[dict], list[dict], list[tuple[str, str]], dict]:
    """(corpus, queries, qrels, manifest) of the shipped set, from the running Python's pydoc topics.

    Every section with at least MIN_WORDS words of prose becomes a document (its first MAX_WORDS words, in
    whole sentences; a section repeated in another topic is kept once).  A section whose heading names it
    alone (not generic, not shared with another kept section) gives a query: the heading, with the section
    as its one relevant document; the other sections stay in the corpus as distractors."""
    docs, source = python_reference_documents()
    corpus: list[dict] = []
    seen: set[str] = set()
    heading_of: dict[str, str] = {}
    for doc in docs:
        topic = doc.id.split(":", 1)[1]
        for n, (heading, prose) in enumerate(_sections(topic, doc.text)):
            text = _cap(prose)
            key = " ".join(words(text)).lower()
            if len(words(text)) < MIN_WORDS or key in seen:
                continue
            seen.add(key)
            did = f"{topic}#{n}"
            corpus.append({"_id": did, "text": text})
            heading_of[did] = heading
    count: dict[str, int] = {}
    for h in heading_of.values():
        count[h.lower()] = count.get(h.lower(), 0) + 1
    queries, qrels = [], []
    for did, h in heading_of.items():
        if count[h.lower()] == 1 and h.lower() not in GENERIC_HEADINGS and len(words(h)) >= 1:
            qid = f"q{len(queries):04d}"
            queries.append({"_id": qid, "text": h})
            qrels.append((qid, did))
    manifest = {"name": "pyref-sections", "layout": "beir", "source": dict(source, license=LICENSE, url=URL),
                "documents": len(corpus), "queries": len(queries),
                "construction": f"one document per section of pydoc_data.topics with >= {MIN_WORDS} words of prose "
                                f"(code and grammar dropped, the first {MAX_WORDS} words in whole sentences, repeated "
                                "sections kept once); one query per section whose heading is unique and not "
                                "generic: the heading; binary qrels"}
    return corpus, queries, qrels, manifest


def write_beir(out: str | Path, corpus: Sequence[dict], queries: Sequence[dict], qrels: Sequence[tuple[str, str]],
               manifest: dict) -> Path:
    out = Path(out)
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    for name, rows in (("corpus.jsonl", corpus), ("queries.jsonl", queries)):
        (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    (out / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n"
                                            + "".join(f"{q}\t{d}\t1\n" for q, d in qrels), encoding="utf-8")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out
