"""attncal tune: the shared-prefix sweep against encoding from scratch, the hidden-state cache, the
recommendation rule on hand-made tables, the general-retrieval check, the command end to end and its
refusals."""

from __future__ import annotations

import importlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from attncal.calibration.config import CalibrationConfig
from attncal.eval.encoders import EncodeCache, TorchBackend
from attncal.eval.prefix_cache import HiddenCache
from attncal.eval.recommend import DO_NOT, Rule, recommend
from attncal.eval.sweep import encode_sweep

TOL = 1e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Random-weight models with a char-level tokenizer (one token per character): bert (cls pooling), qwen3
    (last pooling, left padding), distilbert (mean pooling) and t5 (its layers hand on a position bias)."""
    from attncal.synthetic import save_synthetic_model

    root = tmp_path_factory.mktemp("tune-tiny")
    return {a: save_synthetic_model(a, root / a, seed=1, max_positions=512)
            for a in ("bert", "qwen3", "distilbert", "t5")}


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 90))) for _ in range(n)]


GRID = [CalibrationConfig(strength=1.0, basket_size=32, layers="last"),
        CalibrationConfig(variant="uniform", strength=0.5, basket_size=64, layers="last-half"),
        CalibrationConfig(variant="cls-hard", strength=1.0, basket_size=200, layers=[1, 3]),
        CalibrationConfig(strength=0.0, basket_size=32, layers="all"),
        CalibrationConfig(variant="cls-hard", strength=1.0, basket_size=32, layers="last")]


def _sweep(model, texts, configs, hidden_root=None, batch_size=4):
    backend = TorchBackend(model, batch_size=batch_size)
    labels = [f"c{i}" for i in range(len(configs))]
    hidden = HiddenCache(hidden_root)
    out = encode_sweep(backend, texts, configs, labels, cache=EncodeCache(None), hidden=hidden, data_fp="fp",
                       budget_bytes=1 << 30, progress=False)
    out.hidden = hidden
    return backend, labels, out


@pytest.mark.parametrize("arch", ["bert", "qwen3", "distilbert", "t5"])
def test_shared_prefix_sweep_equals_encoding_from_scratch(tiny, arch):
    texts = _texts(13)
    backend, labels, out = _sweep(tiny[arch], texts, GRID)
    assert np.abs(out.embeddings["uncalibrated"] - backend.encode(texts, None)).max() <= TOL
    for label, cfg in zip(labels, GRID):
        assert np.abs(out.embeddings[label] - backend.encode(texts, cfg)).max() <= TOL, label
    lengths = np.array([len(t.replace(" ", "")) + (1 if arch in ("qwen3", "t5") else 2) for t in texts])
    runs = out.runs
    assert runs["c3"]["source"].startswith("uncalibrated") and runs["c3"]["passages_calibrated"] == 0  # λ = 0
    # a passage with less than one basket of content is left as it is, and not run
    n_iso = backend.bind(GRID[2]).resolve().n_isolated
    assert runs["c2"]["passages_calibrated"] == int(np.sum(lengths - n_iso >= 200)) < len(texts)
    t = out.timing
    if arch == "t5":  # the first layer's position bias reaches every layer: no layer can be skipped
        assert not t["resumed"] and any("cannot start" in n for n in out.notes)
        assert runs["c0"]["layers_run"] == 4
    else:
        assert t["resumed"] and t["start_layers"] == [1, 2, 3]
        assert runs["c0"]["layers_run"] == 1 and runs["c1"]["layers_run"] == 2 and runs["c2"]["layers_run"] == 3
    # cls-soft and cls-hard differ only in the isolated tokens' weights: mean pooling isolates none
    if backend.info.pooling == "mean":
        assert runs["c4"]["source"].startswith("same as c0")
    else:
        assert runs["c4"]["source"] == "computed"


def test_minilm_shared_prefix_equals_from_scratch():
    """all-MiniLM-L6-v2 (real weights, mean pooling) on real prose: every configuration starts at its first
    calibrated layer and matches the full encode."""
    from attncal.eval.realtext import python_reference_documents

    docs, _ = python_reference_documents()
    texts = [" ".join(d.text.split())[:1500] for d in docs[:6]]
    configs = [CalibrationConfig(strength=1.0, layers="last"), CalibrationConfig(strength=0.5, basket_size=64)]
    backend, labels, out = _sweep("default", texts, configs, batch_size=3)
    assert out.timing["resumed"] and out.timing["start_layers"] == [3, 5]
    for label, cfg in zip(labels, configs):
        assert out.runs[label]["passages_calibrated"] == len(texts)
        assert np.abs(out.embeddings[label] - backend.encode(texts, cfg)).max() <= TOL


def test_hidden_states_are_reused_and_a_damaged_entry_is_recomputed(tiny, tmp_path):
    texts = _texts(9, seed=3)
    configs = GRID[:2]
    root = tmp_path / "hidden"
    _, labels, first = _sweep(tiny["bert"], texts, configs, hidden_root=root)
    files = sorted(root.glob("*.npy"))
    assert len(files) == 2 and first.timing["factor"] is not None  # the inputs of layers 2 and 3
    _, _, again = _sweep(tiny["bert"], texts, configs, hidden_root=root)
    assert (again.hidden.hits, again.hidden.writes, first.hidden.writes) == (2, 0, 2)
    for label in labels:
        assert np.array_equal(again.embeddings[label], first.embeddings[label])
    raw = bytearray(files[0].read_bytes())
    raw[-5] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    _, _, repaired = _sweep(tiny["bert"], texts, configs, hidden_root=root)
    assert any("damaged and is recomputed" in n for n in repaired.notes)
    for label in labels:
        assert np.abs(repaired.embeddings[label] - first.embeddings[label]).max() <= TOL


def test_over_budget_cache_is_refused_before_encoding(tiny, tmp_path):
    from attncal.eval.sweep import Sweep

    backend = TorchBackend(tiny["bert"])
    with pytest.raises(ValueError, match="over the budget") as exc:
        Sweep(backend, _texts(5), GRID[:1], ["c0"], cache=EncodeCache(None), hidden=HiddenCache(tmp_path / "h"),
              data_fp="fp", budget_bytes=1000)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "h").exists() or not any((tmp_path / "h").iterdir())


# --------------------------------------------------------------------------- the rule, on hand-made tables
def _row(label, hm, ci, begin=0.0, psi=0.2):
    return {"label": label, "scores": {"psi": psi},
            "delta": {"hm": {"delta": hm, "ci": ci}, "group_begin": {"delta": begin, "ci": None},
                      "psi": {"delta": -0.01, "ci": [-0.02, 0.0]}}}


GROUPS = ("begin", "middle", "end")


def test_rule_clear_winner():
    rows = [_row("a", 0.010, [0.002, 0.018]), _row("b", 0.030, [0.012, 0.05], begin=-0.01),
            _row("c", 0.040, [-0.01, 0.09])]
    d = recommend(rows, GROUPS, Rule())
    assert d["recommended"] == "b" and d["decision"] == "calibrate"
    assert d["verdicts"] == {"a": "qualifies", "b": "qualifies", "c": "ΔHM interval includes 0"}


def test_rule_no_significant_gain():
    rows = [_row("a", 0.004, [-0.013, 0.022]), _row("b", -0.019, [-0.036, -0.003])]
    d = recommend(rows, GROUPS, Rule())
    assert d["decision"] == DO_NOT and d["recommended"] is None
    assert "no configuration raises HM significantly" in d["reason"] and "a's" in d["reason"]
    assert d["verdicts"]["b"] == "lowers HM"


def test_rule_gain_that_costs_the_beginning_too_much():
    rows = [_row("a", 0.04, [0.025, 0.057], begin=-0.029), _row("b", 0.01, [-0.01, 0.03])]
    d = recommend(rows, GROUPS, Rule())
    assert d["decision"] == DO_NOT and d["closest"] == "a"
    assert "costs the begin group more than 0.02" in d["reason"]
    assert recommend(rows, GROUPS, Rule(max_begin_loss=0.03))["recommended"] == "a"


def test_rule_ties_go_to_the_lowest_psi_then_grid_order():
    rows = [_row("a", 0.0300, [0.01, 0.05], psi=0.20), _row("b", 0.0295, [0.01, 0.05], psi=0.15),
            _row("c", 0.0250, [0.01, 0.05], psi=0.05), _row("d", 0.0295, [0.01, 0.05], psi=0.15)]
    d = recommend(rows, GROUPS, Rule(tie_margin=0.001))
    assert d["recommended"] == "b" and sorted(d["ties"]) == ["a", "d"]
    assert recommend(rows, GROUPS, Rule(tie_margin=0.0))["recommended"] == "a"
    assert recommend(rows, GROUPS, Rule(tie_margin=0.01))["recommended"] == "c"


# --------------------------------------------------------------------------- the general set
def test_shipped_general_set_loads_and_rebuilds():
    import platform

    from attncal.eval.general import EXAMPLE, build_reference_sections, load_general, shuffle_sentences

    data = load_general("example")
    manifest = json.loads((EXAMPLE / "manifest.json").read_text())
    assert data.groups == ("all",) and len(data.corpus) == manifest["documents"]
    assert len(data.query_ids()) == manifest["queries"] and "PSF-2.0" in manifest["source"]["license"]
    assert (EXAMPLE / "LICENSE-PSF.txt").is_file() and "PSF-2.0" in (EXAMPLE / "README.md").read_text()
    text = next(iter(data.corpus.values()))
    mixed = shuffle_sentences(text, random.Random(0))
    assert mixed != text and sorted(mixed.split()) == sorted(text.split())
    if platform.python_version() == manifest["source"]["python"]:
        corpus, queries, _, _ = build_reference_sections()
        assert [d["text"] for d in corpus] == list(data.corpus.values())
        assert [q["text"] for q in queries] == [data.queries[q] for q in data.queries]


def test_general_set_reads_beir_as_eval_does(posq_set, tmp_path):
    """--general reads a BEIR-layout set with eval's reader: one group, positions not needed, and a bad file
    fails naming the file and line."""
    from attncal.eval.data import DataError, load_dataset
    from attncal.eval.general import load_general

    root = _beir_from(posq_set, tmp_path / "beir")
    rows = (root / "queries.jsonl").read_text().splitlines()
    (root / "queries.jsonl").write_text("".join(
        json.dumps({k: v for k, v in json.loads(r).items() if k != "position"}) + "\n" for r in rows))
    data = load_general(root)
    assert data.groups == ("all",) and set(data.group.values()) == {"all"}
    assert sorted(data.query_ids()) == sorted(json.loads(r)["_id"] for r in rows)
    with pytest.raises(DataError, match="no relative position"):
        load_dataset(root)
    qrels = root / "qrels" / "test.tsv"
    qrels.write_text(qrels.read_text() + f"{json.loads(rows[0])['_id']}\tmissing-doc\t1\n")
    n = len(qrels.read_text().splitlines())
    with pytest.raises(DataError, match=rf"test\.tsv:{n}: corpus id 'missing-doc' is not in corpus\.jsonl"):
        load_general(root)


# --------------------------------------------------------------------------- the command
def _main(argv):
    from attncal.cli import main

    return main(["tune", *map(str, argv)])


@pytest.fixture(scope="module")
def posq_set(tmp_path_factory):
    from attncal.eval.synthetic_set import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("tune-data") / "posq", n_per_class=8, words=60)


def _beir_from(posq: Path, out: Path) -> Path:
    """The same set in the PosIR/BEIR layout, with each query's position."""
    position = {"beginning": 0.1, "middle": 0.5, "end": 0.9}
    passages = [json.loads(x) for x in (posq / "passages.jsonl").read_text().splitlines()]
    queries = [json.loads(x) for x in (posq / "queries.jsonl").read_text().splitlines()]
    (out / "qrels").mkdir(parents=True)
    (out / "corpus.jsonl").write_text("".join(json.dumps({"_id": p["id"], "text": p["text"]}) + "\n"
                                              for p in passages))
    (out / "queries.jsonl").write_text("".join(json.dumps({"_id": q["id"], "text": q["text"],
                                                           "position": position[q["span_class"]]}) + "\n"
                                               for q in queries))
    (out / "qrels" / "test.tsv").write_text("".join(f"{q['id']}\t{q['passage_id']}\t1\n" for q in queries))
    return out


def test_tune_on_a_posq_set_with_the_general_check(tiny, posq_set, tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("- {name: strong, strength: 1.0, basket_size: 32, layers: last}\n"
                    "- {name: soft, strength: 0.5, basket_size: 64}\n")
    out = tmp_path / "out"
    assert _main([tiny["bert"], "--data", posq_set, "-o", out, "--grid", grid, "--bootstrap", "200",
                  "--general", "example", "--shuffled", "--no-cache"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in res["rows"]] == ["uncalibrated", "strong", "soft"]
    rec = res["recommendation"]
    assert set(rec["verdicts"]) == {"strong", "soft"} and rec["closest"] in ("strong", "soft")
    for r in res["rows"][1:]:
        hm = r["delta"]["hm"]
        assert hm["ci"][0] <= hm["delta"] <= hm["ci"][1]
        assert r["verdict"] == rec["verdicts"][r["label"]]
    g = res["general"]
    assert [r["label"] for r in g["rows"]] == ["uncalibrated", rec["closest"]]
    assert g["dataset"]["queries"] == 135 and isinstance(g["flagged"], bool) and g["shuffled"]["rows"]
    assert g["rows"][1]["passages_calibrated"] > 0
    sweep = res["sweep"]
    assert sweep["resumed"] and sweep["start_layers"] == [2, 3] and sweep["factor"] > 0
    report = (out / "report.md").read_text()
    for part in ("## Recommendation", "The rule:", "## General retrieval", "sentences shuffled", res["command"],
                 "attncal export", "## What the sweep cost"):
        assert part in report, part
    assert (out / "delta_hm.png").stat().st_size > 0 and (out / "groups.png").stat().st_size > 0


def test_export_of_the_recommendation(tiny, posq_set, tmp_path, monkeypatch, capsys):
    """--export writes the recommended configuration and its uncalibrated twin, parity-checked, and prints the
    re-indexing command (the recommendation is fixed here: a random model's is whatever its weights give)."""
    tune_module = importlib.import_module("attncal.eval.tune")  # attncal.eval.tune is also the function

    real = tune_module.recommend

    def always(rows, groups, rule):
        return dict(real(rows, groups, rule), decision="calibrate", recommended="strong", closest="strong",
                    reason="forced by the test")

    monkeypatch.setattr(tune_module, "recommend", always)
    grid = tmp_path / "grid.yaml"
    grid.write_text("- {name: strong, strength: 1.0, basket_size: 32, layers: last}\n")
    out = tmp_path / "out"
    assert _main([tiny["bert"], "--data", posq_set, "-o", out, "--grid", grid, "--bootstrap", "50", "--no-cache",
                  "--no-plots", "--export", "--exporter", "torchscript"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["export"]["calibrated"]["parity_ok"] and res["export"]["uncalibrated"]["parity_ok"]
    meta = json.loads((out / "export-calibrated" / "attncal.json").read_text())
    assert meta["calibrated"] and meta["config"]["strength"] == 1.0 and meta["config"]["basket_size"] == 32
    assert not json.loads((out / "export-uncalibrated" / "attncal.json").read_text())["calibrated"]
    assert f"attncal encode {out / 'export-calibrated'} --input" in capsys.readouterr().out
    # From Python, the export step is the caller's (eval does not import the exporter): refused up front without it.
    with pytest.raises(ValueError, match=r"TuneOptions\(export=True\) needs tune\(\.\.\., export_step=\.\.\.\)"):
        tune_module.tune(tiny["bert"], posq_set, tune_module.TuneOptions(export=True), out=tmp_path / "py")
    assert not (tmp_path / "py").exists()


def test_tune_on_a_beir_layout_set_and_on_documents(tiny, posq_set, tmp_path):
    beir = _beir_from(posq_set, tmp_path / "beir")
    out = tmp_path / "out-beir"
    assert _main([tiny["bert"], "--data", str(beir), "-o", str(out), "--grid", "default", "--bootstrap", "100",
                  "--no-cache", "--no-plots"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["dataset"]["layout"] == "beir" and [r["label"] for r in res["rows"]][1:] == [
        "cls-soft λ0.5 b128 last-half"]
    docs = tmp_path / "docs"
    docs.mkdir()
    from attncal.eval.realtext import python_reference_documents

    for d in python_reference_documents()[0][:6]:
        (docs / (d.id.split(":")[1] + ".txt")).write_text(d.text)
    out = tmp_path / "out-docs"
    assert _main([tiny["bert"], "--docs", str(docs), "-o", str(out), "--grid", "default", "--bootstrap", "100",
                  "--cache", str(tmp_path / "cache"), "--no-plots"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["dataset"]["built_from_documents"] and (out / "set" / "posq.json").is_file()
    assert res["dataset"]["passages"] == len((out / "set" / "passages.jsonl").read_text().splitlines())
    assert "attncal eval --compare uncal cal --data " + str(out / "set") in (out / "report.md").read_text()
    assert any((tmp_path / "cache" / "hidden").glob("*.npy"))
    # the set it built is an `attncal eval --make-posq` set: --data takes it, and the caches serve the rerun
    again = tmp_path / "out-again"
    assert _main([tiny["bert"], "--data", out / "set", "-o", again, "--grid", "default", "--bootstrap", "100",
                  "--cache", tmp_path / "cache", "--no-plots"]) == 0
    rerun = json.loads((again / "results.json").read_text())
    assert [(r["scores"], r["delta"]) for r in rerun["rows"]] == [(r["scores"], r["delta"]) for r in res["rows"]]
    assert rerun["cache"]["misses"] == 0 and {r["run"]["source"] for r in rerun["rows"]} == {"cache"}
    assert rerun["sweep"]["factor"] is None and any("came from the cache" in n for n in rerun["notes"])


def _refused(capsys, argv, match, out):
    assert _main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert not out.exists()


def test_bad_input_is_refused_with_one_line(tiny, posq_set, tmp_path, capsys):
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(capsys, [tiny["bert"], "--docs", str(empty), "-o", str(out)], "no .txt, .md or .rst files", out)
    grid = tmp_path / "g.yaml"
    grid.write_text("- {strength: 0.5, colour: red}\n")
    _refused(capsys, [tiny["bert"], "--data", str(posq_set), "-o", str(out), "--grid", str(grid)],
             "unknown field(s) colour", out)
    grid.write_text("- {strength: 0.5, basket_size: 600}\n- {strength: 1.0, basket_size: 1024}\n")
    _refused(capsys, [tiny["bert"], "--data", str(posq_set), "-o", str(out), "--grid", str(grid)],
             "maximum length (512 tokens) is shorter than one basket", out)
    _refused(capsys, [tiny["bert"], "--data", str(posq_set), "-o", str(out), "--grid", "default",
                      "--cache-budget", "0.000001", "--no-cache"], "over the budget", out)
    _refused(capsys, [tiny["bert"], "-o", str(out)], "give the set as one of", out)
