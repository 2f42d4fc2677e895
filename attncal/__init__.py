"""attncal: attention calibration for text-embedding encoders."""

from .calibration import CalibrationConfig, apply, calibrate, compute_geometry, encode_torch, reference

__version__ = "0.1.0"

__all__ = ["CalibrationConfig", "apply", "calibrate", "compute_geometry", "encode_torch", "reference", "__version__"]
