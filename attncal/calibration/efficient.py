"""The efficient calibration used at inference time.

Differences from the oracle (`attncal.calibration.oracle.reference`), all of
which keep the math identical:

* Only the calibrated rows are read and written (the pooling row of each head,
  every valid row for mean pooling, the marked rows for landmark and mean-every
  pooling); the result is written back in place.
* The batch geometry (valid span, content span, basket count) is computed once
  per batch by `compute_geometry` and reused by every calibrated layer.
* Each item's content span is aligned to offset 0 of a buffer of length
  `n_max * basket_size`, so basket sums are a reshape of the key axis into
  `(n_baskets, basket_size)` followed by a sum; no scatter/gather over baskets.
* The calibrated row is `z * g[basket]` on content positions, where `g` is one
  multiplier per basket (`λ * f_k + 1 - λ`), so the blend never materialises
  the calibrated distribution separately.
* float16 and bfloat16 inputs are computed in float32.
* A calibrated row holding a NaN or an infinity comes back NaN at every key,
  as in the oracle (one extra sum over the calibrated rows detects it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .config import MODE_EQUAL, MODE_FIXED, MODE_ORIGINAL, ROW_MARK, CalibrationConfig, ResolvedCalibration


@dataclass(frozen=True)
class BatchGeometry:
    """Per-item spans of one batch, derived from the attention mask once."""

    seq_len: int  # K
    basket_size: int
    active: torch.Tensor  # [B] bool: item has a row to calibrate
    active_idx: torch.Tensor  # [A] long: indices of active items
    start: torch.Tensor  # [A] long: first valid position
    end: torch.Tensor  # [A] long: last valid position
    c0: torch.Tensor  # [A] long: first content position
    content_len: torch.Tensor  # [A] long: C
    t: torch.Tensor  # [A] float64: baskets + isolated tokens
    n_max: int  # max basket count among active items
    common_c0: int | None  # c0 shared by every active item (right padding), else None
    token_mask: torch.Tensor  # [A,K] bool
    align_idx: torch.Tensor | None  # [A, n_max*S] long, only when common_c0 is None
    align_valid: torch.Tensor  # [A, n_max*S] bool: j < C
    basket_of_pos: torch.Tensor  # [A,K] long: basket of each content position (clamped)
    content_pos: torch.Tensor  # [A,K] bool

    @property
    def any_active(self) -> bool:
        return self.active_idx.numel() > 0


def _resolved(config: CalibrationConfig | ResolvedCalibration) -> ResolvedCalibration:
    return config.resolve() if isinstance(config, CalibrationConfig) else config


def compute_geometry(
    attention_mask: torch.Tensor, config: CalibrationConfig | ResolvedCalibration
) -> BatchGeometry:
    """Derive the spans of every batch item from `attention_mask[B,K]` (1 = token)."""
    rc = _resolved(config)
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B,K], got shape {tuple(attention_mask.shape)}")
    mask = attention_mask != 0
    B, K = mask.shape
    device = mask.device
    pos = torch.arange(K, device=device)
    count = mask.sum(-1)
    has = count > 0
    start_all = torch.where(mask, pos, K).amin(-1)
    end_all = torch.where(mask, pos, -1).amax(-1)
    length = end_all - start_all + 1
    if bool((has & (length != count)).any()):
        raise ValueError(
            "attention_mask must mark one contiguous run of tokens per row (left or right padding); "
            "found a row with holes"
        )
    n_iso = int(rc.isolate_first) + int(rc.isolate_last)
    S = rc.basket_size
    C_all = length - n_iso
    active = has & (C_all > 0)
    if rc.skip_short:
        active &= C_all >= S
    idx = torch.nonzero(active).flatten()
    start, end, C = start_all[idx], end_all[idx], C_all[idx]
    c0 = start + int(rc.isolate_first)
    n = (C + S - 1) // S
    n_max = int(n.max()) if idx.numel() else 0
    L = n_max * S
    j = torch.arange(L, device=device)
    align_valid = j[None, :] < C[:, None]
    uniq = torch.unique(c0) if idx.numel() else c0
    common_c0 = int(uniq[0]) if uniq.numel() == 1 else None
    align_idx = None
    if common_c0 is None:
        align_idx = (c0[:, None] + j[None, :]).clamp_(max=K - 1)
    rel = pos[None, :] - c0[:, None]
    content_pos = (rel >= 0) & (rel < C[:, None])
    basket_of_pos = torch.div(rel.clamp(min=0), S, rounding_mode="floor").clamp_(max=max(n_max - 1, 0))
    return BatchGeometry(
        seq_len=K,
        basket_size=S,
        active=active,
        active_idx=idx,
        start=start,
        end=end,
        c0=c0,
        content_len=C,
        t=(n + n_iso).to(torch.float64),
        n_max=n_max,
        common_c0=common_c0,
        token_mask=mask[idx],
        align_idx=align_idx,
        align_valid=align_valid,
        basket_of_pos=basket_of_pos,
        content_pos=content_pos,
    )


def apply(
    probs: torch.Tensor,
    attention_mask: torch.Tensor,
    config: CalibrationConfig | ResolvedCalibration,
    geometry: BatchGeometry | None = None,
) -> torch.Tensor:
    """Calibrate `probs[B,H,Q,K]` in place and return it.

    `geometry` may be passed to reuse the spans computed for an earlier layer of
    the same batch; it must come from the same mask and config.
    """
    rc = _resolved(config)
    if probs.dim() != 4:
        raise ValueError(f"probs must be [B,H,Q,K], got shape {tuple(probs.shape)}")
    B, H, Q, K = probs.shape
    if tuple(attention_mask.shape) != (B, K):
        raise ValueError(f"attention_mask must be [B,K]=[{B},{K}], got {tuple(attention_mask.shape)}")
    if rc.strength == 0.0:
        return probs
    geom = geometry if geometry is not None else compute_geometry(attention_mask, rc)
    if geom.seq_len != K:
        raise ValueError(f"geometry was computed for K={geom.seq_len}, probs have K={K}")
    if not geom.any_active:
        return probs
    work = torch.float32 if probs.dtype in (torch.float16, torch.bfloat16) else probs.dtype
    ai = geom.active_idx
    with torch.no_grad():
        if rc.all_rows:
            if Q != K:
                raise ValueError(f"all-rows calibration needs Q == K, got Q={Q}, K={K}")
            rows = probs[ai].to(work)  # [A,H,Q,K]
            new = _calibrate(rows.reshape(ai.numel(), H * Q, K), geom, rc).reshape(rows.shape)
            # Only valid query rows are calibrated; pad query rows stay as they were.
            qvalid = geom.token_mask[:, None, :, None]
            new = torch.where(qvalid, new.to(probs.dtype), probs[ai])
            probs[ai] = new
        elif rc.row_set:
            if Q != K:
                raise ValueError(f"{rc.pooling} pooling calibrates the marked rows of self-attention: Q == K, "
                                 f"got Q={Q}, K={K}")
            # One row set per marked (item, row) pair: the pair's item geometry, its own key at its row.
            item, r = torch.nonzero(attention_mask[ai] == ROW_MARK, as_tuple=True)  # item: index into ai
            if item.numel():
                b = ai[item]
                rows = probs[b, :, r, :].to(work)  # [P,H,K], a copy
                probs[b, :, r, :] = _calibrate(rows, _pairs(geom, item), rc, own=r).to(probs.dtype)
        else:
            r = geom.end if rc.pool_last else geom.start
            if Q == 1:
                r = torch.zeros_like(r)  # the single row is the pooling row (row placement)
            if bool((r >= Q).any()):
                raise ValueError(f"pooling row {int(r.max())} is outside the {Q} query rows")
            rows = probs[ai, :, r, :].to(work)  # [A,H,K], a copy
            own = geom.end if rc.pool_last else geom.start
            probs[ai, :, r, :] = _calibrate(rows, geom, rc, own=own).to(probs.dtype)
    return probs


def _pairs(g: BatchGeometry, item: torch.Tensor) -> BatchGeometry:
    """The geometry of the active items `item` [P] (indices into `g.active_idx`, repeats allowed): one entry
    per calibrated (item, row) pair."""
    pick = lambda t: None if t is None else t[item]  # noqa: E731
    return replace(g, active_idx=g.active_idx[item], start=g.start[item], end=g.end[item], c0=g.c0[item],
                   content_len=g.content_len[item], t=g.t[item], token_mask=g.token_mask[item],
                   align_idx=pick(g.align_idx), align_valid=g.align_valid[item], basket_of_pos=g.basket_of_pos[item],
                   content_pos=g.content_pos[item])


def _calibrate(x: torch.Tensor, g: BatchGeometry, rc: ResolvedCalibration,
               own: torch.Tensor | None = None) -> torch.Tensor:
    """Calibrate rows `x[A,R,K]` (R rows per active item), overwriting `x`, and return it.

    long: the calibration's steps 4-10 in order, in place on one tensor, each padding or subnormal branch beside
    the step it changes; split apart, each step would hand on most of the others' tensors.

    `own` [A]: the key of each entry's rows that is their own (their pooling token), which `rc.isolate_self`
    isolates.  `x` must be a private copy (the caller gathers it).  Apart from it, only O(A·R·n_baskets)
    memory is allocated on the right-padding path; the left-padding path allocates two more
    [A,R,K]-sized buffers.
    """
    A, R, K = x.shape
    S, n_max = g.basket_size, g.n_max
    lam = rc.strength
    z = x.mul_(g.token_mask[:, None, :].to(x.dtype))  # step 4: pads -> 0
    # NaN in, NaN out (attncal.graphs.ops.contract): a row holding a NaN or an infinity at any key (x * 0
    # keeps it at a pad) comes back NaN at every key; its NaN never reaches another row.
    not_finite = ~torch.isfinite(z.sum(-1, keepdim=True))  # [A,R,1]
    start_idx = g.start[:, None, None].expand(A, R, 1)
    end_idx = g.end[:, None, None].expand(A, R, 1)
    z_first = torch.gather(z, -1, start_idx)
    z_last = torch.gather(z, -1, end_idx)
    t = g.t.to(x.dtype)[:, None, None]  # [A,1,1]
    iso_self = rc.isolate_self
    if iso_self:
        if own is None:
            raise ValueError("isolate_self needs each row's own key")
        # The own key is the row's pooling token: it takes the self share, in place of the first or last
        # key's where it is that key, else it leaves its basket (zeroed before the sums; written last).
        own_idx = own[:, None, None].expand(A, R, 1)
        z_own = torch.gather(z, -1, own_idx)
        own_first = (own == g.start) & rc.isolate_first  # [A]
        own_last = (own == g.end) & rc.isolate_last
        own_content = ~(own_first | own_last)
        z.scatter_(-1, own_idx, 0.0)
        t = t + own_content.to(x.dtype)[:, None, None]
    if g.common_c0 is not None:
        # Right padding: every content span starts at the same offset c0, so the
        # baskets are a view of the key axis.  The only non-content token inside
        # the window is an isolated last token; zero it while summing.
        c0 = g.common_c0
        if rc.isolate_last:
            z.scatter_(-1, end_idx, 0.0)
        n_full = min(n_max, (K - c0) // S)
        full = z[..., c0 : c0 + n_full * S].view(A, R, n_full, S)
        parts = [full.sum(-1)]
        if n_full < n_max:
            parts.append(z[..., c0 + n_full * S :].sum(-1, keepdim=True))
        basket_mass = torch.cat(parts, -1) if len(parts) > 1 else parts[0]  # A_k: [A,R,n]
    else:
        # Left padding: align each item's content at offset 0, then reshape.
        aligned = torch.gather(z, -1, g.align_idx[:, None, :].expand(A, R, n_max * S))
        aligned.mul_(g.align_valid[:, None, :].to(x.dtype))
        basket_mass = aligned.view(A, R, n_max, S).sum(-1)
        del aligned
    nonzero = basket_mass != 0
    # A basket mass below 2^-64 (subnormal probabilities behind a dominant key) would overflow
    # 1 / A_k in float32.  Then (rarely) the multipliers are kept scaled by 2^-64 and z by 2^64:
    # powers of two, so the products are unchanged and every factor stays finite.
    pre = 2.0 ** 64 if x.dtype != torch.float64 and bool((nonzero & (basket_mass < 2.0 ** -64)).any()) else 1.0
    # f_k = 1 / A_k / t, so that cal_j = z_j * f_k (step 6); 0 when A_k = 0.
    f = torch.where(nonzero, 1.0 / (torch.where(nonzero, basket_mass, 1.0) * pre) / t, 0.0)
    content_sum = nonzero.sum(-1, keepdim=True).to(x.dtype) / t  # sum_j cal_j: [A,R,1]

    def share(enabled: bool | torch.Tensor, mode: int, weight: float, z_pos: torch.Tensor) -> torch.Tensor:
        if enabled is False:
            return torch.zeros_like(content_sum)
        if mode == MODE_EQUAL:
            s = (1.0 / t).expand_as(content_sum)
        elif mode == MODE_ORIGINAL:
            s = z_pos
        elif mode == MODE_FIXED:
            s = torch.full_like(content_sum, weight)
        else:
            raise ValueError(f"unknown weight mode {mode}")
        return s if enabled is True else torch.where(enabled[:, None, None], s, 0.0)

    first_on = rc.isolate_first if not iso_self or not rc.isolate_first else ~own_first
    last_on = rc.isolate_last if not iso_self or not rc.isolate_last else ~own_last
    s_first = share(first_on, rc.first_mode, rc.first_weight, z_first)  # step 7
    s_last = share(last_on, rc.last_mode, rc.last_weight, z_last)
    s_own = share(True, rc.self_mode, rc.self_weight, z_own) if iso_self else torch.zeros_like(content_sum)
    # Step 8 applies where one of the row's isolated keys takes a share that is not `equal`.
    if iso_self:
        non_equal = torch.full((A,), rc.self_mode != MODE_EQUAL, device=x.device)
        if rc.isolate_first and rc.first_mode != MODE_EQUAL:
            non_equal |= ~own_first
        if rc.isolate_last and rc.last_mode != MODE_EQUAL:
            non_equal |= ~own_last
        non_equal = non_equal[:, None, None]
    else:
        non_equal = torch.tensor(rc.any_non_equal, device=x.device)
    budget = (1.0 - s_first - s_last - s_own).clamp(min=0.0)
    scale = torch.where(non_equal & (content_sum != 0), budget / torch.where(content_sum != 0, content_sum, 1.0),
                        1.0)
    total = content_sum * scale + s_first + s_last + s_own  # step 9
    # Divide (rather than multiply by 1/total): a tiny fixed weight can make total subnormal.
    total = torch.where(total != 0, total, 1.0)  # a zero total skips normalisation
    # Step 10 as one multiplier per basket: out_j = z_j * (lam * f_k * scale / total + 1 - lam).
    mult = (f * scale) / total * lam + (1.0 - lam) / pre  # [A,R,n]
    if g.common_c0 is not None:
        # Positions of the window that are not content are pads (0) or the
        # isolated tokens, which are overwritten below.
        if pre != 1.0:
            z[..., c0:].mul_(pre)
        full.mul_(mult[..., :n_full, None])
        if n_full < n_max:
            z[..., c0 + n_full * S :].mul_(mult[..., n_full:])
        if c0 > 0:
            z[..., :c0].mul_(1.0 - lam)
    else:
        per_pos = torch.gather(mult, -1, g.basket_of_pos[:, None, :].expand(A, R, K))
        per_pos.masked_fill_(~g.content_pos[:, None, :], (1.0 - lam) / pre)
        if pre != 1.0:
            z.mul_(pre)
        z.mul_(per_pos)
    if rc.isolate_first:
        z.scatter_(-1, start_idx, lam * (s_first / total) + (1.0 - lam) * z_first)
    if rc.isolate_last:
        z.scatter_(-1, end_idx, lam * (s_last / total) + (1.0 - lam) * z_last)
    if iso_self:
        z.scatter_(-1, own_idx, lam * (s_own / total) + (1.0 - lam) * z_own)
    if bool(not_finite.any()):
        z.masked_fill_(not_finite, float("nan"))
    return z
