"""Landmark (LMK), multi-CLS and Mean@k pooling: where the landmarks go, that every place that tokenizes places
them alike (Encoder on either tokenizer backend, the Triton tokenizer model, `attncal encode`, the evaluation, and
the parity check's independent reference), and the exported graphs against that reference on every architecture
and graph.  Triton serving with a real server: tests/test_landmark_serving.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import types

import numpy as np
import pytest

from attncal.artifact import read_metadata
from attncal.cli import main
from attncal.exporting.exporter import ExportOptions, export
from attncal.modelinfo import default_model_path
from attncal.runtime import Encoder
from attncal.pooling import Pooling
from attncal.runtime.landmarks import Landmarks, place, transformers_encode
from attncal.runtime.tokenizer import PROBE_TEXTS, load_tokenizer
from attncal.synthetic import ARCHITECTURES, make_tokenizer, save_synthetic_model, synthetic_text
from conftest import quick_exporter

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options

MAX_LEN = 64
# Texts whose landmarks are easy to get wrong: the tokenizer's own hard cases (accents, CJK, emoji, RTL, control
# characters, far past the max length, whitespace only, special tokens spelled out), sentence ends of every kind,
# and the landmark token itself inside the text.
HARD_TEXTS = list(PROBE_TEXTS) + [
    "", "x", "Short. Sentences! Here? And [SEP] inside, [CLS] too.",
    "No sentence end but a long run of words " * 12,
    "Dr. Who said 3.5 is e.g. fine.\n\nNew paragraph; “quoted.” 文。文。 end",
]


def _spec(tok, kind, every, token=None):
    return Pooling(kind, every, token).resolve(tok)


def _tokens(tok, ids):
    return tok.convert_ids_to_tokens(list(ids))


# -- the placement rules ------------------------------------------------------------------------------------

def test_lmk_closes_each_chunk_and_reuses_the_template_sep():
    tok = make_tokenizer("bert", MAX_LEN)
    spec = _spec(tok, "lmk", 4)
    lm = Landmarks(spec, transformers_encode(tok), max_length=None, pad_id=tok.pad_token_id)
    (ids, _), = lm.rows(["abcdefghij"])
    assert _tokens(tok, ids) == ["[CLS]", "a", "##b", "##c", "##d", "[SEP]", "##e", "##f", "##g", "##h", "[SEP]",
                                 "##i", "##j", "[SEP]"]
    # shorter than one chunk, and empty: one landmark at the end, the model's own tokenization
    for text in ("ab", "abcd", ""):
        assert lm.rows([text])[0][0] == tok(text)["input_ids"], text


def test_multi_cls_opens_each_chunk_and_reuses_the_template_cls():
    tok = make_tokenizer("bert", MAX_LEN)
    lm = Landmarks(_spec(tok, "multi-cls", 4), transformers_encode(tok), max_length=None, pad_id=tok.pad_token_id)
    (ids, _), = lm.rows(["abcdefghij"])
    assert _tokens(tok, ids) == ["[CLS]", "a", "##b", "##c", "##d", "[CLS]", "##e", "##f", "##g", "##h", "[CLS]",
                                 "##i", "##j", "[SEP]"]
    assert lm.rows(["abc"])[0][0] == tok("abc")["input_ids"]  # a short text pools as the CLS model does


def test_sentence_chunks_and_a_spelled_landmark_is_dropped():
    tok = make_tokenizer("bert", MAX_LEN)
    lm = Landmarks(_spec(tok, "lmk", "sentence"), transformers_encode(tok), max_length=None, pad_id=tok.pad_token_id)
    (ids, _), = lm.rows(["Hi there. Yes! x [SEP] y"])
    assert _tokens(tok, ids) == ["[CLS]", "h", "##i", "t", "##h", "##e", "##r", "##e", ".", "[SEP]", "y", "##e", "##s",
                                 "!", "[SEP]", "x", "y", "[SEP]"]
    assert tok.sep_token_id in tok("x [SEP] y")["input_ids"][1:-1]  # the tokenizer does match the spelled token


@pytest.mark.parametrize("style,every", [("lmk", 4), ("multi-cls", 5), ("lmk", "sentence"), ("mean-every", 3)])
@pytest.mark.parametrize("side", ["right", "left"])
def test_budget_holds_the_landmarks_and_keeps_the_most_content(style, every, side):
    """Every row fits max_length with its landmarks, and one more content token would not (the paper: the token
    budget is not increased); the truncation side decides which end is kept."""
    tok = make_tokenizer("bert", MAX_LEN)
    tok.truncation_side = side
    spec = _spec(tok, style, every)
    lm = Landmarks(spec, transformers_encode(tok), max_length=MAX_LEN, pad_id=tok.pad_token_id, truncation_side=side)
    text = "Some words here. " * 30
    (ids, _), = lm.rows([text])
    content = [t for t in tok(text, add_special_tokens=False)["input_ids"]]
    kept = [t for t in ids[1:-1] if t != spec.token_id]
    n = len(kept)
    assert len(ids) <= MAX_LEN
    assert kept == (content[-n:] if side == "left" else content[:n])
    if style != "mean-every":  # the sentence numbers of the kept tokens, for one token more
        longer = place(content[-(n + 1):] if side == "left" else content[:n + 1], [0] * (n + 1),
                       _sentences(tok, text, side, n + 1) if every == "sentence" else None, spec, lm.template)[0]
        assert len(longer) > MAX_LEN


def _sentences(tok, text, side, n):
    import bisect

    from attncal.runtime.landmarks import sentence_ends

    ends = sentence_ends(text)
    starts = [s for s, _ in tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    ids = [bisect.bisect_right(ends, s) for s in starts]
    return ids[-n:] if side == "left" else ids[:n]


def test_left_padding_and_a_model_without_cls():
    tok = make_tokenizer("qwen3", MAX_LEN)  # text + [EOS], padded on the left
    spec = _spec(tok, "lmk", 3)
    assert spec.token == "[EOS]"  # no SEP: its end-of-sequence token, which its template puts last
    lm = Landmarks(spec, transformers_encode(tok), max_length=MAX_LEN, pad_id=tok.pad_token_id, padding_side="left")
    batch = lm(["abcdefg", "ab"])
    assert batch["attention_mask"][1].tolist() == [0] * 7 + [1] * 3  # ab [EOS], padded on the left
    assert _tokens(tok, batch["input_ids"][0]) == ["a", "##b", "##c", "[EOS]", "##d", "##e", "##f", "[EOS]", "##g",
                                                   "[EOS]"]
    with pytest.raises(ValueError, match="^invalid pooling: the model's tokenizer has no cls token or bos token to use "
                                         "as the multi-cls landmark; name one with --lmk-token$"):
        _spec(tok, "multi-cls", 8)
    cls = _spec(tok, "multi-cls", 3, token="[CLS]")  # a named token goes before every chunk, the first included
    (ids, _), = Landmarks(cls, transformers_encode(tok), max_length=None, pad_id=tok.pad_token_id).rows(["abcd"])
    assert _tokens(tok, ids) == ["[CLS]", "a", "##b", "##c", "[CLS]", "##d", "[EOS]"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(kind="lmk2"), "'lmk2' is not one of cls, mean, last, lmk, multi-cls, mean-every, auto"),
    (dict(kind="lmk", every=0), "--lmk-every must be a whole number of tokens >= 1 or 'sentence', got 0"),
    (dict(kind="multi-cls", every="sentences"), "--lmk-every must be a whole number"),
    (dict(kind="mean-every", every="sentence"), "mean-every needs k, a whole number of tokens >= 1"),
    (dict(kind="mean-every", every=4, token="[SEP]"), "mean-every inserts no token"),
])
def test_bad_specs_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match="^invalid pooling: " + message.replace("[", r"\[").replace("?", r"\?")):
        Pooling(**kwargs)


def test_unknown_landmark_token_is_refused():
    tok = make_tokenizer("bert", MAX_LEN)
    with pytest.raises(ValueError, match=r"^invalid pooling: --lmk-token '<lmk>' is not a token of the model's "
                                         r"vocabulary"):
        _spec(tok, "lmk", 8, token="<lmk>")


# -- one tokenization everywhere ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_tokenizer_model(tmp_path_factory):
    """A tiny random BERT with all-MiniLM-L6-v2's real WordPiece tokenizer (what the hard texts need)."""
    out = tmp_path_factory.mktemp("lmk") / "model"
    save_synthetic_model("bert", out, seed=4, max_positions=MAX_LEN, max_seq_length=MAX_LEN, vocab=30522,
                         layers=2, hidden=32, pooling="mean")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        (out / name).unlink(missing_ok=True)
        shutil.copy2(default_model_path() / name, out / name)
    return out


@pytest.fixture(scope="module")
def sentence_export(real_tokenizer_model, tmp_path_factory):
    from attncal.calibration.config import CalibrationConfig

    out = tmp_path_factory.mktemp("lmk") / "export"
    export(str(real_tokenizer_model), out, ExportOptions(config=CalibrationConfig(pooling=Pooling("lmk", "sentence")),
                                                         calibrate=False, exporter="torchscript", optimized=False),
           quiet=True)
    return out


def _triton_tokenizer(repo, name):
    """The generated Triton tokenizer model, run in this process with a stand-in for Triton's Python module."""
    from google.protobuf.json_format import MessageToDict

    from attncal.serving import pbtxt

    stub = types.ModuleType("triton_python_backend_utils")
    stub.Tensor = lambda name, arr: (name, arr)
    sys.modules.setdefault("triton_python_backend_utils", stub)
    path = repo / f"{name}-tokenizer" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"tokenizer_model_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    config = MessageToDict(pbtxt.validate((repo / f"{name}-tokenizer" / "config.pbtxt").read_text()),
                           preserving_proto_field_name=True)
    model.initialize({"model_config": json.dumps(config), "model_repository": str(repo / f"{name}-tokenizer"),
                      "model_version": "1"})
    return lambda texts: dict(model._encode(texts))


def test_token_ids_are_the_same_in_every_runtime(sentence_export, real_tokenizer_model, tmp_path, monkeypatch):
    """Encoder (tokenizers and transformers backends), the Triton tokenizer model (both paddings), `attncal encode`,
    the evaluation's torch backend and the parity check's independent reference give the same ids, type ids and
    masks on the hard texts."""
    pytest.importorskip("tritonclient")
    from attncal.calibration.encode import TorchEncoder
    from attncal.eval.encoders import TorchBackend
    from attncal.calibration.config import CalibrationConfig
    from attncal.runtime.parity import PaperReference
    from attncal.serving.repository import RepoOptions, build_repository

    enc = Encoder(sentence_export, providers=["CPUExecutionProvider"])
    meta = read_metadata(sentence_export)
    assert meta["tokenizer"] == "tokenizers" and meta["pooling"]["kind"] == "lmk"
    spec = enc.pooling
    want = enc.tokenize(HARD_TEXTS)
    ref = {n: want[n] for n in ("input_ids", "attention_mask")}
    lengths = want["attention_mask"].sum(1)
    assert lengths.max() == MAX_LEN and (want["input_ids"] == spec.token_id).sum(1).min() >= 1

    slow = load_tokenizer(sentence_export, "transformers", MAX_LEN, "right", spec)
    got = slow(HARD_TEXTS)
    assert all(np.array_equal(got[n], want[n]) for n in want), "the transformers backend places them otherwise"

    repo = tmp_path / "repo"
    build_repository(sentence_export, repo, RepoOptions(name="lmk"))
    build_repository(sentence_export, repo, RepoOptions(name="lmk-ort", backend="onnxruntime"))
    for name, width in (("lmk", want["input_ids"].shape[1]), ("lmk-ort", MAX_LEN)):
        served = _triton_tokenizer(repo, name)(HARD_TEXTS)
        assert served["input_ids"].shape == (len(HARD_TEXTS), width)
        assert np.array_equal(served["input_ids"][:, :want["input_ids"].shape[1]], want["input_ids"]), name
        assert np.array_equal(served["attention_mask"][:, :want["input_ids"].shape[1]], want["attention_mask"]), name

    seen: list[np.ndarray] = []
    real_run = Encoder.run
    monkeypatch.setattr(Encoder, "run", lambda self, feeds: seen.append(feeds["input_ids"]) or real_run(self, feeds))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(HARD_TEXTS) if t))
    assert main(["encode", str(sentence_export), "--input", str(corpus), "--output", str(tmp_path / "emb"),
                 "--batch-size", "1", "-q"]) == 0
    by_text = {t: want["input_ids"][i][want["attention_mask"][i] == 1].tolist() for i, t in enumerate(HARD_TEXTS)}
    assert sorted(row.tolist() for row in (s[0] for s in seen)) == sorted(by_text[t] for t in HARD_TEXTS if t)

    torch_backend = TorchBackend(real_tokenizer_model, max_length=MAX_LEN)
    config = CalibrationConfig(strength=0.0, pooling=Pooling("lmk", "sentence"))
    evaluated = torch_backend.landmarks(config)(HARD_TEXTS)
    assert all(np.array_equal(evaluated[n], ref[n]) for n in ref)

    paper = PaperReference(TorchEncoder(real_tokenizer_model), spec, MAX_LEN)
    assert [paper.sequence(t)[0] for t in HARD_TEXTS] == [by_text[t] for t in HARD_TEXTS]


def test_export_records_the_pooling_and_the_eval_sweeps_it(sentence_export, real_tokenizer_model):
    from attncal.calibration.config import CalibrationConfig
    from attncal.eval.encoders import TorchBackend

    meta = read_metadata(sentence_export)
    assert meta["pooling"] == {"kind": "lmk", "every": "sentence", "token": "[SEP]", "token_id": 102}
    enc = Encoder(sentence_export, providers=["CPUExecutionProvider"])
    texts = ["One sentence. Another one, longer than the first! A third?", "short"]
    backend = TorchBackend(real_tokenizer_model, max_length=MAX_LEN)
    swept = backend.encode(texts, CalibrationConfig(strength=0.0, pooling=Pooling("lmk", "sentence")))
    assert np.abs(swept - enc.encode(texts)).max() <= 1e-5
    own = backend.encode(texts, None)  # the model's own (mean) pooling differs
    assert np.abs(own - swept).max() > 1e-3
    calibrated = backend.encode(texts, CalibrationConfig(strength=0.5, basket_size=4,
                                                         pooling=Pooling("lmk", "sentence")))
    assert np.abs(calibrated - swept).max() > 1e-4  # the landmark rows are calibrated


def test_a_damaged_pooling_record_is_named(sentence_export, tmp_path):
    from attncal.artifact import ArtifactError

    for change, message in (
            (lambda m: m["pooling"].update(token_id="102"), "key 'pooling': invalid pooling: the landmark "
                                                            "token id must be an integer >= 0, got '102'"),
            (lambda m: m["pooling"].pop("token_id"), r"key 'pooling' \(lmk \[SEP\] per sentence\) must be concrete, "
                                                     "with a landmark kind's token_id"),
            (lambda m: m.update(pooling="landmark"), "key 'pooling' must be an object, got 'landmark'"),
            (lambda m: m.update(pooling={"kind": "lmk", "every": 4, "token_id": 102, "style": "lmk"}),
             "key 'pooling': invalid pooling: unknown field\\(s\\) style")):
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(sentence_export, copy)
        meta = json.loads((copy / "attncal.json").read_text())
        change(meta)
        (copy / "attncal.json").write_text(json.dumps(meta))
        with pytest.raises(ArtifactError, match=f"^{copy / 'attncal.json'}: {message}$"):
            Encoder(copy, providers=["CPUExecutionProvider"])


# -- the graphs against the paper's reference ---------------------------------------------------------------

# Every pooling on every architecture (multi-CLS with [CLS] named: T5's and Qwen3's tokenizers have no CLS); Gemma3,
# whose dynamo export takes six times as long, with multi-CLS on its default token, the BOS its template opens with.
STYLES = (("lmk", 8, None), ("multi-cls", "sentence", "[CLS]"), ("mean-every", 5, None))
CASES = [(arch, *s) for arch in ARCHITECTURES if arch != "gemma3_text" for s in STYLES] + [
    ("gemma3_text", "multi-cls", 8, None)]


@pytest.mark.parametrize("arch,style,every,token", CASES)
def test_every_graph_matches_the_paper_reference(arch, style, every, token, tiny_models, tmp_path):
    """The export's own parity check (every graph it writes, against `PaperReference`) at <= 1e-5, and the
    pooling is not the model's own (random tiny models' token states lie close: CLS and multi-CLS of ModernBERT
    differ by about 2e-4)."""
    from attncal.calibration.encode import TorchEncoder

    out = tmp_path / "out"
    from attncal.calibration.config import CalibrationConfig

    meta = export(str(tiny_models[arch]), out, ExportOptions(
        config=CalibrationConfig(pooling=Pooling(style, every, token)), calibrate=False,
        exporter=quick_exporter(arch)), quiet=True)
    assert meta["pooling"]["kind"] == style and meta["pooling"]["every"] == every
    for graph, entry in meta["graphs"].items():
        assert entry["parity"]["max_abs"] <= 1e-5, (graph, entry["parity"])
    if arch == "bert":
        assert len(meta["graphs"]) == 3, meta.get("optimizer")
    words = synthetic_text(300, seed=2).split()
    text = [" ".join(w + ("." if i % 6 == 5 else "") for i, w in enumerate(words))]  # sentences too
    own = TorchEncoder(tiny_models[arch]).encode(text)  # apart by more than the parity tolerance
    assert np.abs(Encoder(out, providers=["CPUExecutionProvider"]).encode(text) - own).max() > 1e-5


# -- eval and bench -----------------------------------------------------------------------------------------

def test_eval_sweeps_poolings_from_the_command_line(tiny_models, tmp_path, capsys):
    argv = ["eval", str(tiny_models["bert"]), "--synthetic-per-class", "4", "--synthetic-words", "40", "--no-plots",
            "--no-cache"]
    out = tmp_path / "res"
    assert main(argv + ["--make-synthetic", str(tmp_path / "syn"), "--strength", "0",
                        "--pooling", "cls,lmk,multi-cls,mean-every", "--lmk-every", "16,sentence", "--mean-every", "8",
                        "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["label"] for r in rows] == [
        "uncalibrated", "λ=0 pooling=cls", "λ=0 lmk [SEP] every 16 tokens", "λ=0 lmk [SEP] per sentence",
        "λ=0 multi-cls [CLS] every 16 tokens", "λ=0 multi-cls [CLS] per sentence", "λ=0 mean-every 8"]
    assert rows[2]["config"]["pooling"] == {"kind": "lmk", "every": 16, "token": "[SEP]", "token_id": 3}
    assert rows[6]["config"]["pooling"] == {"kind": "mean-every", "every": 8}
    capsys.readouterr()


def test_bench_feeds_carry_the_landmarks():
    from attncal.bench.engines import make_feeds, pooled_feeds

    feeds = make_feeds(2, 20, vocab=30)
    feeds["input_ids"][0, 3] = 12  # a content token spelled as the landmark: replaced, the rows keep one length
    out = pooled_feeds(feeds, Pooling("lmk", 8, "[SEP]", 12))
    assert out["input_ids"].shape == (2, 23) and out["attention_mask"].all()  # 20 tokens + one landmark per 8
    assert [np.flatnonzero(row == 12).tolist() for row in out["input_ids"]] == [[8, 17, 22]] * 2
    assert np.array_equal(pooled_feeds(feeds, Pooling("mean-every", 4))["input_ids"], feeds["input_ids"])
    capped = pooled_feeds(feeds, Pooling("lmk", 8, "[SEP]", 12), max_length=20)  # landmarks replace content
    assert capped["input_ids"].shape == (2, 20) and (capped["input_ids"] == 12).sum(1).tolist() == [3, 3]


@pytest.mark.parametrize("spec", [Pooling("lmk", 8), Pooling("multi-cls", 8), Pooling("mean-every", 3)],
                         ids=["lmk", "multi-cls", "mean-every"])
def test_calibrated_pooled_export_matches_pytorch_on_every_graph(spec, tiny_models, tmp_path):
    """Calibration with landmark / Mean@k pooling calibrates the pooled rows in PyTorch (the patch marks them from
    the batch's input_ids) and in every graph, and the export's parity check holds them to 1e-5."""
    from attncal.calibration.config import CalibrationConfig

    cfg = CalibrationConfig(basket_size=4, strength=0.8, pooling=spec)
    out, worst = {}, {}
    for name, calibrate in (("cal", True), ("off", False)):
        out[name] = tmp_path / name
        meta = export(str(tiny_models["bert"]), out[name], ExportOptions(config=cfg, calibrate=calibrate,
                                                                    exporter="torchscript"), quiet=True)
        for graph_file, g in meta["graphs"].items():
            assert g["parity"]["ok"] and g["parity"]["max_abs"] <= 1e-5, (graph_file, g["parity"])
        worst[name] = max(g["parity"]["max_abs"] for g in meta["graphs"].values())
    assert Pooling.from_json(read_metadata(out["cal"])["config"]["pooling"]).kind == spec.kind
    texts = ["A long enough text, with several chunks of tokens in it, to hold more than one landmark. " * 3]
    cal, off = (Encoder(out[n], providers=["CPUExecutionProvider"]).encode(texts) for n in ("cal", "off"))
    # A tiny random model's attention is nearly flat, so calibration moves it little; but by far more than the
    # graphs and PyTorch differ, so both calibrate the pooled rows.
    assert np.abs(cal - off).max() > 10 * worst["cal"], (np.abs(cal - off).max(), worst)


def test_a_comparison_labels_a_calibrated_landmark_export_by_its_calibration():
    from attncal.eval.compare_report import calibration_of

    config = {"variant": "cls-soft", "strength": 0.5, "basket_size": 128, "layers": "last-half",
              "pooling": {"kind": "lmk", "every": 64, "token": "[SEP]", "token_id": 102}}
    assert calibration_of({"calibrated": True, "config": config}) == "calibrated λ=0.5"
    assert calibration_of({"calibrated": True, "config": dict(config, pooling={"kind": "mean-every", "every": 4},
                                                              basket_size=64)}) == "calibrated λ=0.5 basket=64"
    old = dict(config, pooling="landmark", pool_token_id=102, pool_every=0)  # the config's form before `Pooling`
    assert calibration_of({"calibrated": True, "config": old}) == "calibrated λ=0.5"
