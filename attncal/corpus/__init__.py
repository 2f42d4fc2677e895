"""Re-index a corpus with a calibrated export: streaming input, Parquet shards, resume, three engines,
local paths or object storage.

`encode_corpus` is the Python API of `attncal encode`; see docs/reindexing.md.
"""

from .api import ENGINES, EncodeResult, encode_corpus, scan
from .inputs import BadRow, CorpusInputError, resolve_inputs
from .shards import MANIFEST, SKIP_FILE, load_manifest, read_embeddings
from .storage import StorageError

__all__ = ["ENGINES", "BadRow", "CorpusInputError", "EncodeResult", "MANIFEST", "SKIP_FILE", "encode_corpus",
           "StorageError", "load_manifest", "read_embeddings", "resolve_inputs", "scan"]
