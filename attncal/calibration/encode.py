"""Reference embeddings from PyTorch: tokenize, forward with calibration, pool, normalise.

Every parity check in attncal compares against `encode_torch`, so it follows
the model's sentence-transformers conventions exactly (padding side, max
length, pooling, normalisation).
"""

from __future__ import annotations

import contextlib
import os
from typing import Sequence

import numpy as np
import torch

from ..modelinfo import (ModelInfo, choose_prompt, forward_kwargs, load_dense_head, load_model_info,
                         load_transformer)
from ..pooling import Pooling
from .config import CalibrationConfig
from .patching import LayerInputs, ResumeAt, calibrate


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling | str) -> torch.Tensor:
    """Pool token states [B,S,D] into [B,D] the way sentence-transformers does.

    `cls` takes the first valid token (position 0 with right padding), `last`
    the last valid token (works for both padding sides), `mean` the masked mean.  A row-set pooling is the
    mean of its rows: pass its `row_mask` as `attention_mask` with `mean`.
    """
    pooling = Pooling.of(pooling).kind
    mask = attention_mask != 0
    pos = torch.arange(mask.shape[1], device=mask.device)
    if pooling == "mean":
        m = mask.to(hidden.dtype).unsqueeze(-1)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    if pooling == "cls":
        idx = torch.where(mask, pos, mask.shape[1]).amin(-1).clamp(max=mask.shape[1] - 1)
    elif pooling == "last":
        idx = torch.where(mask, pos, -1).amax(-1).clamp(min=0)
    else:
        raise ValueError(f"{pooling} pooling is the mean of its rows: pool its row_mask with mean pooling")
    return torch.gather(hidden, 1, idx[:, None, None].expand(-1, 1, hidden.shape[-1])).squeeze(1)


class TorchEncoder:
    """A loaded model + tokenizer that encodes texts like sentence-transformers, optionally calibrated."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_length: int | None = None,
        attn_implementation: str = "sdpa",
    ) -> None:
        """`attn_implementation` is the model's attention ("sdpa" or "eager"); calibration keeps it
        (split attention on SDPA, calibrated probabilities on eager)."""
        from dataclasses import replace

        from transformers import AutoTokenizer

        self.info: ModelInfo = load_model_info(model_path)
        if max_length is not None:
            self.info = replace(self.info, max_seq_length=max_length)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.info.path))
        self.tokenizer.padding_side = self.info.padding_side
        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation must be 'sdpa' or 'eager', got {attn_implementation!r}")
        try:
            self.model = load_transformer(self.info.path, attn_implementation=attn_implementation, dtype=dtype)
        except ValueError as exc:
            if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(exc):
                raise
            # The model has no SDPA path (MPNet): its own eager attention, as sentence-transformers runs it.
            self.model = load_transformer(self.info.path, attn_implementation="eager", dtype=dtype)
        self.model.to(device).eval()
        self.head = load_dense_head(self.info, dtype)  # sentence-transformers Dense modules after pooling
        if self.head is not None:
            self.head.to(device)
        self.device = device

    def pooling_for(self, config: CalibrationConfig | None) -> Pooling:
        return (config or CalibrationConfig()).pooling.bind(self.info.pooling)

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        batch = self.tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=self.info.max_seq_length,
            return_tensors="pt",
        )
        return {k: v.to(self.device) for k, v in batch.items()}

    def forward(
        self, batch: dict[str, torch.Tensor], config: CalibrationConfig | None = None, implementation: str = "auto"
    ) -> torch.Tensor:
        """Pooled (and, per the model's config, normalised) embeddings of one tokenized batch."""
        return self.run(batch, config, implementation=implementation)[0]

    @torch.no_grad()
    def run(
        self,
        batch: dict[str, torch.Tensor],
        config: CalibrationConfig | None = None,
        *,
        implementation: str = "auto",
        capture: Sequence[int] = (),
        resume: tuple[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`forward`, and the input hidden states of the layers in `capture` ({layer: [B,S,D]}).

        `resume=(layer, hidden)` starts the forward at `layer` with `hidden` as its input (taken by an
        earlier `capture` of the same batch): the layers below are not computed, so configurations that
        calibrate only from `layer` up share them (`attncal.calibration.patching.ResumeAt`)."""
        pooling = self.pooling_for(config)
        kwargs = {**batch, **forward_kwargs(self.model)}
        with contextlib.ExitStack() as stack:
            if config is not None:
                stack.enter_context(calibrate(self.model, config, pooling=pooling, implementation=implementation))
            tap = stack.enter_context(LayerInputs(self.model, capture)) if capture else None
            if resume is not None:
                stack.enter_context(ResumeAt(self.model, *resume))
            hidden = self.model(**kwargs).last_hidden_state
        emb = pool(hidden, batch["attention_mask"], pooling)
        if self.head is not None:
            emb = self.head(emb)
        if self.info.normalize:
            emb = torch.nn.functional.normalize(emb, p=2, dim=-1)
        return emb, ({} if tap is None else tap.captured)

    def encode(
        self,
        texts: Sequence[str],
        config: CalibrationConfig | None = None,
        batch_size: int = 32,
        show_progress: bool = False,
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
    ) -> np.ndarray:
        """Embeddings of `texts`; prompts are chosen like `attncal.runtime.Encoder.encode` (and
        sentence-transformers)."""
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings, not a single string")
        text_prompt = choose_prompt(self.info.prompts, self.info.default_prompt_name, prompt_name, prompt)
        if text_prompt:
            texts = [text_prompt + t for t in texts]
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        from tqdm.auto import tqdm

        out = []
        starts = range(0, len(texts), batch_size)
        for i in tqdm(starts, desc="encode (torch)", disable=not show_progress, unit="batch"):
            out.append(self.forward(self.tokenize(texts[i : i + batch_size]), config).float().cpu().numpy())
        if not out:
            dim = self.info.dense[-1].out_features if self.info.dense else self.model.config.hidden_size
            return np.zeros((0, dim), dtype=np.float32)
        return np.concatenate(out, axis=0)


def encode_torch(
    model_path: str | os.PathLike,
    texts: Sequence[str],
    config: CalibrationConfig | None = None,
    batch_size: int = 32,
    show_progress: bool = False,
) -> np.ndarray:
    """Reference embeddings of `texts` (float32 [N,D]), calibrated when `config` is given."""
    return TorchEncoder(model_path).encode(texts, config, batch_size=batch_size, show_progress=show_progress)
