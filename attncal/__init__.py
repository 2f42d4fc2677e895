"""attncal: attention calibration for text-embedding encoders.

The short public API::

    from attncal import CalibrationConfig, export, Encoder, check
    export("path/to/model", "out/")          # the attncal.export package forwards to exporter.export
    emb = Encoder("out/").encode(texts)      # attncal.runtime.Encoder
    report = check("out/")                   # attncal.runtime.parity.check_parity
    get_library_path()                       # the packaged ONNX Runtime custom-op library (attncal.native)

Every name but `__version__` and the `get_*_path` functions is imported on first use, so `import attncal`
loads neither torch (the calibration math, about 3 s on a 2-core machine) nor ONNX Runtime nor the exporter:
commands that do not need them (`attncal --help`, `attncal inspect`) start without them.
`encode_corpus` needs the `attncal.corpus` package.  `export` is the `attncal.export` package, which is callable
(see attncal/export/__init__.py), so `attncal.export.exporter` keeps working.  The deep module
paths keep working.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .native import get_cuda_library_path, get_library_path, get_tensorrt_plugin_path

__version__ = "0.1.0"

_LAZY = {  # public name -> (module, attribute)
    "CalibrationConfig": ("attncal.calibration.config", "CalibrationConfig"),
    "apply": ("attncal.calibration.efficient", "apply"),
    "calibrate": ("attncal.calibration.patching", "calibrate"),
    "compute_geometry": ("attncal.calibration.efficient", "compute_geometry"),
    "encode_torch": ("attncal.calibration.encode", "encode_torch"),
    "reference": ("attncal.calibration.oracle", "reference"),
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


if TYPE_CHECKING:  # what type checkers and editors see
    from .artifact import ArtifactError
    from .calibration.config import CalibrationConfig
    from .calibration.efficient import apply, compute_geometry
    from .calibration.encode import encode_torch
    from .calibration.oracle import reference
    from .calibration.patching import calibrate
    from .corpus import encode_corpus
    from .export.exporter import ExportOptions
    from .runtime.encoder import Encoder
    from .runtime.parity import check_parity as check


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["ArtifactError", "CalibrationConfig", "Encoder", "ExportOptions", "apply", "calibrate", "check",
           "compute_geometry", "encode_corpus", "export", "encode_torch", "get_cuda_library_path", "get_library_path",
           "get_tensorrt_plugin_path", "reference", "__version__"]
