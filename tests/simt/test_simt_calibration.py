"""The calibration ops' CUDA kernels run on the simulator (marker `simt`): attncal_cuda_calibrate
(PooledRowCalibration / AllRowsCalibration, calibrate_kernel) and attncal_cuda_softmax_calibrate (their
Softmax-fused forms, softmax_calibrate_kernel), with the span kernel before each, against the float64 oracle
`attncal.calibration.reference`, with the GPU tests' harness and bounds (tests/gpu/test_calibration_cuda.py:
float32 <= 1e-6, float16 <= 2e-3, bfloat16 <= 4e-3; out of place into a NaN-filled buffer, the input checked
untouched, and in place).

The cases are the GPU tests' kind at the simulator's scale: random attributes (every pooling and variant of
`random_config`, isolated first/last keys, empty baskets), ragged lengths padded on either side, basket sizes
that do not divide the row, holes, Q = 1, rows of 64-, 128- and 256-thread blocks; the marked rows (landmark,
multi-CLS, Mean@k); the GPU tests' corner cases; and the launcher's fallback, the basket values recomputed where
the device's shared memory does not hold them (a simulated device with 1 KiB)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from attncal.calibration import reference
from gpu.test_calibration_cuda import DTYPES, TOL, check_corner_case, compare, random_inputs, run_case
from support.cases import calibrated_rows, mark_rows, random_config, row_set_config
from support.masks import mixed_mask
from support.tensors import random_probs, random_scores

from . import build

pytestmark = pytest.mark.simt

# A launch holds a batch of cases: every (item, head, query row) it computes is checked against the oracle.  Each
# launcher runs random launches until CASES of its rows were calibrated rows and at least LAUNCHES launches ran
# (so that the attribute sets vary as much as the rows do).  SIMT_CASES=<n> runs another count.
CASES = int(os.environ.get("SIMT_CASES", "2000"))
LAUNCHES = 150


def small_case(rng: random.Random, marked: bool = False, size: str = ""):
    """(rc, B, H, Q, K, mask): the GPU tests' random case with the simulator's shapes (every block is run thread
    by thread): mostly rows of up to 120 keys (64-thread blocks), sometimes up to 700 (128 threads) or past 1024
    (256 threads, Q = 1 or in place); all-rows cases at most 24 keys (a block per row).  `size` "long" or "mid"
    forces a pooled case of the 256- or 128-thread blocks."""
    S = rng.choice([1, 2, 3, 4, 5, 8, 16, 32, 33, 64])
    cfg = random_config(rng, S, weights_first=True, weight_p=0.25, random_strengths=1)
    rc = (row_set_config(rng, cfg) if marked else cfg).resolve()
    if size and (rc.all_rows or rc.row_set):  # the long rows of the pooled op (an all-rows one is a block per row)
        rc = type(cfg)(**{**vars(cfg), "pooling": "cls"}).resolve()
    r = {"long": 0.0, "mid": 0.1}.get(size, rng.random())
    if r < 0.04 and not rc.all_rows:
        K, B, H = rng.randint(1025, 1300), 1, 1
    elif r < 0.12 and not rc.all_rows:
        K, B, H = rng.randint(257, 700), 1, 1
    else:
        K, B, H = rng.randint(1, 24 if rc.all_rows else 120), rng.randint(1, 3), rng.randint(1, 2)
    if rc.row_set:  # marked rows are rows of self-attention
        K = min(K, 24)
    Q = K if rc.all_rows or rc.row_set or (K <= 24 and rng.random() < 0.5) else 1
    mask = mixed_mask(rng, B, K, holes=0.1 if marked else 0.0)
    if marked:
        mask = mark_rows(rng, mask, p=0.02 if K > 1024 else None)
    elif (size == "mid" or rng.random() < 0.1) and K > 4:
        mask[:, rng.randrange(1, K - 1)] = 0  # a hole in every item
    return rc, B, H, Q, K, mask


def n_calibrated(mask: torch.Tensor, rc, H: int, Q: int) -> int:
    """The calibrated rows of a [B,H,Q,K] launch (Q == K, or the pooled op's single row)."""
    rows = calibrated_rows(mask, rc)
    return H * int(rows.sum() if Q == mask.shape[1] else rows.any(1).sum())


def run_random(lib, n_cases: int, seed: int, softmax: bool, marked: bool = False, launches: int = LAUNCHES) -> dict:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    worst = dict.fromkeys(TOL, 0.0)
    seen = dict.fromkeys((*TOL, "in_place", "out_of_place", "q1", "blocks_128", "blocks_256",
                          "left_padded", "holes", "ragged"), 0)
    n_launches = n_rows = n_cal = 0
    while n_cal < n_cases or n_launches < launches:
        size = "" if marked else ("long", "mid")[n_launches] if n_launches < 2 else ""
        rc, B, H, Q, K, mask = small_case(rng, marked, size)
        cal = n_calibrated(mask, rc, H, Q)
        if 4 * cal < B * H * Q and not size and rng.random() >= 1 / 3:
            continue  # every row is a block: two cases in three where most rows are not calibrated are drawn again
        x, ref = random_inputs(rng, gen, rc, H, Q, K, mask, softmax)
        dt = x.dtype
        in_place = rng.random() < 0.5
        out = run_case(x, mask, rc, in_place, softmax, lib, device="cpu")
        name = str(dt).replace("torch.", "")
        err = compare(out, ref, f"{'fused ' if softmax else ''}case ({rc}, B={B}, H={H}, Q={Q}, K={K}, "
                                f"in_place={in_place}, mask={mask.tolist()})")
        worst[name] = max(worst[name], err)
        n_launches += 1
        n_rows += B * H * Q
        n_cal += cal
        seen[name] += 1
        seen["in_place" if in_place else "out_of_place"] += 1
        seen["q1"] += Q == 1 and K > 1
        seen["blocks_128"] += 256 < K <= 1024
        seen["blocks_256"] += K > 1024
        seen["left_padded"] += bool((mask[:, 0] == 0).any() and (mask.sum(1) > 0).any())
        seen["holes"] += any(int(m.sum()) and int(m.nonzero()[-1] - m.nonzero()[0] + 1) != int(m.sum()) for m in mask)
        seen["ragged"] += len({int(m.sum()) for m in mask}) > 1
    print(f"\nsimt {'fused' if softmax else 'separate'}{' marked rows' if marked else ''}: {n_launches} launches, "
          f"{n_rows} rows checked, {n_cal} of them calibrated; max abs err {worst} (bounds {TOL}), {seen}")
    if marked:  # rows of self-attention, at most 24 keys
        seen = {k: v for k, v in seen.items() if k not in ("q1", "blocks_128", "blocks_256", "holes")}
    assert min(seen.values()) > 0, seen
    return worst


@pytest.mark.parametrize("softmax,seed", [(False, 100), (True, 101)], ids=["separate", "fused"])
def test_calibration_kernels_match_the_oracle(sim, softmax, seed):
    run_random(sim, CASES, seed, softmax)


@pytest.mark.parametrize("softmax,seed", [(False, 110), (True, 111)], ids=["separate", "fused"])
def test_marked_rows_match_the_oracle(sim, softmax, seed):
    run_random(sim, CASES // 16, seed, softmax, marked=True, launches=LAUNCHES // 6)


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("softmax", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_corner_cases(sim, pooling, dtype, softmax, in_place):
    """The GPU tests' corner cases: a subnormal total, an item with no valid key, an odd K."""
    check_corner_case(sim, pooling, dtype, softmax, in_place, device="cpu")


@pytest.mark.parametrize("softmax", [False, True], ids=["separate", "fused"])
def test_baskets_recomputed_where_shared_memory_is_short(sim, softmax):
    """A device with 1 KiB of opt-in shared memory: rows of more than 256 baskets do not keep their basket values
    (launch_config.h: choose_baskets), the kernel recomputes them; the launch log shows 0 bytes of dynamic shared
    memory for those launches, and the results stay within the bounds."""
    rng, gen = random.Random(120 + softmax), torch.Generator().manual_seed(120)
    build.configure(sim, 1024)
    kept = recomputed = 0
    for i in range(40):
        S = rng.choice([1, 2, 3, 32, 33])
        rc = random_config(rng, S, weights_first=True, random_strengths=1).resolve()
        K = rng.randint(300, 700) if i % 2 else rng.randint(20, 200)
        Q = 1 if not rc.all_rows else 1
        if rc.all_rows:
            rc = random_config(random.Random(i), S).resolve()
        mask = mixed_mask(rng, 1, K, holes=0.2, max_holes=3)
        dt = DTYPES[i % len(DTYPES)]
        if softmax:
            x = random_scores(gen, mask, 1, dt, Q=Q)
            ref = reference(torch.softmax(x.double(), -1), mask, rc)
        else:
            x = random_probs(gen, mask, 1, dt, Q=Q)
            ref = reference(x.double(), mask, rc)
        out = run_case(x, mask, rc, rng.random() < 0.5, softmax, sim, device="cpu")
        compare(out, ref, f"recomputed baskets ({rc}, K={K})")
        for line in build.launch_log(sim):
            if "calibrate_kernel" in line:
                if line.endswith(" smem=0"):
                    recomputed += 1
                else:
                    kept += 1
    assert recomputed > 0 and kept > 0, (recomputed, kept)
