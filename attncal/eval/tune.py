"""`tune`: should this model be calibrated on these documents, and how?

One call does what the manual path (`attncal eval --make-posq`, a grid, `--compare --bootstrap`) does in
four steps, and decides on evidence the choice was not made on:

1. the position-labelled set: built from the user's documents with the `--make-posq` builder, or given;
2. a seeded split of the documents (never of one document's passages) into a selection and a confirmation
   part (`attncal.eval.recommend.split_documents`); too few queries per position group in a part is a
   refusal that says how many more documents would do (`MIN_QUERIES_PER_GROUP`);
3. a grid fitted to the model and the passages (by default: baskets of 1/8, 1/4 and 1/2 of the typical
   passage, four strengths, the last layer and the last two, the variants that differ for the model's
   pooling) swept on the selection part with the uncalibrated model, sharing the uncalibrated layers below
   each configuration's first calibrated one (`attncal.eval.sweep`);
4. the distinct configurations counted (equal embeddings are one configuration, an unchanged corpus none),
   their paired bootstrap intervals against the uncalibrated model at the family-wise level for that count,
   and the candidate chosen by the written rule (`attncal.eval.recommend`);
5. the candidate alone run on the confirmation part: its held-out ΔHM is the expected effect, and it must
   hold there; the uncalibrated model's bias direction, the beginning group's loss and (optionally) a general
   retrieval check can each block the recommendation, and the decision names the trade-off;
6. optionally the recommendation exported with its uncalibrated twin (parity-checked by the exporter).

Everything is checked before the first encode (OUT, the grid, the model's max length against the
baskets, the data, the hidden-state cache's size); the report (report.md, results.json, plots, the set
and any exports) is written to a temporary directory and renamed into place when complete.
"""

from __future__ import annotations

import itertools
import json
import math
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..calibration.config import VARIANTS, CalibrationConfig
from .bootstrap import LEVEL, describe, draw_resamples, paired_deltas, paired_mean_delta
from .data import Dataset, load_dataset
from .encoders import EncodeCache, TorchBackend, content_lengths
from .general import general_check, load_general
from .metrics import per_query, require_ir_measures, score_delta, scores_from_per_query
from .output import atomic_output_dir, cache_record, check_out_dir, display_path, hash_texts, library_versions
from .posq_builder import build_posq, read_documents, write_posq
from .prefix_cache import HiddenCache, check_budget, estimate_bytes
from .recommend import (
    CONFIRMATION, SELECTION, Rule, bias_direction, decide, distinct, resamples_for, select, split_documents,
)
from .runner import (
    BASELINES, METRICS, TOP_K, effective_max_length, exact_search, is_export, sea_embeddings,
    truncation_note, truncation_stats,
)
from .sweep import Sweep, effective
from .tune_report import write_report

GIB = 2 ** 30
DEFAULT_BUDGET_GIB = 8.0
DEFAULT_RESAMPLES = 1000


def _paper(ctx: GridContext | None = None) -> list[CalibrationConfig]:
    """The paper's grid: 2 layer sets x 2 baskets x 2 strengths x 3 variants."""
    return [CalibrationConfig(variant=v, strength=s, basket_size=b, layers=layers)
            for layers, b, s, v in itertools.product(("last", "last-half"), (128, 256), (0.5, 1.0),
                                                     ("uniform", "cls-soft", "cls-hard"))]


@dataclass
class GridContext:
    """What a grid is fitted to: the model (its pooling and maximum length) and the passages' token lengths."""

    backend: TorchBackend
    lengths: list[int]  # tokens of every passage as the model reads it (special tokens included)


FITTED_FRACTIONS = (0.125, 0.25, 0.5)  # baskets, as shares of the typical passage's content
FITTED_STRENGTHS = (0.25, 0.5, 0.75, 1.0)


def typical_content(ctx: GridContext) -> int:
    """The median passage's content tokens (what a basket divides), as the model reads it."""
    iso = ctx.backend.bind(CalibrationConfig()).resolve().n_isolated
    return max(1, int(np.median(np.asarray(ctx.lengths)) - iso))


def distinct_variants(backend: TorchBackend) -> list[list[str]]:
    """The variants grouped by what they compute for this model's pooling (each group in VARIANTS order)."""
    groups: dict = {}
    for v in VARIANTS:
        key = effective(backend.bind(CalibrationConfig(variant=v)).resolve())
        groups.setdefault(key, []).append(v)
    return list(groups.values())


def fitted_layers(backend: TorchBackend) -> list:
    """The last layer, and the last two: a calibrated layer costs about one and a half uncalibrated ones, so
    24 configurations over at most three layers each stay within the sweep's budget (8 uncalibrated encodes
    with the confirmation) on a 6-layer model; the last half of a deeper model would not."""
    from ..calibration.probing import layer_blocks  # lazy: torch (the export extra), not needed to import eval

    return ["last", [-2, -1]] if len(layer_blocks(backend.encoder.model).blocks) > 1 else ["last"]


def fitted(ctx: GridContext) -> list[CalibrationConfig]:
    """Baskets of 1/8, 1/4 and 1/2 of the typical passage's content (so that most passages are calibrated by
    every one), λ 0.25 / 0.5 / 0.75 / 1, the last layer and the last two: 24 configurations of the published
    default variant, or of the variant it computes the same as for this pooling (uniform under mean pooling).
    Where the variants differ for this pooling, each other variant adds the middle basket at λ 0.5 and 1 on
    the last layer."""
    typical = typical_content(ctx)
    baskets = sorted({max(2, round(typical * f)) for f in FITTED_FRACTIONS})
    classes = distinct_variants(ctx.backend)
    main = next(c for c in classes if "cls-soft" in c)[0]
    out = [CalibrationConfig(variant=main, strength=s, basket_size=b, layers=layers)
           for layers, b, s in itertools.product(fitted_layers(ctx.backend), baskets, FITTED_STRENGTHS)]
    middle = baskets[len(baskets) // 2]
    for c in classes:
        if c[0] != main:
            out += [CalibrationConfig(variant=c[0], strength=s, basket_size=middle, layers="last") for s in (0.5, 1.0)]
    return out


PRESETS = {
    "fitted": ("fitted to the model and the passages: baskets 1/8, 1/4, 1/2 of the typical passage's content, "
               "λ 0.25 / 0.5 / 0.75 / 1, the last layer and the last two; variants only where they differ for "
               "the model's pooling", fitted),
    "paper": ("the paper's 24: layers last / last half, basket 128 / 256, λ 0.5 / 1, uniform / cls-soft / cls-hard",
              _paper),
    "default": ("the published default alone (cls-soft, λ 0.5, basket 128, last half)",
                lambda ctx=None: [CalibrationConfig()]),
    "strengths": ("the default with λ 0.25, 0.5, 0.75, 1", lambda ctx=None: [CalibrationConfig(strength=s)
                                                                             for s in (0.25, 0.5, 0.75, 1.0)]),
}
DEFAULT_GRID = "fitted"


def grid_label(cfg: CalibrationConfig) -> str:
    """`variant λ b<basket> <layers>`, e.g. `cls-soft λ0.5 b128 last-half`."""
    layers = cfg.layers if isinstance(cfg.layers, str) else ",".join(map(str, cfg.layers))
    return f"{cfg.variant} λ{cfg.strength:g} b{cfg.basket_size} {layers}"


def preset(name: str, ctx: GridContext | None = None) -> tuple[list[CalibrationConfig], list[str]]:
    """A preset's configurations and labels; `fitted` needs the context it is fitted to."""
    if name not in PRESETS:
        raise ValueError(f"unknown grid preset {name!r}; presets: {', '.join(PRESETS)} (or a YAML file)")
    if ctx is None and name == "fitted":
        raise ValueError("the fitted grid needs the model and the passages (GridContext)")
    configs = PRESETS[name][1](ctx)
    return configs, [grid_label(c) for c in configs]


ExportStep = Callable[[str, Path, CalibrationConfig, bool], dict]
"""(model, output directory, configuration, calibrate) -> the export's attncal.json: how `opts.export` exports.
eval does not import the exporter (a sibling layer); `attncal.cli.tune.export_step` is the command line's."""


MIN_QUERIES_PER_GROUP = 60
"""Queries per position group each part needs, at least.  ΔHM ≈ the mean of the G groups' Δ when the groups
score alike, so its 95 % interval's half-width is about 1.96 σ / √(G n) for n queries per group, σ being the
spread of one query's paired nDCG@10 difference.  σ ≈ 0.135 on the real-prose example of docs/tuning.md (a
half-width of 0.0095 on 257 queries per group); a held-out half-width of 0.02, the size of the effects
calibration has shown and of the default --max-begin-loss, then needs (1.96 · 0.135 / 0.02)² / 3 ≈ 58 queries
per group, rounded up to 60."""
MIN_QUERIES_WHY = ("a held-out ΔHM interval of about ±0.02 needs about 60 queries per group: its half-width is "
                   "1.96 σ / √(3 n) with σ ≈ 0.135 per query (docs/tuning.md, 'Too little data')")


@dataclass
class TuneOptions:
    """What `tune` sweeps and how it decides; the CLI's flags map one to one."""

    configs: list[CalibrationConfig] = field(default_factory=list)  # empty: the `grid` preset
    labels: list[str] | None = None
    grid: str = DEFAULT_GRID  # the preset used when `configs` is empty, or the YAML file's name (report only)
    baselines: Sequence[str] = ()
    sea_chunk_tokens: int = 128
    max_begin_loss: float = 0.02
    tie_margin: float = 0.001
    accept_general_loss: float = 0.0
    min_queries: int = MIN_QUERIES_PER_GROUP  # per position group in each part
    confirm_only: bool = False  # the grid was chosen elsewhere: every document is held out, nothing selected
    n_resamples: int = DEFAULT_RESAMPLES
    seed: int = 0
    level: float = LEVEL
    top_k: int = TOP_K
    batch_size: int = 32
    max_length: int | None = None
    cache_dir: str | Path | None = None  # embeddings and hidden states; None: hidden states in a temporary dir
    cache_budget_gib: float = DEFAULT_BUDGET_GIB
    general: str | Path | None = None  # a BEIR-layout directory, or "example" (the shipped set)
    general_split: str = "test"
    shuffled: bool = False
    export: bool = False
    exporter: str = "dynamo"
    plots: bool = True
    progress: bool = True
    command: str | None = None  # the command line that ran this, for the report

    def resolved_grid(self, ctx: GridContext | None = None) -> tuple[list[CalibrationConfig], list[str]]:
        if not self.configs:
            return preset(self.grid, ctx)
        labels = list(self.labels) if self.labels else [grid_label(c) for c in self.configs]
        return list(self.configs), labels

    def rule(self) -> Rule:
        return Rule(self.max_begin_loss, self.tie_margin, self.level, self.accept_general_loss)


def _validate(opts: TuneOptions, out: Path | None, export_step: ExportStep | None) -> None:
    if not opts.configs and opts.grid not in PRESETS:
        raise ValueError(f"unknown grid preset {opts.grid!r}; presets: {', '.join(PRESETS)} (or a YAML file)")
    if opts.configs:
        _validate_grid(*opts.resolved_grid())
    unknown = sorted(set(opts.baselines) - set(BASELINES))
    if unknown:
        raise ValueError(f"unknown baseline(s) {', '.join(unknown)}; available: {', '.join(BASELINES)}")
    if opts.top_k < 10:
        raise ValueError(f"top-k must be >= 10 for nDCG@10, got {opts.top_k}")
    if opts.n_resamples < 1:
        raise ValueError(f"--bootstrap must be >= 1 resample, got {opts.n_resamples}")
    if opts.min_queries < 1:
        raise ValueError(f"--min-queries must be >= 1, got {opts.min_queries}")
    if opts.cache_budget_gib <= 0:
        raise ValueError(f"--cache-budget must be > 0 GiB, got {opts.cache_budget_gib}")
    if opts.export and out is None:
        raise ValueError("--export writes the exports into OUT; give -o OUT")
    if opts.export and export_step is None:
        raise ValueError("TuneOptions(export=True) needs tune(..., export_step=...): "
                         "attncal.cli.tune.export_step(exporter, max_length) makes the command line's")
    if opts.shuffled and opts.general is None:
        raise ValueError("--shuffled re-encodes the --general set with its sentences shuffled; give --general DATA")
    opts.rule()


def _validate_grid(configs: list[CalibrationConfig], labels: list[str]) -> None:
    if not configs:
        raise ValueError("the grid is empty")
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"the grid has two configurations named {dup[0]!r}; names must be unique")
    if "uncalibrated" in labels:
        raise ValueError("'uncalibrated' is the name of the reference row; rename that configuration")


def basket_reach(backend: TorchBackend, configs: list[CalibrationConfig], labels: list[str],
                 model: str) -> list[str]:
    """Refuse a model whose max length is shorter than one basket of every configuration (nothing could be
    calibrated); name the configurations that can calibrate no passage of this model."""
    ml = effective_max_length(backend)
    if ml is None:
        return []
    out, never = [], []
    for lab, cfg in zip(labels, configs):
        rc = backend.bind(cfg).resolve()
        if rc.skip_short and ml - rc.n_isolated < rc.basket_size:
            never.append((lab, rc.basket_size, ml - rc.n_isolated))
    if len(never) == len(configs):
        smallest = min(b for _, b, _ in never)
        raise ValueError(f"{model}: its maximum length ({ml} tokens) is shorter than one basket of every configuration "
                         f"in the grid (the smallest is {smallest} tokens): nothing would be calibrated; use baskets "
                         f"of at most {max(c for _, _, c in never)} tokens")
    if never:
        out.append(f"{len(never)} configuration{'s' if len(never) > 1 else ''} ({', '.join(n for n, _, _ in never)}) "
                   f"can calibrate no passage of this model: a basket of {never[0][1]} tokens is more content than "
                   f"its maximum length of {ml} tokens holds; they equal the uncalibrated model")
    return out


def _part_rows(data: Dataset, part: Part, embeddings: dict[str, np.ndarray], q_emb: np.ndarray,
               kinds: dict[str, str], configs: dict[str, dict | None], level: float, n_resamples: int, seed: int,
               untruncated: set[str] | None, top_k: int) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Scores, per-query nDCG@10 and the paired intervals of every row against the uncalibrated one, on one part:
    its queries searching its own passages."""
    qids = part.qids
    qrels = {q: data.qrels[q] for q in qids}
    resamples = draw_resamples([data.group[q] for q in qids], data.groups, n_resamples, seed)
    per = {lab: per_query(qrels, exact_search(q_emb, emb, qids, part.dids, top_k))
           for lab, emb in embeddings.items()}
    values = {lab: np.array([p[q]["ndcg10"] for q in qids]) for lab, p in per.items()}
    base = scores_from_per_query(per["uncalibrated"], data.group, data.groups).to_dict()
    keep = None if untruncated is None else [q for q in qids if q in untruncated]
    rows = []
    for lab, p in per.items():
        scores = scores_from_per_query(p, data.group, data.groups).to_dict()
        row = {"label": lab, "kind": kinds[lab], "config": configs.get(lab), "scores": scores, "delta": None}
        if lab != "uncalibrated":
            row["delta"] = paired_deltas(values[lab], values["uncalibrated"], score_delta(scores, base), resamples,
                                         level)
            row["delta"]["ndcg10"] = paired_mean_delta(values[lab], values["uncalibrated"], resamples, level)
        if keep is not None:
            row["untruncated"] = (scores_from_per_query({q: p[q] for q in keep}, data.group, data.groups).to_dict()
                                  if keep else None)
        rows.append(row)
    return rows, values


@dataclass
class Part:
    """The passages and queries of one part of the split."""

    name: str
    dids: list[str]
    qids: list[str]
    documents: list[str]


def passage_documents(data: Dataset, set_dir: Path | None) -> dict[str, str]:
    """{passage id: its document}: the `doc` field of a posq set's passages.jsonl (the builder writes it);
    a passage without one is its own document."""
    doc = {d: d for d in data.corpus}
    path = None if set_dir is None else Path(set_dir) / "passages.jsonl"
    if path is not None and path.is_file():
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    obj = json.loads(line)
                    pid = obj.get("id", obj.get("_id", obj.get("passage_id")))
                    d = obj.get("doc", obj.get("document"))
                    if pid in doc and d is not None:
                        doc[pid] = f"doc:{d}"
    return doc


def _units(data: Dataset, qids: list[str], doc: dict[str, str]) -> dict[str, str]:
    """{document: its unit}: documents that one query is relevant in are one unit, so a split never separates a
    query from any of its relevant passages."""
    parent = {d: d for d in set(doc.values())}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for q in qids:
        ds = sorted({doc[p] for p in data.qrels[q] if p in doc})
        for other in ds[1:]:
            parent[find(other)] = find(ds[0])
    return {d: find(d) for d in parent}


def split_set(data: Dataset, qids: list[str], doc: dict[str, str], seed: int, confirm_only: bool) -> list[Part]:
    """The selection and confirmation parts (by document; see `recommend.split_documents`), or one part holding
    everything with `confirm_only`."""
    unit = _units(data, qids, doc)
    q_unit = {q: unit[doc[next(p for p in data.qrels[q] if p in doc)]] for q in qids}
    counts = {u: 0 for u in set(unit.values())}
    for q in qids:
        counts[q_unit[q]] += 1
    part_of = ({u: CONFIRMATION for u in counts} if confirm_only else split_documents(counts, seed))
    names = [CONFIRMATION] if confirm_only else [SELECTION, CONFIRMATION]
    docs_of = {n: sorted(d for d, u in unit.items() if part_of[u] == n) for n in names}
    return [Part(n, [d for d in data.corpus if part_of[unit[doc[d]]] == n],
                 [q for q in qids if part_of[q_unit[q]] == n], docs_of[n]) for n in names]


def check_enough(data: Dataset, parts: list[Part], n_documents: int, min_queries: int) -> dict:
    """Refuse (ValueError) when a part has fewer than `min_queries` queries in a position group, saying how many
    more documents like these would give enough; else the counts."""
    counts = {p.name: {g: sum(1 for q in p.qids if data.group[q] == g) for g in data.groups} for p in parts}
    worst = min(((n, g, c) for n, per in counts.items() for g, c in per.items()), key=lambda x: x[2])
    record = {"min_queries_per_group": min_queries, "why": MIN_QUERIES_WHY, "queries_per_group": counts}
    if worst[2] >= min_queries:
        return record
    total = {g: sum(per[g] for per in counts.values()) for g in data.groups}
    need = min_queries * len(parts)
    more = max(0, max(math.ceil((need - total[g]) * n_documents / max(total[g], 1)) for g in data.groups))
    where = "there are" if len(parts) == 1 else f"the {worst[0]} part has"
    raise ValueError(f"too little data to decide: {where} {worst[2]} {worst[1]} queries, fewer than the {min_queries} "
                     f"per position group{' in each part' if len(parts) > 1 else ''} that "
                     f"{MIN_QUERIES_WHY.split(':')[0]}; "
                     f"about {max(more, 1)} more documents like these {n_documents} would give enough "
                     "(--min-queries N decides on wider intervals)")


def _export(model: str, cfg: CalibrationConfig, tmp: Path, export_step: ExportStep) -> dict:
    """The recommended configuration and its uncalibrated twin, exported with the exporter's parity check."""
    out = {}
    for name, calibrate in (("calibrated", True), ("uncalibrated", False)):
        meta = export_step(model, tmp / f"export-{name}", cfg, calibrate)
        p = meta.get("parity") or {}
        out[name] = {"dir": f"export-{name}", "parity_ok": p.get("ok"), "max_abs": p.get("max_abs"),
                     "min_cos": p.get("min_cos")}
    return out


def build_set(documents: list, source: dict, backend: TorchBackend, model: str, workdir: Path, posq_options=None
              ) -> tuple[Dataset, dict]:
    """The position-labelled set from the user's documents (the `--make-posq` builder, the model's own
    tokenizer), written to `workdir` and loaded from there."""
    posq = build_posq(documents, backend.tokenizer, effective_max_length(backend), posq_options,
                      tokenizer_label=str(model), source=source)
    write_posq(workdir, posq, overwrite=True)
    data = load_dataset(workdir)
    data.name = source.get("name") or Path(source["path"]).name
    return data, posq.manifest


def tune(model: str, data: Dataset | str | Path | None = None, opts: TuneOptions | None = None,
         out: str | Path | None = None, *, docs: str | Path | tuple[list, dict] | None = None, posq_options=None,
         text_field: str = "text", split: str = "test", overwrite: bool = False,
         export_step: ExportStep | None = None) -> dict:
    """Split, sweep, select, confirm, decide and report (see the module docstring).  Give `docs` (documents
    to build the set from: a path as `attncal eval --make-posq` takes it, or (documents, source) as
    `read_documents` and `python_reference_documents` return them) or `data` (a position-labelled set: a
    Dataset or its directory).  `export_step` exports the recommendation where `opts.export` asks for it.
    Returns results.json's content."""
    require_ir_measures()
    t0 = time.perf_counter()
    opts = opts or TuneOptions()
    if (data is None) == (docs is None):
        raise ValueError("give the documents to build the set from (--docs) or a position-labelled set (--data), "
                         "one of them")
    out_path = check_out_dir(out, overwrite)
    _validate(opts, out_path, export_step)
    if is_export(model):
        raise ValueError(f"{model} is an attncal export, which evaluates its stored calibration only; attncal tune "
                         "sweeps configurations of the model directory")
    if docs is not None and not isinstance(docs, tuple):
        docs = read_documents(docs, text_field)  # an empty or unreadable DOCS fails here, before the model loads
    general = load_general(opts.general, opts.general_split) if opts.general is not None else None
    set_source = None
    if data is not None and not isinstance(data, Dataset):
        set_source = Path(data)
        data = load_dataset(data, split=split)
    backend = TorchBackend(model, batch_size=opts.batch_size, max_length=opts.max_length)
    with tempfile.TemporaryDirectory(prefix="attncal-tune-set-") as workdir:
        manifest = None
        if docs is not None:
            data, manifest = build_set(*docs, backend, model, Path(workdir) / "set", posq_options)
            set_source = Path(workdir) / "set"
        hidden = HiddenCache(None if opts.cache_dir is None else Path(opts.cache_dir) / "hidden")
        try:
            results = _run(model, data, opts, backend, hidden, general, out_path, set_source, manifest, t0,
                           export_step)
        finally:
            hidden.close()
    return results


def _grid_record(opts: TuneOptions, labels: list[str], runs: dict, same: dict[str, str], no_op: list[str],
                 ctx: GridContext) -> dict:
    described = not opts.configs and opts.grid in PRESETS
    rec = {"name": opts.grid if not opts.configs else "custom", "configurations": len(labels),
           "description": PRESETS[opts.grid][0] if described else None,
           "distinct": len(labels) - len(same) - len(no_op),
           "no_op": no_op, "same_as": same}
    if not opts.configs and opts.grid == "fitted":
        rec["typical_content_tokens"] = typical_content(ctx)
    return rec


def _combined_timing(parts: list[dict]) -> dict:
    """The sweeps of both parts as one: the uncalibrated passes together are one uncalibrated encode."""
    def total(key: str) -> float | None:
        vals = [t.get(key) for t in parts]
        return None if any(v is None for v in vals) else round(sum(vals), 3)

    out = {k: total(k) for k in ("uncalibrated_pass_s", "uncalibrated_pass_cpu_s", "hidden_write_s", "hidden_read_s",
                                 "configs_s", "encode_s", "encode_cpu_s", "hidden_bytes_written", "plan_s", "wall_s")}
    computed = all(t["factor"] is not None or t.get("configs_s") == 0.0 and t["uncalibrated_pass_s"] is not None
                   for t in parts)
    u, uc = out["uncalibrated_pass_s"], out["uncalibrated_pass_cpu_s"]
    out["factor"] = round(out["encode_s"] / u, 2) if computed and u else None
    out["factor_cpu"] = round(out["encode_cpu_s"] / uc, 2) if computed and uc else None
    out["factor_definition"] = ("encoding time of every sweep of the run (the uncalibrated pass of each part, "
                                "hidden-state writes and reads, every configuration on the selection part and the "
                                "candidate on the confirmation part) / the uncalibrated passes alone (together one "
                                "uncalibrated encode of all passages); factor in wall time, factor_cpu in this "
                                "process's CPU time")
    out["layers"] = parts[0]["layers"]
    out["start_layers"] = sorted({k for t in parts for k in t["start_layers"]})
    out["resumed"] = all(t["resumed"] or not t["start_layers"] for t in parts)
    out["parts"] = parts
    return out


def _run(model, data: Dataset, opts: TuneOptions, backend: TorchBackend, hidden: HiddenCache,
         general: Dataset | None, out_path: Path | None, set_source: Path | None, manifest: dict | None, t0: float,
         export_step: ExportStep | None) -> dict:
    """One tuning run: split by document, sweep the grid on the selection part, select, confirm on the held-out
    part, check the general set, decide, and write the report.

    long: the steps share one run's state (the parts, both sweeps, the rows, the decision), most of which the
    report records; each step's logic is a function of its own (`split_set`, `select`, `decide`, `_part_rows`,
    `write_report`)."""
    qids = data.query_ids()
    if not qids:
        raise ValueError(f"{data.name}: no query has both a relevant document and a position group")
    if len(data.groups) < 2:
        raise ValueError(f"{data.name}: one position group; tune compares the first with the later ones")
    doc = passage_documents(data, set_source)
    n_docs = len(set(doc.values()))
    parts = split_set(data, qids, doc, opts.seed, opts.confirm_only)
    if not opts.confirm_only and any(not p.qids for p in parts):
        raise ValueError(f"too little data to decide: {n_docs} document{'s' if n_docs != 1 else ''}, and the split "
                         "by document needs queries in two parts")
    enough = check_enough(data, parts, n_docs, opts.min_queries)
    dids = list(data.corpus)
    d_texts = [data.corpus[d] for d in dids]
    ctx = GridContext(backend, content_lengths(backend, d_texts))
    configs, labels = opts.resolved_grid(ctx)
    _validate_grid(configs, labels)
    notes = basket_reach(backend, configs, labels, model)
    config_of = dict(zip(labels, configs))
    cache = EncodeCache(opts.cache_dir)
    budget = int(opts.cache_budget_gib * GIB)
    select_part, confirm_part = (None, parts[0]) if opts.confirm_only else parts
    first = select_part or confirm_part

    def texts(part: Part) -> list[str]:
        return [data.corpus[d] for d in part.dids]

    def fp(part: Part) -> str:
        return hash_texts([f"{d}\0{data.corpus[d]}" for d in part.dids])

    sweep = Sweep(backend, texts(first), configs, labels, cache=cache, hidden=hidden, data_fp=fp(first),
                  budget_bytes=budget, progress=opts.progress)  # refuses an over-budget cache before any encode
    if select_part is not None:  # the candidate's run on the confirmation part stores at most one more layer
        check_budget(sweep.estimated_bytes + estimate_bytes(np.asarray(content_lengths(backend, texts(confirm_part))),
                                                            backend.encoder.model.config.hidden_size, 1),
                     budget, hidden.root, "the hidden states of both parts")
    q_texts = [data.queries[q] for q in qids]
    q_all = cache.get_or_encode(backend, None, hash_texts(q_texts), "queries",
                                lambda: backend.encode(q_texts, None, desc="encode queries"))
    q_row = {q: i for i, q in enumerate(qids)}

    def q_emb(part: Part) -> np.ndarray:
        return q_all[[q_row[q] for q in part.qids]]

    result = sweep.run()
    kinds = {lab: "calibrated" for lab in labels}
    kinds["uncalibrated"] = "uncalibrated"
    bound = {lab: backend.bind(c).to_dict() for lab, c in zip(labels, configs)}
    embeddings = dict(result.embeddings)
    same, no_op = distinct({lab: embeddings[lab] for lab in labels}, embeddings["uncalibrated"])
    compared = [lab for lab in labels if lab not in same and lab not in no_op]
    rule = opts.rule()
    m = max(len(compared), 1)
    sel_level = rule.family_level(m)
    sea_chunker = None
    if "sea" in opts.baselines:
        lab = f"SEA ({opts.sea_chunk_tokens}-token chunks)"
        embeddings[lab], sea_chunker = sea_embeddings(cache, backend, texts(first), fp(first), opts.sea_chunk_tokens)
        kinds[lab] = "baseline"
    lengths = dict(zip(dids, ctx.lengths))
    truncation = truncation_stats(data, qids, lengths, effective_max_length(backend))
    cut = set(truncation.pop("_truncated_queries"))
    if truncation["passages_truncated"]:
        notes.append(truncation_note(truncation))
    untruncated = {q for q in qids if q not in cut} if truncation["passages_truncated"] else None
    n_sel = resamples_for(sel_level, opts.n_resamples)
    rows, values = _part_rows(data, first, embeddings, q_emb(first), kinds, bound, sel_level, n_sel, opts.seed,
                              untruncated, opts.top_k)
    for r in rows:
        r["run"] = result.runs.get(r["label"])
        r["distinct"] = (f"same as {same[r['label']]}" if r["label"] in same
                         else "no-op: changes no passage" if r["label"] in no_op else None)
    chosen = select([r for r in rows if r["label"] in compared], data.groups, rule,
                    "the selection part" if select_part is not None else "these documents")
    for r in rows:
        r["verdict"] = chosen["verdicts"].get(r["label"]) or r["distinct"]
    candidate = chosen["candidate"]
    if select_part is None:  # confirm-only: every document is held out, the family-wise rows are the held-out ones
        held_rows, held_values, conf_result = rows, values, result
        held = next((r for r in rows if r["label"] == (candidate or chosen["closest"])), None)
    else:
        conf_cfg = [config_of[candidate]] if candidate is not None else []
        conf_sweep = Sweep(backend, texts(confirm_part), conf_cfg, [candidate][:len(conf_cfg)], cache=cache,
                           hidden=hidden, data_fp=fp(confirm_part), budget_bytes=budget, progress=opts.progress)
        conf_result = conf_sweep.run()
        held_rows, held_values = _part_rows(data, confirm_part, dict(conf_result.embeddings), q_emb(confirm_part),
                                            kinds, bound, opts.level, opts.n_resamples, opts.seed, untruncated,
                                            opts.top_k)
        for r in held_rows:
            r["run"] = conf_result.runs.get(r["label"])
        held = next((r for r in held_rows if r["label"] == candidate), None)
    base_all = np.concatenate([values["uncalibrated"]] + ([] if select_part is None else [held_values["uncalibrated"]]))
    groups_all = [data.group[q] for q in first.qids] + ([] if select_part is None else
                                                        [data.group[q] for q in confirm_part.qids])
    bias = bias_direction(base_all, groups_all, data.groups, level=opts.level, n_resamples=opts.n_resamples,
                          seed=opts.seed)
    general_result = None
    check = candidate or chosen["closest"]
    if general is not None and check is not None:
        general_result = general_check_for(backend, general, check, config_of[check], cache, hidden, budget, opts)
        general_result["recommended"] = False
    decision = decide(chosen, held, bias, general_result if candidate is not None else None, data.groups, rule, m)
    if general_result is not None:
        general_result["recommended"] = decision["recommended"] == check
    if select_part is not None and held is not None:
        held["verdict"] = "holds on the held-out documents" if decision["confirmed"] else "does not hold held out"
    timing = (_combined_timing([result.timing]) if select_part is None
              else _combined_timing([result.timing, conf_result.timing]))
    results = {
        "mode": "tune",
        "model": str(model),
        "dataset": {"name": data.name, "layout": data.layout, "passages": len(dids), "queries": len(qids),
                    "documents": n_docs,
                    "queries_per_group": {g: sum(1 for q in qids if data.group[q] == g) for g in data.groups},
                    "truncation": truncation, "built_from_documents": manifest is not None},
        "split": {"seed": opts.seed, "by": "document", "confirm_only": opts.confirm_only,
                  "parts": {p.name: {"documents": p.documents, "passages": len(p.dids), "queries": len(p.qids)}
                            for p in parts},
                  "minimum": enough},
        "groups": list(data.groups),
        "grid": _grid_record(opts, labels, result.runs, same, no_op, ctx),
        "top_k": opts.top_k,
        "metrics": METRICS,
        "bootstrap": dict(describe(opts.n_resamples, opts.seed, opts.level,
                                   "every configuration and the uncalibrated model"),
                          selection_level=sel_level, selection_resamples=n_sel,
                          family_wise=f"Bonferroni over the {m} distinct configurations compared"),
        "recommendation": decision,
        "expected_effect": _expected(held, rows, candidate or chosen["closest"], opts.confirm_only),
        "rows": rows,
        "held_out": held_rows if select_part is not None else None,
        "general": general_result,
        "sweep": timing,
        "sea_chunker": sea_chunker,
        "cache": {**cache_record(cache), "hidden_dir": display_path(hidden.root) if hidden.persistent else None,
                  "hidden_hits": hidden.hits, "hidden_writes": hidden.writes},
        "notes": list(data.notes) + notes + result.notes + ([] if select_part is None else conf_result.notes)
                 + list(cache.repaired) + ([] if general_result is None else general_result["notes"]),
        "command": opts.command or _command(model, opts),
        "versions": library_versions(),
    }
    if out_path is not None:
        with atomic_output_dir(out_path) as tmp:
            if opts.export:
                if decision["recommended"] is None:
                    results["export"] = None
                    results["notes"].append("--export: nothing exported, the recommendation is not to calibrate")
                else:
                    results["export"] = _export(model, config_of[decision["recommended"]], tmp, export_step)
            if set_source is not None and manifest is not None:
                shutil.copytree(set_source, tmp / "set")
            pick = candidate or chosen["closest"]
            if pick is not None:
                (tmp / CANDIDATE).write_text(candidate_yaml(pick, config_of[pick]), encoding="utf-8")
            results["seconds"] = round(time.perf_counter() - t0, 1)
            set_dir = out_path / "set" if manifest is not None else set_source
            write_report(tmp, out_path, results, opts, set_dir=set_dir)
    else:
        results["seconds"] = round(time.perf_counter() - t0, 1)
    return results


CANDIDATE = "candidate.yaml"


def candidate_yaml(label: str, cfg: CalibrationConfig) -> str:
    """The candidate as a one-configuration grid (`--grid candidate.yaml --confirm-only` scores it elsewhere)."""
    fields = {k: v for k, v in cfg.to_dict().items() if v != getattr(CalibrationConfig(), k)}
    fields.update(variant=cfg.variant, strength=cfg.strength, basket_size=cfg.basket_size, layers=cfg.layers)
    body = ", ".join(f"{k}: {json.dumps(list(v) if isinstance(v, tuple) else v, ensure_ascii=False)}"
                     for k, v in fields.items())
    return f"# chosen on the selection part of this run\n- {{name: {json.dumps(label, ensure_ascii=False)}, {body}}}\n"


def _expected(held: dict | None, rows: list[dict], label: str | None, confirm_only: bool) -> dict | None:
    """The candidate's held-out ΔHM (the expected effect) and its in-sample one beside it."""
    if label is None:
        return None
    row = next(r for r in rows if r["label"] == label)
    return {"label": label, "held_out": None if held is None else held["delta"]["hm"],
            "held_out_groups": None if held is None else {k: v for k, v in held["delta"].items()
                                                          if k.startswith("group_")},
            "in_sample": None if confirm_only else row["delta"]["hm"]}


def general_check_for(backend: TorchBackend, general: Dataset, label: str, config: CalibrationConfig,
                      cache: EncodeCache, hidden: HiddenCache, budget: int, opts: TuneOptions) -> dict:
    return general_check(backend, general, label, config, cache=cache, hidden=hidden, budget=budget,
                         n_resamples=opts.n_resamples, seed=opts.seed, level=opts.level, top_k=opts.top_k,
                         with_shuffled=opts.shuffled, progress=opts.progress)


def _command(model: str, opts: TuneOptions) -> str:
    """The `attncal tune` command equivalent to a Python call (data given as DATA)."""
    parts = ["attncal", "tune", str(model), "--data", "DATA", "-o", "OUT"]
    if not opts.configs:
        parts += ["--grid", opts.grid]
    if opts.general is not None:
        parts += ["--general", str(opts.general)]
    return " ".join(shlex.quote(p) for p in parts)
