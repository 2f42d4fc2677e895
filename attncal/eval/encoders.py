"""Encoding backends for evaluation, the on-disk embedding cache and the Segment Embed Average baseline.

Two backends share one small interface (`encode(texts, config)`):

* `TorchBackend` - a model directory run through `attncal.calibration.TorchEncoder`;
  any calibration config can be evaluated, so it can sweep λ, baskets, layers.
* `OnnxBackend` - an `attncal export` directory run through `attncal.runtime.Encoder`;
  the calibration is baked into the graph, so only the stored config can be evaluated.

lmk, multi-cls and mean-every pooling are swept as configs with that pooling (`attncal.pooling.Pooling`), whose
tokenization (`attncal.runtime.landmarks`) the torch backend tokenizes with and pools by (strength 0: the pooling
alone, zero-shot).

Corpus embeddings are cached on disk under a key made of the model's
fingerprint, the calibration config (bound to the model's pooling), the data
hash and what was encoded, so a changed config (or model, or corpus) is a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..artifact import METADATA_FILE
from ..calibration.config import CalibrationConfig
from ..modelinfo import forward_kwargs
from ..runtime.encoder import Encoder
from ..runtime.landmarks import Landmarks, transformers_encode

CACHE_FORMAT = 2  # 2: the description holds the array's sha256, shape and dtype


def _file_stamp(path: Path) -> list:
    st = path.stat()
    return [path.name, st.st_size, int(st.st_mtime)]


def _json_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else ""


class TorchBackend:
    """A model directory (or `default`) evaluated in PyTorch; can apply any calibration config."""

    kind = "torch"

    def __init__(self, model: str | os.PathLike, *, batch_size: int = 32, max_length: int | None = None) -> None:
        from ..calibration.encode import TorchEncoder  # lazy: torch (the export extra), not needed to import eval

        self.encoder = TorchEncoder(model, max_length=max_length)
        self.info = self.encoder.info
        self.tokenizer = self.encoder.tokenizer
        self.max_length = self.info.max_seq_length
        self.batch_size = batch_size
        self.label = str(model)

    def bind(self, config: CalibrationConfig | None) -> CalibrationConfig | None:
        """The config with `auto` pooling replaced by the model's pooling, and a landmark pooling's token
        resolved against the model's tokenizer (what the cache key uses)."""
        if config is None:
            return None
        return config.with_pooling(self.encoder.pooling_for(config).resolve(self.tokenizer))

    def fingerprint(self) -> str:
        weights = sorted(p for p in self.info.path.iterdir() if p.suffix in (".safetensors", ".bin"))
        parts = [str(self.info.root), _json_hash(self.info.path / "config.json"), [_file_stamp(p) for p in weights],
                 self.max_length, self.info.pooling]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    def encode(self, texts: Sequence[str], config: CalibrationConfig | None, *, desc: str = "encode") -> np.ndarray:
        from tqdm.auto import tqdm

        pooled = self._pooled(config) if config is not None and config.pooling.row_set else None
        out = []
        for i in tqdm(range(0, len(texts), self.batch_size), desc=desc, unit="batch", leave=False):
            part = texts[i : i + self.batch_size]
            emb = pooled(part) if pooled is not None else self.encoder.forward(self.encoder.tokenize(part), config)
            out.append(emb.float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, self.encoder.model.config.hidden_size), np.float32)


    def landmarks(self, config: CalibrationConfig):
        """The tokenizer of an lmk / multi-cls / mean-every config (`attncal.runtime.landmarks.Landmarks`, called on texts):
        what every runtime of an export with that pooling tokenizes with."""
        tok = self.tokenizer
        return Landmarks(self.bind(config).pooling, transformers_encode(tok), max_length=self.max_length,
                         pad_id=tok.pad_token_id, padding_side=self.info.padding_side,
                         truncation_side=tok.truncation_side)

    def _pooled(self, config: CalibrationConfig):
        """Embeddings of a batch with landmark / Mean@k pooling: tokenized by `landmarks`, pooled over the
        config's rows (`row_mask`), then the Dense modules and the normalisation; calibrated, those are the rows
        calibrated (the patch marks them from the batch's input_ids)."""
        import torch

        from ..calibration.encode import pool  # lazy: torch (the export extra), not needed to import eval
        from ..calibration.patching import calibrate  # lazy: torch, as above

        config = self.bind(config)
        rc = config.resolve()
        landmarks = self.landmarks(config)
        enc = self.encoder
        names = set(self.tokenizer.model_input_names)

        @torch.no_grad()
        def run(texts: Sequence[str]) -> torch.Tensor:
            batch = {k: torch.from_numpy(v).to(enc.device) for k, v in landmarks(texts).items() if k in names}
            with calibrate(enc.model, config) if config.strength > 0 else contextlib.nullcontext():
                hidden = enc.model(**batch, **forward_kwargs(enc.model)).last_hidden_state
            emb = pool(hidden, rc.row_mask(batch["input_ids"], batch["attention_mask"]), "mean")
            if enc.head is not None:
                emb = enc.head(emb)
            return torch.nn.functional.normalize(emb, p=2, dim=-1) if self.info.normalize else emb

        return run


class OnnxBackend:
    """An `attncal export` directory run in ONNX Runtime; evaluates the stored config only."""

    kind = "onnx"

    def __init__(self, out_dir: str | os.PathLike, *, batch_size: int = 32) -> None:
        self.encoder = Encoder(out_dir)
        self.path = Path(out_dir)
        self.meta = self.encoder.meta
        self.tokenizer = self.encoder.tokenizer
        self.max_length = self.encoder.max_length
        self.batch_size = batch_size
        self.label = str(out_dir)
        cfg = self.meta.get("config")
        self.stored: CalibrationConfig | None = (
            CalibrationConfig.from_dict(cfg).bind(self.encoder.pooling) if self.meta.get("calibrated") else None
        )

    def bind(self, config: CalibrationConfig | None) -> CalibrationConfig | None:
        return None if config is None else config.with_pooling(self.encoder.pooling)

    def fingerprint(self) -> str:
        parts = [str(self.path.resolve()), _json_hash(self.path / METADATA_FILE),
                 _file_stamp(self.path / self.encoder.graph_file)]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    def encode(self, texts: Sequence[str], config: CalibrationConfig | None, *, desc: str = "encode") -> np.ndarray:
        if self.bind(config) != self.stored:
            raise ValueError(
                f"{self.path} is an export with calibration {self._describe(self.stored)}; it cannot be evaluated "
                f"with {self._describe(self.bind(config))}. Only the stored config can be evaluated from an export; "
                "pass the model directory to sweep configs"
            )
        from tqdm.auto import tqdm

        texts = list(texts)
        out = []
        for i in tqdm(range(0, len(texts), self.batch_size), desc=desc, unit="batch", leave=False):
            _, emb = self.encoder.run(self.encoder.tokenize(texts[i : i + self.batch_size]))
            out.append(emb.astype(np.float32))
        return np.concatenate(out) if out else np.zeros((0, self.encoder.dimension), np.float32)

    @staticmethod
    def _describe(cfg: CalibrationConfig | None) -> str:
        return "none" if cfg is None else cfg.to_json(sort_keys=True)


Backend = TorchBackend | OnnxBackend


def content_lengths(backend: Backend, texts: Sequence[str]) -> list[int]:
    """Token count of each text as the backend tokenizes it (special tokens included, truncated)."""
    enc = backend.tokenizer(list(texts), truncation=True, max_length=backend.max_length)
    return [len(ids) for ids in enc["input_ids"]]


def _array_sha256(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def _atomic_write(path: Path, write: Callable) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class EncodeCache:
    """Embeddings on disk as <key>.npy with a <key>.json description (sha256, shape, dtype of the
    array); both writes are atomic.  An entry that is truncated, corrupted or does not match its
    description is recomputed, rewritten, and listed in `repaired` (the run reports it)."""

    def __init__(self, root: str | os.PathLike | None) -> None:
        self.root = Path(root) if root is not None else None
        self.hits = 0
        self.misses = 0
        self.repaired: list[str] = []

    def _load(self, key: str) -> np.ndarray | None:
        """The cached array, None when absent; raises ValueError saying why a present entry is damaged."""
        npy, desc_file = self.root / f"{key}.npy", self.root / f"{key}.json"
        if not npy.exists():
            return None
        try:
            desc = json.loads(desc_file.read_text(encoding="utf-8"))
            expect = (desc["sha256"], tuple(desc["shape"]), desc["dtype"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"its description {desc_file.name} is missing or damaged ({type(exc).__name__})")
        try:
            arr = np.load(npy, allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:
            raise ValueError(f"{npy.name} cannot be read ({type(exc).__name__}: {str(exc)[:80]})")
        if (arr.shape, str(arr.dtype)) != expect[1:]:
            raise ValueError(f"{npy.name} holds {arr.dtype}{list(arr.shape)}, expected {expect[2]}{list(expect[1])}")
        if _array_sha256(arr) != expect[0]:
            raise ValueError(f"{npy.name} does not match its sha256 (corrupted)")
        return arr

    @staticmethod
    def key(backend: Backend, config: CalibrationConfig | None, data_fp: str, what: str) -> tuple[str, dict]:
        desc = {
            "format": CACHE_FORMAT,
            "backend": backend.kind,
            "model": backend.fingerprint(),
            "config": None if config is None else config.to_dict(),
            "data": data_fp,
            "what": what,
        }
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:24], desc

    def get_or_encode(
        self,
        backend: Backend,
        config: CalibrationConfig | None,
        data_fp: str,
        what: str,
        compute: Callable[[], np.ndarray],
    ) -> np.ndarray:
        config = backend.bind(config)
        if self.root is None:
            self.misses += 1
            return compute()
        key, desc = self.key(backend, config, data_fp, what)
        try:
            arr = self._load(key)
        except ValueError as why:  # a damaged entry is recomputed and reported, never fatal
            self.repaired.append(f"cache entry {self.root / key}.npy ({what}) was damaged and is recomputed: {why}")
            arr = None
        if arr is not None:
            self.hits += 1
            return arr
        arr = compute()
        self.misses += 1
        self.root.mkdir(parents=True, exist_ok=True)
        desc = dict(desc, sha256=_array_sha256(arr), shape=list(arr.shape), dtype=str(arr.dtype))
        _atomic_write(self.root / f"{key}.npy", lambda fh: np.save(fh, arr))
        _atomic_write(self.root / f"{key}.json", lambda fh: fh.write(json.dumps(desc, indent=1).encode()))
        return arr


# --------------------------------------------------------------------------- Segment Embed Average
def chunker_id() -> str:
    """Which SEA chunker `chunk_texts` uses here (part of the SEA cache key)."""
    try:
        import chonkie  # noqa: F401
    except ImportError:
        return "token-windows"
    return f"chonkie-recursive-{chonkie.__version__}"


def chunk_texts(backend: Backend, texts: Sequence[str], chunk_tokens: int) -> tuple[list[str], list[int], str]:
    """Split every text into chunks of at most about `chunk_tokens` tokens: (chunks, owner index, chunker name).

    Uses chonkie's RecursiveChunker (paragraphs, then sentences, then words)
    with the model's own tokenizer counting tokens when chonkie is installed;
    its chunks are exact substrings of the passage.  (chonkie's TokenChunker is
    not used: it decodes token ids back to text, which lower-cases and mangles
    WordPiece text.)  Without chonkie: fixed token windows cut at the
    tokenizer's character offsets.
    """
    if chunk_tokens < 1:
        raise ValueError(f"--sea-chunk-tokens must be >= 1, got {chunk_tokens}")
    chunks: list[str] = []
    owner: list[int] = []
    try:
        from chonkie import RecursiveChunker
    except ImportError:
        RecursiveChunker = None  # type: ignore[assignment]
    if RecursiveChunker is not None:
        chunker = RecursiveChunker(tokenizer=backend.tokenizer, chunk_size=chunk_tokens, min_characters_per_chunk=1)
        for i, text in enumerate(texts):
            pieces = [c.text.strip() for c in chunker.chunk(text) if c.text.strip()] or [text]
            chunks.extend(pieces)
            owner.extend([i] * len(pieces))
        return chunks, owner, f"chonkie RecursiveChunker ({chunk_tokens} tokens)"
    for i, text in enumerate(texts):
        offsets = backend.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if not offsets:
            chunks.append(text)
            owner.append(i)
            continue
        for s in range(0, len(offsets), chunk_tokens):
            window = offsets[s : s + chunk_tokens]
            chunks.append(text[window[0][0] : window[-1][1]])
            owner.append(i)
    return chunks, owner, f"fixed token windows ({chunk_tokens} tokens)"


def segment_embed_average(backend: Backend, texts: Sequence[str], chunk_tokens: int) -> tuple[np.ndarray, str]:
    """Uncalibrated embedding of each chunk, averaged per passage and L2-normalised."""
    chunks, owner, chunker = chunk_texts(backend, texts, chunk_tokens)
    emb = backend.encode(chunks, None, desc="encode SEA chunks")
    out = np.zeros((len(texts), emb.shape[1]), dtype=np.float64)
    np.add.at(out, np.asarray(owner), emb.astype(np.float64))
    out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out.astype(np.float32), chunker
