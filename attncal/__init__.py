"""attncal: attention calibration for text-embedding encoders.

The short public API::

    from attncal import CalibrationConfig, export, Encoder, check
    export("path/to/model", "out/")          # attncal.exporting.exporter.export
    emb = Encoder("out/").encode(texts)      # attncal.runtime.Encoder
    report = check("out/")                   # attncal.runtime.parity.check_parity
    get_library_path()                       # the packaged ONNX Runtime custom-op library (attncal.native)

Every name but `__version__` and the `get_*_path` functions is imported on first use (`lazy_loader`, as in
`attncal.calibration` and `attncal.graphs`), so `import attncal`
loads neither torch (the calibration math, about 3 s on a 2-core machine) nor ONNX Runtime nor the exporter:
commands that do not need them (`attncal --help`, `attncal inspect`) start without them.
`export` is the function `attncal.exporting.exporter.export`; the exporter's modules are the package
`attncal.exporting`, so the name `attncal.export` is the function and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

from .native import get_cuda_library_path, get_library_path, get_tensorrt_plugin_path

__version__ = "0.1.0"

__getattr__, _lazy_dir, _ = lazy_loader.attach(__name__, submod_attrs={
    "artifact": ["ArtifactError"],
    "calibration": ["CalibrationConfig", "apply", "calibrate", "compute_geometry", "encode_torch", "reference"],
    "corpus": ["encode_corpus"],
    "exporting.exporter": ["export"],
    "exporting.plan": ["ExportOptions"],
    "runtime.encoder": ["Encoder"],
    "runtime.parity": ["check"],
})
del _  # __all__ is below: the lazy names and the eager ones


if TYPE_CHECKING:  # what type checkers and editors see
    from .artifact import ArtifactError
    from .calibration.config import CalibrationConfig
    from .calibration.efficient import apply, compute_geometry
    from .calibration.encode import encode_torch
    from .calibration.oracle import reference
    from .calibration.patching import calibrate
    from .corpus import encode_corpus
    from .exporting.exporter import export
    from .exporting.exporter import export
    from .exporting.plan import ExportOptions
    from .runtime.encoder import Encoder
    from .runtime.parity import check


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_lazy_dir()))


__all__ = ["ArtifactError", "CalibrationConfig", "Encoder", "ExportOptions", "apply", "calibrate", "check",
           "compute_geometry", "encode_corpus", "export", "encode_torch", "get_cuda_library_path", "get_library_path",
           "get_tensorrt_plugin_path", "reference", "__version__"]
