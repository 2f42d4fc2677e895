"""ONNX graph work: the calibration op contract, its function body, and the rewrite pass."""

from .contract import ALL_ROWS_OP, DOMAIN, POOLED_OP, VERSION, op_spec
from .function_body import make_function
from .rewrite import AlreadyCalibratedError, insert_calibration, remove_calibration
from .softmax_pattern import SoftmaxPatternError, find_attention_softmaxes

__all__ = [
    "ALL_ROWS_OP",
    "AlreadyCalibratedError",
    "DOMAIN",
    "POOLED_OP",
    "SoftmaxPatternError",
    "VERSION",
    "find_attention_softmaxes",
    "insert_calibration",
    "make_function",
    "op_spec",
    "remove_calibration",
]
