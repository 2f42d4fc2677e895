"""Running exported models: the ONNX Runtime Encoder and the parity check."""

from .encoder import Encoder
from .parity import ParityReport, check_parity

__all__ = ["Encoder", "ParityReport", "check_parity"]
