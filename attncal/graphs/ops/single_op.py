"""One-node ONNX models holding a calibration op, for tests and kernel checks."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from .contract import (DOMAIN, RELATIVE_BIAS_INPUT, VERSION, OpSpec, first_input, geometry_from_attrs, input_names,
                       is_attention, is_projected)
from .function_body import make_function


def single_op_model(spec: OpSpec, opset: int = 18, float16: bool = False, with_function: bool = True) -> onnx.ModelProto:
    """`calibrated = <op>(probs, attention_mask)` with dynamic [B,H,Q,K] / [B,K] inputs (the first
    input is named `scores` for the Softmax-fused ops).  For the calibrated attention ops:
    `context = <op>(query, key, value, attention_mask)` with dynamic [B,S_q,N*D], [B,S_k,N_kv*D],
    [B,S_k,N_kv*D_v], [B,S_k] inputs and a [B,S_q,N*D_v] output; for the projected ones
    `context = <op>(input, weight, bias, attention_mask)` with [B,S,H_in], [H_in,3*N*D], [3*N*D],
    [B,S] inputs (weight and bias as graph inputs here) and a [B,S,N*D] output.  A calibrated attention op
    with `relative_max_distance` also takes its `relative_bias` table [num_buckets,N] as a graph input."""
    dtype = TensorProto.FLOAT16 if float16 else TensorProto.FLOAT
    relative = is_attention(spec.op_type) and geometry_from_attrs(spec.attrs).relative
    names = input_names(spec.op_type, relative)
    if is_projected(spec.op_type):
        output = "context"
        inputs = [helper.make_tensor_value_info("input", dtype, ["B", "S", "H_in"]),
                  helper.make_tensor_value_info("weight", dtype, ["H_in", "ND3"]),
                  helper.make_tensor_value_info("bias", dtype, ["ND3"]),
                  helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S"])]
        outputs = [helper.make_tensor_value_info(output, dtype, ["B", "S", "ND"])]
    elif is_attention(spec.op_type):
        output = "context"
        # key and value hold N_kv heads (GQA), the context N.
        inputs = [helper.make_tensor_value_info("query", dtype, ["B", "S_q", "ND"]),
                  helper.make_tensor_value_info("key", dtype, ["B", "S_k", "NkvD"]),
                  helper.make_tensor_value_info("value", dtype, ["B", "S_k", "NkvD_v"]),
                  helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S_k"])]
        if relative:
            inputs.append(helper.make_tensor_value_info(RELATIVE_BIAS_INPUT, dtype, ["buckets", "N"]))
        outputs = [helper.make_tensor_value_info(output, dtype, ["B", "S_q", "ND_v"])]
    else:
        output = "calibrated"
        x = first_input(spec.op_type)
        inputs = [helper.make_tensor_value_info(x, dtype, ["B", "H", "Q", "K"]),
                  helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "K"])]
        outputs = [helper.make_tensor_value_info(output, dtype, ["B", "H", "Q", "K"])]
    node = helper.make_node(spec.op_type, names, [output], domain=DOMAIN, **spec.attrs)
    graph = helper.make_graph([node], "attncal_single_op", inputs, outputs)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, VERSION)],
        functions=[make_function(spec.op_type, opset, relative)] if with_function else [],
    )
    model.ir_version = 10
    return model
