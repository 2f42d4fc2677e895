"""Calibrating a transformers model in PyTorch: the reference every export is checked against.

transformers 5 dispatches attention through `AttentionInterface`.  attncal
registers two more implementations:

* `attncal_eager`: the models' own eager attention (matmul, mask add, softmax,
  dropout, matmul, in the same order and dtypes, so uncalibrated layers stay
  bit-identical) with the calibration applied to the post-softmax probabilities
  of the selected layers (`implementation="efficient"` or `"naive"`).
* `attncal_sdpa`: `torch.nn.functional.scaled_dot_product_attention` plus the
  split-attention identity (`attncal.calibration.split`), so the probabilities
  are never materialised and the model keeps its fused SDPA/flash kernels
  (`implementation="split"`; uncalibrated layers run transformers' own SDPA).

`implementation="auto"` (the default) keeps a model on its attention family:
split for SDPA/flash models, efficient for eager ones.

A forward pre-hook on the base model captures the 2-D token mask, from which
the batch geometry is computed once per forward and shared by every
calibrated layer.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .config import CalibrationConfig, ResolvedCalibration
from .efficient import BatchGeometry, apply, compute_geometry
from .naive import naive_apply
from .split import SPLIT_MODES, SplitMode, allowed_from_mask, split_calibrated_attention

IMPL_NAME = "attncal_eager"
SDPA_IMPL_NAME = "attncal_sdpa"
IMPLEMENTATIONS = ("auto", "efficient", "naive", "split")

# base model class -> (attention module class, softmax upcast to float32 like the model's eager code)
_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "BertModel": ("BertSelfAttention", False),
    "XLMRobertaModel": ("XLMRobertaSelfAttention", False),
    "Qwen3Model": ("Qwen3Attention", True),
    "ModernBertModel": ("ModernBertAttention", True),
}


class UnsupportedArchitectureError(ValueError):
    """The model is not one of the architectures attncal can calibrate."""


@dataclass
class _ForwardState:
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
class _ModuleState:
    layer: int
    upcast_softmax: bool
    calibrated: bool
    shared: _ForwardState = field(repr=False)


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
    state: _ModuleState | None = getattr(module, "_attncal_state", None)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    n_rep = getattr(module, "num_key_value_groups", 1)
    key = _repeat_kv(key, n_rep)
    value = _repeat_kv(value, n_rep)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
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

    state: _ModuleState | None = getattr(module, "_attncal_state", None)
    if state is None or not state.calibrated or state.shared.rc.strength == 0.0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    n_rep = getattr(module, "num_key_value_groups", 1)
    key = _repeat_kv(key, n_rep)
    value = _repeat_kv(value, n_rep)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    full = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout if module.training else 0.0, scale=scaling,
        is_causal=causal,
    )
    shared = state.shared
    _, geom = shared.geometry_for(query.shape[0], key.shape[2], query.device)
    allowed = allowed_from_mask(attention_mask, causal, query.shape[2], key.shape[2], query.device)
    out = split_calibrated_attention(query, key, value, full, allowed, shared.rc, geom, scaling, mode=shared.split_mode)
    shared.calls += 1
    return out.transpose(1, 2).contiguous(), None


def _efficient(probs, mask, rc, geom):
    return apply(probs, mask, rc, geometry=geom)


def _naive(probs, mask, rc, geom):
    return naive_apply(probs, mask, rc)


_IMPLEMENTATIONS = {"efficient": _efficient, "naive": _naive}

_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    AttentionInterface.register(IMPL_NAME, attncal_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPL_NAME, eager_mask)
    AttentionInterface.register(SDPA_IMPL_NAME, attncal_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_IMPL_NAME, sdpa_mask)
    _registered = True


def base_model_of(model: nn.Module) -> nn.Module:
    name = type(model).__name__
    if name in _ARCHITECTURES:
        return model
    base = getattr(model, "base_model", None)
    if base is not None and base is not model and type(base).__name__ in _ARCHITECTURES:
        return base
    raise UnsupportedArchitectureError(
        f"attncal cannot calibrate {name}: supported architectures are {', '.join(_ARCHITECTURES)}"
    )


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every layer, in layer order."""
    base = base_model_of(model)
    attn_cls, _ = _ARCHITECTURES[type(base).__name__]
    mods = [m for m in base.modules() if type(m).__name__ == attn_cls]
    n_layers = int(base.config.num_hidden_layers)
    if len(mods) != n_layers:
        raise UnsupportedArchitectureError(
            f"found {len(mods)} {attn_cls} modules in {type(base).__name__} but the config says "
            f"{n_layers} layers"
        )
    return mods


class CalibrationPatch:
    """A calibration applied to a model; undo it with `remove()` or by leaving the `with` block."""

    def __init__(
        self,
        model: nn.Module,
        config: CalibrationConfig,
        pooling: str | None = None,
        implementation: str = "auto",
        split_mode: SplitMode = "loop",
    ) -> None:
        base = base_model_of(model)
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
        if split_mode not in SPLIT_MODES:
            raise ValueError(f"split_mode must be one of {', '.join(SPLIT_MODES)}, got {split_mode!r}")
        orig_impl = base.config._attn_implementation
        if implementation == "auto":
            implementation = "efficient" if orig_impl in (None, "eager", IMPL_NAME) else "split"
        self.implementation = implementation
        if config.pooling == "auto" and pooling is None:
            raise ValueError(
                "invalid calibration config: pooling: 'auto' needs the model's sentence-transformers "
                "config; pass pooling='cls'|'last'|'mean' to calibrate() or set it in the config"
            )
        if pooling is not None and config.pooling != "auto" and pooling != config.pooling:
            raise ValueError(f"pooling={pooling!r} contradicts the config's pooling={config.pooling!r}")
        self.config = config if config.pooling != "auto" else config.with_pooling(pooling)  # type: ignore[arg-type]
        self.model = model
        self.base = base
        mods = attention_modules(model)
        self.layers = self.config.layer_indices(len(mods))
        impl_fn = _IMPLEMENTATIONS.get(implementation, _efficient)
        self._shared = _ForwardState(rc=self.config.resolve(), impl=impl_fn, split_mode=split_mode)
        self._modules = mods
        self._orig_impl = orig_impl
        self._active = False
        _register()
        _, upcast = _ARCHITECTURES[type(base).__name__]
        target = SDPA_IMPL_NAME if implementation == "split" else IMPL_NAME
        if target == IMPL_NAME and self._orig_impl not in (None, "eager", IMPL_NAME):
            warnings.warn(
                f"attncal: {type(base).__name__} was using {self._orig_impl!r} attention; switched to eager "
                "attention for calibration (restored when the patch is removed)",
                stacklevel=3,
            )
        for i, mod in enumerate(mods):
            if hasattr(mod, "_attncal_state"):
                raise RuntimeError("this model is already calibrated; remove the existing patch first")
            mod._attncal_state = _ModuleState(  # type: ignore[attr-defined]
                layer=i, upcast_softmax=upcast, calibrated=i in self.layers, shared=self._shared
            )
        base.config._attn_implementation = target
        params = list(inspect.signature(base.forward).parameters)
        self._mask_pos = params.index("attention_mask") if "attention_mask" in params else None
        self._hook = base.register_forward_pre_hook(self._capture_mask, with_kwargs=True)
        self._active = True

    @property
    def calls(self) -> int:
        """How many calibrated attention calls ran since the patch was applied."""
        return self._shared.calls

    def _capture_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        if mask is None and self._mask_pos is not None and len(args) > self._mask_pos:
            mask = args[self._mask_pos]
        if mask is not None and mask.dim() != 2:
            raise ValueError(f"attncal needs a 2-D attention_mask [batch, seq], got shape {tuple(mask.shape)}")
        self._shared.token_mask = mask
        self._shared.geometry = None

    def remove(self) -> None:
        if not self._active:
            return
        self._hook.remove()
        for mod in self._modules:
            if hasattr(mod, "_attncal_state"):
                del mod._attncal_state
        self.base.config._attn_implementation = self._orig_impl
        self._active = False

    def __enter__(self) -> "CalibrationPatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def calibrate(
    model: nn.Module,
    config: CalibrationConfig,
    *,
    pooling: str | None = None,
    implementation: str = "auto",
    split_mode: SplitMode = "loop",
) -> CalibrationPatch:
    """Calibrate `model` with `config`.

    Use as a context manager (`with calibrate(model, cfg): model(**batch)`) or
    keep the returned patch for a persistent change and call `.remove()` later.
    `implementation`: "auto" (split for SDPA/flash models, efficient for eager
    ones), "efficient" (eager attention, calibrated probabilities), "split"
    (SDPA, no probabilities), or "naive" (full-tensor variant, benchmarks only).
    `split_mode` ("loop" or "batched") picks how the split basket terms are run.
    """
    return CalibrationPatch(model, config, pooling=pooling, implementation=implementation, split_mode=split_mode)
