"""Calibrating a transformers model in PyTorch: the reference every export is checked against.

`calibrate(model, config)` finds the model's attention (`attncal.calibration.probing.find_attention`) and
patches it: on the "interface" path, the model's attention implementation is switched to one of attncal's
(`attncal.calibration.attention_functions`: `attncal_eager`, the calibrated eager attention, or `attncal_sdpa`,
split attention); on the "softmax" path (models whose attention modules compute their own eager softmax:
MPNet), a `TorchFunctionMode` applies the calibration to the output of the 4-D softmax while a calibrated
attention module runs.

`implementation="auto"` (the default) keeps a model on its attention family: split for SDPA/flash models,
efficient for eager ones.

A forward pre-hook on the base model captures the 2-D token mask, from which the batch geometry is computed
once per forward and shared by every calibrated layer.

`LayerInputs` and `ResumeAt` run part of the layers: the inputs of some blocks recorded, a forward resumed at
a block from them.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .attention_functions import (CALIBRATIONS, IMPL_NAME, SDPA_IMPL_NAME, ForwardState, ModuleState,
                                  UnsupportedArchitectureError, register)
from ..pooling import Pooling
from .config import CalibrationConfig
from .probing import (AttentionPath, find_attention, is_attention_softmax, layer_blocks,
                      restore_attn_implementation, set_attn_implementation)
from .split import SPLIT_MODES, SplitMode

IMPLEMENTATIONS = ("auto", "efficient", "naive", "split")


class _SoftmaxCalibration(TorchFunctionMode):
    """Calibrates the output of the attention softmax of one module's forward (the "softmax" path)."""

    def __init__(self, state: ModuleState) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if is_attention_softmax(func, args, kwargs):
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
        pooling: Pooling | str | None = None,
        implementation: str = "auto",
        split_mode: SplitMode = "loop",
    ) -> None:
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
        if split_mode not in SPLIT_MODES:
            raise ValueError(f"split_mode must be one of {', '.join(SPLIT_MODES)}, got {split_mode!r}")
        pooling = None if pooling is None else Pooling.of(pooling)
        if not config.pooling.concrete and pooling is None:
            raise ValueError(
                "invalid calibration config: pooling: 'auto' needs the model's sentence-transformers "
                "config; pass pooling='cls'|'last'|'mean' to calibrate() or set it in the config"
            )
        if pooling is not None and config.pooling.concrete and pooling != config.pooling:
            raise ValueError(f"pooling={pooling.describe()!r} contradicts the config's pooling="
                             f"{config.pooling.describe()!r}")
        for m in model.modules():
            if hasattr(m, "_attncal_state"):
                raise RuntimeError("this model is already calibrated; remove the existing patch first")
        sites = find_attention(model)
        base = sites.base
        orig_impl = base.config._attn_implementation
        self.config = config.bind(pooling)  # type: ignore[arg-type]
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
        impl_fn = CALIBRATIONS.get(implementation, CALIBRATIONS["efficient"])
        self._shared = ForwardState(rc=rc, impl=impl_fn, split_mode=split_mode)
        self._modules = mods
        self._active = False
        self._hooks: list[Any] = []
        self._saved_impl: tuple[nn.Module, str | None] | None = None
        register()
        for i, mod in enumerate(mods):
            mod._attncal_state = ModuleState(  # type: ignore[attr-defined]
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


def _hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    """A block's input hidden states: its first positional argument, else its `hidden_states` keyword."""
    return args[0] if args else kwargs["hidden_states"]


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
