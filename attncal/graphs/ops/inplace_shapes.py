"""Symbolic shapes on the calibration op's input, so ONNX Runtime can run it in place.

Written at export time (not only when a session is made), so every runtime that reads the
graph's value_info benefits.
"""

from __future__ import annotations

from .contract import DOMAIN, takes_scores
from ..pass_base import PROTO, GraphPass


def annotate_inplace_shapes(model) -> int:
    """Give each calibration op's `probs` input symbolic dims [B, H, S, S] of its own, in place
    on the ModelProto; returns how many ops were annotated.

    Why: ONNX Runtime runs the native op in place (no [B,H,S,S] output buffer, and for the
    pooled op only B*H rows of traffic) only when its planner can prove input and output have
    the same size, i.e. when both shapes are known or carry the same dim_params.  Exports
    whose attention shapes come from runtime Reshapes have unknown dims there; the library's
    shape inference copies the input's dims to the output, so labelling the input is enough.
    Softmax placements only (Q == K: the op after a Softmax, or the Softmax-fused op); a
    [B,H,1,K] row-placement input is left alone."""
    import onnx

    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    targets = [n.input[0] for n in graph.node if n.domain == DOMAIN and n.input and n.input[0] in producers
               and (producers[n.input[0]].op_type == "Softmax" or takes_scores(n.op_type))]  # [B,H,S,S]
    if not targets:
        return 0
    # Element types come from ONNX shape inference (its unknown dims are not used).
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except (ValueError, onnx.shape_inference.InferenceError):  # > 2 GiB or an unusual graph: leave it
        return 0
    types = {v.name: v.type.tensor_type for v in inferred.graph.value_info}
    known = {v.name: v for v in graph.value_info}
    count = 0
    for i, name in enumerate(dict.fromkeys(targets)):
        tt = types.get(name)
        if tt is None or not tt.elem_type:
            continue
        if name in known and any(d.HasField("dim_value") or d.dim_param
                                 for d in known[name].type.tensor_type.shape.dim):
            continue  # already informative: leave it
        vi = onnx.helper.make_tensor_value_info(name, tt.elem_type, [f"attncal_b{i}", f"attncal_h{i}",
                                                                      f"attncal_s{i}", f"attncal_s{i}"])
        if name in known:
            known[name].CopyFrom(vi)
        else:
            graph.value_info.append(vi)
        count += 1
    return count


PASS = GraphPass(
    "inplace_shapes", PROTO, matches="the [B,H,S,S] input of each calibration op after a Softmax or on the scores",
    checks="its element type is inferred and its recorded shape says nothing yet", rewrite=annotate_inplace_shapes)
