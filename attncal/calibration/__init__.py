"""Calibration math: configuration, the float64 oracle, the efficient implementation, model patching.

The names below load on first use (`lazy_loader`): `config` needs only the standard library, the rest need
torch, and a command that only reads an export's configuration (`attncal inspect`, `attncal --help`)
should not pay torch's import (about 3 s on a 2-core machine) to do it.  (The `Encoder` still imports torch
where it is installed: transformers' AutoTokenizer loads its configuration module, which imports torch; the
tokenizer class is AutoTokenizer's to choose, so attncal does not second-guess it.)
"""

from typing import TYPE_CHECKING

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "config": ["CalibrationConfig", "ResolvedCalibration"],
    "efficient": ["BatchGeometry", "apply", "compute_geometry"],
    "encode": ["TorchEncoder", "encode_torch", "pool"],
    "oracle": ["reference"],
    "attention_functions": ["UnsupportedArchitectureError"],
    "patching": ["CalibrationPatch", "calibrate"],
    "probing": ["attention_modules"],
})

if TYPE_CHECKING:  # what type checkers and editors see
    from .config import CalibrationConfig, ResolvedCalibration
    from .efficient import BatchGeometry, apply, compute_geometry
    from .encode import TorchEncoder, encode_torch, pool
    from .oracle import reference
    from .attention_functions import UnsupportedArchitectureError
    from .patching import CalibrationPatch, calibrate
    from .probing import attention_modules
