"""The split-attention identity (attncal.calibration.split) against the float64 oracle.

The oracle calibrates the probabilities; the split form never sees them.  Both must give the same
context rows for every weight mode, isolation, padding side, partial last basket, and for models
whose own mask hides keys from a row (causal, sliding window).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from attncal.calibration import CalibrationConfig, compute_geometry, reference
from attncal.calibration.config import MODE_EQUAL, MODE_FIXED, MODE_ORIGINAL, ResolvedCalibration
from attncal.calibration.split import SPLIT_MODES, allowed_from_mask, split_calibrated_attention
from support.masks import token_mask


def _model_mask(kind: str, tok: torch.Tensor, window: int = 5) -> torch.Tensor | None:
    """The model's own boolean mask [B,1,K,K] (True = attend), padding included, or None."""
    B, K = tok.shape
    keys = tok.bool()[:, None, None, :]
    if kind == "padding":
        return keys
    i = torch.arange(K)
    if kind == "causal":
        return keys & (i[None, :] <= i[:, None])[None, None]
    if kind == "window":
        return keys & ((i[None, :] - i[:, None]).abs() <= window)[None, None]
    raise ValueError(kind)


def _case(rc: ResolvedCalibration, lengths, K, left, kind, mode, dtype=torch.float64, H=3, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q = torch.randn(B, H, K, d, generator=g, dtype=dtype) * 1.5
    k = torch.randn(B, H, K, d, generator=g, dtype=dtype)
    v = torch.randn(B, H, K, d, generator=g, dtype=dtype)
    tok = token_mask(lengths, K, left)
    allowed = _model_mask(kind, tok)
    scale = d ** -0.5
    s = torch.matmul(q, k.transpose(2, 3)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(s, -1).nan_to_num(0.0)  # rows with no allowed key (pads) -> 0
    expected = torch.matmul(reference(probs, tok, rc), v)
    full = torch.matmul(probs, v)
    geom = compute_geometry(tok, rc)
    got = split_calibrated_attention(q, k, v, full.clone(), allowed if kind != "padding" else None, rc, geom,
                                     scale, mode=mode)
    rows = tok.bool()[:, None, :, None]  # pad query rows are not compared (plain attention of nothing)
    return (torch.where(rows, got - expected, 0.0)).abs().max().item()


def _rc(pooling, lam, S, first, last, fm, lm, fw=0.2, lw=0.1, skip=True) -> ResolvedCalibration:
    return ResolvedCalibration(pooling=pooling, strength=lam, basket_size=S, isolate_first=first, isolate_last=last,
                               first_mode=fm, first_weight=fw, last_mode=lm, last_weight=lw, skip_short=skip)


MODES = (MODE_EQUAL, MODE_ORIGINAL, MODE_FIXED)


@pytest.mark.parametrize("mode", SPLIT_MODES)
@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_identity_matches_the_oracle_for_every_weight_mode(pooling, mode):
    """Every isolation and weight mode, both padding sides, partial last baskets, short items skipped."""
    worst, cases = 0.0, 0
    for (first, last), fm, lm, left, kind in itertools.product(
        [(False, False), (True, False), (False, True), (True, True)], MODES, MODES, [False, True],
        ["padding", "causal", "window"],
    ):
        if (not first and fm != MODE_EQUAL) or (not last and lm != MODE_EQUAL):
            continue
        rc = _rc(pooling, 0.7, 4, first, last, fm, lm, skip=cases % 2 == 0)
        worst = max(worst, _case(rc, [13, 7, 3, 16], 16, left, kind, mode, seed=cases))
        cases += 1
    assert cases == 96
    assert worst <= 1e-12, worst


def test_identity_edge_cases():
    """λ = 1, a single basket, basket larger than the sequence, subnormal fixed weight, all items skipped."""
    cases = [
        (_rc("mean", 1.0, 3, False, False, 0, 0), [9, 8], 9),
        (_rc("cls", 0.5, 16, True, False, MODE_ORIGINAL, 0, skip=False), [9, 4], 9),
        (_rc("cls", 0.5, 64, True, False, 0, 0), [9, 4], 9),  # nothing to calibrate: skip_short
        (_rc("cls", 0.5, 2, True, False, MODE_FIXED, 0, fw=2.2e-311, skip=False), [9, 5], 9),
        (_rc("last", 0.3, 1, True, True, MODE_FIXED, MODE_ORIGINAL, fw=0.9, lw=0.5), [9, 2], 9),
    ]
    for i, (rc, lengths, K) in enumerate(cases):
        for left, kind in itertools.product([False, True], ["padding", "causal"]):
            assert _case(rc, lengths, K, left, kind, "loop", seed=i) <= 1e-12, (rc, left, kind)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float16, 3e-3)])
def test_identity_in_low_precision(dtype, tol):
    rc = CalibrationConfig(variant="cls-soft", basket_size=4, pooling="cls").resolve()
    err = _case(rc, [14, 9], 14, False, "padding", "loop", dtype=dtype)
    assert err <= tol


def test_allowed_from_mask_reads_additive_and_boolean_masks():
    add = torch.tensor([[[[0.0, torch.finfo(torch.float32).min]]]])
    assert allowed_from_mask(add, False, 1, 2, torch.device("cpu")).tolist() == [[[[True, False]]]]
    assert allowed_from_mask(None, False, 2, 2, torch.device("cpu")) is None
    assert allowed_from_mask(None, True, 2, 2, torch.device("cpu")).tolist() == [[[[True, False], [True, True]]]]


# ---- the attncal_sdpa attention implementation on real architectures -------------------------------

def _model(arch: str, attn: str):
    from transformers import AutoModel

    from attncal.synthetic import make_config

    torch.manual_seed(0)
    return AutoModel.from_config(make_config(arch, layers=4, hidden=32, heads=4, max_positions=128),
                                 attn_implementation=attn).eval()


def _batch(arch: str, S: int = 45, lengths=(45, 29, 11)):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(6, 100, (len(lengths), S), generator=gen)
    mask = token_mask(list(lengths), S, left=arch == "qwen3")
    kw = {"input_ids": ids, "attention_mask": mask}
    if arch == "qwen3":
        kw["use_cache"] = False
    return kw


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "qwen3", "modernbert"])
def test_sdpa_split_matches_eager_calibration(arch):
    """calibrate() on an SDPA model stays on SDPA (no eager switch) and equals eager calibration."""
    import warnings

    from attncal.calibration import calibrate

    eager, sdpa = _model(arch, "eager"), _model(arch, "sdpa")
    sdpa.load_state_dict(eager.state_dict())
    kw = _batch(arch)
    poolings = ["last", "mean"] if arch == "qwen3" else ["cls", "mean"]
    worst = 0.0
    for pooling, variant, S in itertools.product(poolings, ["uniform", "cls-soft", "cls-hard"], [8, 7]):
        cfg = CalibrationConfig(variant=variant, strength=0.8, basket_size=S, layers="all", pooling=pooling)
        with torch.no_grad(), calibrate(eager, cfg) as pe:
            ref = eager(**kw).last_hidden_state
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")  # no "switched to eager" warning
            with calibrate(sdpa, cfg) as ps:
                assert ps.implementation == "split"
                assert sdpa.config._attn_implementation == "attncal_sdpa"
                got = sdpa(**kw).last_hidden_state
        assert ps.calls == pe.calls == 4
        valid = kw["attention_mask"].bool()[..., None]
        worst = max(worst, torch.where(valid, got - ref, 0.0).abs().max().item())
        with torch.no_grad():
            plain = sdpa(**kw).last_hidden_state
        assert torch.where(valid, plain - got, 0.0).abs().max() > 1e-4  # calibration did something
    assert sdpa.config._attn_implementation == "sdpa"
    assert worst <= 1e-5, worst


def test_split_modes_agree_and_lambda_zero_is_plain_sdpa():
    from attncal.calibration import calibrate

    model = _model("bert", "sdpa")
    kw = _batch("bert")
    cfg = CalibrationConfig(variant="uniform", basket_size=8, layers="all", pooling="mean")
    with torch.no_grad():
        plain = model(**kw).last_hidden_state
        with calibrate(model, cfg, split_mode="loop"):
            loop = model(**kw).last_hidden_state
        with calibrate(model, cfg, split_mode="batched"):
            batched = model(**kw).last_hidden_state
        with calibrate(model, CalibrationConfig(strength=0.0, basket_size=8, layers="all", pooling="mean")):
            zero = model(**kw).last_hidden_state
    assert (loop - batched).abs().max() <= 1e-5
    assert torch.equal(zero, plain)
    with pytest.raises(ValueError, match="split_mode"):
        calibrate(model, cfg, split_mode="fast")


def test_identity_with_query_rows_in_chunks(monkeypatch):
    """All-rows calibration runs query rows in chunks (bounded memory); chunk edges change nothing."""
    import attncal.calibration.split as split

    monkeypatch.setattr(split, "ROW_CHUNK", 5)
    worst = 0.0
    for (first, last), left, kind in itertools.product([(False, False), (True, True)], [False, True],
                                                      ["padding", "causal", "window"]):
        rc = _rc("mean", 0.7, 4, first, last, MODE_ORIGINAL if first else 0, MODE_FIXED if last else 0)
        worst = max(worst, _case(rc, [13, 7, 3, 16], 16, left, kind, "loop"))
    assert worst <= 1e-12
