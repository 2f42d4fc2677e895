"""`tune`: should this model be calibrated on these documents, and how?

One call does what the manual path (`attncal eval --make-posq`, a grid, `--compare --bootstrap`) does in
four steps, and decides:

1. the position-labelled set: built from the user's documents with the `--make-posq` builder, or given;
2. a sweep of a grid of configurations (by default the paper's 24) and the uncalibrated model, sharing
   the uncalibrated layers below each configuration's first calibrated one (`attncal.eval.sweep`);
3. paired bootstrap intervals of every configuration's ΔHM, ΔPSI and per-group Δ against the
   uncalibrated model, on the same resamples of the queries;
4. a recommendation by a written rule (`attncal.eval.recommend`), "do not calibrate" when nothing
   qualifies;
5. optionally: the recommended configuration checked on a general retrieval set (`attncal.eval.general`),
   and exported with its uncalibrated twin (parity-checked by the exporter).

Everything is checked before the first encode (OUT, the grid, the model's max length against the
baskets, the data, the hidden-state cache's size); the report (report.md, results.json, plots, the set
and any exports) is written to a temporary directory and renamed into place when complete.
"""

from __future__ import annotations

import itertools
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..calibration.config import CalibrationConfig
from .bootstrap import LEVEL, describe, draw_resamples, paired_deltas, paired_mean_delta
from .data import Dataset, load_dataset
from .encoders import EncodeCache, TorchBackend
from .general import general_check, load_general
from .metrics import per_query, require_ir_measures, score_delta, scores_from_per_query
from .output import atomic_output_dir, cache_record, check_out_dir, display_path, hash_texts, library_versions
from .posq_builder import build_posq, read_documents, write_posq
from .prefix_cache import HiddenCache
from .recommend import DECIDE, Rule, recommend
from .runner import (
    BASELINES, METRICS, TOP_K, effective_max_length, exact_search, is_export, sea_embeddings, token_counts,
    truncation_note, truncation_stats,
)
from .sweep import Sweep
from .tune_report import write_report

GIB = 2 ** 30
DEFAULT_BUDGET_GIB = 8.0
DEFAULT_RESAMPLES = 1000


def _paper() -> list[CalibrationConfig]:
    """The paper's grid: 2 layer sets x 2 baskets x 2 strengths x 3 variants."""
    return [CalibrationConfig(variant=v, strength=s, basket_size=b, layers=layers)
            for layers, b, s, v in itertools.product(("last", "last-half"), (128, 256), (0.5, 1.0),
                                                     ("uniform", "cls-soft", "cls-hard"))]


PRESETS = {
    "paper": ("the paper's 24: layers last / last half, basket 128 / 256, λ 0.5 / 1, uniform / cls-soft / cls-hard",
              _paper),
    "default": ("the published default alone (cls-soft, λ 0.5, basket 128, last half)", lambda: [CalibrationConfig()]),
    "strengths": ("the default with λ 0.25, 0.5, 0.75, 1", lambda: [CalibrationConfig(strength=s)
                                                                    for s in (0.25, 0.5, 0.75, 1.0)]),
}
DEFAULT_GRID = "paper"


def grid_label(cfg: CalibrationConfig) -> str:
    """`variant λ b<basket> <layers>`, e.g. `cls-soft λ0.5 b128 last-half`."""
    layers = cfg.layers if isinstance(cfg.layers, str) else ",".join(map(str, cfg.layers))
    return f"{cfg.variant} λ{cfg.strength:g} b{cfg.basket_size} {layers}"


def preset(name: str) -> tuple[list[CalibrationConfig], list[str]]:
    if name not in PRESETS:
        raise ValueError(f"unknown grid preset {name!r}; presets: {', '.join(PRESETS)} (or a YAML file)")
    configs = PRESETS[name][1]()
    return configs, [grid_label(c) for c in configs]


ExportStep = Callable[[str, Path, CalibrationConfig, bool], dict]
"""(model, output directory, configuration, calibrate) -> the export's attncal.json: how `opts.export` exports.
eval does not import the exporter (a sibling layer); `attncal.cli.tune.export_step` is the command line's."""


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

    def resolved_grid(self) -> tuple[list[CalibrationConfig], list[str]]:
        if not self.configs:
            return preset(self.grid)
        labels = list(self.labels) if self.labels else [grid_label(c) for c in self.configs]
        return list(self.configs), labels


def _validate(opts: TuneOptions, configs: list[CalibrationConfig], labels: list[str], out: Path | None,
              export_step: ExportStep | None) -> None:
    if not configs:
        raise ValueError("the grid is empty")
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"the grid has two configurations named {dup[0]!r}; names must be unique")
    if "uncalibrated" in labels:
        raise ValueError("'uncalibrated' is the name of the reference row; rename that configuration")
    unknown = sorted(set(opts.baselines) - set(BASELINES))
    if unknown:
        raise ValueError(f"unknown baseline(s) {', '.join(unknown)}; available: {', '.join(BASELINES)}")
    if opts.top_k < 10:
        raise ValueError(f"top-k must be >= 10 for nDCG@10, got {opts.top_k}")
    if opts.n_resamples < 1:
        raise ValueError(f"--bootstrap must be >= 1 resample, got {opts.n_resamples}")
    if opts.cache_budget_gib <= 0:
        raise ValueError(f"--cache-budget must be > 0 GiB, got {opts.cache_budget_gib}")
    if opts.export and out is None:
        raise ValueError("--export writes the exports into OUT; give -o OUT")
    if opts.export and export_step is None:
        raise ValueError("TuneOptions(export=True) needs tune(..., export_step=...): "
                         "attncal.cli.tune.export_step(exporter, max_length) makes the command line's")
    if opts.shuffled and opts.general is None:
        raise ValueError("--shuffled re-encodes the --general set with its sentences shuffled; give --general DATA")
    Rule(opts.max_begin_loss, opts.tie_margin, opts.level)


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


def _rows(data: Dataset, qids: list[str], embeddings: dict[str, np.ndarray], q_emb: np.ndarray, dids: list[str],
          kinds: dict[str, str], configs: dict[str, dict | None], untruncated: list[str] | None,
          opts: TuneOptions) -> list[dict]:
    """Scores, per-query nDCG@10 and the paired intervals of every row against the uncalibrated one."""
    qrels = {q: data.qrels[q] for q in qids}
    resamples = draw_resamples([data.group[q] for q in qids], data.groups, opts.n_resamples, opts.seed)
    per = {lab: per_query(qrels, exact_search(q_emb, emb, qids, dids, opts.top_k)) for lab, emb in embeddings.items()}
    values = {lab: np.array([p[q]["ndcg10"] for q in qids]) for lab, p in per.items()}
    base = scores_from_per_query(per["uncalibrated"], data.group, data.groups).to_dict()
    rows = []
    for lab, p in per.items():
        scores = scores_from_per_query(p, data.group, data.groups).to_dict()
        row = {"label": lab, "kind": kinds[lab], "config": configs.get(lab), "scores": scores, "delta": None}
        if lab != "uncalibrated":
            row["delta"] = paired_deltas(values[lab], values["uncalibrated"], score_delta(scores, base), resamples,
                                         opts.level)
            row["delta"]["ndcg10"] = paired_mean_delta(values[lab], values["uncalibrated"], resamples, opts.level)
        if untruncated is not None:
            row["untruncated"] = (scores_from_per_query({q: p[q] for q in untruncated}, data.group, data.groups)
                                  .to_dict() if untruncated else None)
        rows.append(row)
    return rows


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
    """Sweep, decide and report (see the module docstring).  Give `docs` (documents to build the set from:
    a path as `attncal eval --make-posq` takes it, or (documents, source) as `read_documents` and
    `python_reference_documents` return them) or `data` (a position-labelled set: a Dataset or its
    directory).  `export_step` exports the recommendation where `opts.export` asks for it.  Returns
    results.json's content."""
    require_ir_measures()
    t0 = time.perf_counter()
    opts = opts or TuneOptions()
    if (data is None) == (docs is None):
        raise ValueError("give the documents to build the set from (--docs) or a position-labelled set (--data), "
                         "one of them")
    out_path = check_out_dir(out, overwrite)
    configs, labels = opts.resolved_grid()
    _validate(opts, configs, labels, out_path, export_step)
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
    notes = basket_reach(backend, configs, labels, model)
    with tempfile.TemporaryDirectory(prefix="attncal-tune-set-") as workdir:
        manifest = None
        if docs is not None:
            data, manifest = build_set(*docs, backend, model, Path(workdir) / "set", posq_options)
            set_source = Path(workdir) / "set"
        hidden = HiddenCache(None if opts.cache_dir is None else Path(opts.cache_dir) / "hidden")
        try:
            results = _run(model, data, opts, configs, labels, backend, hidden, general, notes, out_path, set_source,
                           manifest, t0, export_step)
        finally:
            hidden.close()
    return results


def _run(model, data: Dataset, opts: TuneOptions, configs, labels, backend: TorchBackend, hidden: HiddenCache,
         general: Dataset | None, notes: list[str], out_path: Path | None, set_source: Path | None,
         manifest: dict | None, t0: float, export_step: ExportStep | None) -> dict:
    qids = data.query_ids()
    if not qids:
        raise ValueError(f"{data.name}: no query has both a relevant document and a position group")
    dids = list(data.corpus)
    d_texts = [data.corpus[d] for d in dids]
    q_texts = [data.queries[q] for q in qids]
    cache = EncodeCache(opts.cache_dir)
    budget = int(opts.cache_budget_gib * GIB)
    fp = data.fingerprint()
    sweep = Sweep(backend, d_texts, configs, labels, cache=cache, hidden=hidden, data_fp=fp, budget_bytes=budget,
                  progress=opts.progress)  # refuses an over-budget cache before anything is encoded
    q_emb = cache.get_or_encode(backend, None, hash_texts(q_texts), "queries",
                                lambda: backend.encode(q_texts, None, desc="encode queries"))
    result = sweep.run()
    embeddings = dict(result.embeddings)
    kinds = {lab: "calibrated" for lab in labels}
    kinds["uncalibrated"] = "uncalibrated"
    bound = {lab: backend.bind(c).to_dict() for lab, c in zip(labels, configs)}
    sea_chunker = None
    if "sea" in opts.baselines:
        lab = f"SEA ({opts.sea_chunk_tokens}-token chunks)"
        embeddings[lab], sea_chunker = sea_embeddings(cache, backend, d_texts, fp, opts.sea_chunk_tokens)
        kinds[lab] = "baseline"
    lengths = dict(zip(dids, token_counts(backend.tokenizer, d_texts)))
    truncation = truncation_stats(data, qids, lengths, effective_max_length(backend))
    cut = set(truncation.pop("_truncated_queries"))
    if truncation["passages_truncated"]:
        notes.append(truncation_note(truncation))
    untruncated = [q for q in qids if q not in cut] if truncation["passages_truncated"] else None
    rows = _rows(data, qids, embeddings, q_emb, dids, kinds, bound, untruncated, opts)
    for r in rows:
        r["run"] = result.runs.get(r["label"])
    rule = Rule(opts.max_begin_loss, opts.tie_margin, opts.level)
    decision = recommend([r for r in rows if r["kind"] == "calibrated"], data.groups, rule)
    for r in rows:
        r["verdict"] = decision["verdicts"].get(r["label"])
    config_of = dict(zip(labels, configs))
    general_result = None
    if general is not None and decision["closest"] is not None:
        label = decision["closest"]
        general_result = general_check_for(backend, general, label, config_of[label], cache, hidden, budget, opts)
        general_result["recommended"] = decision["recommended"] == label
        if decision["decision"] == DECIDE and general_result["flagged"]:
            decision["general_flag"] = general_result["verdict"]
    results = {
        "mode": "tune",
        "model": str(model),
        "dataset": {"name": data.name, "layout": data.layout, "passages": len(dids), "queries": len(qids),
                    "queries_per_group": {g: sum(1 for q in qids if data.group[q] == g) for g in data.groups},
                    "truncation": truncation, "built_from_documents": manifest is not None},
        "groups": list(data.groups),
        "grid": {"name": opts.grid if not opts.configs else "custom", "configurations": len(configs),
                 "description": PRESETS[opts.grid][0] if not opts.configs and opts.grid in PRESETS else None},
        "top_k": opts.top_k,
        "metrics": METRICS,
        "bootstrap": describe(opts.n_resamples, opts.seed, opts.level,
                              "every configuration and the uncalibrated model"),
        "recommendation": decision,
        "rows": rows,
        "general": general_result,
        "sweep": result.timing,
        "sea_chunker": sea_chunker,
        "cache": {**cache_record(cache), "hidden_dir": display_path(hidden.root) if hidden.persistent else None,
                  "hidden_hits": hidden.hits, "hidden_writes": hidden.writes},
        "notes": list(data.notes) + notes + result.notes + list(cache.repaired)
                 + ([] if general_result is None else general_result["notes"]),
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
            results["seconds"] = round(time.perf_counter() - t0, 1)
            set_dir = out_path / "set" if manifest is not None else set_source
            write_report(tmp, out_path, results, opts, set_dir=set_dir)
    else:
        results["seconds"] = round(time.perf_counter() - t0, 1)
    return results


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
