"""Calibration math: configuration, the naive oracle, the efficient implementation, model patching."""

from .config import CalibrationConfig, ResolvedCalibration
from .efficient import BatchGeometry, apply, compute_geometry
from .encode import TorchEncoder, encode_torch, pool
from .oracle import reference
from .patching import CalibrationPatch, UnsupportedArchitectureError, attention_modules, calibrate

__all__ = [
    "BatchGeometry",
    "CalibrationConfig",
    "CalibrationPatch",
    "ResolvedCalibration",
    "TorchEncoder",
    "UnsupportedArchitectureError",
    "apply",
    "attention_modules",
    "calibrate",
    "compute_geometry",
    "encode_torch",
    "pool",
    "reference",
]
