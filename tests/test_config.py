"""CalibrationConfig: defaults, presets, layer selection, validation and JSON round-trip."""

from __future__ import annotations

import math

import pytest

from attncal.calibration import CalibrationConfig
from attncal.calibration.config import MODE_EQUAL, MODE_FIXED, MODE_ORIGINAL
from attncal.pooling import Pooling


def test_defaults_are_the_published_ones():
    c = CalibrationConfig()
    assert (c.variant, c.strength, c.basket_size, c.layers, c.pooling) == ("cls-soft", 0.5, 128, "last-half",
                                                                           Pooling("auto"))
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
        ({"pooling": "max"}, r"pooling: 'max' is not one of cls, mean, last, lmk, multi-cls, mean-every, auto$"),
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
    with pytest.raises(ValueError, match="pooling: auto must be resolved"):
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


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"pooling": {"kind": "lmk", "token_id": -2}}, r"pooling: the landmark token id must be an integer >= 0"),
        ({"pooling": {"kind": "mean-every", "every": 0}}, r"pooling: mean-every needs k"),
        ({"pooling": {"kind": "lmk", "token_id": 3}, "variant": "cls-hard", "self_weight": 0.5, "first_weight": 0.5},
         r"fixed weights: .* sum to 1; they must sum to < 1"),
    ],
)
def test_row_set_pooling_fields_are_validated(kwargs, match):
    with pytest.raises(ValueError, match="^invalid calibration config: " + match):
        CalibrationConfig.from_dict(kwargs)
    with pytest.raises(ValueError, match=r"^invalid calibration config: pooling: --pooling landmark: name its style"):
        CalibrationConfig(pooling="landmark")


@pytest.mark.parametrize("old, match", [
    ({"pooling": "landmark", "pool_token_id": -2}, r"pool_token_id -2 is not an integer >= -1"),
    ({"pooling": "landmark", "pool_token_id": 1.5}, r"pool_token_id 1.5 is not an integer"),
    ({"pooling": "mean-every", "pool_every": True}, r"pool_every True is not an integer >= 0"),
    ({"pooling": "cls", "pool_token_id": 102}, r"pool_token_id is set \(102\) but pooling is 'cls'"),
    ({"pooling": "auto", "pool_every": 4}, r"pool_every is set \(4\) but pooling is 'auto'"),
])
def test_old_row_set_fields_are_validated(old, match):
    with pytest.raises(ValueError, match="invalid calibration config: pooling: " + match):
        CalibrationConfig.from_dict(old)


def test_old_config_json_reads():
    """Before `Pooling`, the config spelled landmark pooling `landmark` with `pool_token_id`, Mean@k `mean-every`
    with `pool_every`; the word alone for the others."""
    base = CalibrationConfig(variant="cls-hard").to_dict()
    old = dict(base, pooling="landmark", pool_token_id=102, pool_every=0)
    assert CalibrationConfig.from_dict(old).pooling == Pooling("lmk", token_id=102)
    old = dict(base, pooling="mean-every", pool_token_id=-1, pool_every=8)
    assert CalibrationConfig.from_dict(old).pooling == Pooling("mean-every", 8)
    assert CalibrationConfig.from_dict(dict(base, pooling="cls")).pooling == Pooling("cls")
    with pytest.raises(ValueError, match="unknown field"):  # the old fields go with the old form only
        CalibrationConfig.from_dict(dict(base, pooling={"kind": "cls"}, pool_every=0))


def test_landmark_pooling_needs_its_token_to_resolve():
    unbound = CalibrationConfig(pooling="lmk")  # an export binds the model's SEP (or CLS) later
    with pytest.raises(ValueError, match="pooling: lmk pooling needs the landmark token's id"):
        unbound.resolve()
    rc = CalibrationConfig(pooling=Pooling("lmk", token_id=7)).resolve()
    assert rc.row_set and not rc.all_rows and rc.pooling.token_id == 7


@pytest.mark.parametrize(
    "variant,self_mode,self_weight",
    [("uniform", MODE_EQUAL, 0.0), ("cls-soft", MODE_ORIGINAL, 0.0), ("cls-hard", MODE_FIXED, 0.3)],
)
def test_landmark_rows_isolate_their_own_key_with_the_variant_share(variant, self_mode, self_weight):
    rc = CalibrationConfig(variant=variant, pooling=Pooling("multi-cls", token_id=7)).resolve()
    assert (rc.isolate_first, rc.isolate_last, rc.isolate_self) == (True, False, True)
    assert (rc.self_mode, rc.self_weight) == (self_mode, self_weight)
    assert (rc.first_mode, rc.last_mode) == (MODE_EQUAL, MODE_EQUAL)  # not the pooling token: equal


def test_mean_every_calibrates_like_mean():
    every = CalibrationConfig(variant="cls-hard", pooling=Pooling("mean-every", 4)).resolve()
    mean = CalibrationConfig(variant="cls-hard", pooling="mean").resolve()
    assert every.row_set and not every.isolate_self and every.pooling.every == 4
    fields = ("isolate_first", "isolate_last", "first_mode", "first_weight", "last_mode", "last_weight")
    assert [getattr(every, f) for f in fields] == [getattr(mean, f) for f in fields]


def test_row_masks_pick_landmarks_and_every_kth_valid_token():
    torch = pytest.importorskip("torch")
    ids = torch.tensor([[0, 0, 101, 5, 102, 6, 7, 102], [101, 102, 5, 6, 102, 102, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]])
    lmk = CalibrationConfig(pooling=Pooling("lmk", token_id=102)).resolve().row_mask(ids, mask)
    assert lmk.tolist() == (ids.eq(102) & mask.bool()).tolist()
    assert lmk[1, 5].item() is False  # a landmark id under padding is not a row
    every = CalibrationConfig(pooling=Pooling("mean-every", 2)).resolve().row_mask(ids, mask)
    every_second_valid = [torch.nonzero(mask[b]).flatten().tolist()[1::2] for b in range(2)]  # k-1, 2k-1, ...
    assert [torch.nonzero(every[b]).flatten().tolist() for b in range(2)] == every_second_valid
    with pytest.raises(ValueError, match="mean pooling has no row mask"):
        CalibrationConfig(pooling="mean").resolve().row_mask(ids, mask)


def test_row_set_pooling_round_trips_through_json():
    for cfg in (CalibrationConfig(pooling=Pooling("lmk", 32, "[SEP]", 102), variant="cls-hard"),
                CalibrationConfig(pooling=Pooling("multi-cls", "sentence", "[CLS]", 101)),
                CalibrationConfig(pooling=Pooling("mean-every", 8), basket_size=16),
                CalibrationConfig.off(Pooling("lmk", token_id=2))):
        assert CalibrationConfig.from_json(cfg.to_json()) == cfg
