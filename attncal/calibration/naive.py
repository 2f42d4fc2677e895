"""A full-tensor calibration in the style of the original research code.

It computes basket ids for every key, scatters basket sums and gathers them
back over the whole [B,H,Q,K] tensor, calibrates every row, then selects the
calibrated rows with a mask.  It is correct (tested against the oracle) but
allocates several full-size tensors per layer; benchmarks use it to show what
the efficient implementation saves.  Do not use it for real work.
"""

from __future__ import annotations

import torch

from .config import MODE_EQUAL, MODE_FIXED, MODE_ORIGINAL, CalibrationConfig, ResolvedCalibration


def naive_apply(
    probs: torch.Tensor, attention_mask: torch.Tensor, config: CalibrationConfig | ResolvedCalibration
) -> torch.Tensor:
    rc = config.resolve() if isinstance(config, CalibrationConfig) else config
    B, H, Q, K = probs.shape
    dtype = probs.dtype
    p = probs.float() if dtype in (torch.float16, torch.bfloat16) else probs
    mask = attention_mask != 0
    pos = torch.arange(K, device=p.device).expand(B, K)
    start = torch.where(mask, pos, K).amin(-1, keepdim=True)  # [B,1]
    end = torch.where(mask, pos, -1).amax(-1, keepdim=True)
    length = end - start + 1
    n_iso = int(rc.isolate_first) + int(rc.isolate_last)
    c0 = start + int(rc.isolate_first)
    C = length - n_iso
    S = rc.basket_size
    n = (C + S - 1) // S
    t = (n + n_iso).to(p.dtype)[:, :, None, None]  # [B,1,1,1]
    rel = pos - c0
    content = (rel >= 0) & (rel < C)
    n_slots = int(n.max().clamp(min=1))
    basket = torch.where(content, rel // S, n_slots)  # non-content keys go to a dump slot
    basket4 = basket[:, None, None, :].expand(B, H, Q, K)  # full-size index tensor
    z = p * mask[:, None, None, :]
    sums = torch.zeros(B, H, Q, n_slots + 1, dtype=p.dtype, device=p.device)
    sums.scatter_add_(-1, basket4, z)
    A = torch.gather(sums, -1, basket4)  # full-size
    cal = torch.where(content[:, None, None, :] & (A != 0), z / torch.where(A != 0, A, 1.0) / t, 0.0)
    is_first = (pos == start)[:, None, None, :]
    is_last = (pos == end)[:, None, None, :]

    def share(mode: int, w: float, is_pos: torch.Tensor) -> torch.Tensor:
        if mode == MODE_EQUAL:
            return (1.0 / t).expand(B, H, Q, 1)
        if mode == MODE_ORIGINAL:
            return (z * is_pos).sum(-1, keepdim=True)
        if mode == MODE_FIXED:
            return torch.full((B, H, Q, 1), w, dtype=p.dtype, device=p.device)
        raise ValueError(f"unknown weight mode {mode}")

    zero = torch.zeros(B, H, Q, 1, dtype=p.dtype, device=p.device)
    sf = share(rc.first_mode, rc.first_weight, is_first) if rc.isolate_first else zero
    sl = share(rc.last_mode, rc.last_weight, is_last) if rc.isolate_last else zero
    if rc.any_non_equal:
        budget = (1 - sf - sl).clamp(min=0)
        csum = cal.sum(-1, keepdim=True)
        cal = torch.where(csum != 0, cal * budget / torch.where(csum != 0, csum, 1.0), cal)
    if rc.isolate_first:
        cal = torch.where(is_first, sf, cal)
    if rc.isolate_last:
        cal = torch.where(is_last, sl, cal)
    total = cal.sum(-1, keepdim=True)
    cal = torch.where(total != 0, cal / torch.where(total != 0, total, 1.0), cal)
    out = rc.strength * cal + (1 - rc.strength) * z
    qpos = torch.arange(Q, device=p.device)[None, :]
    if rc.all_rows:
        rows = (qpos >= start) & (qpos <= end)
    else:
        rows = qpos == (0 if Q == 1 else (end if rc.pool_last else start))
    active = (C > 0) & (length > 0)
    if rc.skip_short:
        active &= C >= S
    rows = rows & active
    return torch.where(rows[:, None, :, None], out.to(dtype), probs)
