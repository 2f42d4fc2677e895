"""A real-prose example corpus that every Python installation already has: the Python Language Reference.

CPython ships the text of its Language Reference and parts of the Library
Reference ("Built-in Types") as `pydoc_data.topics` (what `help("for")` shows),
rendered from the reStructuredText sources of docs.python.org to plain text.
It is human-written technical prose, about 80 sections, under the Python
Software Foundation License Version 2 (the documentation's code examples are
additionally under the Zero-Clause BSD licence; they are dropped here anyway,
see `text.prose_blocks`).  Using it needs no download and no extra dependency,
so `attncal eval --make-posq-example DIR` works offline and in CI.

Its text follows the running Python version, so the set (and any table made
from it) is tied to that version; the manifest records it together with a hash
of the text.
"""

from __future__ import annotations

import hashlib
import os
import platform
from typing import Callable

from .data import DataError
from .posq_builder import Document, PosqOptions, PosqSet, make_posq

SOURCE_NAME = "Python Language Reference (pydoc_data.topics)"
LICENSE = "PSF-2.0 (Python Software Foundation License Version 2); code examples 0BSD"
URL = "https://docs.python.org/3/reference/"


def python_reference_documents() -> tuple[list[Document], dict]:
    """One document per pydoc topic (sorted by name), and a source record for the manifest."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DataError("this Python has no pydoc_data module (some distributions strip it); "
                        "use --make-posq DOCS with your own documents instead") from None
    h = hashlib.sha256()
    docs = []
    for name in sorted(topics):
        text = topics[name]
        h.update(name.encode() + b"\0" + text.encode() + b"\1")
        docs.append(Document(f"pydoc:{name}", text))
    source = {"path": "pydoc_data.topics", "kind": "python-reference", "name": SOURCE_NAME, "license": LICENSE,
              "url": URL, "python": platform.python_version(), "documents": len(docs), "sha256": h.hexdigest()}
    return docs, source


def make_posq_example(out: str | os.PathLike, model: str | os.PathLike = "default", opts: PosqOptions | None = None,
                      *, overwrite: bool = False, warn: Callable[[str], None] | None = None) -> PosqSet:
    """The real-prose example set (`attncal eval --make-posq-example DIR`): `make_posq` on these documents,
    passages counted with MODEL's tokenizer (a model directory, `default` or an export), written to OUT."""
    return make_posq(python_reference_documents(), out, model, opts, overwrite=overwrite, warn=warn)
