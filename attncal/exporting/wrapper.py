"""The module that is exported: encoder + pooling + normalisation, so the graph returns
`sentence_embedding` directly, pooled exactly like `encode_torch`.

The pooling head is written with ops whose output shapes ONNX Runtime's symbolic shape
inference (onnxruntime/tools/symbolic_shape_infer.py, run by its transformer optimizer) knows.
It has no handler for ReduceL2 / ReduceMin / ReduceMax, and ONNX's single-node inference it
falls back to cannot read their opset-18 `axes` input (a Constant node): their outputs get no
shape, and the next Expand (`F.normalize`'s `expand_as`) or Unsqueeze (`amin(...)[:, None]`)
raises a TypeError.  The optimizer then disables shape inference and leaves Add +
LayerNormalization unfused (no SkipLayerNormalization).  ReduceSum, ArgMin and ArgMax it
infers, so the head below uses those; results are the same as `attncal.calibration.encode.pool`
and `F.normalize` (the same positions are gathered; the norm is sqrt(sum(x*x))).

Landmark and Mean@k pooling (`attncal.runtime.landmarks`) are the mean over the rows the calibration
config's `row_mask` selects from the graph's own inputs (the rows it calibrates: Equal, or CumSum / Mod, And
with the mask), so the graph's inputs stay input_ids, attention_mask (and token_type_ids).
"""

from __future__ import annotations

import torch
from torch import nn

from ..calibration.encode import pool
from ..pooling import Pooling

_NORM_EPS = 1e-12  # F.normalize's default eps


def export_pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling | str) -> torch.Tensor:
    """`attncal.calibration.encode.pool`, with ArgMin/ArgMax instead of ReduceMin/ReduceMax for cls / last."""
    pooling = Pooling.of(pooling).kind
    if pooling not in ("cls", "last"):
        return pool(hidden, attention_mask, pooling)  # mean: ReduceSum only; others raise there
    mask = attention_mask != 0
    seq = mask.shape[1]
    pos = torch.arange(seq, device=mask.device)
    if pooling == "cls":
        # pool: where(mask, pos, S).amin(-1).clamp(max=S-1), i.e. the first valid position, S-1 when none.
        # The valid positions are distinct, so argmin finds the minimum; on the reversed row, ties (no valid
        # token: every entry S) resolve to the first entry there, i.e. position S-1.
        idx = (seq - 1) - torch.where(mask, pos, seq).flip(-1).argmin(-1)
    else:
        # pool: where(mask, pos, -1).amax(-1).clamp(min=0): the last valid position (its value is its index),
        # 0 when none (every entry -1, argmax takes the first).
        idx = torch.where(mask, pos, -1).argmax(-1)
    return torch.gather(hidden, 1, idx[:, None, None].expand(-1, 1, hidden.shape[-1])).squeeze(1)


def export_normalize(emb: torch.Tensor) -> torch.Tensor:
    """`F.normalize(emb, p=2, dim=-1)` as emb / max(sqrt(sum(emb * emb)), eps) (ReduceSum, no ReduceL2 / Expand).

    Half precision keeps F.normalize: a float16 sum of squares can overflow, and no ORT-optimized
    graph is written for fp16 exports (exporter.optimized_graph_applies)."""
    if emb.dtype in (torch.float16, torch.bfloat16):
        return nn.functional.normalize(emb, p=2, dim=-1)
    return emb / (emb * emb).sum(-1, keepdim=True).sqrt().clamp_min(_NORM_EPS)


class SentenceEmbeddingModule(nn.Module):
    def __init__(self, model: nn.Module, pooling: Pooling, normalize: bool, extra: dict | None = None,
                 head: nn.Module | None = None) -> None:
        """`pooling`: concrete, a landmark kind's token resolved (`ExportPlan.pooling`); `extra`: fixed forward keyword arguments
        (`modelinfo.forward_kwargs`: no KV cache for decoders); `head`: the sentence-transformers Dense modules
        (`modelinfo.load_dense_head`), after pooling."""
        super().__init__()
        self.model = model
        self.head = head
        self.pooling = Pooling.of(pooling)  # lmk / multi-cls / mean-every pool its row_mask, as calibration selects
        self.normalize = normalize
        self.extra = dict(extra or {})

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        kwargs.update(self.extra)
        hidden = self.model(**kwargs).last_hidden_state
        if self.pooling.row_set:
            emb = export_pool(hidden, self.pooling.row_mask(input_ids, attention_mask), "mean")
        else:
            emb = export_pool(hidden, attention_mask, self.pooling)
        if self.head is not None:
            emb = self.head(emb)
        if self.normalize:
            emb = export_normalize(emb)
        return hidden, emb
