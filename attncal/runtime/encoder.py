"""`Encoder`: encode texts with an exported (calibrated or not) ONNX model in ONNX Runtime."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ..export.exporter import METADATA_FILE, ONNX_FILE, ONNX_SUBDIR
from ..modelinfo import ModelNotFoundError


def load_metadata(out_dir: str | os.PathLike) -> dict:
    path = Path(out_dir) / METADATA_FILE
    if not path.exists():
        raise ModelNotFoundError(f"{out_dir} is not an attncal export: {METADATA_FILE} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from None


def default_providers() -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    preferred = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    return [p for p in preferred if p in available]


class Encoder:
    """Tokenizes like the source model, batches by length and runs the ONNX session.

    `providers` defaults to TensorRT/CUDA when the installed onnxruntime offers
    them, else CPU.  `custom_op_library` registers the attncal native kernels
    (see plugins/), which then replace the function body.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        providers: Sequence[str] | None = None,
        *,
        custom_op_library: str | os.PathLike | None = None,
        intra_op_threads: int | None = None,
        session_options=None,
    ) -> None:
        import onnxruntime as ort
        from transformers import AutoTokenizer

        self.path = Path(out_dir)
        self.meta = load_metadata(self.path)
        model_file = self.path / ONNX_SUBDIR / ONNX_FILE
        if not model_file.exists():
            raise ModelNotFoundError(f"{model_file} is missing")
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.tokenizer.padding_side = self.meta.get("padding_side", "right")
        self.max_length = self.meta.get("max_seq_length")
        so = session_options or ort.SessionOptions()
        if intra_op_threads is not None:
            so.intra_op_num_threads = intra_op_threads
        if custom_op_library is not None:
            lib = Path(custom_op_library)
            if not lib.exists():
                raise FileNotFoundError(f"custom-op library {lib} not found")
            so.register_custom_ops_library(str(lib))
        self.session = ort.InferenceSession(str(model_file), so, providers=list(providers or default_providers()))
        self.input_names = [i.name for i in self.session.get_inputs()]

    @property
    def dimension(self) -> int:
        dim = self.session.get_outputs()[1].shape[-1]
        if isinstance(dim, int):
            return dim
        import json as _json

        return int(_json.loads((self.path / "config.json").read_text())["hidden_size"])

    def tokenize(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        batch = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                               return_tensors="np")
        return {n: batch[n].astype(np.int64) for n in self.input_names}

    def run(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Raw session call: (last_hidden_state, sentence_embedding)."""
        hidden, emb = self.session.run(["last_hidden_state", "sentence_embedding"], feeds)
        return hidden, emb

    def encode(
        self,
        texts: Sequence[str],
        batch_size: int = 32,
        show_progress: bool = False,
        sort_by_length: bool = True,
    ) -> np.ndarray:
        """`sentence_embedding` of every text, float32 [N, D], in input order."""
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings, not a single string")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        from tqdm.auto import tqdm

        texts = list(texts)
        order = np.arange(len(texts))
        if sort_by_length and texts:
            lengths = [len(ids) for ids in self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]]
            order = np.argsort(lengths, kind="stable")[::-1]
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        for i in tqdm(range(0, len(texts), batch_size), desc="encode (onnx)", disable=not show_progress, unit="batch"):
            idx = order[i : i + batch_size]
            _, emb = self.run(self.tokenize([texts[j] for j in idx]))
            out[idx] = emb
        return out
