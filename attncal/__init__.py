"""attncal: attention calibration for text-embedding encoders.

The short public API::

    from attncal import CalibrationConfig, export, Encoder, check
    export("path/to/model", "out/")          # the attncal.export package forwards to exporter.export
    emb = Encoder("out/").encode(texts)      # attncal.runtime.Encoder
    report = check("out/")                   # attncal.runtime.parity.check_parity
    get_library_path()                       # the packaged ONNX Runtime custom-op library (attncal.native)

`ExportOptions`, `Encoder`, `check`, `ArtifactError` and `encode_corpus` (when the
`attncal.corpus` package is installed) are imported on first use, so `import attncal` does not
load ONNX Runtime or the exporter.  `export` is the `attncal.export` package, which is callable
(see attncal/export/__init__.py), so `attncal.export.exporter` keeps working.  The deep module
paths keep working.
"""

from __future__ import annotations

import importlib
from typing import Any

from .calibration import CalibrationConfig, apply, calibrate, compute_geometry, encode_torch, reference
from .native import get_cuda_library_path, get_library_path, get_tensorrt_plugin_path

__version__ = "0.1.0"

_LAZY = {  # public name -> (module, attribute)
    "ExportOptions": ("attncal.export.exporter", "ExportOptions"),
    "Encoder": ("attncal.runtime.encoder", "Encoder"),
    "check": ("attncal.runtime.parity", "check_parity"),
    "ArtifactError": ("attncal.artifact", "ArtifactError"),
    "encode_corpus": ("attncal.corpus", "encode_corpus"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'attncal' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise AttributeError(f"attncal.{name} needs the {module_name} package, which is not installed") from None
    value = getattr(module, attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["ArtifactError", "CalibrationConfig", "Encoder", "ExportOptions", "apply", "calibrate", "check",
           "compute_geometry", "encode_corpus", "export", "encode_torch", "get_cuda_library_path", "get_library_path",
           "get_tensorrt_plugin_path", "reference", "__version__"]
