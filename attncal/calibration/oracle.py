"""The float64 reference implementation: the test oracle.

It follows the specification step by step, one (batch, head, row) at a time,
in float64, and shares no code with the efficient implementation
(`attncal.calibration.efficient`).  Speed does not matter here; being
obviously right does.
"""

from __future__ import annotations

import numpy as np
import torch

from .config import MODE_EQUAL, MODE_FIXED, MODE_ORIGINAL, ROW_MARK, CalibrationConfig, ResolvedCalibration
from .relative_position import relative_bias as position_bias


def reference(
    probs: torch.Tensor,
    attention_mask: torch.Tensor,
    config: CalibrationConfig | ResolvedCalibration,
) -> torch.Tensor:
    """Calibrate post-softmax attention `probs[B,H,Q,K]` given `attention_mask[B,K]`.

    Q == K, or Q == 1 for pooled calibration: then the single row is the
    pooling row (its query was computed separately, as in row placement).
    For a row-set pooling (landmark, mean-every) the calibrated rows are those
    whose mask value is `ROW_MARK` (`ResolvedCalibration.marked_mask`); Q == K.
    Returns a new tensor of the input dtype; the input is not modified.

    A calibrated row that holds a NaN or an infinity at any of its K keys (masked
    keys included) comes back NaN at every key; rows that are not calibrated are
    returned as they are, NaN included (attncal.graphs.ops.contract, "Rows that are
    fully masked or not finite").
    """
    rc = config.resolve() if isinstance(config, CalibrationConfig) else config
    if probs.dim() != 4:
        raise ValueError(f"probs must be [B,H,Q,K], got shape {tuple(probs.shape)}")
    B, H, Q, K = probs.shape
    if tuple(attention_mask.shape) != (B, K):
        raise ValueError(f"attention_mask must be [B,K]=[{B},{K}], got {tuple(attention_mask.shape)}")
    if rc.row_set and Q != K:
        raise ValueError(f"{rc.pooling} pooling calibrates the marked rows of self-attention: Q == K, got Q={Q}, K={K}")
    a_all = probs.detach().to(torch.float64).cpu().numpy()
    out = a_all.copy()
    values = attention_mask.detach().cpu().numpy()
    mask = values != 0
    for b in range(B):
        valid = np.nonzero(mask[b])[0]
        if valid.size == 0:
            continue
        start, end = int(valid[0]), int(valid[-1])
        if rc.all_rows:
            rows = list(range(start, end + 1))
        elif rc.row_set:
            rows = [int(q) for q in np.nonzero(values[b] == ROW_MARK)[0]]
        elif Q == 1:
            rows = [0]  # a single row is the pooling row itself (row placement)
        else:
            rows = [end if rc.pool_last else start]
        for q in rows:
            if q >= Q:
                continue
            own = q if Q == K else (end if rc.pool_last else start)  # the row's own key
            for h in range(H):
                new = _calibrate_row(a_all[b, h, q], mask[b], start, end, own, rc)
                if new is not None:
                    out[b, h, q] = new
    # float16/bfloat16/float32 values survive the float64 round trip exactly, so
    # rows that were not calibrated come back bit-identical.
    return torch.from_numpy(out).to(device=probs.device, dtype=probs.dtype)


def _calibrate_row(
    a: np.ndarray, mask: np.ndarray, start: int, end: int, own: int, rc: ResolvedCalibration
) -> np.ndarray | None:
    """Steps 1-10 of the specification for one row whose own key is `own`; None means 'leave it as is'."""
    length = end - start + 1
    iso_first, iso_last = rc.isolate_first, rc.isolate_last
    n_iso = int(iso_first) + int(iso_last)
    c0 = start + int(iso_first)
    C = length - n_iso
    S = rc.basket_size
    if C <= 0 or (rc.skip_short and C < S) or rc.strength == 0:
        # Strength 0 leaves every row as it is (the contract): a row holding mass at masked keys (one whose
        # window sees no valid key is uniform over all keys) keeps it.
        return None
    if not np.all(np.isfinite(a)):
        # Step 0: NaN in, NaN out.  A row with no softmax (scores all -inf, or holding a NaN or
        # +inf: ONNX Softmax gives NaN for every key) or otherwise not a probability row is returned
        # NaN at every key, masked keys included: never partly finite, never finite.
        return np.full_like(a, np.nan)
    z = np.where(mask, a, 0.0)
    # The isolated keys: (position, weight mode, fixed share).  With isolate_self the row's own key is its
    # pooling token: it takes the self share, in place of the first or last key's when it is that key, else
    # it leaves its basket as one more isolated key.
    isolated = [(pos, mode, w) for pos, enabled, mode, w in (
        (start, iso_first, rc.first_mode, rc.first_weight),
        (end, iso_last, rc.last_mode, rc.last_weight),
    ) if enabled]
    content = z[c0 : c0 + C].copy()
    if rc.isolate_self:
        isolated = [(pos, mode, w) for pos, mode, w in isolated if pos != own]
        if c0 <= own < c0 + C:
            content[own - c0] = 0.0
        isolated.append((own, rc.self_mode, rc.self_weight))
    n = -(-C // S)
    t = n + len(isolated)
    cal = np.zeros_like(z)
    # Basket k covers [c0 + k*S, min(c0 + (k+1)*S, c0 + C)); A_k is its mass (the own key left out).
    A = np.add.reduceat(content, np.arange(0, C, S))  # [n]
    A_per_pos = np.repeat(A, S)[:C]
    with np.errstate(divide="ignore", invalid="ignore"):
        cal[c0 : c0 + C] = np.where(A_per_pos != 0, content / A_per_pos / t, 0.0)
    iso: list[tuple[int, float]] = []
    for pos, mode, w in isolated:
        if mode == MODE_EQUAL:
            share = 1.0 / t
        elif mode == MODE_ORIGINAL:
            share = z[pos]
        elif mode == MODE_FIXED:
            share = w
        else:
            raise ValueError(f"unknown weight mode {mode}")
        iso.append((pos, share))
    if any(mode != MODE_EQUAL for _, mode, _ in isolated):
        budget = max(0.0, 1.0 - sum(s for _, s in iso))
        content_sum = cal.sum()
        if content_sum != 0:
            cal = cal * (budget / content_sum)
    for pos, share in iso:
        cal[pos] = share
    total = cal.sum()
    if total != 0:
        cal = cal / total
    out = rc.strength * cal + (1.0 - rc.strength) * z
    out[~mask] = 0.0
    return out


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    config: CalibrationConfig | ResolvedCalibration,
    num_heads: int,
    scale: float = 0.0,
    num_kv_heads: int = 0,
    window_left: int = -1,
    window_right: int = -1,
    relative_max_distance: int = 0,
    relative_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The calibrated attention ops' contract (attncal.graphs.ops.contract) in float64: `reference` applied
    to the softmax of scale·Q·Kᵀ plus the relative position bias (`relative_bias` [num_buckets,N] at
    `attncal.calibration.relative_position`'s buckets, where `relative_max_distance` > 0) plus float32's
    lowest finite value at keys that are masked or outside the query's window, times V.

    `query` [B,S_q,N*D], `key` [B,S_k,N_kv*D], `value` [B,S_k,N_kv*D_v], `attention_mask` [B,S_k]
    (N_kv = `num_kv_heads`, 0 meaning N; query head h reads key/value head h // (N / N_kv)); returns
    the float64 context [B,S_q,N*D_v]."""
    B, S_q, _ = query.shape
    S_k = key.shape[1]
    n_kv = num_kv_heads or num_heads

    def heads(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.detach().cpu().double().reshape(B, x.shape[1], n, -1).transpose(1, 2)

    q = heads(query, num_heads)
    k = heads(key, n_kv).repeat_interleave(num_heads // n_kv, dim=1)
    v = heads(value, n_kv).repeat_interleave(num_heads // n_kv, dim=1)
    s = float(scale) if scale != 0 else 1.0 / float(np.sqrt(q.shape[-1]))
    visible = (attention_mask.cpu() != 0)[:, None, None, :].expand(B, 1, S_q, S_k)
    offset = torch.arange(S_k)[None, :] - torch.arange(S_q)[:, None]  # k - q
    if window_left >= 0:
        visible = visible & (offset >= -window_left)
    if window_right >= 0:
        visible = visible & (offset <= window_right)
    bias = torch.where(visible, 0.0, float(np.finfo(np.float32).min)).double()
    scores = s * (q @ k.transpose(-1, -2))
    if relative_max_distance > 0:
        table = relative_bias.detach().cpu().float().numpy()
        scores = scores + torch.from_numpy(position_bias(table, S_q, S_k, relative_max_distance)).double()
    probs = torch.softmax(scores + bias, -1)
    out = reference(probs, attention_mask.cpu(), config) @ v  # [B,N,S_q,D_v]
    return out.transpose(1, 2).reshape(B, S_q, -1)
