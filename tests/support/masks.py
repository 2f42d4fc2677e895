"""Attention masks [B,K] (int64, 1 = a valid key) for the tests and the benchmarks.

* `token_mask`: given lengths, all on one padding side;
* `random_mask`: random lengths, all on one padding side (one contiguous run per item);
* `mixed_mask`: random lengths, each item its own padding side, optionally empty items and holes.

The random ones draw from `rng` in a fixed order, so a seed gives the same masks wherever they are
built: per item the emptiness draw (only when `empty` is set), the length, the side (only when it is
random), then the hole draws (only when `holes` is set).
"""

from __future__ import annotations

import random

import torch


def token_mask(lengths: list[int], K: int, left: bool) -> torch.Tensor:
    """[len(lengths),K]: item b has lengths[b] valid keys, at the end (left padding) or the start."""
    m = torch.zeros(len(lengths), K, dtype=torch.long)
    for b, n in enumerate(lengths):
        if left:
            m[b, K - n:] = 1
        else:
            m[b, :n] = 1
    return m


def _random_runs(rng: random.Random, B: int, K: int, left: bool | None, min_len: int, empty: float, holes: float,
                 max_holes: int) -> torch.Tensor:
    mask = torch.zeros(B, K, dtype=torch.long)
    for b in range(B):
        n = 0 if empty and rng.random() < empty else rng.randint(min(min_len, K), K)
        if (rng.random() < 0.5) if left is None else left:
            mask[b, K - n:] = 1
        else:
            mask[b, :n] = 1
        if holes and n > 4 and rng.random() < holes:
            idx = mask[b].nonzero().flatten()
            for _ in range(rng.randint(1, max_holes) if max_holes > 1 else 1):
                mask[b, int(idx[rng.randrange(1, n - 1)])] = 0
    return mask


def random_mask(rng: random.Random, B: int, K: int, left: bool, min_len: int = 0) -> torch.Tensor:
    """A [B,K] mask with one contiguous run per row, every row padded on the same side; each length
    uniform in [min(min_len, K), K]."""
    return _random_runs(rng, B, K, left, min_len, empty=0.0, holes=0.0, max_holes=1)


def mixed_mask(rng: random.Random, B: int, K: int, holes: float = 0.1, *, min_len: int = 0, empty: float = 0.0,
               max_holes: int = 1) -> torch.Tensor:
    """Each item its own length (uniform in [min(min_len, K), K], so 0 is possible by default) and padding
    side (left or right).  With probability `empty` an item has no valid key at all (drawn first; no draw
    when `empty` is 0).  With probability `holes` an item longer than 4 gets masked keys strictly inside its
    span: one, or 1 to `max_holes` of them (two may fall on the same key); no draw when `holes` is 0."""
    return _random_runs(rng, B, K, None, min_len, empty, holes, max_holes)
