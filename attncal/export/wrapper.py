"""The module that is exported: encoder + pooling + normalisation, so the graph returns
`sentence_embedding` directly, pooled exactly like `encode_torch`."""

from __future__ import annotations

import torch
from torch import nn

from ..calibration.encode import pool


class SentenceEmbeddingModule(nn.Module):
    def __init__(self, model: nn.Module, pooling: str, normalize: bool, decoder: bool = False) -> None:
        super().__init__()
        self.model = model
        self.pooling = pooling
        self.normalize = normalize
        self.decoder = decoder

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        if self.decoder:
            kwargs["use_cache"] = False
        hidden = self.model(**kwargs).last_hidden_state
        emb = pool(hidden, attention_mask, self.pooling)
        if self.normalize:
            emb = nn.functional.normalize(emb, p=2, dim=-1)
        return hidden, emb
