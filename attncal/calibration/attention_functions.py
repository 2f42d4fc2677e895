"""The attention functions attncal registers with transformers' `AttentionInterface`, which calibrate the
attention of the layers a patch selects (`attncal.calibration.patching`):

* `attncal_eager` (`attncal_attention_forward`): the models' own eager attention (matmul, mask add, softmax,
  dropout, matmul, in the same order and dtypes, so uncalibrated layers stay bit-identical) with the
  calibration applied to the post-softmax probabilities of the selected layers (`implementation="efficient"`
  or `"naive"`).
* `attncal_sdpa` (`attncal_sdpa_forward`): `torch.nn.functional.scaled_dot_product_attention` plus the
  split-attention identity (`attncal.calibration.split`), so the probabilities are never materialised and the
  model keeps its fused SDPA/flash kernels (`implementation="split"`; uncalibrated layers run transformers' own
  SDPA).

A module runs calibrated when the patch has given it a `ModuleState` (`_attncal_state`); without one, the eager
function is plain eager attention, which the probe (`attncal.calibration.probing`) compares with the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .config import ResolvedCalibration
from .efficient import BatchGeometry, apply, compute_geometry
from .naive import naive_apply
from .split import SplitMode, allowed_from_mask, split_calibrated_attention

IMPL_NAME = "attncal_eager"
SDPA_IMPL_NAME = "attncal_sdpa"


class UnsupportedArchitectureError(ValueError):
    """The model's attention has no path attncal can calibrate."""


@dataclass
class ForwardState:
    """Shared by all attention modules of one patched model."""

    rc: ResolvedCalibration
    impl: Callable[..., torch.Tensor]
    token_mask: torch.Tensor | None = None
    geometry: BatchGeometry | None = None
    calls: int = 0  # calibrated layer invocations, for tests and diagnostics
    split_mode: SplitMode = "loop"

    def geometry_for(self, batch: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, BatchGeometry]:
        if self.token_mask is None:
            self.token_mask = torch.ones(batch, seq_len, dtype=torch.long, device=device)
        mask = self.token_mask
        if tuple(mask.shape) != (batch, seq_len):
            raise RuntimeError(
                f"attncal: attention over {seq_len} keys but the attention_mask is {tuple(mask.shape)}; "
                "calibration supports plain encoder forwards only (no KV cache)"
            )
        if self.geometry is None:
            self.geometry = compute_geometry(mask, self.rc)
        return mask, self.geometry


@dataclass
class ModuleState:
    layer: int
    upcast_softmax: bool
    calibrated: bool
    shared: ForwardState = field(repr=False)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def attncal_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with calibration of the post-softmax probabilities."""
    state: ModuleState | None = getattr(module, "_attncal_state", None)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    n_rep = getattr(module, "num_key_value_groups", 1)
    key = _repeat_kv(key, n_rep)
    value = _repeat_kv(value, n_rep)
    if kwargs.get("s_aux") is not None:
        raise UnsupportedArchitectureError("attncal cannot calibrate attention with sinks (s_aux): the sink's "
                                           "share of the row is outside every basket")
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    softcap = kwargs.get("softcap")
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    position_bias = kwargs.get("position_bias")  # T5's relative position bias
    if position_bias is not None:
        weights = weights + position_bias
    if attention_mask is not None:
        weights = weights + attention_mask
    if state is not None and state.upcast_softmax:
        weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        weights = nn.functional.softmax(weights, dim=-1)
    if state is not None and state.calibrated:
        shared = state.shared
        mask, geom = shared.geometry_for(weights.shape[0], weights.shape[-1], weights.device)
        weights = shared.impl(weights, mask, shared.rc, geom)
        shared.calls += 1
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value)
    return out.transpose(1, 2).contiguous(), weights


def attncal_sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA attention; calibrated layers add the split-attention terms (no probabilities)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state: ModuleState | None = getattr(module, "_attncal_state", None)
    if state is None or not state.calibrated or state.shared.rc.strength == 0.0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    if kwargs.get("softcap") is not None:
        raise UnsupportedArchitectureError("split calibration cannot replay a logit soft-cap (SDPA has none); "
                                           "use implementation='efficient'")
    n_rep = getattr(module, "num_key_value_groups", 1)
    key = _repeat_kv(key, n_rep)
    value = _repeat_kv(value, n_rep)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    allowed = allowed_from_mask(attention_mask, causal, query.shape[2], key.shape[2], query.device)
    bias = kwargs.get("position_bias")  # T5: an additive score bias, outside the mask
    attn_mask = attention_mask
    if bias is not None:
        attn_mask = bias if allowed is None else bias.masked_fill(~allowed, torch.finfo(bias.dtype).min)
        attn_mask = attn_mask.to(query.dtype)
        causal = False
    full = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout if module.training else 0.0, scale=scaling,
        is_causal=causal,
    )
    shared = state.shared
    _, geom = shared.geometry_for(query.shape[0], key.shape[2], query.device)
    out = split_calibrated_attention(query, key, value, full, allowed, shared.rc, geom, scaling, mode=shared.split_mode,
                                     bias=bias)
    shared.calls += 1
    return out.transpose(1, 2).contiguous(), None


def _efficient(probs, mask, rc, geom):
    return apply(probs, mask, rc, geometry=geom)


def _naive(probs, mask, rc, geom):
    return naive_apply(probs, mask, rc)


CALIBRATIONS = {"efficient": _efficient, "naive": _naive}

_registered: set[str] = set()


def register_attention(name: str, forward: Callable, mask: str) -> None:
    """`forward` as transformers' attention implementation `name`, with the mask function of `mask` ("eager" or
    "sdpa"); once per process."""
    if name in _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    AttentionInterface.register(name, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, {"eager": eager_mask, "sdpa": sdpa_mask}[mask])
    _registered.add(name)


def register() -> None:
    """Register `attncal_eager` and `attncal_sdpa` with transformers (once per process)."""
    register_attention(IMPL_NAME, attncal_attention_forward, "eager")
    register_attention(SDPA_IMPL_NAME, attncal_sdpa_forward, "sdpa")
