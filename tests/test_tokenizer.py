"""The runtime tokenizer: the export's tokenizer.json on `tokenizers` alone gives transformers' ids, type ids
and masks on every tested architecture and on all-MiniLM-L6-v2; the exporter records it only where its check
passes, and the check refuses a tokenizer.json that transformers changes on load; an Encoder of such an export
never imports transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from attncal.artifact import ArtifactError, validate_metadata
from attncal.modelinfo import default_model_path, read_prompts
from attncal.runtime.tokenizer import (FAST, TRANSFORMERS, FastTokenizer, TransformersTokenizer, load_tokenizer,
                                       probe_texts, verify_fast_tokenizer)

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options


@pytest.fixture(scope="module")
def tokenizer_dirs(tiny_models):
    return dict(tiny_models, minilm=str(default_model_path()))


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("max_length", [None, 16])
def test_fast_tokenizer_equals_transformers_on_every_architecture(tokenizer_dirs, padding_side, max_length):
    for name, d in tokenizer_dirs.items():
        want = TransformersTokenizer(d, max_length, padding_side)
        got = FastTokenizer(d, max_length, padding_side)
        prompts = list((read_prompts(d)[0] or {}).values())
        texts = probe_texts(want.hf, prompts)
        assert len(texts) > 11 and any("[MASK]" in t for t in texts)  # the added tokens' text is probed
        w, g = want(texts), got(texts)
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=f"{name} {key}")
        assert got.token_lengths(texts) == want.token_lengths(texts), name
        if max_length is not None:
            assert max(got.token_lengths(texts)) == max_length  # the long text is truncated, specials kept
        assert verify_fast_tokenizer(d, max_length, padding_side, prompts) is None, name


def test_max_length_can_be_changed_after_loading(tokenizer_dirs):
    d = tokenizer_dirs["minilm"]
    fast, hf = FastTokenizer(d, 128, "right"), TransformersTokenizer(d, 128, "right")
    for n in (8, None, 40):
        fast.set_max_length(n)
        hf.set_max_length(n)
        assert fast.token_lengths(probe_texts(hf.hf)) == hf.token_lengths(probe_texts(hf.hf))


def test_check_refuses_what_transformers_changes_on_load(tokenizer_dirs, tmp_path):
    """A tokenizer_config that contradicts tokenizer.json (BERT's do_lower_case against the file's lowercasing
    normaliser): transformers rebuilds the normaliser on load, so the file alone would tokenize otherwise."""
    d = tmp_path / "cased"
    shutil.copytree(tokenizer_dirs["minilm"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["do_lower_case"] = False
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    why = verify_fast_tokenizer(d, 64, "right")
    assert why is not None and "backend" in why, why
    (d / "tokenizer.json").unlink()
    assert verify_fast_tokenizer(d, 64, "right") == "the export has no tokenizer.json"


def test_check_sees_a_wrong_padding_side_and_a_missing_pad_token(tokenizer_dirs, tmp_path, monkeypatch):
    d = tokenizer_dirs["qwen3"]  # left padding
    texts = ["a", "a longer text"]
    fast, hf = FastTokenizer(d, 32, "left"), TransformersTokenizer(d, 32, "left")
    np.testing.assert_array_equal(fast(texts)["input_ids"], hf(texts)["input_ids"])
    assert fast(texts)["attention_mask"][0, 0] == 0  # padded on the left
    monkeypatch.setattr(FastTokenizer, "__init__", lambda self, p, m, s: _init_right(self, p, m))
    assert verify_fast_tokenizer(d, 32, "left") == "input_ids differ on the probe texts"
    fast.pad_id = None
    with pytest.raises(ValueError, match="no padding token"):
        fast(texts)


_ORIGINAL_INIT = FastTokenizer.__init__


def _init_right(self, path, max_length):
    _ORIGINAL_INIT(self, path, max_length, "right")


def test_metadata_names_a_known_tokenizer(tmp_path):
    base = {"format": 2, "calibrated": False, "pooling": "mean", "calibrated_layers": [], "model_type": "bert",
            "num_layers": 2, "inputs": ["input_ids", "attention_mask"], "padding_side": "right", "files": []}
    for kind in (FAST, TRANSFORMERS):
        validate_metadata(dict(base, tokenizer=kind))
    validate_metadata(base)  # older exports: transformers
    with pytest.raises(ArtifactError, match="key 'tokenizer' must be one of tokenizers, transformers"):
        validate_metadata(dict(base, tokenizer="sentencepiece"))
    assert isinstance(load_tokenizer(default_model_path(), None, 32, "right"), TransformersTokenizer)


_NO_TRANSFORMERS = """
import json, sys
from attncal.runtime import Encoder
enc = Encoder(sys.argv[1])
feeds = enc.tokenize(json.loads(sys.argv[2]))
emb = enc.encode(json.loads(sys.argv[2]))
print(json.dumps({"transformers": "transformers" in sys.modules, "feeds": {k: v.tolist() for k, v in feeds.items()},
                  "emb": emb.tolist()}))
"""


def test_export_records_the_fast_tokenizer_and_the_encoder_runs_without_transformers(tiny_models, tmp_path):
    from attncal import CalibrationConfig
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.runtime import Encoder

    out = tmp_path / "export"
    export(tiny_models["bert"], out, ExportOptions(config=CalibrationConfig(basket_size=16), exporter="torchscript",
                                                  check=False, optimized=False), quiet=True)
    meta = json.loads((out / "attncal.json").read_text())
    assert meta["tokenizer"] == FAST
    shown = subprocess.run([sys.executable, "-m", "attncal", "inspect", str(out)], capture_output=True, text=True)
    assert "tokenizer  tokenizer.json on tokenizers alone" in shown.stdout, shown.stdout + shown.stderr
    texts = ["calibration", "a much longer passage about position bias " * 3, "é"]
    proc = subprocess.run([sys.executable, "-c", _NO_TRANSFORMERS, str(out), json.dumps(texts)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["transformers"] is False
    hf = TransformersTokenizer(out, meta["max_seq_length"], "right")
    want = hf(texts)
    assert got["feeds"] == {k: want[k].tolist() for k in meta["inputs"]}
    # The same export read with transformers' tokenizer gives the same embeddings.
    meta["tokenizer"] = TRANSFORMERS
    (out / "attncal.json").write_text(json.dumps(meta))
    enc = Encoder(out)
    assert isinstance(enc._tokenizer, TransformersTokenizer)
    np.testing.assert_array_equal(np.array(got["emb"], dtype=np.float32), enc.encode(texts))
    assert enc.tokenizer is enc._tokenizer.hf
    # Padding side and max length are the Encoder's, whichever tokenizer runs.
    for kind in (FAST, TRANSFORMERS):
        meta["tokenizer"] = kind
        (out / "attncal.json").write_text(json.dumps(meta))
        enc = Encoder(out)
        enc.padding_side, enc.max_length = "left", 8
        feeds = enc.tokenize(texts)
        assert feeds["attention_mask"].shape == (3, 8) and feeds["attention_mask"][2].tolist() == [0] * 5 + [1] * 3, kind
        assert enc.tokenizer.padding_side == "left"
        with pytest.raises(ValueError, match="padding_side must be"):
            enc.padding_side = "middle"
