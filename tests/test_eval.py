"""attncal eval: metrics on hand-made rankings, loaders and their errors, the encode cache, end-to-end runs."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from attncal.calibration.config import CalibrationConfig
from attncal.eval import DataError, exact_search, group_scores, harmonic_mean, load_dataset, make_passages, psi
from attncal.eval.encoders import EncodeCache, TorchBackend, chunk_texts
from attncal.eval.synthetic_set import write_synthetic

DATA = Path(__file__).parent / "data" / "eval"


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """One random-weight BERT with a char-level tokenizer (one token per character), max 256 tokens."""
    from attncal.synthetic import save_synthetic_model

    return save_synthetic_model("bert", tmp_path_factory.mktemp("tiny") / "bert", seed=1, max_positions=256)


def _cli(argv: list[str]) -> int:
    from attncal.cli import eval as ev

    p = argparse.ArgumentParser()
    ev.add_arguments(p)
    return ev.run(p.parse_args(argv))


# --------------------------------------------------------------------------- metrics
def test_group_metrics_on_hand_made_rankings():
    qrels = {q: {"rel": 1} for q in "abcde"}
    run = {
        "a": {"rel": 3.0, "x": 2.0},  # rank 1 -> nDCG 1
        "b": {"x": 3.0, "y": 2.0, "rel": 1.0},  # rank 3 -> 1/log2(4) = 0.5
        "c": {"x": 3.0, "y": 2.0, "rel": 1.5},  # rank 3 -> 0.5
        "d": {"x": 1.0},  # not retrieved -> 0
        "e": {"rel": 5.0},  # rank 1 -> 1
    }
    group = {"a": "begin", "b": "begin", "c": "middle", "d": "end", "e": "end"}
    s = group_scores(qrels, run, group, ("begin", "middle", "end"))
    assert s.groups == pytest.approx({"begin": 0.75, "middle": 0.5, "end": 0.5})
    assert s.counts == {"begin": 2, "middle": 1, "end": 2}
    assert s.hm == pytest.approx(3 / (1 / 0.75 + 2 / 0.5))  # 0.5625
    assert s.psi == pytest.approx(1 - 0.5 / 0.75)
    assert s.ndcg10 == pytest.approx(0.6)
    assert s.recall10 == pytest.approx(0.8)


def test_rank_two_and_graded_qrels_are_binary():
    # rank 2 -> 1/log2(3); a grade of 2 counts like 1 (binary relevance)
    s = group_scores({"a": {"r": 2}}, {"a": {"x": 2.0, "r": 1.0}}, {"a": "begin"}, ("begin", "middle", "end"))
    assert s.groups["begin"] == pytest.approx(1 / math.log2(3))
    assert list(s.groups) == ["begin"]  # empty groups are left out, not scored 0


def test_hm_and_psi_edge_cases():
    assert harmonic_mean([0.5, 0.0, 1.0]) == 0.0
    assert psi([0.8, 0.8, 0.8]) == 0.0
    assert math.isnan(psi([0.0, 0.0]))
    assert psi([0.2, 0.8]) == pytest.approx(0.75)


def test_exact_search_orders_by_cosine_and_caps_k():
    c = np.array([[1, 0], [0, 1], [1, 1]], dtype=np.float32)
    q = np.array([[2, 0.1]], dtype=np.float32)
    run = exact_search(q, c, ["q"], ["a", "b", "c"], k=2)
    assert set(run["q"]) == {"a", "c"}
    assert run["q"]["a"] > run["q"]["c"]
    assert len(exact_search(q, c, ["q"], ["a", "b", "c"], k=100)["q"]) == 3


# --------------------------------------------------------------------------- loaders
def test_load_posq_fixture():
    ds = load_dataset(DATA / "posq")
    assert ds.layout == "fineweb-posq"
    assert len(ds.corpus) == 3 and ds.query_ids() == ["q1", "q2", "q3"]
    assert ds.group == {"q1": "begin", "q2": "middle", "q3": "end"}
    assert ds.qrels["q2"] == {"p2": 1}


def test_load_beir_fixture_groups_positions_into_thirds():
    ds = load_dataset(DATA / "beir")
    assert ds.layout == "beir"
    assert ds.corpus["d1"].startswith("Violins. ")
    assert ds.group == {"q1": "begin", "q2": "middle", "q3": "end", "q4": "middle"}
    assert ds.qrels["q4"] == {"d1": 1}  # score 0 is not relevant
    assert "q5" not in ds.query_ids() and any("without relevant" in n for n in ds.notes)
    ds4 = load_dataset(DATA / "beir", n_groups=4)
    assert ds4.groups == ("g1of4", "g2of4", "g3of4", "g4of4")
    assert ds4.group["q4"] == "g2of4" and ds4.group["q3"] == "g4of4"


def test_load_posq_flat(tmp_path):
    rows = [
        {"question": "Q1?", "content": "passage A", "span_class": ["beginning"]},
        {"question": "Q2?", "content": "passage A", "span_class": "end"},
        {"question": "Q3?", "content": "passage B", "span_class": ["middle", "end"]},
    ]
    (tmp_path / "posq.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    ds = load_dataset(tmp_path)
    assert len(ds.corpus) == 1 and len(ds.queries) == 2
    assert sorted(ds.group.values()) == ["begin", "end"]
    assert "1 rows" in ds.notes[0]


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(DATA / name, dst)
    return dst


def _append(path: Path, line: str) -> None:
    with open(path, "a") as fh:
        fh.write(line + "\n")


@pytest.mark.parametrize(
    "layout, file, line, match",
    [
        ("posq", "passages.jsonl", "{not json", r"passages\.jsonl:4: invalid JSON"),
        ("posq", "passages.jsonl", '{"id": "p9"}', r"passages\.jsonl:4: missing field 'text'"),
        ("posq", "passages.jsonl", '{"id": "p1", "text": "again"}', r"passages\.jsonl:4: duplicate passage id"),
        ("posq", "queries.jsonl", '{"id": "q9", "text": "x", "passage_id": "p1", "span_class": "late"}',
         r"queries\.jsonl:5: span_class 'late'"),
        ("posq", "queries.jsonl", '{"id": "q9", "text": "x", "passage_id": "nope", "span_class": "end"}',
         r"queries\.jsonl:5: passage_id 'nope' is not in passages\.jsonl"),
        ("posq", "queries.jsonl", "[1, 2]", r"queries\.jsonl:5: expected a JSON object"),
        ("beir", "corpus.jsonl", '{"_id": "d9", "text": 3.5e}', r"corpus\.jsonl:5: invalid JSON"),
        ("beir", "queries.jsonl", '{"_id": "q9", "text": "x", "position": 1.5}', r"queries\.jsonl:6: position 1\.5"),
        ("beir", "qrels/test.tsv", "q1\td1", r"test\.tsv:7: expected 3 tab-separated columns"),
        ("beir", "qrels/test.tsv", "q1\td99\t1", r"test\.tsv:7: corpus id 'd99' is not in corpus\.jsonl"),
        ("beir", "qrels/test.tsv", "q1\td1\thigh", r"test\.tsv:7: score 'high' is not a number"),
        ("beir", "positions.tsv", "q1\tlate", r"positions\.tsv:4: position 'late' is not a number"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path, layout, file, line, match):
    root = _copy(tmp_path, layout)
    _append(root / file, line)
    with pytest.raises(DataError, match=match):
        load_dataset(root)


def test_missing_files_and_positions(tmp_path):
    with pytest.raises(DataError, match="data directory not found"):
        load_dataset(tmp_path / "nowhere")
    with pytest.raises(DataError, match="no corpus.jsonl"):
        load_dataset(tmp_path)
    root = _copy(tmp_path, "posq")
    (root / "queries.jsonl").unlink()
    with pytest.raises(DataError, match=r"queries\.jsonl: file not found"):
        load_dataset(root)
    beir = _copy(tmp_path, "beir")
    (beir / "positions.tsv").unlink()
    with pytest.raises(DataError, match=r"queries\.jsonl: 2 judged queries have no relative position"):
        load_dataset(beir)
    with pytest.raises(DataError, match=r"qrels/dev\.tsv: file not found"):
        load_dataset(_copy(tmp_path / "x", "beir"), split="dev")


# --------------------------------------------------------------------------- synthetic set
def test_synthetic_set_is_deterministic_and_plants_facts_where_labelled(tmp_path):
    p1, q1 = make_passages(5, words=60, seed=3)
    p2, q2 = make_passages(5, words=60, seed=3)
    assert (p1, q1) == (p2, q2)
    assert make_passages(5, words=60, seed=4) != (p1, q1)
    assert len({q["text"] for q in q1}) == 15  # every planted fact is unique
    for p, q in zip(p1, q1):
        s, e = q["span"]
        fact = p["text"][s:e]
        assert fact.startswith(tuple(__import__("attncal.eval.synthetic_set", fromlist=["NAMES"]).NAMES))
        if q["span_class"] == "beginning":
            assert s == 0
        elif q["span_class"] == "end":
            assert e == len(p["text"])
        else:
            assert 0.25 < q["position"] < 0.75
    out = write_synthetic(tmp_path / "syn", n_per_class=2, words=30)
    ds = load_dataset(out)
    assert len(ds.corpus) == 6 and sorted(ds.group.values()) == ["begin"] * 2 + ["end"] * 2 + ["middle"] * 2
    with pytest.raises(FileExistsError):
        write_synthetic(out, n_per_class=2, words=30)


# --------------------------------------------------------------------------- cache and chunking
def test_encode_cache_is_invalidated_when_the_config_changes(tmp_path, tiny_bert):
    backend = TorchBackend(tiny_bert)
    texts = [f"{i} " + "abcdefgh " * 25 for i in range(3)]  # ~230 chars = tokens: over one 128 basket
    calls: list = []

    def enc(cfg):
        def compute():
            calls.append(cfg)
            return backend.encode(texts, cfg)
        return compute

    cache = EncodeCache(tmp_path / "cache")
    a = CalibrationConfig(strength=0.5)
    b = CalibrationConfig(strength=1.0)
    e1 = cache.get_or_encode(backend, a, "data1", "corpus", enc(a))
    e2 = cache.get_or_encode(backend, a, "data1", "corpus", enc(a))
    assert len(calls) == 1 and np.array_equal(e1, e2) and cache.hits == 1
    e3 = cache.get_or_encode(backend, b, "data1", "corpus", enc(b))
    assert len(calls) == 2 and not np.allclose(e1, e3)  # new config: recomputed, and it matters
    cache.get_or_encode(backend, CalibrationConfig(strength=0.5, basket_size=64), "data1", "corpus", enc(None))
    cache.get_or_encode(backend, a, "data2", "corpus", enc(a))  # other data
    assert len(calls) == 4
    # `auto` pooling and the model's explicit pooling are the same config
    cache.get_or_encode(backend, CalibrationConfig(strength=0.5, pooling=backend.info.pooling), "data1", "corpus",
                        enc(a))
    assert len(calls) == 4
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 4


def test_chunk_texts_covers_every_passage(tiny_bert):
    backend = TorchBackend(tiny_bert)
    texts = ["short one.", "First sentence here. " * 6 + "Tail."]
    chunks, owner, name = chunk_texts(backend, texts, 48)
    assert owner[0] == 0 and chunks[0] == "short one." and owner.count(1) >= 2
    for c, o in zip(chunks, owner):
        assert c in texts[o]  # exact substrings of the passage, never decoded text
        assert len(c) <= 48  # one token per character in the tiny tokenizer
    assert "".join(c for c, o in zip(chunks, owner) if o == 1).replace(" ", "") == texts[1].replace(" ", "")
    assert name.startswith("chonkie")


# --------------------------------------------------------------------------- end to end
def _rows(out: Path) -> dict:
    return {r["label"]: r for r in json.loads((out / "results.json").read_text())["rows"]}


def test_end_to_end_tiny_model(tmp_path, tiny_bert, capsys):
    data = tmp_path / "data"
    assert _cli(["--make-synthetic", str(data), "--synthetic-per-class", "4", "--synthetic-words", "40"]) == 0
    out, cache = tmp_path / "out", tmp_path / "cache"
    argv = [str(tiny_bert), "--data", str(data), "--strength", "0,1", "--baselines", "sea",
            "--sea-chunk-tokens", "64", "--out", str(out), "--cache", str(cache), "--length-buckets", "200"]
    assert _cli(argv) == 0
    printed = capsys.readouterr().out
    assert "| config | begin | mid | end | HM | PSI |" in printed
    rows = _rows(out)
    assert list(rows) == ["uncalibrated", "λ=0", "λ=1", "SEA (64-token chunks)"]
    # strength 0 is the identity: same ranking, so exactly the uncalibrated scores and zero deltas
    assert rows["λ=0"]["scores"] == rows["uncalibrated"]["scores"]
    assert all(v == 0 for v in rows["λ=0"]["delta"].values())
    d = rows["λ=1"]["delta"]
    assert d["hm"] == pytest.approx(rows["λ=1"]["scores"]["hm"] - rows["uncalibrated"]["scores"]["hm"])
    assert set(rows["λ=1"]["by_length"]) <= {"<200", ">=200"}
    assert {p.name for p in out.iterdir()} == {"results.md", "results.json", "ndcg_vs_strength.png",
                                               "hm_psi_vs_strength.png", "attention_baskets.png"}
    assert (out / "ndcg_vs_strength.png").read_bytes()[:4] == b"\x89PNG"
    # truncation is counted with the tokenizer (one token per non-space character here, plus CLS/SEP)
    texts = [json.loads(line)["text"] for line in (data / "passages.jsonl").read_text().splitlines()]
    trunc = json.loads((out / "results.json").read_text())["dataset"]["truncation"]
    assert trunc["max_length"] == 256 and trunc["passages"] == len(texts)
    assert trunc["passages_truncated"] == sum(len(t.replace(" ", "")) + 2 > 256 for t in texts)
    assert "## Length and truncation" in (out / "results.md").read_text()
    # a second run into the same OUT needs --overwrite; with it, every embedding comes from the cache
    with pytest.raises(FileExistsError):
        _cli(argv)
    assert _cli(argv + ["--overwrite"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["cache"]["misses"] == 0 and res["cache"]["hits"] == 5


def test_end_to_end_minilm_with_a_yaml_grid(tmp_path):
    from attncal.modelinfo import default_model_path

    model = default_model_path()
    data = write_synthetic(tmp_path / "data", n_per_class=3, words=200)
    grid = tmp_path / "grid.yaml"
    grid.write_text("- {strength: 0.0, basket_size: 64}\n- name: full\n  strength: 1.0\n  basket_size: 64\n")
    out = tmp_path / "out"
    assert _cli(["default", "--data", str(data), "--configs", str(grid), "--out", str(out), "--no-cache"]) == 0
    res = json.loads((out / "results.json").read_text())
    rows = {r["label"]: r for r in res["rows"]}
    assert list(rows) == ["uncalibrated", "λ=0 basket=64", "full"]
    assert rows["full"]["config"]["pooling"] == {"kind": "mean"} and rows["full"]["config"]["basket_size"] == 64
    assert rows["λ=0 basket=64"]["scores"] == rows["uncalibrated"]["scores"]
    assert res["dataset"]["queries_per_group"] == {"begin": 3, "middle": 3, "end": 3}
    # the attention plot's data: at λ=1 with mean pooling every basket gets an equal share
    ex = res["attention_example"]
    assert ex["config"] == "full" and ex["calibrated"] and len(ex["after"]) >= 3
    assert ex["after"] == pytest.approx([1 / len(ex["after"])] * len(ex["after"]), abs=1e-5)
    assert sum(ex["before"]) == pytest.approx(1.0, abs=1e-5)
    assert str(model) and (out / "attention_baskets.png").exists()


def test_export_evaluates_its_stored_config_only(tmp_path, tiny_bert):
    from attncal.cli import CLIError
    from attncal.eval.encoders import OnnxBackend
    from attncal.exporting.exporter import ExportOptions, export

    cfg = CalibrationConfig(strength=1.0)
    exp = tmp_path / "exp"
    export(tiny_bert, exp, ExportOptions(config=cfg, calibrate=True, exporter="torchscript", check=False), quiet=True)
    data = write_synthetic(tmp_path / "data", n_per_class=2, words=40)
    texts = [json.loads(line)["text"] for line in (data / "passages.jsonl").read_text().splitlines()]
    onnx_emb = OnnxBackend(exp).encode(texts, cfg)
    torch_emb = TorchBackend(tiny_bert).encode(texts, cfg)
    assert np.min(np.sum(onnx_emb * torch_emb, axis=1)) > 0.9999
    with pytest.raises(ValueError, match="Only the stored config can be evaluated"):
        OnnxBackend(exp).encode(texts, CalibrationConfig(strength=0.5))
    with pytest.raises(CLIError, match="only its stored calibration"):
        _cli([str(exp), "--data", str(data), "--strength", "0.5"])
    out = tmp_path / "out"
    assert _cli([str(exp), "--data", str(data), "--out", str(out), "--no-cache"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in res["rows"]] == ["uncalibrated", "λ=1 pooling=cls"]  # as stored in attncal.json
    assert res["backend"] == "onnx" and res["rows"][1]["config"]["strength"] == 1.0
    assert any("source model" in n for n in res["notes"])


def test_cli_user_errors(tmp_path):
    from attncal.cli import CLIError

    with pytest.raises(CLIError, match="give MODEL and --data"):
        _cli(["default"])
    grid = tmp_path / "g.yaml"
    grid.write_text("- strength: 0.5\n")
    with pytest.raises(CLIError, match="exclusive"):
        _cli(["default", "--data", str(DATA / "posq"), "--configs", str(grid), "--strength", "0,1"])
    grid.write_text("- strength: 0.5\n- basket_size: 0\n")
    with pytest.raises(ValueError, match=r"g\.yaml: item 2: invalid calibration config: basket_size"):
        _cli(["default", "--data", str(DATA / "posq"), "--configs", str(grid)])
    grid.write_text("- strength: [0.5\n")
    with pytest.raises(ValueError, match=r"g\.yaml:2: invalid YAML"):
        _cli(["default", "--data", str(DATA / "posq"), "--configs", str(grid)])
    with pytest.raises(ValueError, match="unknown baseline"):
        _cli(["default", "--data", str(DATA / "posq"), "--strength", "1", "--baselines", "bm25"])
    with pytest.raises(SystemExit):
        _cli(["default", "--data", str(DATA / "posq"), "--strength", "0,x"])
