"""`encode_sweep`: one model's corpus embeddings under many calibration configs, sharing what they share.

A configuration changes nothing below its first calibrated layer, and nothing at all in a passage it
leaves alone, so a sweep of N configurations costs much less than N encodes:

* **One uncalibrated pass** encodes the corpus through every layer (the uncalibrated row of the report)
  and keeps, on disk, the input of each layer at which some configuration starts calibrating
  (`attncal.eval.prefix_cache`).
* **Each configuration runs only its own layers**: from that stored input up
  (`TorchEncoder.run(resume=...)`), so a configuration that calibrates the last layer costs one layer.
* **Passages a configuration provably leaves unchanged are not run at all**: with `skip_short` a passage
  with less than one basket of content keeps its uncalibrated rows, and λ = 0 changes nothing, so their
  embeddings are the uncalibrated ones.
* **Configurations that coincide for this model run once**: the variants differ only in how they weight
  the isolated tokens, and mean pooling isolates none, so uniform, cls-soft and cls-hard give the same
  embeddings on a mean-pooled model (the resolved calibration and the layers decide).

Passages are batched longest first, so a batch holds passages of similar length and little padding.  The
embeddings equal those of encoding every configuration from scratch (tests/test_tune.py holds them to
1e-6).  A model whose layers hand more than their hidden states to the next (T5: the first layer's
position bias) cannot start in the middle; a probe on two passages finds that before the sweep, and every
configuration then runs all its layers (still skipping the passages it leaves unchanged).

The final embeddings go through the embedding cache that `attncal eval` uses, under the same keys, so a
tune run and an eval run of the same model, corpus and config share them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from ..calibration.config import MODE_EQUAL, CalibrationConfig, ResolvedCalibration
from .encoders import EncodeCache, TorchBackend, content_lengths
from .output import hash_texts
from .prefix_cache import HiddenCache, HiddenStates, check_budget, estimate_bytes, model_digest

RESUME_TOLERANCE = 1e-6  # a resumed forward of the probe passages must match the full one to this


@dataclass
class Plan:
    """What one configuration needs: the passages it changes and the layer it starts at."""

    label: str
    config: CalibrationConfig | None  # bound to the model's pooling; None = uncalibrated
    active: np.ndarray  # indices of the passages it calibrates, longest first
    start: int  # first calibrated layer


@dataclass
class SweepOutput:
    embeddings: dict[str, np.ndarray]  # label -> [passages, dim]; "uncalibrated" first
    runs: dict[str, dict]  # label -> how it was obtained (source, passages calibrated, start layer, seconds)
    timing: dict
    notes: list[str] = field(default_factory=list)


def calibrated_passages(config: CalibrationConfig, lengths: np.ndarray) -> np.ndarray:
    """Mask of the passages `config` (bound) changes: some content, at least one basket of it with
    skip_short, and λ > 0.  Every other passage keeps its uncalibrated embedding exactly."""
    rc = config.resolve()
    if rc.strength == 0.0:
        return np.zeros(len(lengths), dtype=bool)
    content = lengths - rc.n_isolated
    return (content > 0) & ((content >= rc.basket_size) if rc.skip_short else True)


def effective(rc: ResolvedCalibration) -> ResolvedCalibration:
    """`rc` with the weight of a token that is not isolated set to a fixed value: it is never read, so two
    calibrations that differ only there compute the same thing."""
    if not rc.isolate_first:
        rc = replace(rc, first_mode=MODE_EQUAL, first_weight=0.0)
    if not rc.isolate_last:
        rc = replace(rc, last_mode=MODE_EQUAL, last_weight=0.0)
    return rc


def longest_first(lengths: np.ndarray, subset: np.ndarray | None = None) -> np.ndarray:
    idx = np.arange(len(lengths)) if subset is None else np.flatnonzero(subset)
    return idx[np.argsort(-lengths[idx], kind="stable")]


def _now() -> np.ndarray:
    """(wall, CPU) seconds now."""
    return np.array([time.perf_counter(), time.process_time()])


def _round(v: float | None) -> float | None:
    return None if v is None else round(float(v), 3)


def _batches(order: np.ndarray, size: int) -> list[np.ndarray]:
    return [order[i:i + size] for i in range(0, len(order), size)]


def _in_cache(cache: EncodeCache, backend: TorchBackend, config: CalibrationConfig | None, fp: str) -> bool:
    """Whether the embedding cache holds an entry for this config (checked again, with its hash, on read)."""
    if cache.root is None:
        return False
    key, _ = EncodeCache.key(backend, config, fp, "corpus")
    return (cache.root / f"{key}.npy").exists()


def resume_is_exact(backend: TorchBackend, texts: Sequence[str], lengths: np.ndarray, layers: Sequence[int]) -> bool:
    """Whether starting at each of `layers` reproduces the full forward on the two shortest passages."""
    import torch

    enc = backend.encoder
    probe = [texts[i] for i in longest_first(lengths)[::-1][:2]]
    batch = enc.tokenize(probe)
    full, captured = enc.run(batch, None, capture=layers)
    for k in layers:
        resumed, _ = enc.run(batch, None, resume=(k, captured[k]))
        if not float(torch.max(torch.abs(resumed - full))) <= RESUME_TOLERANCE * max(1.0, float(full.abs().max())):
            return False
    return True


class _Sweep:
    def __init__(self, backend: TorchBackend, texts: Sequence[str], cache: EncodeCache, hidden: HiddenCache,
                 data_fp: str, progress: bool) -> None:
        self.backend, self.texts, self.cache, self.hidden = backend, list(texts), cache, hidden
        self.fp, self.progress = data_fp, progress
        self.enc = backend.encoder
        self.lengths = np.asarray(content_lengths(backend, self.texts), dtype=np.int64)
        self.states = HiddenStates(self.lengths)
        # wall and CPU seconds (this process's, all threads): on a machine other jobs share, CPU time is the
        # steadier measure of what the sweep costs
        self.timing = {"uncalibrated_pass_s": None, "uncalibrated_pass_cpu_s": None, "hidden_write_s": 0.0,
                       "hidden_write_cpu_s": 0.0, "hidden_read_s": 0.0}
        self._keys: dict[int, tuple[str, dict]] = {}

    # ------------------------------------------------------------------ the uncalibrated pass
    def hidden_key(self, layer: int) -> tuple[str, dict]:
        if layer not in self._keys:
            if not hasattr(self, "_digest"):
                self._digest = model_digest(self.backend.info.path)
            self._keys[layer] = self.hidden.describe(
                self._digest, hash_texts(self.texts), self.backend.max_length, layer, self.lengths.tolist(),
                self.enc.model.config.hidden_size, str(next(self.enc.model.parameters()).dtype))
        return self._keys[layer]

    def load_layers(self, layers: Sequence[int]) -> list[int]:
        """Open the stored layers; the ones not on disk (or damaged)."""
        missing = []
        for k in layers:
            arr = self.hidden.open(*self.hidden_key(k))
            if arr is None:
                missing.append(k)
            else:
                self.states.arrays[k] = arr
        return missing

    def uncalibrated_pass(self, capture: Sequence[int]) -> np.ndarray:
        """Encode every passage uncalibrated, writing the inputs of the `capture` layers to the cache."""
        from tqdm.auto import tqdm

        writers = {k: self.hidden.writer(*self.hidden_key(k)) for k in capture}
        out: np.ndarray | None = None
        forward = np.zeros(2)
        write = np.zeros(2)
        order = longest_first(self.lengths)
        kept = (f", keeping layer input{'s' if len(capture) > 1 else ''} {', '.join(map(str, capture))}"
                if capture else "")
        bar = tqdm(total=len(order), desc=f"uncalibrated pass{kept}", unit="passage", leave=False,
                   disable=not self.progress)
        try:
            for idx in _batches(order, self.backend.batch_size):
                t0 = _now()
                batch = self.enc.tokenize([self.texts[i] for i in idx])
                emb, captured = self.enc.run(batch, None, capture=capture)
                emb = emb.float().cpu().numpy()
                t1 = _now()
                if out is None:
                    out = np.zeros((len(self.texts), emb.shape[1]), dtype=np.float32)
                out[idx] = emb
                mask = batch["attention_mask"].bool()
                self._check_lengths(idx, mask)
                for k, w in writers.items():
                    rows = captured[k][mask].float().cpu().numpy()
                    pos = 0
                    for i in idx:
                        n = int(self.lengths[i])
                        w.write(int(self.states.offsets[i]), rows[pos:pos + n])
                        pos += n
                forward += t1 - t0
                write += _now() - t1
                bar.update(len(idx))
            t1 = _now()
            for k, w in writers.items():
                self.states.arrays[k] = w.commit()
            write += _now() - t1
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        finally:
            bar.close()
        self.timing["uncalibrated_pass_s"], self.timing["uncalibrated_pass_cpu_s"] = forward
        self.timing["hidden_write_s"] += write[0]
        self.timing["hidden_write_cpu_s"] += write[1]
        return out if out is not None else np.zeros((0, self.enc.model.config.hidden_size), np.float32)

    def _check_lengths(self, idx: np.ndarray, mask) -> None:
        got = mask.sum(1).cpu().numpy()
        if not np.array_equal(got, self.lengths[idx]):
            raise RuntimeError("the tokenizer gave a passage a different length in a batch than alone; "
                               "the stored hidden states cannot be matched to it")

    # ------------------------------------------------------------------ one configuration
    def run_config(self, plan: Plan, uncal: np.ndarray, resume: bool, n_layers: int) -> np.ndarray:
        import torch
        from tqdm.auto import tqdm

        out = uncal.copy()
        start = plan.start if resume else 0
        what = ("all layers" if not start else f"layer {start}" if start == n_layers - 1
                else f"layers {start}-{n_layers - 1}")
        bar = tqdm(total=len(plan.active), desc=f"{plan.label} ({what})", unit="passage", leave=False,
                   disable=not self.progress)
        try:
            for idx in _batches(plan.active, self.backend.batch_size):
                batch = self.enc.tokenize([self.texts[i] for i in idx])
                state = None
                if start:
                    t0 = time.perf_counter()
                    mask = batch["attention_mask"].bool()
                    self._check_lengths(idx, mask)
                    h = torch.zeros((*mask.shape, self.enc.model.config.hidden_size), dtype=torch.float32)
                    h[mask] = torch.from_numpy(self.states.rows(start, idx))
                    state = (start, h)
                    self.timing["hidden_read_s"] += time.perf_counter() - t0
                emb, _ = self.enc.run(batch, plan.config, resume=state)
                out[idx] = emb.float().cpu().numpy()
                bar.update(len(idx))
        finally:
            bar.close()
        return out


class Sweep:
    """A planned sweep: `__init__` plans it and refuses it (ValueError, one line) when the hidden states it
    would write exceed the budget, before anything is encoded; `run()` encodes."""

    def __init__(self, backend: TorchBackend, texts: Sequence[str], configs: Sequence[CalibrationConfig],
                 labels: Sequence[str], *, cache: EncodeCache, hidden: HiddenCache, data_fp: str,
                 budget_bytes: int, progress: bool = True) -> None:
        from ..calibration.probing import layer_blocks  # lazy: torch (the export extra), not needed to import eval

        self.t_start = time.perf_counter()
        self.sw = sw = _Sweep(backend, texts, cache, hidden, data_fp, progress)
        self.backend, self.cache, self.hidden, self.fp, self.progress = backend, cache, hidden, data_fp, progress
        self.n_layers = len(layer_blocks(backend.encoder.model).blocks)
        self.plans = []
        for label, cfg in zip(labels, configs):
            bound = backend.bind(cfg)
            self.plans.append(Plan(label, bound, longest_first(sw.lengths, calibrated_passages(bound, sw.lengths)),
                                   min(bound.layer_indices(self.n_layers))))
        self.notes: list[str] = []
        self.same_as: dict[str, str] = {}  # a config whose calibration, resolved for this model, an earlier one has
        first: dict[tuple, str] = {}
        for p in self.plans:
            key = (effective(p.config.resolve()), tuple(p.config.layer_indices(self.n_layers)))
            if key in first:
                self.same_as[p.label] = first[key]
            else:
                first[key] = p.label
        todo = [p for p in self.plans if len(p.active) and p.label not in self.same_as
                and not _in_cache(cache, backend, p.config, data_fp)]
        self.layers = sorted({p.start for p in todo if p.start > 0})
        self.resume = bool(self.layers) and resume_is_exact(backend, sw.texts, sw.lengths, self.layers)
        if self.layers and not self.resume:
            self.notes.append(f"{type(backend.encoder.model).__name__}'s layers hand more than their hidden states to "
                              "the next, so a configuration cannot start at its first calibrated layer: each runs all "
                              "layers")
        self.missing = sw.load_layers(self.layers) if self.resume else []
        hidden_size = backend.encoder.model.config.hidden_size
        self.estimated_bytes = estimate_bytes(sw.lengths, hidden_size, len(self.missing))
        if self.missing:
            check_budget(self.estimated_bytes, budget_bytes, hidden.root,
                         f"{int(sw.lengths.sum()):,} tokens x {hidden_size} x 4 bytes x {len(self.missing)} "
                         f"layer{'s' if len(self.missing) > 1 else ''}")
        self.planned = time.perf_counter()

    def run(self) -> SweepOutput:
        """The uncalibrated embeddings and those of every config (see the module docstring).

        long: the sweep's passes (uncalibrated, then the configurations by layer) share the cache, the hidden
        states and the timing, through closures over one run."""
        from tqdm.auto import tqdm

        sw, backend, cache, fp, n_layers = self.sw, self.backend, self.cache, self.fp, self.n_layers
        t_run = time.perf_counter()
        ran_pass = {"done": False}

        def first_pass() -> np.ndarray:
            ran_pass["done"] = True
            return sw.uncalibrated_pass(self.missing)

        uncal = cache.get_or_encode(backend, None, fp, "corpus", first_pass)
        if self.missing and not ran_pass["done"]:
            first_pass()
        embeddings = {"uncalibrated": uncal}
        runs = {"uncalibrated": {"source": "computed" if ran_pass["done"] else "cache", "passages_calibrated": 0,
                                 "start_layer": None, "layers_run": n_layers if ran_pass["done"] else 0,
                                 "seconds": _round(sw.timing["uncalibrated_pass_s"]),
                                 "cpu_seconds": _round(sw.timing["uncalibrated_pass_cpu_s"])}}
        for plan in tqdm(self.plans, desc="configs", unit="config", disable=not self.progress):
            run = {"passages_calibrated": int(len(plan.active)), "start_layer": plan.start}
            if not len(plan.active):
                embeddings[plan.label] = uncal
                runs[plan.label] = dict(run, source="uncalibrated: it changes no passage", layers_run=0, seconds=0.0,
                                        cpu_seconds=0.0)
                continue
            if plan.label in self.same_as:
                embeddings[plan.label] = embeddings[self.same_as[plan.label]]
                runs[plan.label] = dict(run, source=f"same as {self.same_as[plan.label]}: the same calibration once "
                                        "resolved for this model's pooling", layers_run=0, seconds=0.0,
                                        cpu_seconds=0.0)
                continue
            t0 = _now()
            computed = {"done": False}

            def compute(plan=plan) -> np.ndarray:
                computed["done"] = True
                return sw.run_config(plan, uncal, self.resume, n_layers)

            embeddings[plan.label] = cache.get_or_encode(backend, plan.config, fp, "corpus", compute)
            done = computed["done"]
            spent = _now() - t0 if done else np.zeros(2)
            runs[plan.label] = dict(run, source="computed" if done else "cache",
                                    layers_run=n_layers - (plan.start if self.resume else 0) if done else 0,
                                    seconds=round(float(spent[0]), 3), cpu_seconds=round(float(spent[1]), 3))
        notes = self.notes + self.hidden.repaired
        t = sw.timing
        configs = [r for lab, r in runs.items() if lab != "uncalibrated"]
        configs_s = sum(r["seconds"] for r in configs)
        configs_cpu = sum(r["cpu_seconds"] for r in configs)
        total = (t["uncalibrated_pass_s"] or 0.0) + t["hidden_write_s"] + configs_s
        total_cpu = (t["uncalibrated_pass_cpu_s"] or 0.0) + t["hidden_write_cpu_s"] + configs_cpu
        all_computed = ran_pass["done"] and all(r["source"] != "cache" for r in runs.values())

        def ratio(a: float, b: float | None) -> float | None:
            return round(a / b, 2) if all_computed and b else None

        timing = {
            "uncalibrated_pass_s": _round(t["uncalibrated_pass_s"]),
            "uncalibrated_pass_cpu_s": _round(t["uncalibrated_pass_cpu_s"]),
            "hidden_write_s": _round(t["hidden_write_s"]),
            "hidden_read_s": _round(t["hidden_read_s"]),
            "configs_s": _round(configs_s),
            "encode_s": _round(total),
            "encode_cpu_s": _round(total_cpu),
            "factor": ratio(total, t["uncalibrated_pass_s"]),
            "factor_cpu": ratio(total_cpu, t["uncalibrated_pass_cpu_s"]),
            "factor_definition": "encoding time of the whole sweep (uncalibrated pass, hidden-state writes and "
                                 "reads, every configuration) / the uncalibrated pass alone (one uncalibrated "
                                 "encode); factor in wall time, factor_cpu in this process's CPU time",
            "layers": n_layers,
            "start_layers": self.layers,
            "resumed": self.resume,
            "hidden_bytes_written": self.estimated_bytes if ran_pass["done"] else 0,
            "plan_s": round(self.planned - self.t_start, 3),
            "wall_s": round(time.perf_counter() - t_run, 3),
        }
        if not all_computed:
            notes.append("some embeddings came from the cache, so the sweep's cost is not compared with an "
                         "uncalibrated encode (run with --no-cache to measure it)")
        return SweepOutput(embeddings, runs, timing, notes)


def encode_sweep(backend: TorchBackend, texts: Sequence[str], configs: Sequence[CalibrationConfig],
                 labels: Sequence[str], *, cache: EncodeCache, hidden: HiddenCache, data_fp: str,
                 budget_bytes: int, progress: bool = True) -> SweepOutput:
    """Plan and run a sweep (see `Sweep`)."""
    return Sweep(backend, texts, configs, labels, cache=cache, hidden=hidden, data_fp=data_fp,
                 budget_bytes=budget_bytes, progress=progress).run()
