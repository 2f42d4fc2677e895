"""The attncal export directory format: its layout, `attncal.json`, and its ONNX files.

One package owns what an export directory is, so every reader (the runtime, the exporter's parity check,
serving, bench, eval, the CLI) validates it the same way and reports a damaged export the same way: one
`ArtifactError` (a `ValueError`) whose message starts with the file and says what is wrong with it, instead of
a protobuf or JSON traceback from deep inside a library.  Its rooms:

* `layout`: the file names, the limits, the format versions, the error, atomic writes;
* `checks`: the checks on untrusted input, made before anything in an export is read or followed;
* `metadata`: `attncal.json`, its schema and validation;
* `onnx_io`: the graphs' digests, and their reading and writing with the weights streamed (protobuf
  fragments, external data);
* `export_dir`: a whole export, opened and validated (`open_export`).

Every public name of the rooms is importable from `attncal.artifact` (below); each is defined in its room.
`INLINE_LIMIT` (the tensor bytes from which a graph is written with external data) is read, and lowered by
tests, in `attncal.artifact.onnx_io` only.

Layering: this package sits below export, graphs and runtime; it imports nothing from them (the calibration
config, to validate the stored one, is below it).
"""

from .layout import (CONFIG_FILE, DIGEST_KEY, DIMENSION_LIMIT, EXPORT_LOG_FILE, EXTERNAL_DATA_FILE, FORMAT_VERSION,
                     GRAPH_FILES, GRAPH_FILE_LIMIT, INLINED_FILE, INLINED_GRAPH, INPUT_NAMES, LOADER_FILES,
                     LOADER_FILE_LIMIT, LONG_CONTEXT_TOKENS, MAX_SEQ_LENGTH_LIMIT, METADATA_FILE, NATIVE_FILE,
                     NATIVE_GRAPH, ONNX_FILE, ONNX_SUBDIR, OPTIMIZED_FILE, OPTIMIZED_GRAPH, OUTPUT_NAMES,
                     PORTABLE_GRAPH, REQUIRED_INPUTS, SUPPORTED_FORMATS, TOKENIZERS, TWO_GIB, ArtifactError,
                     MissingArtifactError, commit_dir, graph_files, is_long_context, loader_files, looks_like_export,
                     write_text_atomic)
from .checks import (check_dir, check_export_file, check_external_data, check_model_files, check_readable, config_int,
                     read_bytes, read_json)
from .metadata import ExportMetadata, pooling_of, read_metadata, validate_metadata, write_metadata
from .onnx_io import (GRAPH_INITIALIZER, MODEL_GRAPH, MODEL_PROPS, TENSOR_RAW_DATA, external_data_name, external_info,
                      field_header, graph_digest, load_onnx_checked, save_onnx, save_onnx_proto, save_structure,
                      set_external, stage_onnx, stamp_onnx, stored_digest, varint_bytes, weights_on_disk, write_graph,
                      write_graph_file)
from .export_dir import ExportDir, open_export

__all__ = [
    "CONFIG_FILE", "DIGEST_KEY", "DIMENSION_LIMIT", "EXPORT_LOG_FILE", "EXTERNAL_DATA_FILE", "FORMAT_VERSION",
    "GRAPH_FILES", "GRAPH_FILE_LIMIT", "INLINED_FILE", "INLINED_GRAPH", "INPUT_NAMES", "LOADER_FILES",
    "LOADER_FILE_LIMIT", "LONG_CONTEXT_TOKENS", "MAX_SEQ_LENGTH_LIMIT", "METADATA_FILE", "NATIVE_FILE", "NATIVE_GRAPH",
    "ONNX_FILE", "ONNX_SUBDIR", "OPTIMIZED_FILE", "OPTIMIZED_GRAPH", "OUTPUT_NAMES", "PORTABLE_GRAPH",
    "REQUIRED_INPUTS", "SUPPORTED_FORMATS", "TOKENIZERS", "TWO_GIB", "ArtifactError", "MissingArtifactError",
    "commit_dir", "graph_files", "is_long_context", "loader_files", "looks_like_export", "write_text_atomic",
    "check_dir", "check_export_file", "check_external_data", "check_model_files", "check_readable", "config_int",
    "read_bytes", "read_json", "ExportMetadata", "pooling_of", "read_metadata", "validate_metadata", "write_metadata",
    "GRAPH_INITIALIZER", "MODEL_GRAPH", "MODEL_PROPS", "TENSOR_RAW_DATA", "external_data_name", "external_info",
    "field_header", "graph_digest", "load_onnx_checked", "save_onnx", "save_onnx_proto", "save_structure",
    "set_external", "stage_onnx", "stamp_onnx", "stored_digest", "varint_bytes", "weights_on_disk", "write_graph",
    "write_graph_file", "ExportDir", "open_export",
]
