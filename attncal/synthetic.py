"""Random-weight models with real tokenizers, built locally (nothing is downloaded).

Tests and benchmarks need every supported architecture, and long-context
shapes that no small real checkpoint offers (`SYNTHETIC_SHAPES`).  These builders write complete
sentence-transformers directories (weights, config, tokenizer, modules.json,
Pooling config), so they go through exactly the same loading code as a real
model.
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass
from pathlib import Path

from .modelinfo import model_class

ARCHITECTURES = ("bert", "xlm-roberta", "qwen3", "modernbert", "mpnet", "distilbert", "roberta", "t5", "gemma3_text")
DEFAULT_POOLING = {"bert": "cls", "xlm-roberta": "cls", "qwen3": "last", "modernbert": "cls", "mpnet": "mean",
                   "distilbert": "mean", "roberta": "mean", "t5": "mean", "gemma3_text": "mean"}
# Tokenizer conventions: CLS ... SEP (BERT family), text + EOS (T5, and Qwen3 with left padding), BOS + text + EOS
# (Gemma3).
_EOS_ONLY = ("qwen3", "t5")
_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[EOS]"]
_CHARS = string.ascii_lowercase + string.digits + ".,;:!?'-()\""


def _vocab() -> dict[str, int]:
    """A character-level WordPiece vocabulary: any ASCII text tokenizes, one token per character."""
    words = _SPECIALS + list(_CHARS) + ["##" + c for c in _CHARS]
    return {w: i for i, w in enumerate(words)}


def vocab_size() -> int:
    return 128  # >= len(_vocab()), a round number for the embedding table


def make_tokenizer(arch: str, max_length: int):
    """A fast tokenizer with the conventions of `arch` (CLS/SEP; EOS only for T5, with left padding for Qwen3;
    BOS/EOS for Gemma3)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = _vocab()
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=1000))
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()])
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if arch in _EOS_ONLY:
        tok.post_processor = TemplateProcessing(single="$A [EOS]", special_tokens=[("[EOS]", vocab["[EOS]"])])
        specials = dict(pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
        padding_side = "left" if arch == "qwen3" else "right"
    elif arch == "gemma3_text":
        tok.post_processor = TemplateProcessing(
            single="[CLS] $A [EOS]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[EOS]", vocab["[EOS]"])])
        specials = dict(pad_token="[PAD]", unk_token="[UNK]", bos_token="[CLS]", eos_token="[EOS]")
        padding_side = "right"
    else:
        tok.post_processor = TemplateProcessing(
            single="[CLS] $A [SEP]",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
        specials = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
        padding_side = "right"
    names = ["input_ids", "token_type_ids", "attention_mask"] if arch == "bert" else ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, model_max_length=max_length, padding_side=padding_side, model_input_names=names,
        **specials,
    )


def make_config(
    arch: str,
    *,
    layers: int = 4,
    hidden: int = 32,
    heads: int = 4,
    intermediate: int | None = None,
    max_positions: int = 256,
    vocab: int | None = None,
    head_dim: int | None = None,
    kv_heads: int | None = None,
    window: int | None = None,
    global_every: int = 2,
    buckets: int | None = None,
    max_distance: int | None = None,
):
    """A transformers config for a model of `arch` with eager attention: small by default; `vocab` (the
    embedding table's rows; the synthetic tokenizer uses the first `vocab_size()`) and `head_dim` (Qwen3's and
    Gemma3's, which need not be hidden / heads) let benchmarks build deployed models' real sizes, and so do
    `kv_heads` (Qwen3's and Gemma3's key/value heads; default heads // 2), `window` (Gemma3's sliding window,
    default 24; ModernBERT's local attention, default 64) and `global_every` (every how many layers Gemma3 and
    ModernBERT attend globally); `buckets` and `max_distance` set the relative position bias of T5 (default 8 and
    64, so that a tiny model's bias varies across the test lengths) and MPNet (`buckets`; default 32, and MPNet's
    distance is always 128).

    long: one config per architecture family, each in that family's field names, and 12 keyword parameters."""
    from transformers import (BertConfig, DistilBertConfig, Gemma3TextConfig, ModernBertConfig, MPNetConfig,
                              Qwen3Config, RobertaConfig, T5Config, XLMRobertaConfig)

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {', '.join(ARCHITECTURES)}")
    v = _vocab()
    if vocab is not None and vocab < vocab_size():
        raise ValueError(f"vocab must be >= {vocab_size()} (the synthetic tokenizer's ids), got {vocab}")
    rows = vocab or vocab_size()
    common = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate or 2 * hidden,
        vocab_size=rows,
        pad_token_id=v["[PAD]"],
        attn_implementation="eager",
    )
    if arch == "bert":
        cfg = BertConfig(**common, max_position_embeddings=max_positions)
    elif arch in ("xlm-roberta", "roberta", "mpnet"):
        # Position ids start at padding_idx + 1 (RoBERTa family, MPNet).
        cls = {"xlm-roberta": XLMRobertaConfig, "roberta": RobertaConfig, "mpnet": MPNetConfig}[arch]
        extra = {"relative_attention_num_buckets": buckets} if arch == "mpnet" and buckets else {}
        cfg = cls(**common, max_position_embeddings=max_positions + common["pad_token_id"] + 2, **extra)
    elif arch == "distilbert":
        cfg = DistilBertConfig(vocab_size=rows, dim=hidden, n_layers=layers, n_heads=heads,
                               hidden_dim=intermediate or 2 * hidden, max_position_embeddings=max_positions,
                               pad_token_id=v["[PAD]"], attn_implementation="eager")
    elif arch == "t5":
        # The T5 encoder as sentence-t5 / GTR use it: relative position bias (few buckets, so a tiny model's
        # bias varies across the test lengths), no score scaling, gated-GELU feed-forward.
        cfg = T5Config(vocab_size=rows, d_model=hidden, d_kv=hidden // heads, d_ff=intermediate or 2 * hidden,
                       num_layers=layers, num_heads=heads, relative_attention_num_buckets=buckets or 8,
                       relative_attention_max_distance=max_distance or 64, feed_forward_proj="gated-gelu", pad_token_id=v["[PAD]"],
                       eos_token_id=v["[EOS]"], use_cache=False,
                       architectures=["T5EncoderModel"], attn_implementation="eager")
    elif arch == "gemma3_text":
        # EmbeddingGemma: bidirectional attention, alternating sliding-window and global layers, GQA.
        cfg = Gemma3TextConfig(
            **common, num_key_value_heads=kv_heads or max(1, heads // 2), head_dim=head_dim or hidden // heads,
            max_position_embeddings=max_positions, sliding_window=window or 24, query_pre_attn_scalar=hidden // heads,
            layer_types=["full_attention" if (i + 1) % global_every == 0 else "sliding_attention"
                         for i in range(layers)],
            use_bidirectional_attention=True, bos_token_id=v["[CLS]"], eos_token_id=v["[EOS]"], use_cache=False,
        )
    elif arch == "qwen3":
        kv = kv_heads or max(1, heads // 2)
        cfg = Qwen3Config(
            **common,
            num_key_value_heads=kv,
            head_dim=head_dim or hidden // heads,
            max_position_embeddings=max_positions,
            eos_token_id=v["[EOS]"],
            bos_token_id=v["[EOS]"],
            tie_word_embeddings=False,
            use_cache=False,
        )
    else:
        cfg = ModernBertConfig(
            **common,
            max_position_embeddings=max_positions,
            local_attention=window or 64,
            global_attn_every_n_layers=global_every,
            cls_token_id=v["[CLS]"],
            sep_token_id=v["[SEP]"],
            bos_token_id=v["[CLS]"],
            eos_token_id=v["[SEP]"],
        )
    return cfg


@dataclass(frozen=True)
class SyntheticShape:
    """A deployed long-context model's attention shape at benchmark scale (few layers, random weights)."""

    arch: str
    kwargs: dict
    description: str


# `attncal bench --synthetic NAME`: what each family's attention costs at long context.
SYNTHETIC_SHAPES = {
    "long": SyntheticShape("xlm-roberta", dict(layers=4, hidden=256, heads=4, intermediate=1024, max_positions=8192),
                           "XLM-R (bge-m3's family), 4 layers, hidden 256, 4 heads, 8192 positions"),
    "embeddinggemma": SyntheticShape(
        "gemma3_text", dict(layers=6, hidden=768, heads=3, head_dim=256, kv_heads=1, window=512, global_every=6,
                            intermediate=1152, max_positions=8192),
        "EmbeddingGemma, 6 layers, hidden 768, 3 heads x 256 over 1 key/value head, bidirectional sliding window "
        "512 in 5 of 6 layers, 8192 positions"),
    "qwen3": SyntheticShape(
        "qwen3", dict(layers=4, hidden=1024, heads=16, head_dim=128, kv_heads=8, intermediate=3072,
                      max_positions=8192),
        "Qwen3-Embedding-0.6B's layer, 4 layers, hidden 1024, 16 heads x 128 over 8 key/value heads, causal, "
        "8192 positions"),
    "modernbert": SyntheticShape(
        "modernbert", dict(layers=6, hidden=768, heads=12, window=128, global_every=3, intermediate=1152,
                           max_positions=8192),
        "ModernBERT-base's layer, 6 layers, hidden 768, 12 heads, local attention 128 in 2 of 3 layers, "
        "8192 positions"),
    "mpnet": SyntheticShape(
        "mpnet", dict(layers=6, hidden=768, heads=12, intermediate=3072, buckets=32, max_positions=512),
        "MPNet-base's layer (all-mpnet-base-v2), 6 layers, hidden 768, 12 heads, relative position bias of 32 "
        "buckets, 512 positions"),
    "t5": SyntheticShape(
        "t5", dict(layers=6, hidden=768, heads=12, intermediate=2048, buckets=32, max_distance=128,
                   max_positions=512),
        "the T5-base encoder's layer (sentence-T5, GTR), 6 layers, d_model 768, 12 heads, gated-GELU 2048, "
        "relative position bias of 32 buckets up to 128, 512 tokens"),
}


def save_synthetic_model(
    arch: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    pooling: str | None = None,
    normalize: bool = True,
    max_seq_length: int | None = None,
    dense: tuple[tuple[int, str, bool], ...] = (),
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    **config_kwargs,
) -> Path:
    """Write a random-weight sentence-transformers model directory and return its path.

    `dense`: Dense modules after pooling, each (out_features, activation class name, bias), as distiluse
    (tanh) and EmbeddingGemma (two bias-free projections) have; `prompts` / `default_prompt_name`: the
    named prompts of `config_sentence_transformers.json`."""
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model = model_class(cfg).from_config(cfg, attn_implementation="eager")
    model.eval()
    max_pos = config_kwargs.get("max_positions", 256)
    max_len = max_seq_length or max_pos
    model.save_pretrained(out)
    make_tokenizer(arch, max_len).save_pretrained(out)
    pooling = pooling or DEFAULT_POOLING[arch]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    width = cfg.hidden_size
    for k, (features, activation, bias) in enumerate(dense):
        name = f"{len(modules)}_Dense"
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": name,
                        "type": "sentence_transformers.models.Dense"})
        _save_dense(out / name, width, features, activation, bias, seed + 100 + k)
        width = features
    if normalize:
        n = len(modules)
        modules.append({"idx": n, "name": str(n), "path": f"{n}_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    if prompts is not None:
        (out / "config_sentence_transformers.json").write_text(json.dumps(
            {"prompts": prompts, "default_prompt_name": default_prompt_name, "similarity_fn_name": "cosine"}, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": cfg.hidden_size,
                "pooling_mode_cls_token": pooling == "cls",
                "pooling_mode_mean_tokens": pooling == "mean",
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
                "pooling_mode_lasttoken": pooling == "last",
                "include_prompt": True,
            },
            indent=2,
        )
    )
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len, "do_lower_case": False}))
    return out


def _save_dense(path: Path, in_features: int, out_features: int, activation: str, bias: bool, seed: int) -> None:
    """A Dense module directory as sentence-transformers writes it (config.json + model.safetensors)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {"linear.weight": torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5}
    if bias:
        tensors["linear.bias"] = torch.randn(out_features, generator=gen) * 0.1
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "in_features": in_features, "out_features": out_features, "bias": bias,
        "activation_function": f"torch.nn.modules.{'linear' if activation == 'Identity' else 'activation'}.{activation}",
    }, indent=2))


def synthetic_text(n_chars: int, seed: int = 0) -> str:
    """Deterministic pseudo-text of about `n_chars` characters (one token per character)."""
    import random

    rng = random.Random(seed)
    words = []
    total = 0
    while total < n_chars:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8)))
        words.append(w)
        total += len(w) + 1
    return " ".join(words)[:n_chars]
