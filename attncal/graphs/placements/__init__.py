"""The calibration placements: each way of inserting the calibration into an exported encoder graph, one rule
per module (`*_placement`), their protocol (`placement_base`), their names (`placement_names`), the registry
and `auto`'s choice (`registry`), and the graph readers the rules share: the attention Softmax of each layer
(`softmax_pattern`), a plain graph's explicit attention (`attention_chain`), what a mask or a position bias is,
read by running it (`mask_probe`, `position_bias_probe`), the marked rows of a row-set pooling (`row_marks`),
and the softmax placement's insertion and its inverse (`rewrite`).

The registry's names load on first use (`lazy_loader`): `placements.get(name)`, `placements.plan(...)`.  The
registry imports every rule and onnx_ir with them (about a second), which the exporter's option checks and the
command line, importing only `placement_names`, do not.
"""

from typing import TYPE_CHECKING

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "registry": ["CHOICES", "NATIVE_BY_PRECISION", "PLACEMENTS", "Plan", "get", "plan"],
})

if TYPE_CHECKING:  # what type checkers and editors see
    from .registry import CHOICES, NATIVE_BY_PRECISION, PLACEMENTS, Plan, get, plan
