"""encode_torch follows sentence-transformers conventions; real weights of all-MiniLM-L6-v2."""

from __future__ import annotations

import numpy as np
import pytest

from attncal import CalibrationConfig, encode_torch
from attncal.modelinfo import ModelNotFoundError, UnsupportedModelError, default_model_path, load_model_info
from attncal.synthetic import ARCHITECTURES, synthetic_text

TEXTS = [synthetic_text(n, seed=n) for n in (3, 40, 120, 300)]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_uncalibrated_matches_sentence_transformers(tiny_models, arch):
    from sentence_transformers import SentenceTransformer

    path = tiny_models[arch]
    st = SentenceTransformer(str(path), device="cpu", model_kwargs={"attn_implementation": "eager"})
    expected = st.encode(TEXTS, convert_to_numpy=True)
    got = encode_torch(path, TEXTS, batch_size=3)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-5
    info = load_model_info(path)
    assert info.padding_side == ("left" if arch == "qwen3" else "right")


def test_explicit_pooling_overrides_model_pooling(tiny_models):
    path = tiny_models["bert"]
    cls = encode_torch(path, TEXTS[:2], CalibrationConfig(strength=0.0, pooling="cls"))
    mean = encode_torch(path, TEXTS[:2], CalibrationConfig(strength=0.0, pooling="mean"))
    assert np.abs(cls - encode_torch(path, TEXTS[:2])).max() == 0
    assert np.abs(cls - mean).max() > 1e-3


def test_real_minilm_matches_sentence_transformers_and_calibration_moves_long_texts():
    from sentence_transformers import SentenceTransformer

    path = default_model_path()
    texts = [
        "A short query about attention.",
        " ".join(["Dense retrieval compresses a passage into one vector."] * 30),  # > 256 tokens: truncated
    ]
    st = SentenceTransformer(str(path), device="cpu")
    expected = st.encode(texts, convert_to_numpy=True)
    got = encode_torch(path, texts)
    assert np.abs(got - expected).max() <= 1e-5
    cal = encode_torch(path, texts, CalibrationConfig())  # published defaults, mean pooling from the model
    moved = np.abs(cal - got).max(axis=1)
    assert moved[0] == 0  # under one basket: skipped
    assert moved[1] > 1e-4


def test_model_errors_are_clear(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_model_info(tmp_path / "missing")
    (tmp_path / "config.json").write_text('{"model_type": "no-such-arch", "num_hidden_layers": 2}')
    with pytest.raises(UnsupportedModelError, match="architecture 'no-such-arch' is not known to the installed "
                                                    "transformers"):
        load_model_info(tmp_path)
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    with pytest.raises(UnsupportedModelError, match="has no model_type"):
        load_model_info(tmp_path)
    # An architecture outside the tested list loads, labelled untested (GPT-2 keeps n_layer: the alias is read).
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 3}')
    info = load_model_info(tmp_path)
    assert (info.tested, info.num_layers, info.architecture, info.pooling) == (False, 3, "GPT2Model", "last")
