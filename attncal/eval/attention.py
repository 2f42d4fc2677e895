"""Attention mass per basket of one passage, before and after calibration.

Reads the post-softmax attention of the pooling row(s) in one calibrated layer
from a forward with `output_attentions=True` (eager attention), once plain and
once under `calibrate()`, and sums it over the same baskets the calibration
uses.  Heads are averaged; for mean pooling every valid row is calibrated, so
the rows are averaged too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..calibration.config import CalibrationConfig
from ..calibration.encode import TorchEncoder
from ..calibration.patching import calibrate
from ..calibration.probing import base_model_of, restore_attn_implementation, set_attn_implementation
from ..modelinfo import forward_kwargs
from ..pooling import Pooling


@dataclass
class BasketMass:
    labels: list[str]
    before: list[float]
    after: list[float]
    layer: int
    pooling: Pooling
    n_tokens: int
    calibrated: bool  # False when skip_short left this passage unchanged

    def to_dict(self) -> dict:
        return dict(self.__dict__, pooling=self.pooling.to_json())


def _row_mass(attn: torch.Tensor, rows: list[int], spans: list[tuple[int, int]]) -> list[float]:
    a = attn[0].double().mean(0)  # [S, S], mean over heads
    row = a[rows].mean(0)
    return [float(row[s:e].sum()) for s, e in spans]


@torch.no_grad()
def basket_mass(encoder: TorchEncoder, text: str, config: CalibrationConfig, layer: int | None = None) -> BasketMass:
    """Mass of the pooling row on each isolated token and content basket, before and after calibration."""
    pooling = encoder.pooling_for(config)
    bound = config.with_pooling(pooling)
    rc = bound.resolve()
    layers = bound.layer_indices(encoder.info.num_layers)
    layer = layers[-1] if layer is None else layer
    batch = encoder.tokenize([text])
    valid = batch["attention_mask"][0].nonzero().flatten().tolist()
    start, end = valid[0], valid[-1]
    c0 = start + int(rc.isolate_first)
    c_end = end + 1 - int(rc.isolate_last)
    spans, labels = [], []
    if rc.isolate_first:
        spans.append((start, start + 1))
        labels.append("first token")
    for k, s in enumerate(range(c0, c_end, rc.basket_size)):
        e = min(s + rc.basket_size, c_end)
        spans.append((s, e))
        labels.append(f"basket {k + 1}\n(tokens {s - start}-{e - start - 1})")
    if rc.isolate_last:
        spans.append((end, end + 1))
        labels.append("last token")
    rows = list(range(start, end + 1)) if rc.all_rows else [end if rc.pool_last else start]
    kwargs = dict(batch, output_attentions=True, **forward_kwargs(encoder.model))
    # Attention probabilities are only returned by eager attention; the encoder may run SDPA.
    saved = set_attn_implementation(base_model_of(encoder.model), "eager")
    try:
        before = encoder.model(**kwargs).attentions[layer]
        with calibrate(encoder.model, bound, implementation="efficient") as patch:
            after = encoder.model(**kwargs).attentions[layer]
    finally:
        restore_attn_implementation(saved)
    calibrated = patch.calls > 0 and not torch.equal(before, after)
    return BasketMass(labels, _row_mass(before, rows, spans), _row_mass(after, rows, spans), layer, pooling,
                      len(valid), bool(calibrated))


def plot_basket_mass(mass: BasketMass, config_label: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(mass.labels))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(x) + 2), 3.8))
    ax.bar(x - 0.2, mass.before, 0.4, label="uncalibrated")
    ax.bar(x + 0.2, mass.after, 0.4, label=f"calibrated ({config_label})")
    ax.set_xticks(x, mass.labels, fontsize=8)
    ax.set_ylabel("attention mass" + (" (mean over rows)" if mass.pooling.all_rows else " of the pooling row"))
    ax.set_xlabel(f"key positions ({mass.n_tokens} tokens, {mass.pooling} pooling)")
    rows = "mean over all rows" if mass.pooling.all_rows else "pooling row"
    note = "" if mass.calibrated else " - passage shorter than one basket: unchanged"
    ax.set_title(f"Layer {mass.layer}, {rows}, mean over heads{note}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
