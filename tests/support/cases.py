"""Random calibration attributes, and which query rows the spec calibrates.

`random_config` draws from `rng` in a fixed order (isolation and weights, then variant, strength,
pooling, self weight, skip_short), so that a seed gives the same configurations in every test that uses
it.  The GPU cases draw the weights before the isolation and use other probabilities; the keywords keep
those sequences reachable instead of restating the function.
"""

from __future__ import annotations

import random

import torch

from attncal.calibration import CalibrationConfig
from attncal.calibration.config import ROW_MARK
from attncal.pooling import Pooling


def random_config(rng: random.Random, S: int, *, weights_first: bool = False, weight_p: float = 0.25,
                  random_strengths: int = 2, skip_short_p: float = 0.5) -> CalibrationConfig:
    """Random attributes with basket size `S`: each isolation flag set with probability 0.3, each
    isolated-token weight ("equal", "original" or a fixed weight) with probability `weight_p` (drawn before
    the isolation flags when `weights_first`), strength 0, 1 or one of `random_strengths` uniform draws,
    skip_short with probability `skip_short_p`."""
    kw: dict = {}

    def isolation() -> None:
        for name in ("isolate_first", "isolate_last"):
            if rng.random() < 0.3:
                kw[name] = rng.random() < 0.5

    def weights() -> None:
        for name in ("first_weight", "last_weight"):
            if rng.random() < weight_p:
                kw[name] = rng.choice(["equal", "original", round(rng.uniform(0, 0.45), 3)])

    for step in (weights, isolation) if weights_first else (isolation, weights):
        step()
    # Keyword arguments are evaluated left to right: the draws' order is the order written here.
    return CalibrationConfig(
        variant=rng.choice(["uniform", "cls-soft", "cls-hard"]),
        strength=rng.choice([0.0, 1.0, *(rng.random() for _ in range(random_strengths))]),
        basket_size=S,
        pooling=rng.choice(["cls", "last", "mean"]),
        self_weight=round(rng.uniform(0, 0.5), 3),
        skip_short=rng.random() < skip_short_p,
        **kw,
    )


def row_set_config(rng: random.Random, cfg: CalibrationConfig) -> CalibrationConfig:
    """`cfg` with a row-set pooling: landmark (each row's own key isolated) three times in four, else
    mean-every; the token id and k matter only to `marked_mask`, the tests mark rows with `mark_rows`."""
    pooling = Pooling("lmk", token_id=5) if rng.random() < 0.75 else Pooling("mean-every", 3)
    data = {**cfg.to_dict(), "pooling": pooling}
    try:
        return CalibrationConfig(**data)
    except ValueError:  # the self share and the isolated fixed shares sum to 1 or more: fixed overrides dropped
        return CalibrationConfig(**{**data, "first_weight": None, "last_weight": None})


def mark_rows(rng: random.Random, mask: torch.Tensor, p: float | None = None) -> torch.Tensor:
    """`mask` with some valid tokens marked `ROW_MARK` (calibrated rows of a row-set pooling): each with
    probability `p` (drawn per item from 0.05, 0.2, 0.5 and 1 when None), the first and last valid ones
    now and then for sure, since a landmark often ends the text and multi-CLS starts it."""
    out = mask.clone()
    for b in range(mask.shape[0]):
        idx = mask[b].nonzero().flatten().tolist()
        if not idx:
            continue
        pb = rng.choice([0.05, 0.2, 0.5, 1.0]) if p is None else p
        for q in idx:
            if rng.random() < pb:
                out[b, q] = ROW_MARK
        for q in (idx[0], idx[-1]):
            if rng.random() < 0.3:
                out[b, q] = ROW_MARK
    return out


def calibrated_rows(mask: torch.Tensor, rc) -> torch.Tensor:
    """[B,Q=K] bool: which query rows the spec calibrates (derived from the spec, not from an
    implementation; the valid span counts holes, as the oracle does)."""
    B, K = mask.shape
    out = torch.zeros(B, K, dtype=torch.bool)
    if rc.strength == 0:
        return out
    for b in range(B):
        idx = mask[b].nonzero().flatten()
        if len(idx) == 0:
            continue
        start, end = int(idx[0]), int(idx[-1])
        C = end - start + 1 - rc.n_isolated  # the span's length: a hole inside it still counts
        if C <= 0 or (rc.skip_short and C < rc.basket_size):
            continue
        if rc.all_rows:
            out[b, start : end + 1] = True
        elif rc.row_set:
            out[b] = mask[b] == ROW_MARK
        else:
            out[b, end if rc.pool_last else start] = True
    return out
