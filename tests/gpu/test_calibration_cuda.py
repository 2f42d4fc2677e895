"""The CUDA launchers of the calibration ops through ctypes: attncal_cuda_calibrate (PooledRowCalibration,
AllRowsCalibration, on probabilities) and attncal_cuda_softmax_calibrate (their Softmax-fused forms, on
scores) against the float64 oracle `attncal.calibration.reference`, float32 (<= 1e-6), float16 (<= 2e-3)
and bfloat16 (<= 4e-3: two half-units in the last place of a probability in [0.5, 1]), out of place into a
NaN-filled buffer (a row left unwritten fails; the input must stay untouched) and in place.

* random cases with random attributes: mostly short rows (64- and 128-thread blocks), sometimes long ones
  (256 threads), Q = 1 for the pooled op, both padding sides, masked columns inside the span, empty baskets;
  the fused op's scores sometimes offset, so that the max subtraction matters;
* deterministic corner cases: a subnormal fixed weight (1e-40) on an isolated first key whose row has no
  content mass, so the kernel must divide by a subnormal total (1/total overflows float32); an item with no
  valid key (scores all the lowest value: softmax 1/K, not calibrated); an odd K (out-of-place rows not
  16-byte aligned).

The check functions take `device` and `launch`, so that the harness itself can be dry-run on the CPU with a
stand-in launcher.
"""

from __future__ import annotations

import random
from functools import lru_cache

import pytest
import torch

from attncal.calibration import reference
from support.cases import random_config
from support.cuda import dtype_name, launch, params_of
from support.masks import mixed_mask
from support.oracle_loop import OracleLoop, run_oracle_loop
from support.tensors import random_probs, random_scores

pytestmark = pytest.mark.gpu

TOL = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 4e-3}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def random_case(rng: random.Random):
    """Randomized attributes and geometry: (rc, B, H, Q, K, mask).  Mostly short rows, sometimes long ones
    (K > 1024); pooled cases sometimes have Q == 1 (row placement); now and then a masked column inside
    every item's span."""
    S = rng.choice([1, 2, 3, 4, 8, 16, 32, 33, 64, 128])
    rc = random_config(rng, S, weights_first=True, weight_p=0.25, random_strengths=1).resolve()
    if rng.random() < 0.1:
        K = rng.randint(1025, 1600)
        B, H = rng.randint(1, 2), 1
    else:
        K = rng.randint(1, 64 if rc.all_rows else 600)
        B, H = rng.randint(1, 4), rng.randint(1, 3)
    Q = 1 if not rc.all_rows and rng.random() < 0.2 else K
    mask = mixed_mask(rng, B, K, holes=0.0)
    if rng.random() < 0.1 and K > 4:
        mask[:, rng.randrange(1, K - 1)] = 0  # holes
    return rc, B, H, Q, K, mask


def compare(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """Max abs error of `out` against the float64 reference; raises over the tolerance of out's dtype or
    on a non-finite value."""
    name = dtype_name(out.dtype)
    out = out.double()
    if not bool(torch.isfinite(out).all()):
        raise AssertionError(f"{what}: non-finite output ({int((~torch.isfinite(out)).sum())} values)")
    err = float((out - ref).abs().max()) if out.numel() else 0.0
    if not err <= TOL[name]:
        raise AssertionError(f"{name} {what}: err {err:.3g} > {TOL[name]}")
    return err


def run_case(x: torch.Tensor, mask: torch.Tensor, rc, in_place: bool, softmax: bool, lib, device: str = "cuda",
             launch=launch) -> torch.Tensor:
    """One launch on `device`, in place or out of place into a NaN-filled buffer (then the input must be
    unchanged); the output on the host."""
    d_x, d_mask = x.to(device, copy=True), mask.to(device)  # a copy on any device: `x` stays the input
    if in_place:
        launch(lib, d_x, d_x, d_mask, params_of(rc), softmax=softmax)
        _sync(device)
        return d_x.cpu()
    d_out = torch.full_like(d_x, float("nan"))
    launch(lib, d_x, d_out, d_mask, params_of(rc), softmax=softmax)
    _sync(device)
    if not torch.equal(d_x.cpu(), x):
        raise AssertionError("the out-of-place launch modified its input")
    return d_out.cpu()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def random_inputs(rng: random.Random, gen: torch.Generator, rc, H: int, Q: int, K: int, mask: torch.Tensor,
                  softmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, the oracle's output) of one random case, in one of DTYPES: the fused op's scores (sometimes offset,
    so that the max subtraction matters) or the separate op's probabilities (sometimes with empty baskets)."""
    if softmax:
        dt = rng.choice(DTYPES)
        x = random_scores(gen, mask, H, dt, temp=rng.choice([0.5, 2.0, 6.0]), Q=Q,
                          offset=rng.uniform(-30.0, 30.0) if rng.random() < 0.2 else 0.0)
        return x, reference(torch.softmax(x.double(), -1), mask, rc)
    probs64 = random_probs(gen, mask, H, torch.float64, temp=rng.choice([0.5, 2.0, 6.0]), Q=Q)
    if rng.random() < 0.2:
        probs64[..., rng.randrange(K):][..., : 2 * rc.basket_size] = 0  # empty baskets
    x = probs64.to(rng.choice(DTYPES))
    return x, reference(x.double(), mask, rc)


def check_random_cases(lib, n_cases: int, seed: int, softmax: bool, device: str = "cuda", launch=launch) -> OracleLoop:
    """`n_cases` random cases of one launcher against the oracle: the separate op on probabilities
    (sometimes with empty baskets), or with `softmax` the fused op on scores against the oracle of
    softmax(scores) in float64 (logit ranges that keep valid keys' float32 probabilities normal, as the CPU
    kernel's test does; the scores at masked keys are the dtype's lowest value)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    worst = dict.fromkeys(TOL, 0.0)

    def run(case, seen):
        rc, B, H, Q, K, mask = case
        x, ref = random_inputs(rng, gen, rc, H, Q, K, mask, softmax)
        dt = x.dtype
        in_place = rng.random() < 0.5
        out = run_case(x, mask, rc, in_place, softmax, lib, device, launch)
        err = compare(out, ref, f"{'fused ' if softmax else ''}case ({rc}, B={B}, H={H}, Q={Q}, K={K}, "
                                f"in_place={in_place})")
        name = dtype_name(dt)
        worst[name] = max(worst[name], err)
        seen[name] += 1
        seen["in_place" if in_place else "out_of_place"] += 1
        seen["q1"] += Q == 1 and K > 1
        seen["long_rows"] += K > 1024
        return 1, err

    loop = run_oracle_loop(n_cases, lambda: random_case(rng), run, runs_per_config=1,
                           seen=(*TOL, "in_place", "out_of_place", "q1", "long_rows"))
    print(f"\n{'fused' if softmax else 'separate'} launcher: {loop.cases} cases, max abs err {worst}, {loop.seen}")
    return loop


@pytest.mark.parametrize("softmax,n_cases,seed", [(False, 400, 0), (True, 200, 1)], ids=["separate", "fused"])
def test_launcher_matches_oracle_on_random_cases(launchers, softmax, n_cases, seed):
    loop = check_random_cases(launchers, n_cases, seed, softmax)
    assert loop.cases == n_cases
    assert min(loop.seen.values()) > 0, loop.seen  # both dtypes and placements, Q = 1 and long rows all ran


@lru_cache(maxsize=None)
def corner_inputs() -> dict:
    """{(pooling, dtype name): (rc, mask, scores, probs, probs64)}, drawn in one fixed order from one generator,
    so that each parametrized case gets the same tensors whichever cases run."""
    from attncal.calibration import ResolvedCalibration
    from attncal.calibration.config import MODE_EQUAL, MODE_FIXED

    B, H, K = 3, 2, 7  # K odd: out-of-place rows are not 16-byte aligned
    mask = torch.ones(B, K, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2] = 0  # an item with no valid key
    gen = torch.Generator().manual_seed(2)
    out = {}
    for pooling in ("cls", "mean"):
        rc = ResolvedCalibration(pooling=pooling, strength=0.5, basket_size=2, isolate_first=True,
                                 isolate_last=False, first_mode=MODE_FIXED, first_weight=1e-40,
                                 last_mode=MODE_EQUAL, last_weight=0.0, skip_short=False)
        for dt in DTYPES:
            fmin = torch.finfo(dt).min
            logits = torch.randn(B, H, K, K, generator=gen, dtype=torch.float64)
            logits[:, :, :, 1:] = fmin  # every row: all mass on the first key, so the content mass is 0
            logits[:, 1, 3:, :] = torch.randn(B, K - 3, K, generator=gen, dtype=torch.float64)  # some normal rows
            scores = logits.to(dt).masked_fill(mask[:, None, None, :] == 0, fmin)
            probs64 = torch.softmax(scores.double(), -1)
            out[pooling, dtype_name(dt)] = (rc, mask, scores, probs64.to(dt), probs64)
    return out


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("softmax", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_corner_cases(launchers, pooling, dtype, softmax, in_place):
    check_corner_case(launchers, pooling, dtype, softmax, in_place)


def check_corner_case(lib, pooling: str, dtype: str, softmax: bool, in_place: bool, device: str = "cuda") -> None:
    """A subnormal total (fixed weight 1e-40, no content mass), an item with no valid key, an odd K."""
    rc, mask, scores, probs, probs64 = corner_inputs()[pooling, dtype]
    x, ref = (scores, reference(probs64, mask, rc)) if softmax else (probs, reference(probs.double(), mask, rc))
    out = run_case(x, mask, rc, in_place, softmax, lib, device)
    compare(out, ref, f"corner case ({pooling}, softmax={softmax}, in_place={in_place})")
    # The fully masked item is not calibrated: its rows are the input's (separate) or uniform (fused).
    expect = torch.full_like(out[2].double(), 1.0 / mask.shape[1]) if softmax else probs[2].double()
    assert float((out[2].double() - expect).abs().max()) <= TOL[dtype]
