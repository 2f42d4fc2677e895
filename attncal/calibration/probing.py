"""Where a model's attention can be calibrated, found by running it: `find_attention`.

Support is by capability, not by name: a model is calibratable when one forward on a tiny batch shows one
attention module per layer going through transformers' `AttentionInterface` (and attncal's eager attention,
`attncal.calibration.attention_functions`, then reproduces the model's own), or one module per layer computing
a 4-D softmax (MPNet: the "softmax" path, calibrated at that softmax).  `layer_blocks` finds the transformer
block of every layer from the attention modules, for running part of the layers
(`attncal.calibration.patching.LayerInputs`, `ResumeAt`).
"""

from __future__ import annotations

import inspect
import sys
import threading
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..modelinfo import forward_kwargs
from .attention_functions import UnsupportedArchitectureError, attncal_attention_forward, register_attention

PROBE_IMPL_NAME = "attncal_probe"
# Keyword arguments of attention functions that `attncal_attention_forward` replays (or that only say what the
# mask already holds); any other one is reported when the probe finds attncal's eager attention differs.
_REPLAYED_KWARGS = {"position_bias", "softcap", "sliding_window", "dropout", "scaling", "is_causal",
                    "output_attentions", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                    "max_length_k", "use_cache", "cache_position"}


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
        if is_attention_softmax(func, args, kwargs) and self.stack:
            self.calls.append(self.stack[-1])
        return func(*args, **kwargs)


SOFTMAX_FUNCS = (torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax)


def is_attention_softmax(func, args, kwargs) -> bool:
    if func not in SOFTMAX_FUNCS or not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 4:
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
    register_attention(PROBE_IMPL_NAME, _probe_forward, "eager")
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


@dataclass(frozen=True)
class LayerBlocks:
    """The transformer block of every layer, in layer order, and what a block's forward returns: a tensor
    (`tuple_len` 0) or a tuple of `tuple_len` items whose first is the hidden states."""

    blocks: tuple[nn.Module, ...]
    tuple_len: int


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

