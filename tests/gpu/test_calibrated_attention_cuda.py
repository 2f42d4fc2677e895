"""The CUDA calibrated attention launchers (PooledRowCalibratedAttention / AllRowsCalibratedAttention) through
ctypes: the tiled kernel (attncal_cuda_calibrated_attention) and the exact per-row kernel
(attncal_cuda_calibrated_attention_reference) against the float64 oracle `attention_reference` and against
each other, float32, float16 and bfloat16; then against torch SDPA + the split identity.

Tolerances against the oracle, beyond the float32 rounding of the scores themselves (added per item,
`score_rounding`, except where the scores are exact in float32): float32 is computed in float32
throughout (1e-6, as every float32 op here).  The 16-bit tiled kernel multiplies P rounded to the input
type by V on the tensor cores, as FlashAttention does: each weight moves by a relative 2^-11 (float16) /
2^-8 (bfloat16), the context (|v| <= 2) by at most 2 * 2^-11 * 2 = 2e-3 / 1.6e-2 in the worst case, on top
of the output's own rounding (half an ulp below 2: 4.9e-4 / 3.9e-3).  Hence 3e-3 (float16) and 2e-2
(bfloat16).

The geometry (grouped key/value heads, windows, the relative position bias:
attncal.graphs.ops.contract.AttentionGeometry) is checked on random cases of both launchers against the same
oracle, float32 and float16, with the same tolerances (plus, for a bias, the rounding of its addition to the
float32 score).

The check functions take `device` and `launch`, so that the harness itself can be dry-run on the CPU with a
stand-in launcher.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from attncal.calibration import CalibrationConfig
from attncal.calibration.oracle import attention_reference
from attncal.graphs.ops.contract import AttentionGeometry
from support.cases import random_config
from support.cuda import attention_launch
from support.masks import mixed_mask
from support.oracle_loop import (OracleLoop, attention_oracle_errors, kv_heads, random_geometry, random_relative_bias,
                                 relative_table, run_oracle_loop)
from support.tensors import plain_attention, random_qkv, score_rounding

pytestmark = pytest.mark.gpu

ATTN_TOL = {"float32": 1e-6, "float16": 3e-3, "bfloat16": 2e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TILED_PER_ROW = [False, True]  # the `reference` argument of attention_launch: tiled kernel, then per-row kernel


def random_attention_case(rng: random.Random):
    """Attributes and geometry of one random case: (rc, B, N, S_q, S_k, D, D_v, scale, exact, dead, mask).
    Head sizes cover both tiled-kernel widths (<= 64, <= 128), the 16-byte and element-wise load paths and
    the per-row kernel (> 128); basket sizes below, at and above the 64-key tile, divisors and not; items
    with no valid key, holes."""
    S = rng.choice([1, 2, 3, 5, 8, 16, 33, 64, 100, 128])
    rc = random_config(rng, S, weights_first=True, weight_p=0.3, random_strengths=2, skip_short_p=0.4).resolve()
    D = rng.choice([4, 8, 12, 16, 32, 40, 64, 72, 96, 128] + ([160] if rng.random() < 0.05 else []))
    D_v = D if rng.random() < 0.7 else rng.choice([8, 16, 24, 64])
    N = rng.randint(1, 3)
    S_k = rng.randint(1, 160 if rc.all_rows else 400)
    B = rng.randint(1, 3)
    S_q = 1 if (not rc.all_rows and rng.random() < 0.25) else S_k
    exact = rng.random() < 0.4
    scale = rng.choice([0.125, 0.25, 0.5]) if exact else rng.choice([0.0, 0.0, 0.1, 0.3])
    lo = rng.randrange(S_k)
    dead = (lo, lo + rng.choice([1, 2]) * S) if rng.random() < 0.2 and D >= 2 else None
    mask = mixed_mask(rng, B, S_k, holes=0.2, empty=0.1, max_holes=3)
    return rc, B, N, S_q, S_k, D, D_v, scale, exact, dead, mask


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_both(lib, q, k, v, mask, rc, N: int, scale: float, device: str = "cuda", launch=attention_launch,
             kernels=TILED_PER_ROW):
    """[tiled, per-row] outputs (float64, on the host), each written into a NaN-filled buffer, so that an
    unwritten row shows; `kernels` a subset of TILED_PER_ROW runs only those launchers."""
    dq, dk, dv, dm = (x.to(device) for x in (q, k, v, mask))
    outs = []
    for reference in kernels:
        out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype, device=device)
        launch(lib, dq, dk, dv, dm, out, rc, N, scale, reference=reference)
        _sync(device)
        outs.append(out.cpu().double())
    return outs


def assert_within(outs, ref: torch.Tensor, bound: torch.Tensor, what: str, kernels=TILED_PER_ROW) -> float:
    """Each output (of run_both with the same `kernels`) finite and within `bound` ([B], per item) of the
    oracle; the first output's max error."""
    for reference, out in zip(kernels, outs):
        kernel = "per-row" if reference else "tiled"
        if not bool(torch.isfinite(out).all()):
            raise AssertionError(f"{kernel} {what}: non-finite output ({int((~torch.isfinite(out)).sum())} values)")
        err = (out - ref).abs().flatten(1).amax(dim=1) if out.numel() else torch.zeros(out.shape[0])
        if bool((err > bound).any()):
            b = int(torch.argmax(err - bound))
            raise AssertionError(f"{kernel} {what}: item {b} err {float(err[b]):.3g} > {float(bound[b]):.3g}")
    return float((outs[0] - ref).abs().max()) if outs[0].numel() else 0.0


def check_random_cases(lib, n_cases: int, seed: int = 20, device: str = "cuda", launch=attention_launch) -> OracleLoop:
    """Random cases: both launchers against the oracle (every context row, calibrated or not) and against
    each other."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    worst = dict.fromkeys(DTYPES, 0.0)
    tiled_vs_per_row = dict.fromkeys(DTYPES, 0.0)

    def run(case, seen):
        rc, B, N, S_q, S_k, D, D_v, scale, exact, dead, mask = case
        name = rng.choice(list(DTYPES))
        q, k, v = random_qkv(gen, B, S_q, S_k, N, D, D_v, DTYPES[name], temp=rng.choice([0.5, 1.0, 3.0]), dead=dead,
                             exact=exact)
        ref = attention_reference(q, k, v, mask, rc, N, scale)
        outs = run_both(lib, q, k, v, mask, rc, N, scale, device, launch)
        bound = torch.full((B,), ATTN_TOL[name], dtype=torch.float64)
        if not exact:
            bound = bound + 12 * score_rounding(q, k, mask, N, scale) * float(v.abs().max())
        what = (f"{name} case ({rc}, B={B}, N={N}, S_q={S_q}, S_k={S_k}, D={D}, D_v={D_v}, scale={scale}, "
                f"dead={dead}, mask={mask.tolist()})")
        err = assert_within(outs, ref, bound, what)
        worst[name] = max(worst[name], err)
        tiled_vs_per_row[name] = max(tiled_vs_per_row[name], float((outs[0] - outs[1]).abs().max()))
        seen[name] += 1
        seen["mean" if rc.all_rows else "last" if rc.pool_last else "cls"] += 1
        seen["q1"] += S_q == 1 and S_k > 1
        seen["empty_item"] += int((mask.sum(1) == 0).any())
        span = [(int(m.nonzero()[-1]) - int(m.nonzero()[0]) + 1) if m.any() else 0 for m in mask]
        seen["holes"] += int(any(int(n) != s for n, s in zip(mask.sum(1), span)))
        seen["dead"] += dead is not None
        seen["exact"] += exact
        esize = 4 if name == "float32" else 2
        seen["scalar_loads"] += (D * esize) % 16 != 0 or (D_v * esize) % 16 != 0
        seen["hd128"] += 64 < max(D, D_v) <= 128
        return 1, err

    loop = run_oracle_loop(n_cases, lambda: random_attention_case(rng), run, runs_per_config=1,
                           seen=(*DTYPES, "cls", "last", "mean", "q1", "empty_item", "holes", "dead", "exact",
                                 "scalar_loads", "hd128"))
    print(f"\ncalibrated attention: {loop.cases} cases, max abs err {worst}, tiled vs per-row {tiled_vs_per_row}, "
          f"{loop.seen}")
    return loop


def test_tiled_and_per_row_kernels_match_oracle_on_random_cases(launchers):
    loop = check_random_cases(launchers, 150)
    assert loop.cases == 150
    assert min(loop.seen.values()) > 0, loop.seen  # every dtype, pooling and geometry above ran


# Head sizes (D, D_v) on every load path: the tiled kernel's two widths (<= 64, <= 128), 16-byte and
# element-wise loads (D * element size a multiple of 16 or not), and the per-row kernel (> 128, by D or D_v).
HEAD_SIZES = [(8, 8), (12, 12), (40, 24), (64, 64), (72, 72), (96, 16), (128, 128), (160, 160), (32, 160)]


def check_head_sizes(lib, D: int, D_v: int, device: str = "cuda", launch=attention_launch) -> int:
    """Every dtype, pooled (cls) and all rows (mean), 150 keys (several 64-key tiles, a partial basket), both
    padding sides and a hole: both launchers against the oracle."""
    rng = random.Random(D * 1000 + D_v)
    gen = torch.Generator().manual_seed(D * 1000 + D_v)
    n = 0
    for name, dt in DTYPES.items():
        for pooling in ("cls", "mean"):
            rc = CalibrationConfig(pooling=pooling, basket_size=16, strength=0.8, skip_short=False).resolve()
            mask = mixed_mask(rng, 3, 150, holes=1.0, min_len=20)
            q, k, v = random_qkv(gen, 3, 150, 150, 2, D, D_v, dt, temp=1.0, exact=True)
            outs = run_both(lib, q, k, v, mask, rc, 2, 0.125, device, launch)
            ref = attention_reference(q, k, v, mask, rc, 2, 0.125)
            bound = torch.full((3,), ATTN_TOL[name], dtype=torch.float64)
            assert_within(outs, ref, bound, f"{name} {pooling} D={D} D_v={D_v}")
            n += 1
    return n


@pytest.mark.parametrize("D,D_v", HEAD_SIZES, ids=[f"D{d}-Dv{dv}" for d, dv in HEAD_SIZES])
def test_head_sizes_on_every_load_path(launchers, D, D_v):
    assert check_head_sizes(launchers, D, D_v) == 6


EDGE_MASK = torch.tensor([[1] * 7 + [0] * 3, [0] * 2 + [1] * 8, [0] * 10, [1] * 3 + [0, 0] + [1] * 5],
                         dtype=torch.long)  # right padded, left padded, no valid key, holes
EDGE_N, EDGE_D, EDGE_DV = 2, 16, 8


def check_masked_items_and_padding_rows(lib, name: str, device: str = "cuda", launch=attention_launch) -> int:
    """Per pooling: the oracle; an item with no valid key gives the mean of V over all keys in every row
    (uniform softmax), never 0 or NaN; the padding query rows are plain attention over the valid keys."""
    gen = torch.Generator().manual_seed(21 + list(DTYPES).index(name))
    mask, N, tol = EDGE_MASK, EDGE_N, ATTN_TOL[name] + 1e-5
    n = 0
    for pooling in ("cls", "last", "mean"):
        rc = CalibrationConfig(pooling=pooling, basket_size=2, strength=0.8, skip_short=False).resolve()
        q, k, v = random_qkv(gen, 4, 10, 10, N, EDGE_D, EDGE_DV, DTYPES[name], temp=2.0)
        ref = attention_reference(q, k, v, mask, rc, N)
        plain = plain_attention(q, k, v, mask, N)
        mean_v = v[2].double().mean(0)
        outs = run_both(lib, q, k, v, mask, rc, N, 0.0, device, launch)
        assert_within(outs, ref, torch.full((4,), tol, dtype=torch.float64), f"{name} {pooling}")
        for reference, out in zip(TILED_PER_ROW, outs):
            tag = f"{name} {pooling} {'per-row' if reference else 'tiled'}"
            assert float((out[2] - mean_v[None, :]).abs().max()) <= tol, f"{tag}: fully masked item is not the mean of V"
            for b, rows in ((0, [7, 8, 9]), (1, [0, 1])):
                assert float((out[b, rows] - plain[b, rows]).abs().max()) <= tol, \
                    f"{tag}: padding rows of item {b} are not plain attention"
            n += 1
    return n


def check_nan_rules(lib, name: str, device: str = "cuda", launch=attention_launch) -> int:
    """A NaN in one head of one query row: that row and head only.  A NaN in a masked key: every row of that
    item and head (NaN + lowest = NaN), as the contract says."""
    gen = torch.Generator().manual_seed(31 + list(DTYPES).index(name))
    mask, N, D, D_v = EDGE_MASK, EDGE_N, EDGE_D, EDGE_DV
    n = 0
    for pooling in ("cls", "last", "mean"):
        rc = CalibrationConfig(pooling=pooling, basket_size=2, strength=0.8, skip_short=False).resolve()
        q, k, v = random_qkv(gen, 4, 10, 10, N, D, D_v, DTYPES[name], temp=2.0)
        row = 2  # item 1 (left padded): its first valid token, calibrated by mean and cls pooling
        qn = q.clone()
        qn[1, row, 1] = float("nan")  # head 0 of that row
        kn = k.clone()
        kn[0, 8, D + 1] = float("nan")  # a masked key of item 0, head 1
        for (qq, kk), where in (((qn, k), (1, row, slice(0, D_v))), ((q, kn), (0, slice(None), slice(D_v, None)))):
            for reference, out in zip(TILED_PER_ROW, run_both(lib, qq, kk, v, mask, rc, N, 0.0, device, launch)):
                tag = f"{name} {pooling} {'per-row' if reference else 'tiled'}"
                nan = torch.zeros(out.shape, dtype=torch.bool)
                nan[where] = True
                assert bool(torch.isnan(out[nan]).all()), f"{tag}: the NaN did not reach {where}"
                assert bool(torch.isfinite(out[~nan]).all()), f"{tag}: the NaN leaked beyond {where}"
                n += 1
    return n


def check_dead_baskets(lib, name: str, device: str = "cuda", launch=attention_launch) -> int:
    """Baskets of mass exactly 0 placed before the live keys, so that the tiled kernel counts them when they
    close and must hand the rows to the per-row kernel (its queue), and a basket made only of holes."""
    gen = torch.Generator().manual_seed(41 + list(DTYPES).index(name))
    N, D, D_v, Kd = EDGE_N, EDGE_D, EDGE_DV, 400
    n = 0
    for pooling, S in (("mean", 4), ("cls", 4), ("mean", 64), ("last", 100)):
        rc = CalibrationConfig(pooling=pooling, basket_size=S, strength=0.9, skip_short=False).resolve()
        md = torch.ones(2, Kd, dtype=torch.long)
        hs = int(rc.isolate_first) + S * ((150 + S - 1) // S)  # a basket boundary of item 1 (start 0)
        md[1, hs:hs + S] = 0  # one whole basket of holes: not counted as non-empty
        md[1, hs + S + 1] = 0  # and a single hole in the next one
        q, k, v = random_qkv(gen, 2, Kd, Kd, N, D, D_v, DTYPES[name], temp=1.0, dead=(0, 2 * S + 3), exact=True)
        ref = attention_reference(q, k, v, md, rc, N, 0.25)
        outs = run_both(lib, q, k, v, md, rc, N, 0.25, device, launch)
        assert_within(outs, ref, torch.full((2,), ATTN_TOL[name], dtype=torch.float64),
                      f"{name} dead baskets ({pooling}, basket {S})")
        n += 1
    return n


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("check", [check_masked_items_and_padding_rows, check_nan_rules, check_dead_baskets],
                         ids=["masked_items_and_padding_rows", "nan_rules", "dead_baskets"])
def test_edge_cases(launchers, check, name):
    assert check(launchers, name) > 0


def check_empty_shapes(lib, device: str = "cuda", launch=attention_launch) -> int:
    """An empty key set (context 0: an empty softmax times an empty V) and a zero head size (every score 0,
    as with zero queries and keys of head size 1), float32."""
    rc = CalibrationConfig(pooling="cls", strength=0.5).resolve()
    gen = torch.Generator().manual_seed(23)
    N = EDGE_N
    n = 0
    for b_, sq, sk, d, dv in ((2, 1, 0, 8, 8), (2, 5, 5, 0, 8)):
        q, k = torch.randn(b_, sq, N * d, generator=gen), torch.randn(b_, sk, N * d, generator=gen)
        v = torch.rand(b_, sk, N * dv, generator=gen)
        m = torch.ones(b_, sk, dtype=torch.long)
        if sk == 0:
            ref = torch.zeros(b_, sq, N * dv, dtype=torch.float64)
        else:
            ref = attention_reference(torch.zeros(b_, sq, N), torch.zeros(b_, sk, N), v, m, rc, N, 1.0)
        out = torch.full((b_, sq, N * dv), float("nan"), device=device)
        launch(lib, q.to(device), k.to(device), v.to(device), m.to(device), out, rc, N, 0.0)
        _sync(device)
        err = float((out.cpu().double() - ref).abs().max())
        assert err <= 1e-6, f"shape {(b_, sq, sk, d, dv)}: err {err:.3g}"
        n += 1
    return n


def test_empty_key_set_and_zero_head_size(launchers):
    assert check_empty_shapes(launchers) == 2


def check_split_identity(lib, n_cases: int = 12, seed: int = 22, device: str = "cuda",
                         launch=attention_launch) -> dict:
    """The kernel against torch SDPA + the split identity (attncal.calibration.split: plain attention of the
    valid keys plus one SDPA call per basket), float32 and float16, on items with at least one valid key and
    no holes (the split path's geometry refuses holes).  Baskets of mass exactly 0 are not generated: the
    split path does not treat them as empty (its module says so)."""
    import torch.nn.functional as F

    from attncal.calibration import compute_geometry
    from attncal.calibration.split import split_calibrated_attention

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    worst = {"float32": 0.0, "float16": 0.0}
    for i in range(n_cases):
        name = ("float32", "float16")[i % 2]
        dt = DTYPES[name]
        pooling = ("cls", "last", "mean")[i % 3]
        S = rng.choice([8, 32, 64, 128])
        cfg = CalibrationConfig(pooling=pooling, basket_size=S, strength=rng.choice([0.5, 1.0]),
                                variant=rng.choice(["uniform", "cls-soft", "cls-hard"]), skip_short=False)
        rc = cfg.resolve()
        B, N, D, K = 3, rng.choice([2, 4]), rng.choice([32, 64]), rng.randint(100, 700)
        mask = mixed_mask(rng, B, K, holes=0.0, min_len=1)
        q, k, v = random_qkv(gen, B, K, K, N, D, D, dt, temp=1.0)
        scale = 1.0 / D ** 0.5
        dq, dk, dv, dm = (x.to(device) for x in (q, k, v, mask))
        out = torch.empty(B, K, N * D, dtype=dt, device=device)
        launch(lib, dq, dk, dv, dm, out, rc, N, 0.0)
        heads = lambda x: x.view(B, K, N, D).transpose(1, 2)  # noqa: E731
        allowed = dm.bool()[:, None, None, :]
        full = F.scaled_dot_product_attention(heads(dq), heads(dk), heads(dv), attn_mask=allowed, scale=scale)
        full = full.contiguous()
        geom = compute_geometry(dm, rc)
        # allowed=None: the key padding is the geometry's token mask (baskets hold content keys only; the
        # original shares' LSE masks by it); the plain term above took the padding mask itself.
        split = split_calibrated_attention(heads(dq), heads(dk), heads(dv), full, None, rc, geom, scale)
        split = split.transpose(1, 2).reshape(B, K, N * D)
        _sync(device)
        err = float((out.double() - split.double()).abs().max())
        # Two float32 computations with different summation orders (and SDPA's own backend choice); in
        # float16 both round P (FlashAttention-style) and the context.
        tol = 1e-4 if name == "float32" else 2 * ATTN_TOL[name]
        assert err <= tol, f"split identity {name} ({rc}, K={K}): err {err:.3g} > {tol}"
        worst[name] = max(worst[name], err)
    print(f"\nkernel vs SDPA + split identity: {n_cases} cases, max abs diff {worst}")
    return worst


def test_kernel_matches_sdpa_and_the_split_identity(launchers):
    assert set(check_split_identity(launchers)) == {"float32", "float16"}


GEOMETRY_DTYPES = ("float32", "float16")


def check_geometry_cases(lib, n_cases: int, seed: int = 24, device: str = "cuda", launch=attention_launch) -> OracleLoop:
    """Random cases (`random_attention_case`) with a random geometry (`random_geometry`: key/value heads a divisor
    of N, no window, causal, sliding or one-sided windows; about a third of them with a relative position bias,
    `random_relative_bias`: 4 to 32 buckets, a max distance up to 40, a random table), float32 and float16: both
    launchers against the oracle, every context row, with ATTN_TOL plus the float32 rounding of the scores
    (`attention_oracle_errors`) and, with a bias, of its addition to them (one more rounding of a score,
    2^-24·max|table| beyond what `score_rounding` counts, weighted as it weights the scores')."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    worst = dict.fromkeys(GEOMETRY_DTYPES, 0.0)

    def configure():
        case = random_attention_case(rng)
        N = rng.choice([1, 2, 3, 4, 6])
        geo = random_geometry(rng, N)
        geo, buckets = random_relative_bias(rng, geo) if rng.random() < 0.35 else (geo, 0)
        return case, N, geo, buckets

    def run(config, seen):
        (rc, B, _, S_q, S_k, D, D_v, scale, exact, dead, mask), N, geo, buckets = config
        if geo.windowed or geo.relative:
            S_q = S_k  # a window and the relative position bias need self-attention
        name = rng.choice(GEOMETRY_DTYPES)
        q, k, v = random_qkv(gen, B, S_q, S_k, N, D, D_v, DTYPES[name], temp=rng.choice([0.5, 1.0, 3.0]), dead=dead,
                             exact=exact)
        k, v = kv_heads(k, N, geo), kv_heads(v, N, geo)
        table = relative_table(gen, buckets, N, DTYPES[name]) if geo.relative else None
        dq, dk, dv, dm = (x.to(device) for x in (q, k, v, mask))
        dt = None if table is None else table.to(device)
        what = (f"{name} case ({rc}, {geo}, buckets={buckets}, B={B}, N={N}, S_q={S_q}, S_k={S_k}, D={D}, D_v={D_v}, "
                f"scale={scale}, dead={dead}, mask={mask.tolist()})")
        # The bias table is on a grid of 1/8 (exact in either dtype); adding it rounds the float32 score once more.
        bias_rounding = (0.0 if exact or table is None
                         else 12 * 2.0 ** -24 * float(table.abs().max()) * float(v.abs().max()))
        outs = []
        for reference in TILED_PER_ROW:
            kernel = "per-row" if reference else "tiled"
            out = torch.full((B, S_q, N * D_v), float("nan"), dtype=q.dtype, device=device)
            status = launch(lib, dq, dk, dv, dm, out, rc, N, scale, reference=reference, geometry=geo, check=False,
                            relative_bias=dt)
            assert status == 0, f"{kernel} {what}: refused ({status}): {lib.attncal_cuda_last_error().decode()}"
            _sync(device)
            out = out.cpu().numpy()
            assert np.all(np.isfinite(out)), f"{kernel} {what}: non-finite output"
            err, rounding = attention_oracle_errors(out, q, k, v, mask, rc, N, scale, exact, name == "float16", geo,
                                                    table)
            bound = ATTN_TOL[name] + rounding + bias_rounding
            if np.any(err > bound):
                b = int(np.argmax(err - bound))
                raise AssertionError(f"{kernel} {what}: item {b} err {err[b]:.3g} > {bound[b]:.3g}")
            outs.append(float(err.max()) if err.size else 0.0)
        worst[name] = max(worst[name], outs[0])
        n_kv = geo.num_kv_heads or N
        seen[name] += 1
        seen["mean" if rc.all_rows else "pooled"] += 1
        seen["gqa"] += n_kv < N
        seen["causal"] += geo.window_right == 0
        seen["sliding"] += geo.window_left >= 0 and geo.window_right >= 0
        seen["one_sided"] += (geo.window_left >= 0) != (geo.window_right >= 0)
        seen["multi_tile"] += geo.windowed and S_k > 64
        seen["hd128"] += 64 < max(D, D_v) <= 128
        seen["per_row_head"] += max(D, D_v) > 128
        seen["relative"] += geo.relative
        seen["relative_multi_tile"] += geo.relative and S_k > 64  # offsets across tiles, the log buckets, the clamp
        seen["relative_calibrated"] += geo.relative and rc.strength != 0
        return 1, outs[0]

    loop = run_oracle_loop(n_cases, configure, run, runs_per_config=1,
                           seen=(*GEOMETRY_DTYPES, "mean", "pooled", "gqa", "causal", "sliding", "one_sided",
                                 "multi_tile", "hd128", "per_row_head", "relative", "relative_multi_tile",
                                 "relative_calibrated"))
    print(f"\ncalibrated attention with GQA, windows and relative position bias: {loop.cases} cases, max abs err "
          f"(tiled) {worst}, {loop.seen}")
    return loop


def test_geometry_matches_oracle_on_random_cases(launchers):
    loop = check_geometry_cases(launchers, 200)
    assert loop.cases == 200
    assert min(v for key, v in loop.seen.items() if key != "per_row_head") > 0, loop.seen


def check_geometry_refusals(lib, device: str = "cuda", launch=attention_launch) -> list[str]:
    """An invalid geometry is refused with a one-line message naming it, before any launch: num_kv_heads not
    dividing num_heads, a window with S_q != S_k; a relative position bias table of too few buckets, one with
    S_q != S_k, a table without relative_max_distance and relative_max_distance without a table."""
    rc = CalibrationConfig(pooling="cls", strength=0.5).resolve()
    relative = AttentionGeometry(relative_max_distance=20)
    messages = []
    for geo, S_q, buckets, expect in (
            (AttentionGeometry(num_kv_heads=3), 4, 0, "num_kv_heads must divide num_heads=4"),
            (AttentionGeometry(window_right=0), 1, 0, "needs S_q == S_k"),
            (relative, 4, 2, "at least 4 buckets and relative_max_distance above num_buckets / 4; got 2 buckets"),
            (relative, 1, 32, "a relative position bias needs S_q == S_k (self-attention); got S_q=1, S_k=4"),
            (AttentionGeometry(), 4, 32, "the relative_bias input needs relative_max_distance > 0"),
            (relative, 4, 0, "relative_max_distance=20 needs the relative_bias input")):
        q, k, v = torch.zeros(1, S_q, 4 * 8), torch.zeros(1, 4, 4 * 8), torch.zeros(1, 4, 4 * 8)
        m = torch.ones(1, 4, dtype=torch.long)
        out = torch.zeros(1, S_q, 4 * 8, device=device)
        table = torch.zeros(buckets, 4, device=device) if buckets else None
        status = launch(lib, q.to(device), k.to(device), v.to(device), m.to(device), out, rc, 4, 0.0, geometry=geo,
                        check=False, relative_bias=table)
        message = lib.attncal_cuda_last_error().decode()
        assert status == 1 and expect in message, (geo, status, message)  # ATTNCAL_ERR_INVALID_ARGUMENT
        messages.append(message)
    return messages


def test_invalid_geometry_is_refused(launchers):
    assert len(check_geometry_refusals(launchers)) == 6
