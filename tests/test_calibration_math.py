"""The efficient `apply` against the naive `reference` oracle, closed forms and properties."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attncal.calibration import CalibrationConfig, apply, compute_geometry, reference
from support.cases import calibrated_rows, random_config
from support.masks import random_mask
from support.tensors import random_probs

TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3}
N_CASES = {torch.float64: 14_000, torch.float32: 4_000, torch.float16: 2_000}


def run_case(rng: random.Random, gen: torch.Generator, dtype: torch.dtype, stats: dict) -> None:
    S = rng.choice([1, 1, 2, 3, 4, 5, 8])
    target = rng.choice([1, 2, 3, 4, 7, 12, 20, 41, 45])
    pooling_mean = rng.random() < 0.15
    K = max(1, min(target * S + rng.randint(0, S + 1), 16 if pooling_mean else 96))
    B = rng.randint(1, 3 if pooling_mean or K > 48 else 8)
    H = 1 if pooling_mean else rng.randint(1, 2)
    left = rng.random() < 0.5
    mask = random_mask(rng, B, K, left)
    probs = random_probs(gen, mask, H, torch.float64, temp=rng.choice([0.5, 2.0, 6.0]))
    if rng.random() < 0.2:  # exact zeros, so that empty-mass baskets occur
        lo = rng.randrange(K)
        probs[..., lo : lo + rng.randint(1, 2 * S)] = 0
        probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-300)
    probs = probs.to(dtype)
    cfg = random_config(rng, S)
    if pooling_mean:
        cfg = CalibrationConfig(**{**cfg.to_dict(), "pooling": "mean"})
    ref = reference(probs.to(torch.float64), mask, cfg)
    out = apply(probs.clone(), mask, cfg)
    err = (out.to(torch.float64) - ref).abs().max().item() if probs.numel() else 0.0
    stats["max_err"] = max(stats["max_err"], err)
    assert err <= TOL[dtype], (err, cfg, B, H, K, left)

    rc = cfg.resolve()
    # Which (item, row) pairs are calibrated, derived from the spec independently of both implementations.
    cal_rows = calibrated_rows(mask, rc)
    for b in range(B):
        if cal_rows[b].any():
            n = -(-(int(mask[b].sum()) - rc.n_isolated) // S)
            stats["max_baskets"] = max(stats["max_baskets"], n)
    stats["rows"] += int(cal_rows.sum()) * H
    untouched = ~cal_rows[:, None, :, None].expand_as(out)
    assert torch.equal(out[untouched], probs[untouched]), "untouched rows must be bit-identical"
    sel = cal_rows[:, None, :].expand(B, H, K)
    rows, rows_in = out[sel].to(torch.float64), probs[sel].to(torch.float64)  # [N,K]
    pads = (mask == 0)[:, None, None, :].expand(B, H, K, K)[sel[..., None].expand(B, H, K, K)].view(-1, K)
    assert torch.all(rows[pads] == 0), "pads must be 0 in calibrated rows"
    proper = rows_in.sum(-1) > 0.5
    assert torch.allclose(rows.sum(-1)[proper], torch.ones_like(rows.sum(-1)[proper]), atol=10 * TOL[dtype] * K)


@pytest.fixture
def one_thread():
    """Thousands of tiny tensors: thread hand-off would cost more than the math."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
def test_apply_matches_reference_randomized(dtype, one_thread):
    rng = random.Random(1234 + N_CASES[dtype])
    gen = torch.Generator().manual_seed(99)
    stats = {"max_err": 0.0, "rows": 0, "max_baskets": 0}
    for _ in range(N_CASES[dtype]):
        run_case(rng, gen, dtype, stats)
    print(f"\n{dtype}: {N_CASES[dtype]} cases, {stats['rows']} calibrated rows, "
          f"max baskets {stats['max_baskets']}, max abs err {stats['max_err']:.3g}")
    assert stats["max_baskets"] >= 40
    assert sum(N_CASES.values()) >= 20_000


def test_apply_bfloat16_runs_in_fp32():
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    mask = random_mask(rng, 4, 64, left=False, min_len=40)
    probs = random_probs(gen, mask, 2, torch.bfloat16)
    cfg = CalibrationConfig(basket_size=8, pooling="cls", strength=0.7)
    out = apply(probs.clone(), mask, cfg)
    ref = reference(probs.to(torch.float64), mask, cfg)
    assert out.dtype == torch.bfloat16
    assert (out.to(torch.float64) - ref).abs().max().item() <= 1e-2


def test_apply_is_in_place_and_geometry_reusable():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    mask = random_mask(rng, 5, 50, left=True, min_len=10)
    cfg = CalibrationConfig(basket_size=4, pooling="last", strength=0.6, skip_short=False)
    geom = compute_geometry(mask, cfg.resolve())
    p1 = random_probs(gen, mask, 3, torch.float32)
    p2 = random_probs(gen, mask, 3, torch.float32)
    r1, r2 = reference(p1.double(), mask, cfg), reference(p2.double(), mask, cfg)
    assert apply(p1, mask, cfg, geometry=geom) is p1
    apply(p2, mask, cfg, geometry=geom)
    assert (p1.double() - r1).abs().max() <= 1e-6
    assert (p2.double() - r2).abs().max() <= 1e-6


# ------------------------------------------------------------------ closed forms
def _one_item(K: int, n_valid: int, seed: int = 0, H: int = 2):
    mask = torch.zeros(1, K, dtype=torch.long)
    mask[0, :n_valid] = 1
    gen = torch.Generator().manual_seed(seed)
    return mask, random_probs(gen, mask, H)


@pytest.mark.parametrize("n_valid,S", [(33, 8), (17, 4), (9, 8), (65, 16)])
def test_closed_form_uniform_cls(n_valid, S):
    mask, probs = _one_item(80, n_valid)
    cfg = CalibrationConfig(variant="uniform", strength=1.0, basket_size=S, pooling="cls")
    out = apply(probs.clone(), mask, cfg)[0, :, 0]
    n = math.ceil((n_valid - 1) / S)
    assert torch.allclose(out[:, 0], torch.full((2,), 1 / (n + 1), dtype=torch.float64), atol=1e-12)
    for k in range(n):
        lo, hi = 1 + k * S, min(1 + (k + 1) * S, n_valid)
        assert torch.allclose(out[:, lo:hi].sum(-1), torch.full((2,), 1 / (n + 1), dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("n_valid,S", [(33, 8), (50, 7)])
def test_closed_form_cls_soft(n_valid, S):
    mask, probs = _one_item(64, n_valid)
    cfg = CalibrationConfig(variant="cls-soft", strength=1.0, basket_size=S, pooling="cls")
    out = apply(probs.clone(), mask, cfg)[0, :, 0]
    a_s = probs[0, :, 0, 0]
    n = math.ceil((n_valid - 1) / S)
    assert torch.allclose(out[:, 0], a_s, atol=1e-12)
    for k in range(n):
        lo, hi = 1 + k * S, min(1 + (k + 1) * S, n_valid)
        assert torch.allclose(out[:, lo:hi].sum(-1), (1 - a_s) / n, atol=1e-12)


def test_closed_form_cls_hard_fixes_self_weight():
    mask, probs = _one_item(64, 60)
    cfg = CalibrationConfig(variant="cls-hard", strength=1.0, basket_size=8, pooling="cls", self_weight=0.25)
    out = apply(probs.clone(), mask, cfg)[0, :, 0]
    assert torch.allclose(out[:, 0], torch.full((2,), 0.25, dtype=torch.float64), atol=1e-12)


def test_single_basket_with_original_is_noop():
    # All content in one basket, every isolated token 'original': the row comes back unchanged.
    mask, probs = _one_item(40, 30)
    cfg = CalibrationConfig(variant="cls-soft", strength=1.0, basket_size=64, pooling="cls", skip_short=False)
    out = apply(probs.clone(), mask, cfg)
    assert torch.allclose(out, probs, atol=1e-12)


def test_strength_zero_is_identity():
    mask, probs = _one_item(40, 38)
    cfg = CalibrationConfig(strength=0.0, basket_size=4, pooling="cls")
    assert torch.equal(apply(probs.clone(), mask, cfg), probs)
    assert torch.equal(reference(probs, mask, cfg), probs)


def test_skip_short_leaves_short_rows_bit_identical():
    mask, probs = _one_item(40, 20)
    cfg = CalibrationConfig(basket_size=128, pooling="cls", skip_short=True)
    assert torch.equal(apply(probs.clone(), mask, cfg), probs)
    cfg2 = CalibrationConfig(basket_size=128, pooling="cls", skip_short=False, variant="uniform", strength=1.0)
    out = apply(probs.clone(), mask, cfg2)[0, :, 0]
    assert torch.allclose(out[:, 0], torch.full((2,), 0.5, dtype=torch.float64), atol=1e-12)


def test_bad_inputs_raise():
    cfg = CalibrationConfig(pooling="cls")
    with pytest.raises(ValueError, match=r"\[B,H,Q,K\]"):
        apply(torch.zeros(2, 3, 4), torch.ones(2, 4), cfg)
    with pytest.raises(ValueError, match="attention_mask must be"):
        apply(torch.zeros(2, 1, 4, 4), torch.ones(2, 5), cfg)
    with pytest.raises(ValueError, match="contiguous"):
        apply(torch.zeros(1, 1, 4, 4), torch.tensor([[1, 0, 1, 1]]), cfg)
    with pytest.raises(ValueError, match="pooling"):
        apply(torch.zeros(1, 1, 4, 4), torch.ones(1, 4), CalibrationConfig())


# ------------------------------------------------------------------ properties
@st.composite
def cases(draw):
    S = draw(st.integers(1, 6))
    K = draw(st.integers(1, 40))
    B = draw(st.integers(1, 3))
    left = draw(st.booleans())
    lens = draw(st.lists(st.integers(0, K), min_size=B, max_size=B))
    mask = torch.zeros(B, K, dtype=torch.long)
    for b, n in enumerate(lens):
        if left:
            mask[b, K - n :] = 1
        else:
            mask[b, :n] = 1
    seed = draw(st.integers(0, 2**31 - 1))
    probs = random_probs(torch.Generator().manual_seed(seed), mask, 2, torch.float64)
    zero_from = draw(st.integers(0, K))
    zero_len = draw(st.integers(0, 2 * S))
    probs[..., zero_from : zero_from + zero_len] = 0
    cfg = CalibrationConfig(
        variant=draw(st.sampled_from(["uniform", "cls-soft", "cls-hard"])),
        strength=draw(st.floats(0, 1)),
        basket_size=S,
        pooling=draw(st.sampled_from(["cls", "last", "mean"])),
        skip_short=draw(st.booleans()),
        self_weight=draw(st.floats(0, 0.9)),
    )
    return probs, mask, cfg


@settings(max_examples=300, deadline=None)
@given(cases())
def test_property_apply_equals_reference(case):
    probs, mask, cfg = case
    out = apply(probs.clone(), mask, cfg)
    assert (out - reference(probs, mask, cfg)).abs().max().item() <= 1e-12 if probs.numel() else True


@settings(max_examples=200, deadline=None)
@given(cases())
def test_property_outputs_are_distributions(case):
    probs, mask, cfg = case
    out = apply(probs.clone(), mask, cfg)
    assert torch.all(out >= 0)
    assert torch.all(out <= 1 + 1e-12)
    # Calibration never moves mass onto padding.
    assert torch.all(out[mask[:, None, None, :].expand_as(out) == 0] <= probs[mask[:, None, None, :].expand_as(out) == 0])


@settings(max_examples=200, deadline=None)
@given(cases(), st.floats(0.0, 1.0))
def test_property_blend_is_linear_in_strength(case, lam):
    """out(λ) = λ·out(1) + (1-λ)·out(0) on calibrated rows with pads zeroed."""
    probs, mask, cfg = case
    d = cfg.to_dict()
    one = apply(probs.clone(), mask, CalibrationConfig(**{**d, "strength": 1.0}))
    mid = apply(probs.clone(), mask, CalibrationConfig(**{**d, "strength": lam}))
    changed = (one != probs).any(-1, keepdim=True)
    z = probs * mask[:, None, None, :]
    expected = lam * one + (1 - lam) * z
    assert torch.allclose(torch.where(changed, mid, 0), torch.where(changed, expected, 0), atol=1e-12)


def test_naive_full_tensor_variant_matches_reference(one_thread):
    """The benchmark's contrast implementation must be correct too, or the contrast is meaningless."""
    from attncal.calibration.naive import naive_apply

    rng = random.Random(77)
    gen = torch.Generator().manual_seed(77)
    for _ in range(300):
        S = rng.choice([1, 2, 3, 5])
        K = rng.randint(1, 30)
        mask = random_mask(rng, rng.randint(1, 4), K, rng.random() < 0.5)
        probs = random_probs(gen, mask, 2)
        cfg = random_config(rng, S)
        assert (naive_apply(probs.clone(), mask, cfg) - reference(probs, mask, cfg)).abs().max() <= 1e-12


def test_subnormal_fixed_weight_is_normalised_by_division():
    """Found by hypothesis: an all-zero row with a subnormal cls-hard weight; 1/total would overflow."""
    probs = torch.zeros(1, 2, 2, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.long)
    cfg = CalibrationConfig(variant="cls-hard", strength=1.0, basket_size=1, pooling="cls",
                            self_weight=2.225073858507e-311, skip_short=False)
    out = apply(probs.clone(), mask, cfg)
    assert torch.equal(out, reference(probs, mask, cfg))
    assert torch.all(out[0, :, 0, 0] == 1.0)
