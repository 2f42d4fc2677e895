"""Support by capability: the architectures added for sentence-transformers' most used models (MPNet,
DistilBERT, RoBERTa, the T5 encoder, Gemma3 as a bidirectional embedder), an architecture in no list
(GPT-2: exported, labelled untested, guarded by parity), and the sentence-transformers conventions they
bring (Dense modules after pooling, named prompts).

Graph placements per architecture are in test_export.py (portable graph, every architecture),
test_split_placement.py and test_row_placement.py; Triton serving in test_serving_architectures.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from attncal import CalibrationConfig
from attncal.calibration import TorchEncoder, UnsupportedArchitectureError, calibrate
from attncal.cli import main
from attncal.exporting.exporter import ExportOptions, export
from attncal.modelinfo import UnsupportedModelError, load_model_info
from attncal.runtime import Encoder
from attncal.synthetic import make_tokenizer, save_synthetic_model, synthetic_text

pytestmark = pytest.mark.usefixtures("shared_raw_exports")  # conftest: one torch.onnx export per model and options

NEW = ("mpnet", "distilbert", "roberta", "t5", "gemma3_text")
TEXTS = [synthetic_text(n, seed=n) for n in (5, 40, 90, 180, 400)]
BASKET = 16
EMBEDDING_GEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}


@pytest.mark.parametrize("arch", NEW)
def test_torch_reference_split_equals_eager_on_both_padding_sides(arch, tiny_models):
    """The SDPA split path (T5: with its position bias; Gemma3: GQA + bidirectional sliding windows) equals
    the eager calibrated probabilities; MPNet has no SDPA path and is calibrated at its own softmax."""
    cfg = CalibrationConfig(pooling="mean", basket_size=BASKET, strength=0.9, layers="all")
    eager = TorchEncoder(tiny_models[arch], attn_implementation="eager")
    sdpa = TorchEncoder(tiny_models[arch], attn_implementation="sdpa")
    for side in ("right", "left"):
        for enc in (eager, sdpa):
            enc.tokenizer.padding_side = side
        batch = eager.tokenize(TEXTS)
        ref = eager.forward(batch, cfg, implementation="efficient")
        plain = eager.forward(batch, None)
        assert (ref - plain).abs().amax(-1)[0] == 0, "a text under one basket must not move"
        assert (ref - plain).abs().max() > 1e-4, "calibration must move long texts"
        if arch == "mpnet":
            assert sdpa.model.config._attn_implementation == "eager"  # no SDPA in MPNet: its own eager path
            with pytest.raises(UnsupportedArchitectureError, match="computes its own softmax"):
                sdpa.forward(batch, cfg, implementation="split")
            continue
        got = sdpa.forward(batch, cfg, implementation="split")
        assert (got - ref).abs().max() <= 1e-5, (arch, side)


def test_t5_split_original_share_uses_the_position_bias(tiny_models):
    """An `original` share needs the row's LSE and the isolated token's score, both with T5's bias."""
    cfg = CalibrationConfig(pooling="mean", basket_size=BASKET, strength=0.9, layers="all", isolate_first=True,
                            first_weight="original")
    eager = TorchEncoder(tiny_models["t5"], attn_implementation="eager")
    sdpa = TorchEncoder(tiny_models["t5"], attn_implementation="sdpa")
    batch = eager.tokenize(TEXTS)
    ref = eager.forward(batch, cfg, implementation="efficient")
    assert (sdpa.forward(batch, cfg, implementation="split") - ref).abs().max() <= 1e-5


def test_softmax_path_calibrates_only_selected_layers(tiny_models):
    """MPNet (own eager softmax): the selected layers' calls are counted, the patch comes off cleanly."""
    enc = TorchEncoder(tiny_models["mpnet"])
    batch = enc.tokenize(TEXTS)
    base = enc.forward(batch, None)
    with calibrate(enc.model, CalibrationConfig(pooling="mean", basket_size=BASKET, layers="last")) as patch:
        assert patch.path == "softmax"
        with torch.no_grad():
            enc.model(**batch)
    assert patch.calls == 1
    assert torch.equal(enc.forward(batch, None), base)


def _gpt2_model(root):
    """GPT-2 (no list names it) as a last-token embedder, with a tokenizer, Pooling and Normalize."""
    from transformers import GPT2Config, GPT2Model

    from attncal.synthetic import vocab_size

    torch.manual_seed(0)
    model = GPT2Model(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=vocab_size(), n_positions=256,
                                 bos_token_id=5, eos_token_id=5))
    model.save_pretrained(root)
    make_tokenizer("qwen3", 256).save_pretrained(root)  # EOS-terminated, left padding
    (root / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                 "pooling_mode_lasttoken": True}))
    return root


def test_untested_architecture_exports_labelled_and_guarded_by_parity(tmp_path, capsys):
    src = _gpt2_model(tmp_path / "gpt2")
    info = load_model_info(src)
    assert not info.tested and info.architecture == "GPT2Model" and info.pooling == "last"
    out = tmp_path / "out"
    assert main(["export", str(src), "-o", str(out), "--basket-size", "16"]) == 0
    meta = json.loads((out / "attncal.json").read_text())
    assert meta["tested"] is False and meta["architecture"] == "GPT2Model"
    assert all(g["parity"]["ok"] and g["parity"]["max_abs"] <= 1e-5 for g in meta["graphs"].values())
    assert "of 2 layers of this gpt2 graph" in meta["optimizer"]  # the optimizer was tried, did not fuse
    shown = capsys.readouterr()
    assert "not among attncal's tested architectures" in shown.out + shown.err
    assert main(["inspect", str(out)]) == 0
    assert "UNTESTED architecture" in capsys.readouterr().out
    assert main(["check", str(out)]) == 0
    cfg = CalibrationConfig(pooling="last", basket_size=16)
    got = Encoder(out).encode(TEXTS)
    ref = TorchEncoder(src).encode(TEXTS, cfg)
    assert np.abs(got - ref).max() <= 1e-5
    assert np.abs(got - TorchEncoder(src).encode(TEXTS)).max() > 1e-4


def test_dense_modules_and_prompts(tmp_path, capsys):
    """EmbeddingGemma's layout (two bias-free Dense layers, named prompts, here with a default) and distiluse's
    (one Dense with tanh): every graph matches PyTorch, prompts are chosen as sentence-transformers does.
    The Dense head through both exporters: dynamo for Gemma3, TorchScript for distiluse."""
    gemma = save_synthetic_model("gemma3_text", tmp_path / "gemma", seed=4, dense=((64, "Identity", False),
                                 (24, "Identity", False)), prompts=EMBEDDING_GEMMA_PROMPTS,
                                 default_prompt_name="document")
    distiluse = save_synthetic_model("distilbert", tmp_path / "distiluse", seed=4, dense=((20, "Tanh", True),))
    cfg = CalibrationConfig(pooling="mean", basket_size=BASKET)
    for src, dim in ((gemma, 24), (distiluse, 20)):
        out = tmp_path / f"{src.name}-out"
        meta = export(src, out, ExportOptions(config=cfg, optimized=src == distiluse,
                                              exporter="dynamo" if src == gemma else "torchscript"), quiet=True)
        assert all(g["parity"]["max_abs"] <= 1e-5 for g in meta["graphs"].values())
        assert (out / "2_Dense" / "model.safetensors").exists(), "sentence-transformers runs Dense from the export"
        ref = TorchEncoder(src)
        for graph in meta["graphs"]:
            enc = Encoder(out, graph={"onnx/model.onnx": "portable", "onnx/model_optimized.onnx": "optimized",
                                      "onnx/model_optimized_native.onnx": "native"}[graph])
            for kw in ({}, {"prompt_name": "query"} if src == gemma else {"prompt": "x: "}):
                got = enc.encode(TEXTS, **kw)
                assert got.shape == (len(TEXTS), dim)
                assert np.abs(got - ref.encode(TEXTS, cfg, **kw)).max() <= 1e-5, (src.name, graph, kw)
    enc = Encoder(tmp_path / "gemma-out")
    default = enc.encode(TEXTS[:2])
    assert np.abs(default - enc.encode(TEXTS[:2], prompt_name="document")).max() == 0  # the default prompt
    assert np.abs(default - enc.encode(TEXTS[:2], prompt="")).max() > 1e-3
    with pytest.raises(ValueError, match=r"prompt_name 'passage' is not one of the model's prompts \(document, query\)"):
        enc.encode(TEXTS, prompt_name="passage")
    with pytest.raises(ValueError, match="give prompt or prompt_name, not both"):
        enc.encode(TEXTS, prompt="a", prompt_name="query")


def test_dense_and_prompt_refusals(tmp_path):
    src = save_synthetic_model("bert", tmp_path / "m", seed=1, dense=((16, "Tanh", True),))
    cfg_file = src / "2_Dense" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**cfg, "activation_function": "torch.nn.modules.activation.Softplus"}))
    with pytest.raises(UnsupportedModelError, match="Dense activation 'Softplus' is not supported"):
        load_model_info(src)
    cfg_file.write_text(json.dumps(cfg))
    modules = json.loads((src / "modules.json").read_text())
    (src / "modules.json").write_text(json.dumps([modules[0], modules[2], modules[1], modules[3]]))
    with pytest.raises(UnsupportedModelError, match="a Dense module must come after Pooling and before Normalize"):
        load_model_info(src)
    (src / "modules.json").write_text(json.dumps(modules))
    (src / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"q": "x"},
                                                                       "default_prompt_name": "doc"}))
    with pytest.raises(UnsupportedModelError, match="default_prompt_name 'doc' is not one of its prompts"):
        load_model_info(src)
