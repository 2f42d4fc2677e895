"""The export directory's layout: its file names, the limits on what an export may make a reader read or
allocate, the format versions, and the error every reader raises.

Layout of OUT (sentence-transformers / optimum style):

    attncal.json                 metadata (`attncal.artifact.metadata` reads, validates and writes it)
    config.json, tokenizer.json  the source model's config and tokenizer files, ...
    onnx/model.onnx              the portable graph (standard ONNX)
    onnx/model_optimized.onnx    the ORT-optimized graph (BERT family), optional
    onnx/model_inlined.onnx      the portable graph with its functions inlined (standard ONNX only), optional
    onnx/<graph>.onnx_data       a graph's weights, beside it, above 2 GiB (`model.onnx_data`, ...), and
                                 for a native graph whose feed-forward blocks run over chunks of rows

Format versions: 1 (the first exports) and 2 (adds `files`, the model files a loader needs, and an
`attncal.digest` in each graph's ONNX metadata, `attncal.artifact.onnx_io`).

Every command that writes a directory builds it beside its destination and commits it whole (`commit_dir`), and
a file is written through a temporary name (`write_text_atomic`), so a reader never sees half of one.
"""

from __future__ import annotations

import os
from pathlib import Path

ONNX_SUBDIR = "onnx"
ONNX_FILE = "model.onnx"
OPTIMIZED_FILE = "model_optimized.onnx"  # optimum's name for the ORT-optimized graph
# The ORT-optimized graph with the calibrated attention op (attention placement): run where the attncal
# native library is loaded; the calibrated export writes it beside model_optimized.onnx (split placement,
# no custom op), which runs everywhere else.
NATIVE_FILE = "model_optimized_native.onnx"
# The portable graph with every model-local function inlined, attribute references bound (attncal.exporting.inline):
# standard ONNX only, for the runtimes that do not read ONNX functions (OpenVINO); `attncal export --inlined`.
INLINED_FILE = "model_inlined.onnx"
EXTERNAL_DATA_FILE = "model.onnx_data"
METADATA_FILE = "attncal.json"
EXPORT_LOG_FILE = "attncal-export.log"  # what the libraries wrote during `attncal export` (attncal.console)
CONFIG_FILE = "config.json"
PORTABLE_GRAPH = f"{ONNX_SUBDIR}/{ONNX_FILE}"
OPTIMIZED_GRAPH = f"{ONNX_SUBDIR}/{OPTIMIZED_FILE}"
NATIVE_GRAPH = f"{ONNX_SUBDIR}/{NATIVE_FILE}"
INLINED_GRAPH = f"{ONNX_SUBDIR}/{INLINED_FILE}"
GRAPH_FILES = (PORTABLE_GRAPH, OPTIMIZED_GRAPH, NATIVE_GRAPH, INLINED_GRAPH)
FORMAT_VERSION = 3  # 3: `pooling` is attncal.pooling.Pooling.to_json() (2: a word plus `pooling_spec`)
SUPPORTED_FORMATS = (1, 2, 3)
DIGEST_KEY = "attncal.digest"
TWO_GIB = 2 * 1024**3
# The limits on what an export can make attncal read or allocate (docs/threat-model.md).  A graph file is one
# protobuf message, which cannot exceed 2 GiB, so a larger one is not a graph; it is refused before it is read
# into memory.
GRAPH_FILE_LIMIT = TWO_GIB - 1
# attncal.json, config.json and the tokenizer files are read whole into memory.  The largest real ones are
# tokenizer.json files of 250k-token vocabularies, about 35 MB; 256 MiB leaves seven times that and keeps a
# hostile file from filling the memory of every process that opens the export.
LOADER_FILE_LIMIT = 256 * 1024**2
# attncal.json's `max_seq_length`: tokenizers truncate to it and Triton's tokenizer model pads every batch to it.
# The longest-context text encoders take 128k tokens; 2^20 is eight times that.
MAX_SEQ_LENGTH_LIMIT = 2**20
# Layer counts (attncal.json's `num_layers`) and model dimensions (config.json's hidden size and head count, which
# size the serving configs and the parity check's batches).  The largest transformers have 16,384-wide hidden
# states and under 200 layers; 2^16 is four times the widest.
DIMENSION_LIMIT = 2**16
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
# Above this many tokens, or with no max length, an export is a long-context one: its sessions run without ONNX
# Runtime's memory pattern (attncal.runtime.encoder) and its native graph runs its feed-forward blocks over
# chunks of rows (attncal.graphs.fusions.feed_forward_chunks).
LONG_CONTEXT_TOKENS = 512
# attncal.json's "tokenizer": what runs the export's tokenizer.  "tokenizers": its tokenizer.json alone, which the
# exporter found to give transformers' ids (attncal.runtime.tokenizer); "transformers" (or no key): AutoTokenizer.
TOKENIZERS = ("tokenizers", "transformers")
REQUIRED_INPUTS = ("input_ids", "attention_mask")
OUTPUT_NAMES = ("last_hidden_state", "sentence_embedding")
# Root files a loader (tokenizer, transformers, sentence-transformers) needs; format 2 lists
# the ones an export has under `files`, and a missing one is reported.
LOADER_FILES = frozenset({
    CONFIG_FILE, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "sentencepiece.bpe.model", "spiece.model", "tokenizer.model",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
})


class ArtifactError(ValueError):
    """An export (or a file of it) is missing, unreadable, corrupted or not an attncal export.

    `path` is the offending file or directory; the message is "PATH: problem"."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")

    def __reduce__(self):  # picklable across process pools
        return (type(self), (str(self.path), self.problem))


class MissingArtifactError(ArtifactError, FileNotFoundError):
    """A file or directory of the export does not exist (also a FileNotFoundError)."""


def write_text_atomic(path: Path, text: str) -> None:
    """Write through a temporary name and rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.writing-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def commit_dir(tmp: Path, out: Path) -> None:
    """Move a completed `tmp` directory to `out`, replacing an old `out` only once `tmp` is complete.

    Every command that writes a directory (export, triton-repo, bench --out, eval --out) builds it
    in a temporary directory beside `out` and commits it here, so a failure leaves no half-written
    output."""
    import shutil
    import tempfile

    trash = None
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / "old")
    os.replace(tmp, out)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def loader_files(out_dir: str | os.PathLike) -> list[str]:
    """The loader files present at the root of a directory (what format 2 records under `files`)."""
    return sorted(f.name for f in Path(out_dir).iterdir() if f.is_file() and f.name in LOADER_FILES)


def graph_files(meta: dict) -> list[str]:
    """The export's graphs, relative to OUT, portable first."""
    graphs = meta.get("graphs")
    return sorted(graphs, key=lambda g: g != PORTABLE_GRAPH) if graphs else [PORTABLE_GRAPH]


def is_long_context(max_seq_length: int | None) -> bool:
    """Whether an export of `max_seq_length` tokens is a long-context one (`LONG_CONTEXT_TOKENS`)."""
    return max_seq_length is None or max_seq_length > LONG_CONTEXT_TOKENS


def looks_like_export(path: str | os.PathLike) -> bool:
    """Whether `path` is meant to be an export (attncal.json or an onnx/ directory), damaged or not."""
    p = Path(path)
    try:
        if not p.is_dir():
            return False
        if not os.access(p, os.R_OK | os.X_OK) or not p.stat().st_mode & 0o444:
            return True  # unreadable: let open_export say so
        return (p / METADATA_FILE).exists() or (p / ONNX_SUBDIR).is_dir()
    except OSError:
        return False
