"""The CUDA launchers with marked rows (landmark, multi-CLS and Mean@k pooling: `marked_rows`, `isolate_self`;
attncal/graphs/ops/contract.py, "Marked rows") against the float64 oracle, through ctypes: the calibration ops'
launchers (separate and Softmax-fused, in place and out of place) and the calibrated attention launchers (the
tiled kernel, which hands a row whose own key is isolated to the per-row kernel, and the per-row kernel itself).
Tolerances and harness are those of test_calibration_cuda.py and test_calibrated_attention_cuda.py, whose check
functions run here on row-set attribute sets and masks with marked rows."""

from __future__ import annotations

import random

import pytest
import torch

from attncal.calibration import reference
from attncal.calibration.oracle import attention_reference
from support.cases import mark_rows, random_config, row_set_config
from support.masks import mixed_mask
from support.tensors import random_probs, random_qkv, random_scores, score_rounding

from .test_calibrated_attention_cuda import ATTN_TOL, assert_within, run_both
from .test_calibration_cuda import DTYPES, compare, run_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("softmax", [False, True], ids=["separate", "fused"])
def test_calibration_launchers_match_the_oracle_on_marked_rows(launchers, softmax):
    rng, gen = random.Random(90 + softmax), torch.Generator().manual_seed(90)
    seen = {"in_place": 0, "long_rows": 0, "landmark": 0, "mean-every": 0}
    for _ in range(200):
        S = rng.choice([1, 2, 3, 8, 32, 33, 64, 128])
        rc = row_set_config(rng, random_config(rng, S)).resolve()
        K = rng.randint(1025, 1500) if rng.random() < 0.1 else rng.randint(1, 64)
        B, H = rng.randint(1, 3), rng.randint(1, 2)
        mask = mark_rows(rng, mixed_mask(rng, B, K, holes=0.1), p=0.02 if K > 1024 else None)
        dt = rng.choice(DTYPES)
        if softmax:
            x = random_scores(gen, mask, H, dt)
            ref = reference(torch.softmax(x.double(), -1), mask, rc)
        else:
            x = random_probs(gen, mask, H, dt)
            ref = reference(x.double(), mask, rc)
        in_place = rng.random() < 0.5
        out = run_case(x, mask, rc, in_place, softmax, launchers)
        compare(out, ref, f"marked rows ({rc}, B={B}, H={H}, K={K}, in_place={in_place})")
        seen["in_place"] += in_place
        seen["long_rows"] += K > 1024
        seen["landmark" if rc.pooling.inserts else rc.pooling.kind] += 1
    assert min(seen.values()) > 0, seen


def test_attention_launchers_match_the_oracle_on_marked_rows(launchers):
    rng, gen = random.Random(95), torch.Generator().manual_seed(95)
    for _ in range(100):
        S = rng.choice([1, 2, 5, 16, 64, 100])
        rc = row_set_config(rng, random_config(rng, S)).resolve()
        D = rng.choice([8, 16, 40, 64, 96, 128, 160])
        N, S_k, B = rng.randint(1, 3), rng.randint(1, 300), rng.randint(1, 3)
        mask = mark_rows(rng, mixed_mask(rng, B, S_k, holes=0.1, empty=0.1))
        name = rng.choice(["float32", "float16"])
        q, k, v = random_qkv(gen, B, S_k, S_k, N, D, D, getattr(torch, name), temp=1.0)
        ref = attention_reference(q, k, v, mask, rc, N, 0.0)
        outs = run_both(launchers, q, k, v, mask, rc, N, 0.0)
        bound = ATTN_TOL[name] + 12 * score_rounding(q, k, mask, N, 0.0) * float(v.abs().max())
        assert_within(outs, ref, bound, f"{name} marked rows ({rc}, B={B}, N={N}, S={S_k}, D={D})")
