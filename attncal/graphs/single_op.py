"""One-node ONNX models holding a calibration op, for tests and kernel checks."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from .contract import DOMAIN, VERSION, OpSpec, first_input
from .function_body import make_function


def single_op_model(spec: OpSpec, opset: int = 18, float16: bool = False, with_function: bool = True) -> onnx.ModelProto:
    """`calibrated = <op>(probs, attention_mask)` with dynamic [B,H,Q,K] / [B,K] inputs (the first
    input is named `scores` for the Softmax-fused ops)."""
    dtype = TensorProto.FLOAT16 if float16 else TensorProto.FLOAT
    x = first_input(spec.op_type)
    node = helper.make_node(spec.op_type, [x, "attention_mask"], ["calibrated"], domain=DOMAIN, **spec.attrs)
    graph = helper.make_graph(
        [node],
        "attncal_single_op",
        [
            helper.make_tensor_value_info(x, dtype, ["B", "H", "Q", "K"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "K"]),
        ],
        [helper.make_tensor_value_info("calibrated", dtype, ["B", "H", "Q", "K"])],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, VERSION)],
        functions=[make_function(spec.op_type, opset)] if with_function else [],
    )
    model.ir_version = 10
    return model
