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

Models whose attention modules compute their own eager softmax instead (MPNet)
are calibrated at that softmax: while a calibrated attention module runs, a
`TorchFunctionMode` applies the calibration to the output of its 4-D softmax.

Support is by capability, not by name (`find_attention`): a model is
calibratable when one forward on a tiny batch shows one attention module per
layer going through `AttentionInterface` (and attncal's eager attention then
reproduces the model's own), or one module per layer computing a 4-D softmax.

A forward pre-hook on the base model captures the 2-D token mask, from which
the batch geometry is computed once per forward and shared by every
calibrated layer.
"""

from __future__ import annotations

import inspect
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..modelinfo import forward_kwargs
from .config import CalibrationConfig, ResolvedCalibration
from .efficient import BatchGeometry, apply, compute_geometry
from .naive import naive_apply
from .split import SPLIT_MODES, SplitMode, allowed_from_mask, split_calibrated_attention

IMPL_NAME = "attncal_eager"
SDPA_IMPL_NAME = "attncal_sdpa"
PROBE_IMPL_NAME = "attncal_probe"
IMPLEMENTATIONS = ("auto", "efficient", "naive", "split")
# Keyword arguments of attention functions that `attncal_attention_forward` replays (or that only say what the
# mask already holds); any other one is reported when the probe finds attncal's eager attention differs.
_REPLAYED_KWARGS = {"position_bias", "softcap", "sliding_window", "dropout", "scaling", "is_causal",
                    "output_attentions", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                    "max_length_k", "use_cache", "cache_position"}


class UnsupportedArchitectureError(ValueError):
    """The model's attention has no path attncal can calibrate."""


AttentionPath = Literal["interface", "softmax"]


@dataclass(frozen=True)
class AttentionSites:
    """Where a model's attention is calibrated: one module per layer, in layer order."""

    base: nn.Module
    modules: tuple[nn.Module, ...]
    path: AttentionPath  # "interface": transformers' AttentionInterface; "softmax": the module's own softmax
    upcast_softmax: bool  # the model's eager softmax runs in float32 (replayed by attncal's eager attention)
    # What the probe saw of the attention beyond plain scaled dot-product: "rotary" (position embeddings applied
    # to Q and K), "position_bias" (an additive relative bias: T5, MPNet), "grouped_kv" (fewer KV than Q heads).
    features: frozenset[str] = frozenset()


def attention_features(module: nn.Module, kwargs_seen: set[str]) -> frozenset[str]:
    """The `AttentionSites.features` of one attention module (its forward's inputs, the kwargs it passed)."""
    params = set(inspect.signature(type(module).forward).parameters)
    out = set()
    if "position_embeddings" in params:
        out.add("rotary")
    if "position_bias" in params or "position_bias" in kwargs_seen:
        out.add("position_bias")
    if getattr(module, "num_key_value_groups", 1) > 1:
        out.add("grouped_kv")
    return frozenset(out)


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

    state: _ModuleState | None = getattr(module, "_attncal_state", None)
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
    AttentionInterface.register(PROBE_IMPL_NAME, _probe_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE_IMPL_NAME, eager_mask)
    _registered = True


def base_model_of(model: nn.Module) -> nn.Module:
    """The transformers base model (the encoder) of `model`: itself, or its `base_model`."""
    from transformers import PreTrainedModel

    base = getattr(model, "base_model", None)
    if isinstance(base, PreTrainedModel):
        return base
    if isinstance(model, PreTrainedModel):
        return model
    raise UnsupportedArchitectureError(
        f"attncal cannot calibrate {type(model).__name__}: it is not a transformers PreTrainedModel"
    )


def set_attn_implementation(base: nn.Module, name: str) -> tuple[nn.Module, str | None]:
    """Switch `base` (a transformers PreTrainedModel) to the attention implementation `name` through its public
    `set_attn_implementation`, which reaches every sub-model's config (T5's encoder stack holds a copy); returns
    what to pass to `restore_attn_implementation`.  A model that does not dispatch its attention through
    transformers' AttentionInterface keeps its own (transformers says so in its log); it computes its softmax
    itself, which the softmax path hooks."""
    previous = base.config._attn_implementation
    if name != previous:
        base.set_attn_implementation(name)
    return base, previous


def restore_attn_implementation(saved: tuple[nn.Module, str | None]) -> None:
    base, previous = saved
    if previous is not None and base.config._attn_implementation != previous:
        base.set_attn_implementation(previous)


class _ProbeRecord:
    """What one probe forward saw: attention modules in call order, with the keyword arguments they passed."""

    def __init__(self) -> None:
        self.calls: list[nn.Module] = []
        self.kwargs: set[str] = set()


_probe: _ProbeRecord | None = None
_probe_lock = threading.Lock()  # one probe forward at a time: `_probe` is where `_probe_forward` records


def _probe_forward(module: nn.Module, query, key, value, attention_mask, **kwargs: Any):
    if _probe is not None:
        _probe.calls.append(module)
        _probe.kwargs.update(k for k, v in kwargs.items() if v is not None)
    return attncal_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _probe_batch(base: nn.Module) -> dict[str, torch.Tensor]:
    """Two items of 6 tokens, the second padded (right) by 2: enough for every mask and position path."""
    vocab = int(getattr(base.config, "vocab_size", 0) or 0)
    dev = next(base.parameters()).device
    ids = (torch.arange(12, device=dev).view(2, 6) % max(1, min(vocab, 50) - 3)) + 3 if vocab > 4 else \
        torch.zeros(2, 6, dtype=torch.long, device=dev)
    mask = torch.ones(2, 6, dtype=torch.long, device=dev)
    mask[1, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask, **forward_kwargs(base)}


def _layer_modules(calls: list[nn.Module], n_layers: int) -> tuple[nn.Module, ...] | None:
    """The calls' modules if they are n_layers distinct modules, each called once per forward."""
    order: list[nn.Module] = []
    for m in calls:
        if not any(m is o for o in order):
            order.append(m)
    if len(order) != n_layers or len(calls) != n_layers:
        return None
    return tuple(order)


def _upcasts_softmax(module: nn.Module) -> bool:
    """Whether the model's own eager attention (the `eager_attention_forward` of its modeling file) runs the
    softmax in float32, so attncal's replay keeps uncalibrated layers bit-identical in half precision."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    try:
        return fn is not None and "dtype=torch.float32" in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


class _SoftmaxRecorder(TorchFunctionMode):
    """Records the innermost running module of every 4-D softmax over the last axis."""

    def __init__(self, stack: list[nn.Module]) -> None:
        super().__init__()
        self.stack = stack
        self.calls: list[nn.Module] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_attention_softmax(func, args, kwargs) and self.stack:
            self.calls.append(self.stack[-1])
        return func(*args, **kwargs)


_SOFTMAX_FUNCS = (torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax)


def _is_attention_softmax(func, args, kwargs) -> bool:
    if func not in _SOFTMAX_FUNCS or not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 4:
        return False
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return dim in (-1, 3)


def _probe_softmax(base: nn.Module, batch: dict) -> list[nn.Module]:
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    stack: list[nn.Module] = []

    def push(m: nn.Module, args: tuple) -> None:
        stack.append(m)

    def pop(m: nn.Module, args: tuple, out: Any) -> None:  # returning None keeps the module's output
        stack.pop()

    pre = register_module_forward_pre_hook(push)
    post = register_module_forward_hook(pop, always_call=True)
    saved = set_attn_implementation(base, "eager")
    rec = _SoftmaxRecorder(stack)
    try:
        with torch.no_grad(), rec:
            base(**batch)
    finally:
        pre.remove()
        post.remove()
        restore_attn_implementation(saved)
    return rec.calls


def find_attention(model: nn.Module) -> AttentionSites:
    """Where `model`'s attention can be calibrated, found by running it once on a tiny batch (cached).

    Raises `UnsupportedArchitectureError` naming what the probe saw when neither path applies, or when
    attncal's eager attention does not reproduce the model's own (an attention argument it does not replay).
    """
    global _probe
    base = base_model_of(model)
    cached = getattr(base, "_attncal_sites", None)
    if cached is not None:
        return cached
    name = type(base).__name__
    n_layers = getattr(base.config, "num_hidden_layers", None)
    if not n_layers:
        raise UnsupportedArchitectureError(f"attncal cannot calibrate {name}: its config has no num_hidden_layers")
    _register()
    batch = _probe_batch(base)
    record = _ProbeRecord()
    with _probe_lock:
        saved = set_attn_implementation(base, PROBE_IMPL_NAME)
        _probe = record
        try:
            with torch.no_grad():
                probed = base(**batch).last_hidden_state
        except Exception as exc:  # noqa: BLE001 - any failure of the probe forward is reported with its cause
            raise UnsupportedArchitectureError(
                f"attncal cannot calibrate {name}: a forward with attncal's attention failed "
                f"({type(exc).__name__}: {exc})") from exc
        finally:
            _probe = None
            restore_attn_implementation(saved)
    modules = _layer_modules(record.calls, int(n_layers))
    if modules is not None:
        saved = set_attn_implementation(base, "eager")
        try:
            with torch.no_grad():
                own = base(**batch).last_hidden_state
        finally:
            restore_attn_implementation(saved)
        valid = batch["attention_mask"].bool()
        diff = float((probed - own)[valid].abs().max())
        tol = 1e-5 if own.dtype == torch.float32 else 2e-2
        if not diff <= tol * max(1.0, float(own[valid].abs().max())):
            unknown = sorted(record.kwargs - _REPLAYED_KWARGS)
            raise UnsupportedArchitectureError(
                f"attncal cannot calibrate {name}: its attention goes through AttentionInterface, but attncal's "
                f"eager attention does not reproduce it (max |diff| {diff:.3g}); arguments attncal does not "
                f"replay: {', '.join(unknown) or 'none (the difference is elsewhere)'}"
            )
        sites = AttentionSites(base, modules, "interface", _upcasts_softmax(modules[0]),
                               attention_features(modules[0], record.kwargs))
    else:
        soft = _layer_modules(_probe_softmax(base, batch), int(n_layers))
        if soft is None:
            raise UnsupportedArchitectureError(
                f"attncal cannot calibrate {name}: its attention neither goes through transformers' "
                f"AttentionInterface ({len(record.calls)} calls for {n_layers} layers) nor computes one 4-D "
                f"softmax per layer in a module of its own"
            )
        sites = AttentionSites(base, soft, "softmax", False, attention_features(soft[0], set()))
    base._attncal_sites = sites  # type: ignore[attr-defined]
    return sites


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every layer, in layer order."""
    return list(find_attention(model).modules)


class _SoftmaxCalibration(TorchFunctionMode):
    """Calibrates the output of the attention softmax of one module's forward (the "softmax" path)."""

    def __init__(self, state: _ModuleState) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_attention_softmax(func, args, kwargs):
            shared = self.state.shared
            mask, geom = shared.geometry_for(out.shape[0], out.shape[-1], out.device)
            out = shared.impl(out, mask, shared.rc, geom)
            shared.calls += 1
        return out


def _softmax_hooks(module: nn.Module) -> list[Any]:
    """Hooks that run `module`'s forward under `_SoftmaxCalibration` (the "softmax" path)."""
    modes: list[_SoftmaxCalibration] = []

    def enter(m: nn.Module, args: tuple) -> None:
        mode = _SoftmaxCalibration(m._attncal_state)  # type: ignore[attr-defined]
        mode.__enter__()
        modes.append(mode)

    def leave(m: nn.Module, args: tuple, out: Any) -> None:
        modes.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]


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
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
        if split_mode not in SPLIT_MODES:
            raise ValueError(f"split_mode must be one of {', '.join(SPLIT_MODES)}, got {split_mode!r}")
        if config.pooling == "auto" and pooling is None:
            raise ValueError(
                "invalid calibration config: pooling: 'auto' needs the model's sentence-transformers "
                "config; pass pooling='cls'|'last'|'mean' to calibrate() or set it in the config"
            )
        if pooling is not None and config.pooling != "auto" and pooling != config.pooling:
            raise ValueError(f"pooling={pooling!r} contradicts the config's pooling={config.pooling!r}")
        for m in model.modules():
            if hasattr(m, "_attncal_state"):
                raise RuntimeError("this model is already calibrated; remove the existing patch first")
        sites = find_attention(model)
        base = sites.base
        orig_impl = base.config._attn_implementation
        self.config = config if config.pooling != "auto" else config.with_pooling(pooling)  # type: ignore[arg-type]
        rc = self.config.resolve()
        if sites.path == "softmax":
            if implementation == "split":
                raise UnsupportedArchitectureError(
                    f"split calibration needs attention through transformers' AttentionInterface; "
                    f"{type(base).__name__} computes its own softmax (use implementation='efficient')"
                )
            implementation = "efficient" if implementation == "auto" else implementation
        elif implementation == "auto":  # split calibration computes one pooled row or all rows, not a row set
            implementation = "efficient" if orig_impl in (None, "eager", IMPL_NAME) or rc.row_set else "split"
        self.implementation = implementation
        self.model = model
        self.base = base
        self.path: AttentionPath = sites.path
        mods = list(sites.modules)
        self.layers = self.config.layer_indices(len(mods))
        impl_fn = _IMPLEMENTATIONS.get(implementation, _efficient)
        self._shared = _ForwardState(rc=rc, impl=impl_fn, split_mode=split_mode)
        self._modules = mods
        self._active = False
        self._hooks: list[Any] = []
        self._saved_impl: tuple[nn.Module, str | None] | None = None
        _register()
        for i, mod in enumerate(mods):
            mod._attncal_state = _ModuleState(  # type: ignore[attr-defined]
                layer=i, upcast_softmax=sites.upcast_softmax, calibrated=i in self.layers, shared=self._shared
            )
        if sites.path == "interface":
            target = SDPA_IMPL_NAME if implementation == "split" else IMPL_NAME
            if target == IMPL_NAME and orig_impl not in (None, "eager", IMPL_NAME):
                warnings.warn(
                    f"attncal: {type(base).__name__} was using {orig_impl!r} attention; switched to eager "
                    "attention for calibration (restored when the patch is removed)",
                    stacklevel=3,
                )
            self._saved_impl = set_attn_implementation(base, target)
        else:
            for i in self.layers:
                self._hooks += _softmax_hooks(mods[i])
        params = list(inspect.signature(base.forward).parameters)
        self._mask_pos = params.index("attention_mask") if "attention_mask" in params else None
        self._ids_pos = params.index("input_ids") if "input_ids" in params else None
        self._hooks.append(base.register_forward_pre_hook(self._capture_mask, with_kwargs=True))
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
        rc = self._shared.rc
        if rc.row_set:  # the calibrated rows travel in the mask, marked (ResolvedCalibration.marked_mask)
            ids = kwargs.get("input_ids")
            if ids is None and self._ids_pos is not None and len(args) > self._ids_pos:
                ids = args[self._ids_pos]
            if ids is None:
                raise ValueError(f"{rc.pooling} pooling calibrates the rows its input_ids select; this forward "
                                 "has no input_ids (inputs_embeds?)")
            mask = rc.marked_mask(ids, torch.ones_like(ids) if mask is None else mask)
        self._shared.token_mask = mask
        self._shared.geometry = None

    def remove(self) -> None:
        if not self._active:
            return
        for hook in self._hooks:
            hook.remove()
        for mod in self._modules:
            if hasattr(mod, "_attncal_state"):
                del mod._attncal_state
        if self._saved_impl is not None:
            restore_attn_implementation(self._saved_impl)
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


# --------------------------------------------------------------------------- running part of the layers
@dataclass(frozen=True)
class LayerBlocks:
    """The transformer block of every layer, in layer order, and what a block's forward returns: a tensor
    (`tuple_len` 0) or a tuple of `tuple_len` items whose first is the hidden states."""

    blocks: tuple[nn.Module, ...]
    tuple_len: int


def _hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    """A block's input hidden states: its first positional argument, else its `hidden_states` keyword."""
    return args[0] if args else kwargs["hidden_states"]


def layer_blocks(model: nn.Module) -> LayerBlocks:
    """The blocks of `model`'s layers, found from the attention modules (cached on the base model).

    A layer's block is the element of the model's one `num_hidden_layers`-long ModuleList that holds the
    layer's attention module; its output form is read from one forward on the probe batch."""
    sites = find_attention(model)
    base = sites.base
    cached = getattr(base, "_attncal_blocks", None)
    if cached is not None:
        return cached
    n = len(sites.modules)
    blocks = None
    for lst in base.modules():
        if isinstance(lst, nn.ModuleList) and len(lst) == n and all(
                any(m is a for m in blk.modules()) for blk, a in zip(lst, sites.modules)):
            blocks = tuple(lst)
            break
    if blocks is None:
        raise UnsupportedArchitectureError(
            f"{type(base).__name__}: no list of {n} layer blocks holds the attention modules in layer order")
    seen: list[Any] = []
    hook = blocks[0].register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.no_grad():
            base(**_probe_batch(base))
    finally:
        hook.remove()
    out = seen[0]
    found = LayerBlocks(blocks, len(out) if isinstance(out, tuple) else 0)
    base._attncal_blocks = found  # type: ignore[attr-defined]
    return found


class LayerInputs:
    """While active, every forward of the model records the input hidden states of the blocks `layers`
    (a detached copy each, in `captured[layer]`)."""

    def __init__(self, model: nn.Module, layers: Sequence[int]) -> None:
        found = layer_blocks(model)
        self.captured: dict[int, torch.Tensor] = {}
        self._hooks = [found.blocks[i].register_forward_pre_hook(self._recorder(i), with_kwargs=True)
                       for i in sorted(set(layers))]

    def _recorder(self, layer: int) -> Callable:
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.captured[layer] = _hidden_arg(args, kwargs).detach().clone()
        return record

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> "LayerInputs":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class ResumeAt:
    """While active, a forward of the model starts at block `layer` with `hidden` as that block's input:
    the blocks below it pass their input on without computing, and `hidden` (taken from an earlier forward
    by `LayerInputs`) replaces what reaches block `layer`.  The embeddings still run (cheap; the model's
    masks and position inputs come from them) and so does everything from `layer` up, calibration included.

    Exact for blocks that hand only their hidden states to the next (BERT, RoBERTa, DistilBERT, MPNet,
    ModernBERT, Qwen3, Gemma3); T5 hands its position bias on from the first block, which a skipped block
    cannot, so callers check a resumed forward against a full one before relying on it."""

    def __init__(self, model: nn.Module, layer: int, hidden: torch.Tensor) -> None:
        found = layer_blocks(model)
        if not 0 <= layer < len(found.blocks):
            raise ValueError(f"layer {layer} is out of range for a model with {len(found.blocks)} layers")
        rest = (None,) * (found.tuple_len - 1)

        def skipped(*args: Any, **kwargs: Any) -> Any:
            given = _hidden_arg(args, kwargs)
            return (given, *rest) if found.tuple_len else given

        def replace_input(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            given = _hidden_arg(args, kwargs)
            if given.shape != hidden.shape:
                raise ValueError(f"resuming at layer {layer}: the batch's hidden states are {tuple(given.shape)}, "
                                 f"the stored ones {tuple(hidden.shape)}")
            h = hidden.to(dtype=given.dtype, device=given.device)
            if args:
                return (h, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": h}

        self._blocks = found.blocks[:layer]
        for blk in self._blocks:
            blk.forward = skipped  # an instance attribute: nn.Module.__call__ runs it instead of the class's
        self._hook = found.blocks[layer].register_forward_pre_hook(replace_input, with_kwargs=True)

    def remove(self) -> None:
        for blk in self._blocks:
            blk.__dict__.pop("forward", None)
        self._blocks = ()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __enter__(self) -> "ResumeAt":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
