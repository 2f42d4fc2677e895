"""The driver of the randomized comparisons against the float64 oracle, and the steps its callers share.

Each comparison draws an attribute set (and whatever it builds once for it: a session, a geometry),
then runs a few batches under it, each batch reporting how many cases it held and its largest error
(after asserting its own tolerance), until `n_cases` cases have run.  The driver keeps the counts; the
caller keeps its coverage tallies in `seen` and asserts on them afterwards.  The random draws are the
caller's, in the caller's order: the driver draws nothing.  The calibration ops' native-kernel loops (separate
and Softmax-fused) draw their attribute sets and batches alike (`random_calibration_op`,
`random_calibration_batch`); the calibrated attention ops' loops (function body and native kernel) their
batches and errors (`random_attention_batch`, `attention_oracle_errors`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterable, TypeVar

import numpy as np
import torch

from attncal.calibration.oracle import attention_reference
from attncal.graphs.ops.contract import FULL_ATTENTION, AttentionGeometry, op_spec, resolved_from_attrs

from .cases import random_config
from .masks import mixed_mask
from .tensors import accumulation_bound, random_qkv, score_rounding

Config = TypeVar("Config")


@dataclass
class OracleLoop:
    """What a loop ran: cases, runs (one per batch), the largest error, and the caller's tallies."""

    seen: dict[str, int] = field(default_factory=dict)
    cases: int = 0
    runs: int = 0
    worst: float = 0.0


def run_oracle_loop(n_cases: int, configure: Callable[[], Config],
                    run: Callable[[Config, dict[str, int]], tuple[int, float]], *, runs_per_config: int,
                    seen: Iterable[str] = ()) -> OracleLoop:
    """Until `n_cases` cases have run: `config = configure()`, then `runs_per_config` times
    `run(config, loop.seen) -> (cases, max_abs_err)`.  `seen`: the names of the tallies, each from 0."""
    loop = OracleLoop(seen=dict.fromkeys(seen, 0))
    while loop.cases < n_cases:
        config = configure()
        for _ in range(runs_per_config):
            cases, err = run(config, loop.seen)
            loop.cases += cases
            loop.runs += 1
            loop.worst = max(loop.worst, err)
    return loop


def tally_calibration_items(seen: dict[str, int], mask: torch.Tensor, rc, S: int) -> None:
    """Adds one batch of the calibration ops' cases to `seen`: "left" (items whose last key is valid, fully
    valid ones included), "right" (first key valid, last masked), "partial" (a content length that is not
    a multiple of the basket size `S`), and "all_rows" or "pooled" (every item)."""
    lengths = mask.sum(1)
    seen["left"] += int((mask[:, -1] == 1).sum())
    seen["right"] += int(((mask[:, 0] == 1) & (mask[:, -1] == 0)).sum())
    seen["partial"] += int(((lengths - rc.n_isolated) % S != 0).sum())
    seen["all_rows" if rc.all_rows else "pooled"] += mask.shape[0]


def random_calibration_op(rng, fused_softmax: bool = False):
    """(S, spec, rc): the calibration op of one random attribute set (basket size S, `random_config`, a random
    layer index), Softmax-fused or not, and the resolved calibration its node's attributes give."""
    S = rng.choice([1, 2, 3, 4, 5, 8, 16])
    spec = op_spec(random_config(rng, S).resolve(), layer=rng.randint(0, 30), fused_softmax=fused_softmax)
    return S, spec, resolved_from_attrs(spec.op_type, spec.attrs)


def random_calibration_batch(rng, rc) -> tuple[int, int, torch.Tensor]:
    """(B, K, mask): a batch of 16 to 40 items (`mixed_mask`), rows of up to 16 keys for the all-rows op (every
    row calibrated) and 48 for the pooled one."""
    K = rng.randint(1, 16 if rc.all_rows else 48)
    B = rng.randint(16, 40)
    return B, K, mixed_mask(rng, B, K)


def random_geometry(rng, N: int) -> AttentionGeometry:
    """A random geometry of the calibrated attention ops for N query heads: key/value heads a random divisor
    of N, and no window, a causal one, a sliding window (causal or on both sides), or a bound on one side,
    of 0 to 12 keys (the loops' rows hold up to 32 keys, now and then about 300)."""
    n_kv = rng.choice([d for d in range(1, N + 1) if N % d == 0])
    w = lambda: rng.randint(0, 12)  # noqa: E731
    left, right = rng.choice([(-1, -1), (-1, 0), (w(), 0), (w(), w()), (w(), -1), (-1, w())])
    return AttentionGeometry(0 if n_kv == N and rng.random() < 0.5 else n_kv, left, right)


def random_relative_bias(rng, geometry: AttentionGeometry) -> tuple[AttentionGeometry, int]:
    """(geometry with a relative position bias, its number of buckets): 4 to 32 buckets, a max distance from just
    past the exact buckets to 40 (the loops' rows hold up to 32 keys, now and then about 300: the exact, the
    logarithmic and the clamped last buckets are all reached)."""
    buckets = rng.choice([4, 5, 8, 32])
    return dataclasses.replace(geometry, relative_max_distance=rng.randint(buckets // 4 + 1, 40)), buckets


def relative_table(gen: torch.Generator, buckets: int, N: int, dtype) -> torch.Tensor:
    """A random bias table [buckets, N]: values of either sign up to 2 on a grid of 1/8, so that a score stays
    exact where `random_qkv` makes it exact."""
    return (torch.randint(-16, 17, (buckets, N), generator=gen) / 8).to(dtype)


def kv_heads(x: torch.Tensor, N: int, geometry: AttentionGeometry) -> torch.Tensor:
    """[B,S,N*d] -> [B,S,N_kv*d]: the first N_kv heads, as a GQA op's key or value."""
    n_kv = geometry.num_kv_heads or N
    B, S, _ = x.shape
    return x.reshape(B, S, N, -1)[:, :, :n_kv].reshape(B, S, -1)


def random_attention_batch(rng, gen: torch.Generator, rc, S: int, N: int, D: int, D_v: int, exact: bool, dtype,
                           B: int, K: int, holes: float, geometry: AttentionGeometry = FULL_ATTENTION):
    """(mask, q1, dead, q, k, v): one batch of a calibrated attention op's random comparison: `mixed_mask` with
    `holes`; for the pooled op without a window or a relative position bias (both need S_q == S_k) sometimes a
    single query row (q1: the pooling token's); sometimes two baskets of keys whose scores are far below the
    others' (`dead`: empty baskets); Q, K, V from `random_qkv`, K and V with the geometry's key/value heads
    (`kv_heads`)."""
    mask = mixed_mask(rng, B, K, holes=holes)
    q1 = not rc.all_rows and not rc.row_set and not geometry.windowed and not geometry.relative and rng.random() < 0.3
    lo = rng.randrange(K)
    dead = (lo, lo + 2 * S) if rng.random() < 0.25 and D >= 2 else None
    q, k, v = random_qkv(gen, B, 1 if q1 else K, K, N, D, D_v, dtype, temp=rng.choice([0.5, 1.0, 3.0]), dead=dead,
                         exact=exact)
    return mask, q1, dead, q, kv_heads(k, N, geometry), kv_heads(v, N, geometry)


def attention_oracle_errors(out, q, k, v, mask, rc, N: int, scale: float, exact: bool, float16: bool,
                            geometry: AttentionGeometry = FULL_ATTENTION, table: torch.Tensor | None = None,
                            sums: bool = False):
    """(err, rounding), each [B] (numpy): an ONNX Runtime output's largest error per item against the float64
    oracle (`out` a list of outputs of the same inputs: err a list, one per output, against one oracle), and the float32 rounding of the scores the bound adds (12·δ·max|v|, `score_rounding` over every
    valid key, windows ignored: an upper bound; 0 where the scores are exact), plus with `sums` that of the
    kernel's sums (`accumulation_bound`).  `table`: the relative position bias of a geometry that has one.
    Asserts the output's shape and dtype."""
    ref = attention_reference(q, k, v, mask, rc, N, scale, **vars(geometry), relative_bias=table).numpy()
    errs = []
    for o in out if isinstance(out, list) else [out]:
        assert o.shape == ref.shape and o.dtype == (np.float16 if float16 else np.float32)
        errs.append(np.abs(o.astype(np.float64) - ref).max(axis=(1, 2)))
    err = errs if isinstance(out, list) else errs[0]
    B = mask.shape[0]
    n_kv = geometry.num_kv_heads or N
    k_full = k.reshape(B, k.shape[1], n_kv, -1).repeat_interleave(N // n_kv, dim=2).reshape(B, k.shape[1], -1)
    rounding = (np.zeros(B) if exact
                else (12 * score_rounding(q, k_full, mask, N, scale) * float(v.abs().max())).numpy())
    if sums:
        rounding = rounding + accumulation_bound(v, mask)
    return err, rounding
