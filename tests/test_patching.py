"""Patching transformers models: the PyTorch reference of calibration."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from attncal.calibration import CalibrationConfig, UnsupportedArchitectureError, calibrate, reference
from attncal.synthetic import ARCHITECTURES, make_config

S = 48  # sequence length of the test batches
BASKET = 8


def build(arch: str, seed: int = 0):
    from attncal.modelinfo import model_class

    torch.manual_seed(seed)
    cfg = make_config(arch, layers=4, hidden=32, heads=4, max_positions=128)
    return model_class(cfg).from_config(cfg, attn_implementation="eager").eval()


def batch(arch: str, lengths=(48, 30, 12)):
    gen = torch.Generator().manual_seed(3)
    B = len(lengths)
    ids = torch.randint(6, 100, (B, S), generator=gen)
    mask = torch.zeros(B, S, dtype=torch.long)
    for b, n in enumerate(lengths):
        if arch == "qwen3":  # left padding, like Qwen3-Embedding
            mask[b, S - n :] = 1
        else:
            mask[b, :n] = 1
    kw = {"input_ids": ids, "attention_mask": mask}
    if arch == "qwen3":
        kw["use_cache"] = False
    return kw


def forward(model, kw):
    with torch.no_grad():
        return model(**kw).last_hidden_state


def poolings(arch):
    return ["last", "mean"] if arch == "qwen3" else ["cls", "mean"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_patched_forward_equals_softmax_replaced_by_reference(arch):
    model = build(arch)
    kw = batch(arch)
    for pooling in poolings(arch):
        for layers in ("last-half", "all"):
            cfg = CalibrationConfig(strength=0.8, basket_size=BASKET, layers=layers, pooling=pooling,
                                    variant="uniform" if pooling == "mean" else "cls-soft")
            selected = cfg.layer_indices(4)
            real_softmax = torch.nn.functional.softmax
            calls = []

            def softmax_then_reference(x, *args, **kwargs):
                out = real_softmax(x, *args, **kwargs)
                layer = len(calls)
                calls.append(layer)
                if layer in selected:
                    out = reference(out.double(), kw["attention_mask"], cfg).to(out.dtype)
                return out

            with mock.patch("torch.nn.functional.softmax", softmax_then_reference):
                expected = forward(model, kw)
            assert len(calls) == 4
            with calibrate(model, cfg) as patch:
                got = forward(model, kw)
            assert patch.calls == len(selected)
            assert (got - expected).abs().max().item() <= 1e-5, (arch, pooling, layers)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_strength_zero_equals_unpatched_exactly(arch):
    model = build(arch)
    kw = batch(arch)
    base = forward(model, kw)
    with calibrate(model, CalibrationConfig(strength=0.0, basket_size=BASKET, layers="all"), pooling=poolings(arch)[0]):
        assert torch.equal(forward(model, kw), base)
    # Uncalibrated layers of a patched model are bit-identical too.
    with calibrate(model, CalibrationConfig(strength=0.5, basket_size=1024, layers="all", skip_short=True),
                   pooling=poolings(arch)[0]):
        assert torch.equal(forward(model, kw), base)
    assert torch.equal(forward(model, kw), base)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_positive_strength_changes_long_sequences_only(arch):
    model = build(arch)
    kw = batch(arch, lengths=(48, 30, 6))
    pooling = poolings(arch)[0]
    base = forward(model, kw)
    with calibrate(model, CalibrationConfig(strength=0.7, basket_size=BASKET, layers="all"), pooling=pooling):
        cal = forward(model, kw)
    diff = (cal - base).abs().amax(dim=(1, 2))
    assert diff[0] > 1e-6 and diff[1] > 1e-6  # >= 2 baskets of content
    assert diff[2] == 0  # 6 tokens: shorter than one basket, skipped


def test_persistent_patch_and_removal():
    model = build("bert")
    kw = batch("bert")
    base = forward(model, kw)
    patch = calibrate(model, CalibrationConfig(strength=1.0, basket_size=BASKET, pooling="cls"))
    assert not torch.equal(forward(model, kw), base)
    with pytest.raises(RuntimeError, match="already calibrated"):
        calibrate(model, CalibrationConfig(pooling="cls"))
    patch.remove()
    assert torch.equal(forward(model, kw), base)
    assert model.config._attn_implementation == "eager"


def test_sdpa_model_is_switched_to_eager_with_a_warning_only_when_asked():
    from transformers import AutoModel

    model = AutoModel.from_config(make_config("bert", layers=2), attn_implementation="sdpa").eval()
    kw = batch("bert")
    with pytest.warns(UserWarning, match="was using 'sdpa' attention; switched to eager"):
        with calibrate(model, CalibrationConfig(strength=1.0, basket_size=BASKET, pooling="cls"),
                       implementation="efficient") as p:
            forward(model, kw)
    assert p.calls == 1
    assert model.config._attn_implementation == "sdpa"


def test_untested_architecture_is_calibrated_by_capability():
    """GPT-2 is in no list: its attention goes through AttentionInterface, so the probe finds one module per
    layer, attncal's eager attention reproduces it, and calibration changes long sequences only."""
    from transformers import GPT2Config, GPT2Model

    from attncal.calibration.probing import find_attention

    torch.manual_seed(0)
    gpt2 = GPT2Model(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=120, n_positions=64)).eval()
    sites = find_attention(gpt2)
    assert sites.path == "interface" and len(sites.modules) == 2
    kw = batch("qwen3", lengths=(48, 6, 30))
    base = forward(gpt2, kw)
    with calibrate(gpt2, CalibrationConfig(strength=0.7, basket_size=BASKET, layers="all", pooling="last")) as p:
        cal = forward(gpt2, kw)
    assert p.calls == 2
    diff = (cal - base).abs().amax(dim=(1, 2))
    assert diff[0] > 1e-6 and diff[1] == 0


def test_refusals_name_what_the_probe_saw(monkeypatch):
    from transformers import BertConfig, PreTrainedModel

    from attncal.calibration.probing import find_attention

    with pytest.raises(UnsupportedArchitectureError, match="not a transformers PreTrainedModel"):
        calibrate(torch.nn.Linear(2, 2), CalibrationConfig(pooling="cls"))

    class SigmoidAttention(PreTrainedModel):  # attention without a softmax: no path to calibrate
        config_class = BertConfig

        def __init__(self, config):
            super().__init__(config)
            self.emb = torch.nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(config.hidden_size, config.hidden_size)
                                              for _ in range(config.num_hidden_layers))

        def forward(self, input_ids, attention_mask=None):
            h = self.emb(input_ids)
            for layer in self.layers:
                q = layer(h)
                h = torch.sigmoid(q @ h.transpose(1, 2)) @ h
            return type("Out", (), {"last_hidden_state": h})()

    odd = SigmoidAttention(BertConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=60))
    with pytest.raises(UnsupportedArchitectureError, match=r"SigmoidAttention: its attention neither goes through "
                       r"transformers' AttentionInterface \(0 calls for 2 layers\) nor computes one 4-D softmax"):
        calibrate(odd, CalibrationConfig(pooling="cls"))

    # A model whose own eager attention does something attncal's replay does not (here: a temperature).
    import transformers.models.bert.modeling_bert as mb

    own = mb.eager_attention_forward
    monkeypatch.setattr(mb, "eager_attention_forward", lambda m, q, k, v, mask, **kw: own(m, q * 2, k, v, mask, **kw))
    bert = build("bert", seed=3)
    with pytest.raises(UnsupportedArchitectureError, match=r"BertModel: its attention goes through AttentionInterface, "
                       r"but attncal's eager attention does not reproduce it \(max \|diff\|"):
        find_attention(bert)


def test_bad_bindings():
    model = build("bert")
    with pytest.raises(ValueError, match="'auto' needs the model's sentence-transformers config"):
        calibrate(model, CalibrationConfig())
    with pytest.raises(ValueError, match="layer index 9 is out of range for a model with 4 layers"):
        calibrate(model, CalibrationConfig(layers=[9], pooling="cls"))
