"""Random inputs of the calibration ops and of the calibrated attention ops, and their float64 references.

* `random_probs`, `random_scores`: attention probabilities (after the Softmax) and scores (before it);
* `softmax_reference`: the Softmax-fused ops' spec, the oracle applied to Softmax(scores) in float64;
* `random_qkv`: Q, K, V of the calibrated attention ops ([B,S,N*D] layout);
* `score_rounding`: a bound on the float32 rounding of the attention scores, added to the tolerances;
* `accumulation_bound`: a bound on the float32 rounding of the softmax's sums and of P·V, whatever their order;
* `plain_attention`: uncalibrated attention over the valid keys in float64.

Every random tensor is drawn from the torch generator passed in, nothing from the global one.
"""

from __future__ import annotations

import numpy as np
import torch


def random_probs(gen: torch.Generator, mask: torch.Tensor, H: int, dtype=torch.float64, temp: float = 2.0,
                 Q: int | None = None) -> torch.Tensor:
    """Post-softmax attention [B,H,Q,K] (Q = K by default) with masked keys at exactly 0 (fully masked rows
    all 0)."""
    B, K = mask.shape
    logits = torch.randn(B, H, K if Q is None else Q, K, generator=gen, dtype=torch.float64) * temp
    logits = logits.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
    return torch.softmax(logits, -1).nan_to_num(0.0).to(dtype)


def random_scores(gen: torch.Generator, mask: torch.Tensor, H: int, dtype=torch.float32, temp: float = 2.0,
                  Q: int | None = None, offset: float = 0.0) -> torch.Tensor:
    """Attention scores [B,H,Q,K] (the input of the attention Softmax) as encoders build them: logits (plus
    `offset`, so that the Softmax's max subtraction matters) with the dtype's lowest value at masked keys
    (fully masked rows all equal)."""
    B, K = mask.shape
    logits = torch.randn(B, H, K if Q is None else Q, K, generator=gen, dtype=torch.float64) * temp
    if offset:
        logits = logits + offset
    return logits.to(dtype).masked_fill(mask[:, None, None, :] == 0, torch.finfo(dtype).min)


def softmax_reference(scores: torch.Tensor, mask: torch.Tensor, rc) -> torch.Tensor:
    """The fused ops' spec in float64: the oracle applied to Softmax(scores)."""
    from attncal.calibration import reference

    return reference(torch.softmax(scores.double(), -1), mask, rc)


def random_qkv(gen: torch.Generator, B: int, S_q: int, S_k: int, N: int, D: int, D_v: int, dtype, temp: float,
               dead: tuple[int, int] | None = None, exact: bool = False):
    """Q [B,S_q,N*D] (times `temp`), K [B,S_k,N*D], V [B,S_k,N*D_v] uniform in [-2, 2] (|context| < 2,
    so a float16 context is within 2^-11 of the exact one).  `dead`: keys [lo, hi) whose scores are
    exactly -3e4·scale in every head, far below every other key's (the last column of each head of q
    is 1; k is (0, ..., 0, -3e4) there, its last column 0 elsewhere): exp gives exactly 0 in float32
    and float64, so their baskets are empty (an item whose valid keys are all dead: uniform over them).
    `exact`: q and k on a grid of 1/8 (|q| <= 8, |k| <= 4), so that with a power-of-two scale the
    float32 scores are exact (every product and partial sum fits in float32's 24 bits)."""
    q = torch.randn(B, S_q, N, D, generator=gen, dtype=torch.float64) * temp
    k = torch.randn(B, S_k, N, D, generator=gen, dtype=torch.float64)
    v = torch.rand(B, S_k, N * D_v, generator=gen, dtype=torch.float64) * 4 - 2
    if exact:
        q, k = (q * 8).round().clamp(-64, 64) / 8, (k * 8).round().clamp(-32, 32) / 8
    if dead is not None and D >= 2:
        q[..., -1] = 1.0
        k[..., -1] = 0.0
        k[:, dead[0]:dead[1]] = 0.0
        k[:, dead[0]:dead[1], :, -1] = -3e4  # their scores are exactly -3e4·scale (no rounding)
    return (q.reshape(B, S_q, N * D).to(dtype), k.reshape(B, S_k, N * D).to(dtype), v.to(dtype))


def score_rounding(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, N: int, scale: float) -> torch.Tensor:
    """[B]: a first-order bound δ on the float32 rounding error of the scores at the valid keys,
    2^-24·((D + 1)·Σ_i |q_i·scale|·|k_i| + |s|): the scaled query (one rounding per term), the dot
    product of D terms (γ_D) and the scale itself when it is 1/sqrt(D) (scale 0; D = 0 counts as 1).
    The contract computes the scores in float32, the oracle in float64 from the same inputs; every
    calibrated weight is a ratio of exponentials of these scores (softmax, basket masses, the blend's
    normalisations), so each moves by a relative ≤ ~6δ and the context, a convex combination of V, by
    ≤ 6δ·2·max|v|."""
    B, S_q, _ = q.shape
    qh = q.double().reshape(B, S_q, N, -1).transpose(1, 2)
    kh = k.double().reshape(B, k.shape[1], N, -1).transpose(1, 2)
    D = qh.shape[-1]
    qh = qh * (scale if scale != 0 else 1.0 / np.sqrt(max(D, 1)))
    bound = (D + 1) * (qh.abs() @ kh.abs().transpose(-1, -2)) + (qh @ kh.transpose(-1, -2)).abs()
    bound = bound.masked_fill(mask[:, None, None, :] == 0, 0.0)
    return bound.amax(dim=(1, 2, 3)) * 2.0 ** -24


def accumulation_bound(v: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    """[B]: a first-order bound on what a float32 kernel's sums add to the error of a calibrated attention's
    context, for any order of summation and any blocking (so for every GEMM and every instruction-set path,
    OpenBLAS's kernels included, whose order this project does not choose): (4n + 16)·2^-24·max|v| over an
    item's n valid keys (all S_k where none is valid).  Each weight p_j is exp(s_j - m) times the calibration's
    factor over a sum of n positive terms (relative error ≤ (n - 1)u for the sum in any order, 2u for the exp,
    a few u for the factor and the division); the online softmax's rescale exp(m_old - m) adds ≤ 2u per key tile
    (≤ n tiles); and Σ_j p_j·v_j of n terms, with Σ p_j = 1, is within γ_n·max|v| ≈ n·u·max|v| of its exact
    value in any order.  Masked keys weigh exactly 0 and add nothing."""
    n = (mask != 0).sum(dim=1).double()
    n = torch.where(n > 0, n, float(mask.shape[1]))
    return ((4 * n + 16) * 2.0 ** -24 * float(v.double().abs().max())).numpy()


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, N: int) -> torch.Tensor:
    """[B,S_q,N*D_v] float64: softmax(Q·Kᵀ / sqrt(D)) over the valid keys, times V, no calibration (the
    contract's padding query rows); an item with no valid key gives NaN rows here."""
    B, S_q, _ = q.shape
    S_k = k.shape[1]
    qh = q.double().reshape(B, S_q, N, -1).transpose(1, 2)
    kh = k.double().reshape(B, S_k, N, -1).transpose(1, 2)
    vh = v.double().reshape(B, S_k, N, -1).transpose(1, 2)
    s = (qh @ kh.transpose(-1, -2)) / np.sqrt(qh.shape[-1])
    plain = torch.softmax(s.masked_fill(mask[:, None, None, :] == 0, float("-inf")), -1) @ vh
    return plain.transpose(1, 2).reshape(B, S_q, -1)
