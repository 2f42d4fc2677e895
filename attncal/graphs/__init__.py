"""ONNX graph work: the calibration op contract, its function body, and the rewrite pass.

The names below load on first use (`lazy_loader`): the rewrite pass needs onnx_ir (and through it sympy,
about 1 s to import), which the runtime, importing only the op contract and shape notes from here, does not.
"""

from typing import TYPE_CHECKING

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "contract": ["ALL_ROWS_OP", "DOMAIN", "POOLED_OP", "VERSION", "op_spec"],
    "function_body": ["make_function"],
    "rewrite": ["AlreadyCalibratedError", "insert_calibration", "remove_calibration"],
    "softmax_pattern": ["SoftmaxPatternError", "find_attention_softmaxes"],
})

if TYPE_CHECKING:  # what type checkers and editors see
    from .contract import ALL_ROWS_OP, DOMAIN, POOLED_OP, VERSION, op_spec
    from .function_body import make_function
    from .rewrite import AlreadyCalibratedError, insert_calibration, remove_calibration
    from .softmax_pattern import SoftmaxPatternError, find_attention_softmaxes
