"""Calibration configuration.

`CalibrationConfig` is what a user chooses (variant, strength, basket size,
layers, pooling, ...).  It is frozen, validated on construction and round-trips
through JSON, because the same config travels from the PyTorch reference into
exported ONNX models (`attncal.json`) and must be reproduced exactly there.

Everything that depends on the pooling mode (which rows are calibrated, which
tokens are isolated, how each isolated token is weighted) is resolved by
`CalibrationConfig.resolve()`, which needs a concrete pooling mode.  Layer
indices are resolved against a model's layer count by `layer_indices()`.

The pooling is an `attncal.pooling.Pooling`; the row-set poolings (lmk, multi-cls,
mean-every) pool, and so calibrate, the rows its `row_mask` selects from the token
ids.  Old config JSON (pooling `landmark` with `pool_token_id`, `mean-every` with
`pool_every`) still reads (`from_dict`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence, Union

from ..pooling import Pooling

VARIANTS = ("uniform", "cls-soft", "cls-hard")
# The calibration's mask value of a valid token whose query row is calibrated (row-set poolings; `marked_mask`):
# 0 = padding, 1 = a valid token, ROW_MARK = a valid token whose row is calibrated.  The op contract's
# (attncal.graphs.ops.contract) `attention_mask` input carries it, so the ops keep their inputs.
ROW_MARK = 2
LAYER_PRESETS = ("last-half", "last", "all")
WEIGHT_WORDS = ("equal", "original")

# Integer codes of the weight modes, shared with the ONNX op contract.
MODE_EQUAL, MODE_ORIGINAL, MODE_FIXED = 0, 1, 2
MODE_NAMES = {MODE_EQUAL: "equal", MODE_ORIGINAL: "original", MODE_FIXED: "fixed"}

WeightSpec = Union[str, float, None]
LayerSpec = Union[str, Sequence[int]]


def _err(field_name: str, message: str) -> ValueError:
    return ValueError(f"invalid calibration config: {field_name}: {message}")


@dataclass(frozen=True)
class ResolvedCalibration:
    """The per-row recipe that both implementations (and the ONNX op) execute.

    `pooling` (concrete, its landmark token resolved) says which rows: `pool_last`
    picks the calibrated row for pooled calibration; `all_rows` means every valid
    query row is calibrated (mean pooling); `row_set` means the rows of `row_mask`
    are (lmk, multi-cls, mean-every).  Modes use the integer codes
    `MODE_EQUAL`, `MODE_ORIGINAL`, `MODE_FIXED`.

    `isolate_self` (lmk and multi-cls pooling): each calibrated row's own key is its pooling
    token; it leaves its basket and takes the variant's share (`self_mode`,
    `self_weight`), also where it is the first or last valid token.
    """

    pooling: Pooling
    strength: float
    basket_size: int
    isolate_first: bool
    isolate_last: bool
    first_mode: int
    first_weight: float
    last_mode: int
    last_weight: float
    skip_short: bool
    isolate_self: bool = False
    self_mode: int = MODE_EQUAL
    self_weight: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "pooling", Pooling.of(self.pooling))  # its text form is parsed

    @property
    def all_rows(self) -> bool:
        return self.pooling.all_rows

    @property
    def row_set(self) -> bool:
        return self.pooling.row_set

    @property
    def pool_last(self) -> bool:
        return self.pooling.pool_last

    @property
    def n_isolated(self) -> int:
        return int(self.isolate_first) + int(self.isolate_last)

    @property
    def any_non_equal(self) -> bool:
        """True when some isolated token is not weighted `equal` (step 8 applies)."""
        return (
            (self.isolate_first and self.first_mode != MODE_EQUAL)
            or (self.isolate_last and self.last_mode != MODE_EQUAL)
            or (self.isolate_self and self.self_mode != MODE_EQUAL)
        )

    def row_mask(self, input_ids: Any, attention_mask: Any) -> Any:
        """The calibrated (and pooled) rows of a row-set pooling (`attncal.pooling.Pooling.row_mask`)."""
        return self.pooling.row_mask(input_ids, attention_mask)

    def marked_mask(self, input_ids: Any, attention_mask: Any) -> Any:
        """The mask every calibration implementation takes: `attention_mask` as it is, or for a row-set pooling
        0 at padding, 1 at a valid token and `ROW_MARK` at a valid token whose row is calibrated (`row_mask`),
        int64 like the mask (torch tensors or numpy arrays)."""
        if not self.row_set:
            return attention_mask
        return (attention_mask != 0) * 1 + self.row_mask(input_ids, attention_mask) * (ROW_MARK - 1)


@dataclass(frozen=True)
class CalibrationConfig:
    """How to calibrate the pooling token's attention.

    Defaults are the published ones: cls-soft, basket 128, strength 0.5, the last
    half of the layers, pooling read from the model's sentence-transformers
    config.  `isolate_first`/`isolate_last` default (None) to what the pooling
    mode implies: cls -> (True, False), last -> (True, True), mean -> (False, False).
    `first_weight`/`last_weight` override the variant's weight for that isolated
    token: "equal", "original" or a float (a fixed share).

    `pooling` is an `attncal.pooling.Pooling` (its text form, e.g. "cls" or "lmk",
    is parsed; default auto: the model's own).  lmk / multi-cls need their landmark
    token's id to calibrate (an export resolves the model's SEP, or its CLS for
    multi-cls).  Row-set poolings isolate the first token by default and, for lmk /
    multi-cls, each row's own key (`ResolvedCalibration`).
    """

    variant: str = "cls-soft"
    strength: float = 0.5
    basket_size: int = 128
    layers: LayerSpec = "last-half"
    pooling: Pooling = Pooling()
    self_weight: float = 0.3
    isolate_first: bool | None = None
    isolate_last: bool | None = None
    skip_short: bool = True
    first_weight: WeightSpec = None
    last_weight: WeightSpec = None

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise _err("variant", f"{self.variant!r} is not one of {', '.join(VARIANTS)}")
        try:
            strength = float(self.strength)
        except (TypeError, ValueError):
            raise _err("strength", f"{self.strength!r} is not a number in [0, 1]") from None
        if math.isnan(strength) or not 0.0 <= strength <= 1.0:
            raise _err("strength", f"{self.strength!r} is outside [0, 1]")
        object.__setattr__(self, "strength", strength)
        if isinstance(self.basket_size, bool) or not isinstance(self.basket_size, int):
            raise _err("basket_size", f"{self.basket_size!r} is not an integer >= 1")
        if self.basket_size < 1:
            raise _err("basket_size", f"{self.basket_size} is < 1; it must be >= 1")
        try:
            object.__setattr__(self, "pooling", Pooling.of(self.pooling))
        except ValueError as exc:
            raise _err("pooling", str(exc).removeprefix("invalid pooling: ")) from None
        object.__setattr__(self, "layers", _normalise_layers(self.layers))
        sw = _as_float("self_weight", self.self_weight)
        if sw < 0 or sw >= 1:
            raise _err("self_weight", f"{self.self_weight!r} is outside [0, 1)")
        object.__setattr__(self, "self_weight", sw)
        for name in ("isolate_first", "isolate_last", "skip_short"):
            value = getattr(self, name)
            if value is None and name != "skip_short":
                continue
            if not isinstance(value, bool):
                raise _err(name, f"{value!r} is not a boolean")
        for name in ("first_weight", "last_weight"):
            object.__setattr__(self, name, _normalise_weight(name, getattr(self, name)))
        if self.pooling.concrete:
            self._resolve(self.pooling)  # validates the fixed-weight budget for this pooling

    @classmethod
    def off(cls, pooling: Pooling | str) -> "CalibrationConfig":
        """No calibration (strength 0) for `pooling`: what an uncalibrated export's native graph places, the
        attention op of that pooling computing plain attention in every layer.  A landmark pooling without its
        token id gets mean pooling's op, which at strength 0 computes the same plain attention."""
        pooling = Pooling.of(pooling)
        return cls(pooling=pooling if pooling.resolved else Pooling("mean"), strength=0.0)

    # ------------------------------------------------------------------ resolve
    def with_pooling(self, pooling: Pooling | str) -> "CalibrationConfig":
        """A copy with a concrete pooling (used when binding to a model)."""
        return replace(self, pooling=Pooling.of(pooling))

    def bind(self, model_pooling: Pooling | str) -> "CalibrationConfig":
        """A copy whose pooling, where it is auto, is the model's (`model_pooling`)."""
        return self if self.pooling.concrete else self.with_pooling(model_pooling)

    def resolve(self, pooling: Pooling | str | None = None) -> ResolvedCalibration:
        """Resolve the preset into per-token weight modes for a concrete pooling."""
        pooling = self.pooling if pooling is None else Pooling.of(pooling)
        if not pooling.concrete:
            raise _err("pooling", "auto must be resolved to a concrete pooling before calibrating (bind the "
                                  "config to a model, or pass pooling explicitly)")
        if not pooling.resolved:
            raise _err("pooling", f"{pooling.kind} pooling needs the landmark token's id; bind the config to a "
                                  "model (Pooling.resolve against its tokenizer)")
        return self._resolve(pooling)

    def _resolve(self, pooling: Pooling) -> ResolvedCalibration:
        default_iso = {"cls": (True, False), "last": (True, True), "mean": (False, False), "lmk": (True, False),
                       "multi-cls": (True, False), "mean-every": (False, False)}[pooling.kind]
        iso_first = default_iso[0] if self.isolate_first is None else self.isolate_first
        iso_last = default_iso[1] if self.isolate_last is None else self.isolate_last
        # The pooling token's own position: for lmk / multi-cls pooling each row's own key, for mean and
        # mean-every pooling the first token plays it.
        pool_pos = "self" if pooling.inserts else "last" if pooling.pool_last else "first"

        def preset(pos: str) -> tuple[int, float]:
            if self.variant == "uniform" or pos != pool_pos:
                return MODE_EQUAL, 0.0
            if self.variant == "cls-soft":
                return MODE_ORIGINAL, 0.0
            return MODE_FIXED, self.self_weight

        def mode_for(pos: str, override: WeightSpec) -> tuple[int, float]:
            if override is None:
                return preset(pos)
            if override == "equal":
                return MODE_EQUAL, 0.0
            if override == "original":
                return MODE_ORIGINAL, 0.0
            return MODE_FIXED, float(override)

        fm, fw = mode_for("first", self.first_weight)
        lm, lw = mode_for("last", self.last_weight)
        iso_self = pool_pos == "self"
        sm, sw = preset("self") if iso_self else (MODE_EQUAL, 0.0)
        fixed_sum = (fw if iso_first and fm == MODE_FIXED else 0.0) + (
            lw if iso_last and lm == MODE_FIXED else 0.0
        ) + (sw if iso_self and sm == MODE_FIXED else 0.0)
        if fixed_sum >= 1.0:
            raise _err(
                "fixed weights",
                f"the fixed shares of the isolated tokens sum to {fixed_sum:g}; they must sum to < 1",
            )
        return ResolvedCalibration(
            pooling=pooling,
            strength=self.strength,
            basket_size=self.basket_size,
            isolate_first=iso_first,
            isolate_last=iso_last,
            first_mode=fm,
            first_weight=fw,
            last_mode=lm,
            last_weight=lw,
            skip_short=self.skip_short,
            isolate_self=iso_self,
            self_mode=sm,
            self_weight=sw,
        )

    def layer_indices(self, num_layers: int) -> list[int]:
        """The calibrated layers (sorted, non-negative) of a model with `num_layers` layers."""
        if num_layers < 1:
            raise _err("layers", f"the model reports {num_layers} layers")
        if self.layers == "last-half":
            k = max(1, num_layers // 2)
            return list(range(num_layers - k, num_layers))
        if self.layers == "last":
            return [num_layers - 1]
        if self.layers == "all":
            return list(range(num_layers))
        out = set()
        for i in self.layers:  # type: ignore[union-attr]
            if not -num_layers <= i < num_layers:
                raise _err(
                    "layers",
                    f"layer index {i} is out of range for a model with {num_layers} layers "
                    f"(allowed: {-num_layers}..{num_layers - 1})",
                )
            out.add(i % num_layers)
        return sorted(out)

    # ---------------------------------------------------------------- JSON I/O
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pooling"] = self.pooling.to_json()
        if not isinstance(d["layers"], str):
            d["layers"] = list(d["layers"])
        return d

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CalibrationConfig":
        if not isinstance(data, dict):
            raise ValueError(f"invalid calibration config: expected a JSON object, got {type(data).__name__}")
        old = not isinstance(data.get("pooling", {}), dict)
        known = set(cls.__dataclass_fields__) | (set(_OLD_FIELDS) if old else set())
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"invalid calibration config: unknown field(s) {', '.join(unknown)}; "
                f"known fields: {', '.join(sorted(known))}"
            )
        data = dict(data)
        if old:  # the old form: a word, a landmark's id, k
            try:
                data["pooling"] = _old_pooling(data)
            except ValueError as exc:
                raise _err("pooling", str(exc).removeprefix("invalid pooling: ")) from None
        elif "pooling" in data:
            try:
                data["pooling"] = Pooling.from_json(data["pooling"])
            except ValueError as exc:
                raise _err("pooling", str(exc).removeprefix("invalid pooling: ")) from None
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "CalibrationConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid calibration config JSON: {exc}") from None
        return cls.from_dict(data)


_OLD_FIELDS = ("pool_token_id", "pool_every")


def _old_pooling(data: dict) -> Pooling:
    """The pooling of an old config dict (pops its old fields): `landmark` with `pool_token_id` reads as lmk
    (the config's rows and weights are the same for lmk and multi-cls; attncal.json's old `pooling_spec` says
    which), `mean-every` with `pool_every` as k."""
    name, tid, k = data.pop("pooling"), data.pop("pool_token_id", -1), data.pop("pool_every", 0)
    for key, value, lowest in (("pool_token_id", tid, -1), ("pool_every", k, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise ValueError(f"{key} {value!r} is not an integer >= {lowest}")
    if tid != -1 and name != "landmark":
        raise ValueError(f"pool_token_id is set ({tid}) but pooling is {name!r}")
    if k != 0 and name != "mean-every":
        raise ValueError(f"pool_every is set ({k}) but pooling is {name!r}")
    if name == "landmark":
        return Pooling("lmk", token_id=None if tid == -1 else tid)
    return Pooling("mean-every", k or None) if name == "mean-every" else Pooling.of(name)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _err(name, f"{value!r} is not a number")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise _err(name, f"{value!r} is not a number") from None
    if math.isnan(out):
        raise _err(name, "NaN is not allowed")
    return out


def _normalise_weight(name: str, value: WeightSpec) -> WeightSpec:
    if value is None:
        return None
    if isinstance(value, str):
        if value in WEIGHT_WORDS:
            return value
        try:
            value = float(value)
        except ValueError:
            raise _err(name, f"{value!r} is not 'equal', 'original' or a number in [0, 1)") from None
    w = _as_float(name, value)
    if w < 0:
        raise _err(name, f"fixed weight {w:g} is < 0")
    if w >= 1:
        raise _err(name, f"fixed weight {w:g} is >= 1; fixed weights must sum to < 1")
    return w


def _normalise_layers(layers: Any) -> LayerSpec:
    if isinstance(layers, str):
        text = layers.strip()
        if text in LAYER_PRESETS:
            return text
        try:
            parsed = [int(p) for p in text.split(",") if p.strip() != ""]
        except ValueError:
            raise _err(
                "layers",
                f"{layers!r} is not one of {', '.join(LAYER_PRESETS)} or a comma-separated list of integers",
            ) from None
        layers = parsed
    if isinstance(layers, (list, tuple)):
        if not layers:
            raise _err("layers", "the list of layer indices is empty")
        for i in layers:
            if isinstance(i, bool) or not isinstance(i, int):
                raise _err("layers", f"{i!r} is not an integer layer index")
        return tuple(layers)
    raise _err("layers", f"{layers!r} is not one of {', '.join(LAYER_PRESETS)} or a list of integers")
