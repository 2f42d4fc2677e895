"""torch -> ONNX export (`attncal.export.exporter`).

`from attncal import export` gives this package, and the package is callable:
`export(model, out, options)` is `attncal.export.exporter.export(model, out, options)`.
A package cannot also be a function, and `attncal.export.exporter` must stay importable,
so the package's module type forwards calls instead of the name being rebound.
"""

from __future__ import annotations

import sys
import types


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from .exporter import export  # lazy: the plan and ExportOptions import this package, not the exporter

        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
