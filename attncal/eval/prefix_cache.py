"""The hidden states a calibration sweep shares: every configuration's input to its first calibrated layer.

Calibration changes nothing below the first calibrated layer, so the uncalibrated model's input to that
layer is the same for every configuration that starts there.  `attncal tune` computes it once, in the
uncalibrated pass, and keeps it here, on disk: one float32 array [tokens, hidden] per layer holding the
valid (unpadded) token rows of every passage, in corpus order.  Arrays are written and read through
`numpy.memmap`, so memory holds one batch at a time whatever the corpus size.

An entry is keyed by the model's digest (the bytes of its files: weights, config and tokenizer), the
torch version and dtype, the texts in order, the max length and the layer.  Its description (JSON, written
last) holds the file's sha256 and the per-passage token counts' hash; an entry that does not match is
recomputed, as the embedding cache does (`attncal.eval.encoders.EncodeCache`).  The size of what a run
will write is estimated before it starts and refused over the budget (`check_budget`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

FORMAT = 1
DTYPE = np.float32  # exact for float32, float16 and bfloat16 models (cast back when resuming)
CHUNK = 16 << 20  # bytes hashed at a time: the check's memory bound
_SKIP_SUFFIXES = (".md", ".txt", ".png", ".jpg", ".gif")  # a model card or image changes no hidden state


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def model_digest(model_dir: str | os.PathLike) -> str:
    """sha256 over the names and bytes of the files in the model directory (weights, config, tokenizer)."""
    root = Path(model_dir)
    h = hashlib.sha256()
    for f in sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")
                    and p.suffix.lower() not in _SKIP_SUFFIXES):
        h.update(f.name.encode() + b"\0" + file_sha256(f).encode() + b"\1")
    return h.hexdigest()[:32]


def lengths_hash(lengths: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:16]


def estimate_bytes(lengths: Sequence[int], hidden: int, layers: int) -> int:
    """Bytes of `layers` arrays of every passage's token rows."""
    return int(sum(lengths)) * int(hidden) * np.dtype(DTYPE).itemsize * int(layers)


def check_budget(needed: int, budget: int, where: Path, what: str) -> None:
    """Refuse (ValueError, one line) when `needed` bytes exceed the budget or the free space at `where`."""
    gib = 2.0 ** 30
    if needed > budget:
        raise ValueError(f"the hidden-state cache would take {needed / gib:.2f} GiB ({what}), over the budget of "
                         f"{budget / gib:.2f} GiB; raise --cache-budget, sample fewer passages (--max-passages) or "
                         "use a grid whose configurations start at fewer distinct layers")
    probe = where
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise ValueError(f"the hidden-state cache would take {needed / gib:.2f} GiB ({what}) but {probe} has "
                         f"{free / gib:.2f} GiB free; choose another --cache directory")


class HiddenStates:
    """Each passage's token rows at one or more layers, read from memory-mapped arrays."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.arrays: dict[int, np.ndarray] = {}

    def rows(self, layer: int, passages: Sequence[int]) -> np.ndarray:
        """The token rows of `passages`, concatenated in that order: [sum of their lengths, hidden]."""
        arr = self.arrays[layer]
        return np.concatenate([arr[self.offsets[i]:self.offsets[i + 1]] for i in passages])


class HiddenCache:
    """Where the hidden states live: `root` (kept across runs), or a temporary directory removed by
    `close()` when `root` is None."""

    def __init__(self, root: str | os.PathLike | None) -> None:
        self.persistent = root is not None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="attncal-hidden-"))
        self.repaired: list[str] = []
        self.hits = 0
        self.writes = 0

    def close(self) -> None:
        if not self.persistent:
            shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def describe(digest: str, texts_hash: str, max_length: int | None, layer: int, lengths: Sequence[int],
                 hidden: int, torch_dtype: str) -> tuple[str, dict]:
        import torch

        desc = {"format": FORMAT, "model": digest, "torch": torch.__version__, "dtype": torch_dtype,
                "texts": texts_hash, "max_length": max_length, "layer": layer, "passages": len(lengths),
                "lengths": lengths_hash(lengths), "shape": [int(sum(lengths)), int(hidden)],
                "stored_dtype": np.dtype(DTYPE).name}
        key = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:24]
        return key, desc

    def open(self, key: str, desc: dict) -> np.ndarray | None:
        """The stored array (memory-mapped) when present and intact, else None (a damaged entry is
        removed and reported in `repaired`)."""
        npy, meta = self.root / f"{key}.npy", self.root / f"{key}.json"
        if not npy.exists() or not meta.exists():
            return None
        try:
            stored = json.loads(meta.read_text(encoding="utf-8"))
            arr = np.load(npy, mmap_mode="r", allow_pickle=False)
            why = None
            if {k: stored.get(k) for k in desc} != desc:
                why = "its description does not match"
            elif list(arr.shape) != desc["shape"] or arr.dtype != DTYPE:
                why = f"it holds {arr.dtype}{list(arr.shape)}, expected {np.dtype(DTYPE).name}{desc['shape']}"
            elif file_sha256(npy) != stored.get("sha256"):
                why = "it does not match its sha256 (corrupted)"
        except (OSError, ValueError, EOFError) as exc:
            why = f"it cannot be read ({type(exc).__name__})"
        if why is None:
            self.hits += 1
            return arr
        self.repaired.append(f"hidden-state cache entry {npy} was damaged and is recomputed: {why}")
        npy.unlink(missing_ok=True)
        meta.unlink(missing_ok=True)
        return None

    def writer(self, key: str, desc: dict) -> "EntryWriter":
        self.root.mkdir(parents=True, exist_ok=True)
        return EntryWriter(self, key, desc)


class EntryWriter:
    """One entry being written: rows go into a memory-mapped temporary file; `commit()` hashes it,
    writes the description and renames both into place (atomic: a reader sees a whole entry or none)."""

    def __init__(self, cache: HiddenCache, key: str, desc: dict) -> None:
        self.cache, self.key, self.desc = cache, key, desc
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".npy", dir=cache.root)
        os.close(fd)
        self.tmp = Path(tmp)
        self.array = np.lib.format.open_memmap(self.tmp, mode="w+", dtype=DTYPE, shape=tuple(desc["shape"]))

    def write(self, offset: int, rows: np.ndarray) -> None:
        self.array[offset:offset + len(rows)] = rows

    def commit(self) -> np.ndarray:
        self.array.flush()
        del self.array
        root = self.cache.root
        desc = dict(self.desc, sha256=file_sha256(self.tmp))
        os.chmod(self.tmp, 0o644)
        os.replace(self.tmp, root / f"{self.key}.npy")
        fd, tmp_meta = tempfile.mkstemp(prefix=f".{self.key}.", suffix=".json", dir=root)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(desc, indent=1))
        os.chmod(tmp_meta, 0o644)
        os.replace(tmp_meta, root / f"{self.key}.json")
        self.cache.writes += 1
        return np.load(root / f"{self.key}.npy", mmap_mode="r", allow_pickle=False)

    def abort(self) -> None:
        if hasattr(self, "array"):
            del self.array
        self.tmp.unlink(missing_ok=True)
