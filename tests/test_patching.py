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
    from transformers import AutoModel

    torch.manual_seed(seed)
    model = AutoModel.from_config(make_config(arch, layers=4, hidden=32, heads=4, max_positions=128),
                                  attn_implementation="eager")
    return model.eval()


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


def test_unsupported_architecture_and_bad_bindings():
    from transformers import GPT2Config, GPT2Model

    gpt2 = GPT2Model(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedArchitectureError, match="cannot calibrate GPT2Model: supported"):
        calibrate(gpt2, CalibrationConfig(pooling="cls"))
    model = build("bert")
    with pytest.raises(ValueError, match="'auto' needs the model's sentence-transformers config"):
        calibrate(model, CalibrationConfig())
    with pytest.raises(ValueError, match="layer index 9 is out of range for a model with 4 layers"):
        calibrate(model, CalibrationConfig(layers=[9], pooling="cls"))
