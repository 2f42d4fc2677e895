"""What every `attncal eval` report writer shares: the OUT checks, the atomic directory and JSON helpers.

`attncal eval` (one model, a sweep of configs) and `attncal eval --compare`
(several exports) write the same kind of output directory; keeping the rules
here means both refuse a non-empty OUT the same way and both leave nothing
half-written behind when they fail.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..artifact import commit_dir
from ..versions import library_versions as installed_versions


def check_out_dir(out: str | Path | None, overwrite: bool) -> Path | None:
    """`out` as a Path, refused up front when it is a file or a non-empty directory without `overwrite`.

    Checked before any encoding, so that a run that could not write its report
    does not spend minutes first."""
    if out is None:
        return None
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is a file, not an output directory")
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty; pass --overwrite to replace it")
    return path


@contextlib.contextmanager
def atomic_output_dir(out: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success it replaces `out`, on failure it is removed.

    A reader of `out` therefore sees either the old report or the complete new
    one, never a mix (the same rule as `attncal export` and `bench --out`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        commit_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def hash_texts(texts: Sequence[str]) -> str:
    """A short hash of a list of texts, in order: the encode-cache key of the queries."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def display_path(path: str | Path | None) -> str | None:
    """`path` as `~/...` when it lies under the home directory, else as given: results.json is shared and
    committed, and names no one's home."""
    if path is None:
        return None
    try:
        return str(Path("~") / Path(path).resolve().relative_to(Path.home().resolve()))
    except ValueError:
        return str(path)


def cache_record(cache) -> dict:
    """What results.json records about the embedding cache (attncal.eval.encoders.EncodeCache)."""
    return {"dir": display_path(cache.root), "hits": cache.hits, "misses": cache.misses,
            "repaired": list(cache.repaired)}


def library_versions() -> dict:
    """Versions of the libraries a result depends on, recorded in results.json for reproducing it."""
    return installed_versions(("attncal", "ir-measures", "torch", "transformers", "onnxruntime", "chonkie"))


def json_default(o):
    """`json.dumps` default: NaN as null, numpy scalars as Python numbers."""
    if isinstance(o, float) and math.isnan(o):
        return None
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
