"""ONNX graph work, in three rooms: the calibration ops (`ops`: the op contract, its function body), the
placements that insert them (`placements`: the rules, their registry, the graph readers they share), and the
graph passes that prepare a graph for ONNX Runtime (`fusions`).  What all three use is here: the node builder
(`builder`) and the graph-pass protocol (`pass_base`).

The names below load on first use (`lazy_loader`): the rewrite pass needs onnx_ir (and through it sympy,
about 1 s to import), which the runtime, importing only the op contract and shape notes from here, does not.
"""

from typing import TYPE_CHECKING

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "ops.contract": ["ALL_ROWS_OP", "DOMAIN", "POOLED_OP", "VERSION", "op_spec"],
    "ops.function_body": ["make_function"],
    "placements.rewrite": ["AlreadyCalibratedError", "insert_calibration", "remove_calibration"],
    "placements.softmax_pattern": ["SoftmaxPatternError", "find_attention_softmaxes"],
})

if TYPE_CHECKING:  # what type checkers and editors see
    from .ops.contract import ALL_ROWS_OP, DOMAIN, POOLED_OP, VERSION, op_spec
    from .ops.function_body import make_function
    from .placements.rewrite import AlreadyCalibratedError, insert_calibration, remove_calibration
    from .placements.softmax_pattern import SoftmaxPatternError, find_attention_softmaxes
