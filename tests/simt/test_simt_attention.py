"""The calibrated attention kernels run on the simulator (marker `simt`): the tiled kernel (attention_kernel,
mma.sync / ldmatrix / cp.async for float16 and bfloat16, scalar FMAs for float32) and the per-row kernel
(rows_kernel), with the span kernel and the relative position bias kernel before them, against the float64
oracle `attention_reference`, with the GPU tests' harness and bounds (tests/gpu/test_calibrated_attention_cuda.py:
ATTN_TOL float32 1e-6, float16 3e-3, bfloat16 2e-2, plus the float32 rounding of the scores), each output written
into a NaN-filled buffer.

* random cases at the simulator's scale: every dtype, both tiled head sizes (64, 128), the 16-byte cp.async and
  element-wise load paths, the per-row kernel's heads (> 128), basket sizes below, at and above the 64-key tile,
  ragged items padded on either side, holes, items with no valid key, Q = 1;
* the geometry: grouped key/value heads, causal, sliding and one-sided windows, the relative position bias;
* the GPU tests' edge cases (masked items and padding rows, the NaN rules, the empty shapes, the refusals);
* every configuration the launcher can pick, on simulated devices: sm_90 / sm_80 (the design's configuration
  for both block classes), sm_86 (99 KiB: at head size 128 the calibration blocks on half the warps and one
  stage), a device where the calibration blocks fit no tiled configuration (the per-row kernel computes the
  calibrated rows) and one where nothing tiled fits (the per-row kernel computes every row); and the per-row
  kernel's own ladder (baskets kept, recomputed, the query read from global memory, the value columns in
  chunks), each shown taken by the simulator's launch log."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from attncal.calibration import CalibrationConfig
from attncal.calibration.oracle import attention_reference
from gpu.test_calibrated_attention_cuda import (ATTN_TOL, DTYPES, TILED_PER_ROW, assert_within, check_empty_shapes,
                                                check_geometry_refusals, check_masked_items_and_padding_rows,
                                                check_nan_rules, run_both)
from support.cases import calibrated_rows, mark_rows, random_config, row_set_config
from support.cuda import attention_launch
from support.masks import mixed_mask
from support.oracle_loop import attention_oracle_errors, kv_heads, random_geometry, random_relative_bias, relative_table
from support.tensors import random_qkv, score_rounding

from . import build

pytestmark = pytest.mark.simt

# A launch holds a batch of cases: every (item, head, query row) of its output is checked against the oracle.  The
# random loop runs until each kernel computed CASES calibrated rows and at least LAUNCHES launches ran
# (SIMT_CASES=<n> runs another count); the marked-row tests (rows of the same kernels, in sets) a sixteenth of it.
CASES = int(os.environ.get("SIMT_CASES", "2000"))
LAUNCHES = 100
GEOMETRY_CASES = 10
HEADS = [4, 8, 12, 16, 32, 40, 64, 72, 96, 128]


def small_attention_case(rng: random.Random, marked: bool = False):
    """(rc, B, N, S_q, S_k, D, D_v, scale, exact, dead, mask) at the simulator's scale: up to 2 items and 2 heads,
    up to 150 keys (three 64-key tiles) for a single query row, 48 for self-attention."""
    S = rng.choice([1, 2, 3, 5, 8, 16, 33, 64, 100])
    cfg = random_config(rng, S, weights_first=True, weight_p=0.3, random_strengths=2, skip_short_p=0.4)
    rc = (row_set_config(rng, cfg) if marked else cfg).resolve()
    D = rng.choice(HEADS + ([160] if rng.random() < 0.04 else []))
    D_v = D if rng.random() < 0.7 else rng.choice([8, 16, 24, 64])
    N, B = rng.randint(1, 2), rng.randint(1, 2)
    q1 = not rc.all_rows and not marked and rng.random() < 0.5
    S_k = rng.randint(1, 150 if q1 else 48)
    S_q = 1 if q1 else S_k
    exact = rng.random() < 0.4
    scale = rng.choice([0.125, 0.25, 0.5]) if exact else rng.choice([0.0, 0.0, 0.1, 0.3])
    lo = rng.randrange(S_k)
    dead = (lo, lo + rng.choice([1, 2]) * S) if rng.random() < 0.2 and D >= 2 else None
    mask = mixed_mask(rng, B, S_k, holes=0.2, empty=0.1, max_holes=3)
    if marked:
        mask = mark_rows(rng, mask)
    return rc, B, N, S_q, S_k, D, D_v, scale, exact, dead, mask


def run_random(lib, n_cases: int, seed: int, marked: bool = False, launches: int = LAUNCHES) -> dict:
    """Random launches until each kernel computed `n_cases` calibrated rows (and at least `launches` ran).  Each
    kernel runs the cases where its rows come cheapest, and a share of the others: the tiled kernel computes a
    tile of 64 query rows at the cost of one, so it runs every self-attention case and one single-row case in
    ten; the per-row kernel spends a block on every row it computes, calibrated or not, so it runs a case with
    the chance of its calibrated share of rows (at least three quarters: every time) and one single-row case in
    four (a row of up to 150 keys)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    worst = dict.fromkeys(DTYPES, 0.0)
    seen = dict.fromkeys((*DTYPES, "pooled", "mean", "q1", "empty_item", "holes", "dead", "exact", "scalar_loads",
                          "hd64", "hd128", "multi_tile", "per_row_pooled_self", "tiled_q1"), 0)
    n_launches = n_rows = 0
    n_cal = {"tiled": 0, "per-row": 0}
    while min(n_cal.values()) < n_cases or n_launches < launches:
        rc, B, N, S_q, S_k, D, D_v, scale, exact, dead, mask = small_attention_case(rng, marked)
        name = list(DTYPES)[n_launches % len(DTYPES)]  # every dtype in turn
        rows = calibrated_rows(mask, rc)
        cal = N * int(rows.sum() if S_q == S_k else rows.any(1).sum())
        # Each kernel takes the cases where its calibrated rows come cheapest and a share of the others; a kernel
        # past its count joins one case in eight of those the other still takes; a case no kernel takes is drawn
        # again (a draw costs no launch).
        want = {"tiled": S_q > 1 or rng.random() < 1 / 10,
                "per-row": rng.random() < (1 / 4 if S_q == 1 else min(1.0, 4 * cal / (3 * B * N * S_q)))}
        done = {r: n_cal[r] >= n_cases and n_launches >= launches for r in n_cal}
        if not any(want[r] and not done[r] for r in want):
            continue
        tiled, per_row = (want[r] and (not done[r] or rng.random() < 1 / 8) for r in ("tiled", "per-row"))
        kernels = [r for r, run in zip(TILED_PER_ROW, (tiled, per_row)) if run]
        q, k, v = random_qkv(gen, B, S_q, S_k, N, D, D_v, DTYPES[name], temp=rng.choice([0.5, 1.0, 3.0]), dead=dead,
                             exact=exact)
        ref = attention_reference(q, k, v, mask, rc, N, scale)
        outs = run_both(lib, q, k, v, mask, rc, N, scale, device="cpu", kernels=kernels)
        bound = torch.full((B,), ATTN_TOL[name], dtype=torch.float64)
        if not exact:
            bound = bound + 12 * score_rounding(q, k, mask, N, scale) * float(v.abs().max())
        err = assert_within(outs, ref, bound, f"{name} case ({rc}, B={B}, N={N}, S_q={S_q}, S_k={S_k}, D={D}, "
                                              f"D_v={D_v}, scale={scale}, dead={dead}, mask={mask.tolist()})",
                            kernels=kernels)
        worst[name] = max(worst[name], err)
        n_launches += 1
        n_rows += B * N * S_q
        n_cal["tiled"] += cal if tiled else 0
        n_cal["per-row"] += cal if per_row else 0
        seen[name] += 1
        seen["mean" if rc.all_rows else "pooled"] += 1
        seen["q1"] += S_q == 1 and S_k > 1
        seen["empty_item"] += int((mask.sum(1) == 0).any())
        seen["holes"] += any(int(m.sum()) and int(m.nonzero()[-1] - m.nonzero()[0] + 1) != int(m.sum()) for m in mask)
        seen["dead"] += dead is not None
        seen["exact"] += exact
        esize = 4 if name == "float32" else 2
        seen["scalar_loads"] += (D * esize) % 16 != 0 or (D_v * esize) % 16 != 0
        seen["hd64"] += max(D, D_v) <= 64
        seen["hd128"] += 64 < max(D, D_v) <= 128
        seen["multi_tile"] += S_k > 64
        seen["per_row_pooled_self"] += per_row and not rc.all_rows and S_q == S_k > 1
        seen["tiled_q1"] += tiled and S_q == 1
    print(f"\nsimt calibrated attention{' marked rows' if marked else ''}: {n_launches} launches, {n_rows} rows "
          f"checked, calibrated rows computed {n_cal}, max abs err (tiled) {worst} (bounds {ATTN_TOL} + score "
          f"rounding), {seen}")
    if not marked:  # the marked-row sets take the all-rows op and self-attention (their own test's assertion)
        assert min(seen.values()) > 0, seen
    return worst, seen


def test_tiled_and_per_row_kernels_match_the_oracle(sim):
    run_random(sim, CASES, 200)


def test_marked_rows_match_the_oracle(sim):
    _, seen = run_random(sim, CASES // 16, 210, marked=True, launches=LAUNCHES // 5)
    assert min(seen[k] for k in (*DTYPES, "holes", "exact")) > 0, seen


def test_geometry_matches_the_oracle(sim):
    """GQA, windows and the relative position bias (the relative_kernel), float32 and float16, both launchers."""
    rng, gen = random.Random(220), torch.Generator().manual_seed(220)
    seen = dict.fromkeys(("gqa", "causal", "sliding", "one_sided", "relative", "relative_multi_tile"), 0)
    worst = 0.0
    for _ in range(GEOMETRY_CASES):
        rc, B, _, _, S_k, D, D_v, scale, exact, dead, mask = small_attention_case(rng)
        N = rng.choice([1, 2, 4])
        geo = random_geometry(rng, N)
        geo, buckets = random_relative_bias(rng, geo) if rng.random() < 0.4 else (geo, 0)
        S_k = min(S_k, 80)
        mask = mask[:, :S_k].contiguous()
        S_q = S_k
        name = rng.choice(["float32", "float16"])
        q, k, v = random_qkv(gen, B, S_q, S_k, N, D, D_v, DTYPES[name], temp=rng.choice([0.5, 1.0, 3.0]), exact=exact)
        k, v = kv_heads(k, N, geo).contiguous(), kv_heads(v, N, geo).contiguous()
        table = relative_table(gen, buckets, N, DTYPES[name]) if geo.relative else None
        bias_rounding = 0.0 if exact or table is None else 12 * 2.0 ** -24 * float(table.abs().max()) * float(v.abs().max())
        for reference in (False, True):
            out = torch.full((B, S_q, N * D_v), float("nan"), dtype=q.dtype)
            attention_launch(sim, q, k, v, mask, out, rc, N, scale, reference=reference, geometry=geo,
                             relative_bias=table)
            err, rounding = attention_oracle_errors(out.numpy(), q, k, v, mask, rc, N, scale, exact,
                                                    name == "float16", geo, table)
            bound = ATTN_TOL[name] + rounding + bias_rounding
            assert np.all(np.isfinite(out.numpy())), (geo, rc)
            assert not np.any(err > bound), f"{'per-row' if reference else 'tiled'} {geo} {rc} err {err} > {bound}"
            worst = max(worst, float(err.max()) if err.size else 0.0)
        n_kv = geo.num_kv_heads or N
        seen["gqa"] += n_kv < N
        seen["causal"] += geo.window_right == 0
        seen["sliding"] += geo.window_left >= 0 and geo.window_right >= 0
        seen["one_sided"] += (geo.window_left >= 0) != (geo.window_right >= 0)
        seen["relative"] += geo.relative
        seen["relative_multi_tile"] += geo.relative and S_k > 64
    print(f"\nsimt geometry: {GEOMETRY_CASES} cases, max abs err {worst:.3g}, {seen}")
    assert min(seen.values()) > 0, seen


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("check", [check_masked_items_and_padding_rows, check_nan_rules],
                         ids=["masked_items_and_padding_rows", "nan_rules"])
def test_edge_cases(sim, check, name):
    assert check(sim, name, device="cpu") > 0


def test_empty_shapes_and_refusals(sim):
    assert check_empty_shapes(sim, device="cpu") == 2
    assert len(check_geometry_refusals(sim, device="cpu")) == 6


def _case(rng, gen, dtype, D, S, pooling="mean", S_k=40, B=2, N=2):
    rc = CalibrationConfig(pooling=pooling, basket_size=S, strength=0.8, skip_short=False).resolve()
    mask = mixed_mask(rng, B, S_k, holes=0.5, min_len=S_k // 2)
    S_q = S_k if rc.all_rows else 1
    q, k, v = random_qkv(gen, B, S_q, S_k, N, D, D, DTYPES[dtype], temp=1.0, exact=True)
    return rc, mask, q, k, v, N


def _check_launch(lib, rc, mask, q, k, v, N, dtype, reference=False):
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype)
    attention_launch(lib, q, k, v, mask, out, rc, N, 0.125, reference=reference)
    ref = attention_reference(q, k, v, mask, rc, N, 0.125)
    err = float((out.double() - ref).abs().max())
    assert np.isfinite(err) and err <= ATTN_TOL[dtype], f"{dtype}: err {err:.3g} > {ATTN_TOL[dtype]}"
    return build.launch_log(lib)


def _blocks(log, kernel):
    """The block sizes of the launches of `kernel` in the launch log."""
    return [int(line.split(" block=")[1].split()[0]) for line in log if line.startswith(kernel)]


# (device, opt-in bytes, dtype, head, expected block sizes of attention_kernel: plain launch, calibration launch,
#  whether the per-row kernel runs the calibrated rows (a rows_kernel launch before the queue's))
LADDER = [
    ("sm_90", 227 * 1024, "float16", 128, [128, 128]),
    ("sm_80", 163 * 1024, "bfloat16", 128, [128, 128]),
    ("sm_86", 99 * 1024, "float16", 128, [128, 64]),  # the calibration blocks: 2 warps, 1 stage
    ("sm_86", 99 * 1024, "float32", 128, [64, 32]),   # float32: 1 warp
    ("sm_86", 99 * 1024, "bfloat16", 64, [128, 128]),
    ("sm_90", 227 * 1024, "float32", 64, [64, 64]),
]


@pytest.mark.parametrize("device,optin,dtype,head,blocks", LADDER,
                         ids=[f"{d}-{t}-hd{h}" for d, _, t, h, _ in LADDER])
def test_launcher_configurations(sim, device, optin, dtype, head, blocks):
    """Each rung of the shared-memory ladder the launcher can take (cuda/launch_config.h: choose_tiled), on a
    simulated device with that opt-in limit: the configuration in the launch log, the result within the bound."""
    rng, gen = random.Random(head + optin), torch.Generator().manual_seed(head)
    build.configure(sim, optin)
    rc, mask, q, k, v, N = _case(rng, gen, dtype, head, 16, S_k=70)
    log = _check_launch(sim, rc, mask, q, k, v, N, dtype)
    assert _blocks(log, "kernel") == blocks, log  # the tiled kernel is launched through a variable named `kernel`


def test_calibration_blocks_fall_back_to_the_per_row_kernel(sim):
    """A device whose opt-in limit holds the plain blocks' footprint but not the calibration blocks' (float16, head
    64: 46208 and 78976 bytes): the calibrated rows go to the per-row kernel (calibrated_only)."""
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    build.configure(sim, 60000)
    for dtype in ("float16", "bfloat16"):
        rc, mask, q, k, v, N = _case(rng, gen, dtype, 64, 8)
        log = _check_launch(sim, rc, mask, q, k, v, N, dtype)
        assert _blocks(log, "kernel") == [128] and len(_blocks(log, "attncal::rows_kernel")) == 1, log


def test_every_row_falls_back_to_the_per_row_kernel(sim):
    """A device where not even the plain blocks' footprint fits (16 KiB): the per-row kernel computes every row."""
    rng, gen = random.Random(4), torch.Generator().manual_seed(4)
    build.configure(sim, 16 * 1024)
    for dtype in DTYPES:
        rc, mask, q, k, v, N = _case(rng, gen, dtype, 32, 4, S_k=24)
        log = _check_launch(sim, rc, mask, q, k, v, N, dtype)
        assert not _blocks(log, "kernel") and len(_blocks(log, "attncal::rows_kernel")) == 1, log


# The per-row kernel's own ladder (choose_rows) at D = D_v = 160, 300 keys in baskets of 1: 300 basket sums.
ROWS_LADDER = [(4096, 4 * (160 + 160 + 300)), (2000, 4 * (160 + 160 + 129)), (1500, 4 * (160 + 129)),
               (1100, 4 * (128 + 129))]


@pytest.mark.parametrize("optin,smem", ROWS_LADDER, ids=["kept", "baskets_recomputed", "query_global",
                                                         "value_chunks"])
def test_per_row_kernel_shared_memory_forms(sim, optin, smem):
    rng, gen = random.Random(optin), torch.Generator().manual_seed(optin)
    build.configure(sim, optin)
    rc = CalibrationConfig(pooling="cls", basket_size=1, strength=0.8, skip_short=False).resolve()
    mask = mixed_mask(rng, 1, 300, holes=1.0, min_len=280, max_holes=3)
    q, k, v = random_qkv(gen, 1, 1, 300, 1, 160, 160, torch.float32, temp=1.0, exact=True)
    log = _check_launch(sim, rc, mask, q, k, v, 1, "float32", reference=True)
    assert [line.split(" smem=")[1] for line in log if line.startswith("attncal::rows_kernel")] == [str(smem)], log
