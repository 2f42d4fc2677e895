"""`attncal.pooling.Pooling`: the CLI form, the JSON form and the old attncal.json form give the same value."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attncal.pooling import DEFAULT_EVERY, DEFAULT_MEAN_EVERY, KINDS, Pooling

EVERY_KIND = [Pooling.parse("cls"), Pooling.parse("mean"), Pooling.parse("last"), Pooling.parse("auto"),
              Pooling.parse("lmk", every="32", token="[SEP]"), Pooling.parse("lmk", every="sentence"),
              Pooling("lmk", 128, "[SEP]", 102), Pooling.parse("multi-cls", every=16),
              Pooling("multi-cls", "sentence", "[CLS]", 101), Pooling.parse("mean-every", every="8"),
              Pooling.parse("mean-every")]


def test_every_kind_is_covered():
    assert {p.kind for p in EVERY_KIND} == set(KINDS) | {"auto"}


@pytest.mark.parametrize("pooling", EVERY_KIND, ids=Pooling.describe)
def test_round_trip_parse_to_json_from_json(pooling):
    data = json.loads(json.dumps(pooling.to_json()))
    assert Pooling.from_json(data) == pooling
    assert Pooling.parse(pooling.kind, pooling.every, pooling.token).to_json() == \
        {k: v for k, v in data.items() if k != "token_id"}


def test_defaults_and_parameters_of_other_kinds():
    assert Pooling.parse("lmk").every == DEFAULT_EVERY
    assert Pooling.parse("mean-every").every == DEFAULT_MEAN_EVERY
    # the flags of the landmark kinds do not reach the kinds that take none
    assert Pooling.parse("cls", every="32", token="[SEP]") == Pooling("cls")
    assert Pooling.parse("mean-every", every="4", token="[SEP]") == Pooling("mean-every", 4)


@pytest.mark.parametrize("make, message", [
    (lambda: Pooling.parse("landmark"), "name its style, lmk"),
    (lambda: Pooling.parse("max"), "'max' is not one of cls, mean, last, lmk"),
    (lambda: Pooling.parse("lmk", every="0"), "--lmk-every must be a whole number"),
    (lambda: Pooling.parse("lmk", every="words"), "--lmk-every must be a whole number"),
    (lambda: Pooling.parse("mean-every", every="sentence"), "mean-every needs k"),
    (lambda: Pooling("cls", every=3), "cls takes no chunk size"),
    (lambda: Pooling("mean-every", token="[SEP]"), "inserts no token"),
    (lambda: Pooling("lmk", token_id=-1), "token id must be an integer >= 0"),
    (lambda: Pooling.from_json({"kind": "lmk", "style": "lmk"}), "unknown field(s) style"),
    (lambda: Pooling.from_json({"every": 3}), "missing field 'kind'"),
    (lambda: Pooling.from_json(["cls"]), "expected an object, got list"),
    (lambda: Pooling.from_json("landmark"), "needs its pooling_spec"),
    (lambda: Pooling.from_json("cls", {"style": "lmk"}), "takes no pooling_spec"),
    (lambda: Pooling.from_json("mean-every", {"style": "lmk", "token_id": 3}), "does not fit pooling"),
])
def test_one_line_errors_name_the_problem(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_old_attncal_json_form_reads():
    """Format 2 spelled the pooling as a word plus `pooling_spec` {style, every, token, token_id}."""
    assert Pooling.from_json("cls") == Pooling("cls")
    old = {"style": "multi-cls", "every": "sentence", "token": "[CLS]", "token_id": 101}
    assert Pooling.from_json("landmark", old) == Pooling("multi-cls", "sentence", "[CLS]", 101)
    assert Pooling.from_json("mean-every", {"style": "mean-every", "every": 8}) == Pooling("mean-every", 8)


def test_resolve_finds_the_kinds_default_token():
    class Tok:
        sep_token, cls_token, unk_token, unk_token_id = "[SEP]", "[CLS]", "[UNK]", 100

        def convert_tokens_to_ids(self, token):
            return {"[SEP]": 102, "[CLS]": 101}.get(token, 100)

    assert Pooling.parse("lmk").resolve(Tok()) == Pooling("lmk", 64, "[SEP]", 102)
    assert Pooling.parse("multi-cls", 8).resolve(Tok()) == Pooling("multi-cls", 8, "[CLS]", 101)
    assert Pooling.parse("mean").resolve(Tok()) == Pooling("mean")
    with pytest.raises(ValueError, match="not a token of the model's vocabulary"):
        Pooling.parse("lmk", token="nope").resolve(Tok())


def test_row_mask():
    ids = np.array([[5, 9, 7, 9, 0], [9, 4, 4, 0, 0]])
    mask = (ids != 0).astype(np.int64)
    assert Pooling("lmk", token_id=9).row_mask(ids, mask).tolist() == [[0, 1, 0, 1, 0], [1, 0, 0, 0, 0]]
    assert Pooling("mean-every", 2).row_mask(ids, mask).tolist() == [[0, 1, 0, 1, 0], [0, 1, 0, 0, 0]]
    assert Pooling("mean-every", 5).row_mask(ids, mask).tolist() == [[0, 0, 0, 1, 0], [0, 0, 1, 0, 0]]
    with pytest.raises(ValueError, match="resolved"):
        Pooling("lmk").row_mask(ids, mask)
    with pytest.raises(ValueError, match="no row mask"):
        Pooling("mean").row_mask(ids, mask)


# The forms pooling travelled in before `Pooling`: identifiers that must not come back in attncal/ (the old
# attncal.json and config forms are read as dictionary keys, i.e. strings, which this does not look at).
OLD_FORMS = {"PoolingSpec", "pooling_spec", "pool_token_id", "pool_every", "pooling_head", "PooledConfig",
             "config_fields", "ROW_SET_POOLINGS", "POOLING_CHOICES"}


def old_pooling_forms(source: str) -> list[str]:
    """Where `source` names one of `OLD_FORMS` (a name, an attribute, a parameter or keyword, a definition), or
    writes a parsed pooling back into the argparse namespace (`args.pooling = ...`)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        names = {getattr(node, "id", None), getattr(node, "attr", None), getattr(node, "arg", None),
                 getattr(node, "name", None) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None}
        found += [f"line {node.lineno}: {n}" for n in names & OLD_FORMS]
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in (e for target in targets for e in ast.walk(target)):
                if isinstance(t, ast.Attribute) and t.attr == "pooling" and getattr(t.value, "id", None) == "args":
                    found.append(f"line {node.lineno}: args.pooling written back")
    return found


def test_pooling_travels_as_one_value_in_the_package():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "attncal"
    found = [f"{p.relative_to(root.parent)} {hit}" for p in sorted(root.rglob("*.py"))
             for hit in old_pooling_forms(p.read_text(encoding="utf-8"))]
    assert not found, found


def test_the_old_form_check_can_fail():
    assert sorted(old_pooling_forms("spec = PoolingSpec('lmk')\nx.pool_token_id\nf(pooling_spec=1)\n")) == [
        "line 1: PoolingSpec", "line 2: pool_token_id", "line 3: pooling_spec"]
    assert old_pooling_forms("(args.pooling, spec), = choices(args)\n") == ["line 1: args.pooling written back"]
