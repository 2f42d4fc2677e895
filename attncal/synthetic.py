"""Random-weight models with real tokenizers, built locally (nothing is downloaded).

Tests and benchmarks need every supported architecture, and long-context
shapes that no small real checkpoint offers.  These builders write complete
sentence-transformers directories (weights, config, tokenizer, modules.json,
Pooling config), so they go through exactly the same loading code as a real
model.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import torch

ARCHITECTURES = ("bert", "xlm-roberta", "qwen3", "modernbert")
DEFAULT_POOLING = {"bert": "cls", "xlm-roberta": "cls", "qwen3": "last", "modernbert": "cls"}
_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[EOS]"]
_CHARS = string.ascii_lowercase + string.digits + ".,;:!?'-()\""


def _vocab() -> dict[str, int]:
    """A character-level WordPiece vocabulary: any ASCII text tokenizes, one token per character."""
    words = _SPECIALS + list(_CHARS) + ["##" + c for c in _CHARS]
    return {w: i for i, w in enumerate(words)}


def vocab_size() -> int:
    return 128  # >= len(_vocab()), a round number for the embedding table


def make_tokenizer(arch: str, max_length: int):
    """A fast tokenizer with the conventions of `arch` (CLS/SEP, or EOS + left padding for qwen3)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = _vocab()
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=1000))
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()])
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if arch == "qwen3":
        tok.post_processor = TemplateProcessing(single="$A [EOS]", special_tokens=[("[EOS]", vocab["[EOS]"])])
        specials = dict(pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
        padding_side = "left"
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
):
    """A transformers config for a small model of `arch` with eager attention."""
    from transformers import BertConfig, ModernBertConfig, Qwen3Config, XLMRobertaConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {', '.join(ARCHITECTURES)}")
    v = _vocab()
    common = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate or 2 * hidden,
        vocab_size=vocab_size(),
        pad_token_id=v["[PAD]"],
    )
    if arch == "bert":
        cfg = BertConfig(**common, max_position_embeddings=max_positions)
    elif arch == "xlm-roberta":
        # XLM-R position ids start at padding_idx + 1.
        cfg = XLMRobertaConfig(**common, max_position_embeddings=max_positions + common["pad_token_id"] + 2)
    elif arch == "qwen3":
        kv = max(1, heads // 2)
        cfg = Qwen3Config(
            **common,
            num_key_value_heads=kv,
            head_dim=hidden // heads,
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
            local_attention=64,
            global_attn_every_n_layers=2,
            cls_token_id=v["[CLS]"],
            sep_token_id=v["[SEP]"],
            bos_token_id=v["[CLS]"],
            eos_token_id=v["[SEP]"],
        )
    cfg._attn_implementation = "eager"
    return cfg


def save_synthetic_model(
    arch: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    pooling: str | None = None,
    normalize: bool = True,
    max_seq_length: int | None = None,
    **config_kwargs,
) -> Path:
    """Write a random-weight sentence-transformers model directory and return its path."""
    from transformers import AutoModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModel.from_config(cfg, attn_implementation="eager")
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
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
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
