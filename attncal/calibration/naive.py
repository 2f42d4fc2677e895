"""A full-tensor calibration in the style of the original research code.

It computes basket ids for every key, scatters basket sums and gathers them
back over the whole [B,H,Q,K] tensor, calibrates every row, then selects the
calibrated rows with a mask.  It is correct (tested against the oracle) but
allocates several full-size tensors per layer; benchmarks use it to show what
the efficient implementation saves.  Do not use it for real work.
"""

from __future__ import annotations

import torch

from .config import MODE_EQUAL, MODE_FIXED, MODE_ORIGINAL, ROW_MARK, CalibrationConfig, ResolvedCalibration


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
    rel = pos - c0
    content = (rel >= 0) & (rel < C)
    is_first = (pos == start)[:, None, None, :]
    is_last = (pos == end)[:, None, None, :]
    qpos = torch.arange(Q, device=p.device)
    # The row's own key (its pooling token), which isolate_self takes out of its basket: [B,1,Q,K] one-hot.
    own_pos = qpos[None, :] if Q == K else (end if rc.pool_last else start)  # [1|B,Q|1]
    is_own = (pos[:, None, :] == own_pos[..., None])[:, None].expand(B, 1, Q, K)
    iso_self = rc.isolate_self
    own_first = (is_own & is_first).any(-1, keepdim=True) & rc.isolate_first  # [B,1,Q,1]
    own_last = (is_own & is_last).any(-1, keepdim=True) & rc.isolate_last
    own_content = ~(own_first | own_last) if iso_self else torch.zeros_like(own_first)
    t = (n + n_iso)[:, :, None, None].to(p.dtype) + own_content.to(p.dtype)  # [B,1,Q|1,1]
    n_slots = int(n.max().clamp(min=1))
    basket = torch.where(content, rel // S, n_slots)  # non-content keys go to a dump slot
    basket4 = basket[:, None, None, :].expand(B, H, Q, K)  # full-size index tensor
    z = p * mask[:, None, None, :]
    in_basket = z.masked_fill(is_own, 0.0) if iso_self else z
    sums = torch.zeros(B, H, Q, n_slots + 1, dtype=p.dtype, device=p.device)
    sums.scatter_add_(-1, basket4, in_basket)
    A = torch.gather(sums, -1, basket4)  # full-size
    cal = torch.where(content[:, None, None, :] & (A != 0), in_basket / torch.where(A != 0, A, 1.0) / t, 0.0)

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
    so = share(rc.self_mode, rc.self_weight, is_own) if iso_self else zero
    first_on = torch.full_like(own_first, rc.isolate_first) & ~(own_first & iso_self)
    last_on = torch.full_like(own_last, rc.isolate_last) & ~(own_last & iso_self)
    sf, sl = torch.where(first_on, sf, 0.0), torch.where(last_on, sl, 0.0)
    non_equal = ((first_on & (rc.first_mode != MODE_EQUAL)) | (last_on & (rc.last_mode != MODE_EQUAL))
                 | torch.full_like(first_on, iso_self and rc.self_mode != MODE_EQUAL))
    budget = (1 - sf - sl - so).clamp(min=0)
    csum = cal.sum(-1, keepdim=True)
    cal = torch.where(non_equal & (csum != 0), cal * budget / torch.where(csum != 0, csum, 1.0), cal)
    cal = torch.where(is_first & first_on, sf, cal)
    cal = torch.where(is_last & last_on, sl, cal)
    if iso_self:
        cal = torch.where(is_own, so, cal)
    total = cal.sum(-1, keepdim=True)
    cal = torch.where(total != 0, cal / torch.where(total != 0, total, 1.0), cal)
    out = rc.strength * cal + (1 - rc.strength) * z
    if rc.all_rows:
        rows = (qpos[None, :] >= start) & (qpos[None, :] <= end)
    elif rc.row_set:
        rows = attention_mask == ROW_MARK
    else:
        rows = qpos[None, :] == (0 if Q == 1 else (end if rc.pool_last else start))
    active = (C > 0) & (length > 0)
    if rc.skip_short:
        active &= C >= S
    rows = rows & active
    return torch.where(rows[:, None, :, None], out.to(dtype), probs)
