"""CalibrationConfig: defaults, presets, layer selection, validation and JSON round-trip."""

from __future__ import annotations

import math

import pytest

from attncal.calibration import CalibrationConfig
from attncal.calibration.config import MODE_EQUAL, MODE_FIXED, MODE_ORIGINAL


def test_defaults_are_the_published_ones():
    c = CalibrationConfig()
    assert (c.variant, c.strength, c.basket_size, c.layers, c.pooling) == ("cls-soft", 0.5, 128, "last-half", "auto")
    assert c.self_weight == 0.3 and c.skip_short is True


@pytest.mark.parametrize(
    "pooling,iso", [("cls", (True, False)), ("last", (True, True)), ("mean", (False, False))]
)
def test_isolation_defaults_follow_pooling(pooling, iso):
    rc = CalibrationConfig(pooling=pooling).resolve()
    assert (rc.isolate_first, rc.isolate_last) == iso


def test_presets_resolve_to_weight_modes():
    u = CalibrationConfig(variant="uniform", pooling="last").resolve()
    assert (u.first_mode, u.last_mode) == (MODE_EQUAL, MODE_EQUAL)
    s = CalibrationConfig(variant="cls-soft", pooling="cls").resolve()
    assert (s.first_mode, s.last_mode) == (MODE_ORIGINAL, MODE_EQUAL)
    s_last = CalibrationConfig(variant="cls-soft", pooling="last").resolve()
    assert (s_last.first_mode, s_last.last_mode) == (MODE_EQUAL, MODE_ORIGINAL)
    h = CalibrationConfig(variant="cls-hard", pooling="last", self_weight=0.2).resolve()
    assert (h.first_mode, h.last_mode, h.last_weight) == (MODE_EQUAL, MODE_FIXED, 0.2)
    mean = CalibrationConfig(variant="cls-hard", pooling="mean", isolate_first=True).resolve()
    assert (mean.first_mode, mean.first_weight) == (MODE_FIXED, 0.3)  # the first token plays the pooling role


def test_explicit_weight_overrides():
    rc = CalibrationConfig(pooling="last", first_weight="original", last_weight=0.25).resolve()
    assert (rc.first_mode, rc.last_mode, rc.last_weight) == (MODE_ORIGINAL, MODE_FIXED, 0.25)
    assert CalibrationConfig(pooling="cls", first_weight="0.1").first_weight == 0.1


@pytest.mark.parametrize(
    "layers,n,expected",
    [
        ("last-half", 6, [3, 4, 5]),
        ("last-half", 7, [4, 5, 6]),
        ("last-half", 1, [0]),
        ("last", 12, [11]),
        ("all", 3, [0, 1, 2]),
        ([0, -1], 4, [0, 3]),
        ("1,-2", 5, [1, 3]),
    ],
)
def test_layer_selection(layers, n, expected):
    assert CalibrationConfig(layers=layers).layer_indices(n) == expected


def test_layer_out_of_range_is_reported_when_bound():
    cfg = CalibrationConfig(layers=[7])
    with pytest.raises(ValueError, match=r"layers: layer index 7 is out of range for a model with 6 layers"):
        cfg.layer_indices(6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"strength": 1.5}, r"strength: 1.5 is outside \[0, 1\]"),
        ({"strength": -0.1}, r"strength: .* outside \[0, 1\]"),
        ({"strength": math.nan}, r"strength: nan is outside \[0, 1\]"),
        ({"strength": "x"}, r"strength: 'x' is not a number"),
        ({"basket_size": 0}, r"basket_size: 0 is < 1"),
        ({"basket_size": 2.5}, r"basket_size: 2.5 is not an integer"),
        ({"variant": "soft"}, r"variant: 'soft' is not one of uniform, cls-soft, cls-hard"),
        ({"pooling": "max"}, r"pooling: 'max' is not one of cls, last, mean, auto"),
        ({"self_weight": -0.1}, r"self_weight: .* outside \[0, 1\)"),
        ({"first_weight": -0.5}, r"first_weight: fixed weight -0.5 is < 0"),
        ({"last_weight": "heavy"}, r"last_weight: 'heavy' is not 'equal', 'original' or a number"),
        ({"layers": "middle"}, r"layers: 'middle' is not one of last-half, last, all"),
        ({"layers": []}, r"layers: the list of layer indices is empty"),
        ({"pooling": "last", "first_weight": 0.6, "last_weight": 0.5}, r"fixed weights: .* sum to 1.1; they must sum to < 1"),
        ({"pooling": "last", "variant": "cls-hard", "self_weight": 0.5, "first_weight": 0.5}, r"sum to 1; they must sum to < 1"),
        ({"skip_short": "yes"}, r"skip_short: 'yes' is not a boolean"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CalibrationConfig(**kwargs)


def test_auto_pooling_must_be_resolved():
    with pytest.raises(ValueError, match="pooling: 'auto' must be resolved"):
        CalibrationConfig().resolve()
    assert CalibrationConfig().resolve("last").pool_last


def test_json_round_trip():
    for cfg in (
        CalibrationConfig(),
        CalibrationConfig(variant="cls-hard", strength=0.25, basket_size=16, layers=[0, -1], pooling="last",
                          self_weight=0.1, isolate_first=False, skip_short=False, first_weight="original"),
    ):
        assert CalibrationConfig.from_json(cfg.to_json()) == cfg


def test_from_dict_rejects_unknown_fields_and_bad_json():
    with pytest.raises(ValueError, match="unknown field"):
        CalibrationConfig.from_dict({"lambda": 0.5})
    with pytest.raises(ValueError, match="invalid calibration config JSON"):
        CalibrationConfig.from_json("{not json")
