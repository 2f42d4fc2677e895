"""Calibration as split attention: the calibrated context row without the probabilities.

For one query row q let Attn(q; J) be ordinary softmax attention restricted to
the key set J.  In the op contract's notation (n content baskets, isolated
tokens i with shares share_i, t = n + n_iso), the calibrated context is

    out_q = (1 - λ)·Attn(q; all valid keys)
          + (λ / total)·[ (content / n_ne)·Σ_b Attn(q; basket b) + Σ_i share_i·v_i ]

where the sum runs over the n_ne baskets that hold at least one key the row may
attend to (all n of them, unless the model's own mask, causal or sliding
window, hides a whole basket from the row), content = n_ne / t when every share
is `equal`, else the budget max(0, 1 − Σ share_i) (0 when n_ne = 0), and
total = content + Σ share_i.  An `original` share is p_qi = exp(s_qi − LSE_q).
Rows the contract leaves alone (skip_short, no content, rows that are not
calibrated) are plain attention.  `tests/test_split.py` proves the identity
against the float64 oracle (`attncal.calibration.oracle.reference` followed by
·V).

Every term is an ordinary attention over a contiguous key range, so it runs on
`torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient
kernels, no [B,H,S,S] tensor): the basket terms are one SDPA call per basket
(`mode="loop"`, extra memory O(B·H·S·d)) or one call over all baskets with the
queries repeated per basket (`mode="batched"`, n times the query memory).
`loop` is the default: see `benchmarks/split_modes.py`.

Why `original` shares need care: SDPA does not return the log-sum-exp, so the
LSE of a row is computed here in row chunks of `LSE_CHUNK` (bounded memory).
Mean pooling isolates no token by default and cls/last pooling calibrates one
row, so the common configurations never pay for it.  Basket masses that
underflow to exactly zero in the probability form (scores more than ~100 below
the row maximum across a whole basket) are treated as empty by the oracle but
not here; that is the only place the two forms can differ.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from .config import MODE_EQUAL, MODE_FIXED, MODE_ORIGINAL, ResolvedCalibration
from .efficient import BatchGeometry

SplitMode = Literal["loop", "batched"]
SPLIT_MODES = ("loop", "batched")
LSE_CHUNK = 256
ROW_CHUNK = 512  # query rows calibrated at a time (all-rows calibration)


def allowed_from_mask(
    attention_mask: torch.Tensor | None, causal: bool, q_len: int, k_len: int, device: torch.device
) -> torch.Tensor | None:
    """The model's own mask as booleans (True = may attend), [B|1, 1|H, Q, K], or None = no restriction.

    transformers passes a boolean mask to SDPA implementations and an additive float mask
    (0 or the dtype's minimum) to eager ones; both are accepted.
    """
    if attention_mask is None:
        if not causal:
            return None
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril_(k_len - q_len)[None, None]
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def split_calibrated_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    full: torch.Tensor,
    allowed: torch.Tensor | None,
    rc: ResolvedCalibration,
    geometry: BatchGeometry,
    scaling: float,
    mode: SplitMode = "loop",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Calibrate the attention output `full[B,H,Q,d]` (plain attention of the same inputs).

    `query[B,H,Q,d]`, `key`/`value[B,H,K,d]` (grouped-query keys already repeated),
    `allowed` the model's mask as booleans broadcastable to [B,H,Q,K] (None: every
    token of the sequence may be attended), `geometry` from `compute_geometry` on the
    2-D token mask.  Q == K for mean pooling; cls/last pooling calibrates the pooling
    row only.  `bias` is an additive score bias broadcastable to [B,H,Q,K] (T5's relative
    position bias), added to the scaled scores of every term.  Returns `full`, with the
    calibrated rows overwritten in place.

    long: 10 parameters and their documentation; the identity's terms in the order its docstring
    (`attncal.calibration.split`) states them.
    """
    if mode not in SPLIT_MODES:
        raise ValueError(f"mode must be one of {', '.join(SPLIT_MODES)}, got {mode!r}")
    if rc.row_set:  # each marked row's own key leaves its basket: no contiguous key range per basket term
        raise ValueError(f"split calibration computes one row or every row; {rc.pooling} pooling calibrates the rows "
                         "marked in its mask: calibrate the probabilities (attncal.calibration.apply)")
    g = geometry
    lam = float(rc.strength)
    if lam == 0.0 or not g.any_active:
        return full
    B, H, Q, d = query.shape
    K = key.shape[2]
    if g.seq_len != K:
        raise ValueError(f"geometry was computed for K={g.seq_len}, attention has K={K}")
    work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    ai = g.active_idx
    A = ai.numel()
    everyone = A == B
    k = key if everyone else key[ai]
    v = value if everyone else value[ai]
    dev = query.device
    if rc.all_rows:
        if Q != K:
            raise ValueError(f"all-rows calibration needs Q == K, got Q={Q}, K={K}")
        q = query if everyone else query[ai]  # [A,H,Q,d]
        row_pos = torch.arange(Q, device=dev)[None, :].expand(A, Q)
        row_valid = g.token_mask  # only valid query rows are calibrated
        base = full if everyone else full[ai]
    else:
        r = g.end if rc.pool_last else g.start
        if Q == 1:
            r = torch.zeros_like(r)
        q = query[ai, :, r, :].unsqueeze(2)  # [A,H,1,d]
        row_pos = r[:, None]
        row_valid = torch.ones(A, 1, dtype=torch.bool, device=dev)
        base = full[ai, :, r, :].unsqueeze(2)
    R = q.shape[2]
    def rows_of(t: torch.Tensor | None) -> torch.Tensor | None:
        """A [B|1,h,Q|1,K] mask or bias for the calibrated items and rows: [A,h,R|1,K]."""
        if t is None:
            return None
        t = t.expand(B, t.shape[1], t.shape[2], K)
        t = t if everyone else t[ai]
        if t.shape[2] != 1 and not rc.all_rows:  # the pooling row of a per-row mask: [A,h1,1,K]
            t = t.gather(2, row_pos[:, None, :, None].expand(A, t.shape[1], R, K))
        return t

    al = rows_of(allowed)
    bi = rows_of(bias.to(work) if bias is not None else None)

    # Query rows in chunks: the extra memory is O(chunk) rows of accumulators, not O(S).
    chunk = ROW_CHUNK if rc.all_rows else R
    for lo in range(0, R, chunk):
        hi = min(R, lo + chunk)
        al_c = al[:, :, lo:hi] if al is not None and al.shape[2] != 1 else al
        bi_c = bi[:, :, lo:hi] if bi is not None and bi.shape[2] != 1 else bi
        _calibrate_rows(q[:, :, lo:hi], k, v, al_c, base[:, :, lo:hi], row_valid[:, lo:hi], g, rc, scaling, work,
                        mode, bi_c)
    if rc.all_rows:
        if not everyone:
            full[ai] = base
    else:
        full[ai, :, r, :] = base[:, :, 0, :]
    return full


def _calibrate_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    al: torch.Tensor | None,
    base: torch.Tensor,
    row_valid: torch.Tensor,
    g: BatchGeometry,
    rc: ResolvedCalibration,
    scaling: float,
    work: torch.dtype,
    mode: SplitMode,
    bias: torch.Tensor | None = None,
) -> None:
    """Overwrite `base[A,H,R,d]` (plain attention of rows `q`) with the calibrated rows, in place."""
    A, _, R, _ = q.shape
    dev = q.device
    lam = float(rc.strength)
    acc, n_ne = _basket_terms(q, k, v, al, g, rc.basket_size, scaling, work, mode, bias)  # [A,H,R,d], [A,h1,R]
    t = g.t.to(work)[:, None, None]  # [A,1,1]
    shares: list[tuple[torch.Tensor, torch.Tensor]] = []
    lse = None
    ar = torch.arange(A, device=dev)
    for enabled, wmode, weight, pos in (
        (rc.isolate_first, rc.first_mode, rc.first_weight, g.start),
        (rc.isolate_last, rc.last_mode, rc.last_weight, g.end),
    ):
        if not enabled:
            continue
        v_i = v[ar, :, pos, :].to(work)  # [A,H,d]
        if wmode == MODE_EQUAL:
            share = (1.0 / t).expand(A, 1, R)
        elif wmode == MODE_FIXED:
            share = torch.full((A, 1, R), float(weight), dtype=work, device=dev)
        elif wmode == MODE_ORIGINAL:
            if lse is None:
                lse = _row_lse(q, k, al, g.token_mask, scaling, work, bias)  # [A,H,R]
            k_i = k[ar, :, pos, :].to(work)  # [A,H,d]
            s = torch.einsum("ahrd,ahd->ahr", q.to(work), k_i) * scaling
            if bias is not None:
                s = s + bias.gather(3, pos[:, None, None, None].expand(A, bias.shape[1], bias.shape[2], 1))[..., 0]
            ok = _allowed_at(al, g.token_mask, pos)  # [A,h1,R]
            share = torch.where(ok, torch.exp(s - lse), 0.0)
        else:
            raise ValueError(f"unknown weight mode {wmode}")
        shares.append((share, v_i))
    share_sum = sum((s for s, _ in shares), torch.zeros((), dtype=work, device=dev))
    if rc.any_non_equal:
        budget = (1.0 - share_sum).clamp(min=0.0)
        content = torch.where(n_ne > 0, budget, 0.0)
    else:
        content = n_ne / t
    total = content + share_sum
    nz = total != 0
    safe_total = torch.where(nz, total, 1.0)  # divide by total, never by a reciprocal (subnormal weights)
    lam_row = lam * row_valid[:, None, :].to(work)  # [A,1,R]
    c_basket = torch.where(nz & (n_ne > 0), lam_row * content / (torch.where(n_ne > 0, n_ne, 1.0) * safe_total), 0.0)
    acc.mul_(c_basket[..., None])
    for share, v_i in shares:
        acc.addcmul_((lam_row * share / safe_total)[..., None], v_i[:, :, None, :])
    keep = (1.0 - lam_row)[..., None]
    if base.dtype == work:
        base.mul_(keep).add_(acc)
    else:
        base.copy_(base.to(work).mul_(keep).add_(acc))


def _basket_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    al: torch.Tensor | None,
    g: BatchGeometry,
    S: int,
    scaling: float,
    work: torch.dtype,
    mode: SplitMode,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_b Attn(q; basket b) over non-empty baskets, and the count of non-empty baskets per row
    (`bias`: the additive score bias, [A,h,R|1,K] in `work` precision).

    long: 10 parameters, and the two split modes' forms of the same sum side by side, so they stay comparable."""
    A, H, R, d = q.shape
    K = k.shape[2]
    dev = q.device
    C = g.content_len
    neg = torch.finfo(q.dtype).min
    if mode == "batched":
        n = g.n_max
        j = torch.arange(n * S, device=dev)
        pos = (g.c0[:, None] + j[None, :]).clamp(max=K - 1)  # [A, n*S]
        valid = j[None, :] < C[:, None]
        idx = pos[:, None, :, None].expand(A, k.shape[1], n * S, d)
        kb = k.gather(2, idx).view(A, H, n, S, d).transpose(1, 2).reshape(A * n, H, S, d)
        vb = v.gather(2, idx).view(A, H, n, S, d).transpose(1, 2).reshape(A * n, H, S, d)
        m = valid[:, None, None, :]  # [A,1,1,nS]
        if al is not None:
            m = m & al.gather(3, pos[:, None, None, :].expand(A, al.shape[1], R, n * S))
        h1, r1 = m.shape[1], m.shape[2]
        m = m.view(A, h1, r1, n, S).permute(0, 3, 1, 2, 4)  # [A,n,h1,r1,S]
        ne = m.any(-1)  # [A,n,h1,r1]
        add = torch.zeros(m.shape, dtype=q.dtype, device=dev)
        if bias is not None:
            bb = bias.gather(3, pos[:, None, None, :].expand(A, bias.shape[1], bias.shape[2], n * S))
            bb = bb.view(A, bb.shape[1], bb.shape[2], n, S).permute(0, 3, 1, 2, 4).to(q.dtype)
            add = add + bb
        add = add.masked_fill(~m, neg)
        add = add.reshape(A * n, add.shape[2], add.shape[3], S)
        qb = q[:, None].expand(A, n, H, R, d).reshape(A * n, H, R, d)
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=add, scale=scaling).view(A, n, H, R, d)
        acc = (ob.to(work) * ne[..., None].to(work)).sum(1)
        return acc, ne.sum(1).to(work).expand(A, ne.shape[2], R)
    acc = torch.zeros(A, H, R, d, dtype=work, device=dev)
    n_ne = torch.zeros(A, 1 if al is None else al.shape[1], R, dtype=work, device=dev)
    common = g.common_c0
    for b in range(g.n_max):
        if common is not None:
            lo, hi = common + b * S, min(common + (b + 1) * S, K)
            kb, vb = k[:, :, lo:hi], v[:, :, lo:hi]
            valid = (torch.arange(lo, hi, device=dev) - common)[None, :] < C[:, None]  # [A,Sb]
            alb = al[..., lo:hi] if al is not None else None
            bib = bias[..., lo:hi] if bias is not None else None
        else:
            j = b * S + torch.arange(S, device=dev)
            pos = (g.c0[:, None] + j[None, :]).clamp(max=K - 1)
            valid = j[None, :] < C[:, None]
            idx = pos[:, None, :, None].expand(A, k.shape[1], S, d)
            kb, vb = k.gather(2, idx), v.gather(2, idx)
            alb = al.gather(3, pos[:, None, None, :].expand(A, al.shape[1], R, S)) if al is not None else None
            bib = (bias.gather(3, pos[:, None, None, :].expand(A, bias.shape[1], bias.shape[2], S))
                   if bias is not None else None)
        m = valid[:, None, None, :]
        if alb is not None:
            m = m & alb
        if alb is None and bib is None and bool(valid.all()):
            # Every key of this basket is valid for every row: no mask, so SDPA can take its fused kernel.
            acc += F.scaled_dot_product_attention(q, kb, vb, scale=scaling).to(work)
            n_ne += 1.0
            continue
        ne = m.any(-1)  # [A,h1|1,R|1]
        if not bool(ne.any()):
            continue
        add = torch.zeros(m.shape, dtype=q.dtype, device=dev)
        if bib is not None:
            add = add + bib.to(q.dtype)
        add = add.masked_fill(~m, neg)
        ob = F.scaled_dot_product_attention(q, kb, vb, attn_mask=add, scale=scaling)
        if bool(ne.all()):
            acc += ob.to(work)
        else:
            acc.addcmul_(ob.to(work), ne[..., None].to(work))
        n_ne += ne.to(work)
    return acc, n_ne


def _allowed_at(al: torch.Tensor | None, token_mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Whether each row may attend to key `pos[a]`: [A,h1,R]."""
    A = pos.numel()
    tok = token_mask[torch.arange(A, device=pos.device), pos][:, None, None]
    if al is None:
        return tok
    return al.gather(3, pos[:, None, None, None].expand(A, al.shape[1], al.shape[2], 1))[..., 0] & tok


def _row_lse(
    q: torch.Tensor, k: torch.Tensor, al: torch.Tensor | None, token_mask: torch.Tensor, scaling: float,
    work: torch.dtype, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-sum-exp of each row's allowed scores, [A,H,R], computed LSE_CHUNK rows at a time."""
    A, H, R, _ = q.shape
    out = torch.empty(A, H, R, dtype=work, device=q.device)
    kt = k.to(work).transpose(2, 3)
    for lo in range(0, R, LSE_CHUNK):
        hi = min(lo + LSE_CHUNK, R)
        s = torch.matmul(q[:, :, lo:hi].to(work), kt) * scaling  # [A,H,r,K]
        if bias is not None:
            s = s + (bias[:, :, lo:hi] if bias.shape[2] != 1 else bias)
        m = token_mask[:, None, None, :]
        if al is not None:
            m = m & al[:, :, lo:hi] if al.shape[2] != 1 else m & al
        out[:, :, lo:hi] = torch.logsumexp(s.masked_fill(~m, float("-inf")), -1)
    return out
