"""Every placement refusal on a tiny hand-built graph.

Each refusal gets a negative test (the error names the problem, and the model is left exactly as it
was: same serialized bytes, and no value gained a reader from a node built and then dropped) and a
positive test on the near-identical graph without the defect.  The defect is always in the LAST
of two layers, so a placement that edited layer 0 before checking layer 1 fails the "unchanged"
assertion: every placement must run all of its checks, for every layer, before its first edit.

Two graph families, a few nodes per layer:
* fused: ORT's `com.microsoft::Attention` (packed QKV weight and bias as initializers) and an
  output projection per layer, as in an ORT-optimized BERT graph (row and split placement);
* plain: MatMul(q, kᵀ) -> Mul(scale) -> Add(mask bias) -> Softmax -> MatMul(v) per layer, the
  bias a Where over the attention mask, layer 1's queries being layer 0's context (row, split,
  softmax and fused-softmax placement).
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from attncal import CalibrationConfig
from attncal.graphs import placements
from attncal.graphs.builder import Ops
from attncal.graphs.ops.contract import ALL_ROWS_OP, DOMAIN, POOLED_OP, SOFTMAX_ALL_ROWS_OP
from attncal.graphs.placements.placement_base import PRECISIONS, PlacementPlan, Refusal
from attncal.graphs.placements.rewrite import insert_calibration, remove_calibration
from attncal.graphs.placements.row_placement import RowPlacementError
from attncal.graphs.placements.softmax_pattern import SoftmaxPatternError
from attncal.graphs.placements.split_placement import SplitPlacementError

F, F16, I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64
HIDDEN, HEADS, HEAD = 8, 2, 4
LAYERS = 2
ROW = CalibrationConfig(pooling="cls", layers="all", basket_size=4, strength=0.7)
SPLIT = CalibrationConfig(pooling="mean", layers="all", basket_size=4, strength=0.7)
FUSED_SOFTMAX = SPLIT


def place(name: str, model: ir.Model, config: CalibrationConfig):
    return placements.get(name).place(model, config, LAYERS)


def _model(nodes, inputs, outputs, inits=(), value_info=(), opsets=(("", 18),)) -> ir.Model:
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, initializer=list(inits), value_info=list(value_info))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    proto.ir_version = 10
    return ir.from_proto(proto)


def fused_model(*, weight_input: bool = False, past: bool = False, attrs: dict | None = None,
                ctx_output: bool = False) -> ir.Model:
    """input -> [Attention -> MatMul(out weight)] x 2; the options put a defect in layer 1's Attention:
    its packed weight a graph input, a past state, extra attributes, or its context a graph output."""
    rng = np.random.default_rng(0)
    inputs = [helper.make_tensor_value_info("input", F, ["B", "S", HIDDEN]),
              helper.make_tensor_value_info("attention_mask", I64, ["B", "S"])]
    outputs = [helper.make_tensor_value_info("h2", F, ["B", "S", HIDDEN])]
    nodes = [helper.make_node("Cast", ["attention_mask"], ["mask_index"], to=TensorProto.INT32, name="mask_cast")]
    inits = []
    for layer in range(LAYERS):
        last = layer == LAYERS - 1
        w, b, wo = f"l{layer}.qkv_weight", f"l{layer}.qkv_bias", f"l{layer}.out_weight"
        weight = numpy_helper.from_array(rng.standard_normal((HIDDEN, 3 * HIDDEN)).astype(np.float32), w)
        if last and weight_input:
            inputs.append(helper.make_tensor_value_info(w, F, [HIDDEN, 3 * HIDDEN]))
        else:
            inits.append(weight)
        inits += [numpy_helper.from_array(rng.standard_normal(3 * HIDDEN).astype(np.float32), b),
                  numpy_helper.from_array(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), wo)]
        att_inputs = [f"h{layer}" if layer else "input", w, b, "mask_index"]
        if last and past:
            att_inputs.append("past")
            inputs.append(helper.make_tensor_value_info("past", F, [2, "B", HEADS, "P", HEAD]))
        nodes += [helper.make_node("Attention", att_inputs, [f"ctx{layer}"], domain="com.microsoft",
                                   name=f"Attention_{layer}", num_heads=HEADS, **((attrs or {}) if last else {})),
                  helper.make_node("MatMul", [f"ctx{layer}", wo], [f"h{layer + 1}"], name=f"out_proj_{layer}")]
        if last and ctx_output:
            outputs.append(helper.make_tensor_value_info(f"ctx{layer}", F, ["B", "S", HIDDEN]))
    return _model(nodes, inputs, outputs, inits, opsets=(("", 18), ("com.microsoft", 1)))


def plain_model(*, softmax_dtype: int = F, matmul_outputs: int = 1, ctx_output: bool = False,
                probs_output: bool = False, bias_shape: tuple | None = ("B", 1, 1, "S"),
                before_softmax: str | None = None, after_softmax: str | None = None) -> ir.Model:
    """q -> [MatMul(·, kᵀ) -> Mul(scale) -> Add(bias) -> Softmax -> MatMul(·, v)] x 2 -> Identity -> out,
    with bias = Where(mask, 0, lowest) [B,1,1,S].  The options change layer 1 only:
    * `softmax_dtype` F16: Cast to float16 before its Softmax and back after (F: the same casts to float);
    * `matmul_outputs` 2: its scores MatMul has two outputs and the chain reads the second;
    * `ctx_output` / `probs_output`: its context / probabilities are also graph outputs;
    * `bias_shape`: the shape of a graph input `bias_in` its Add reads through an Identity (None: no
      shape, so the side input's rank is unknown; (1, 1, "S"): rank 3);
    * `before_softmax` / `after_softmax`: an op between its Add and Softmax / Softmax and value MatMul.
    """
    inputs = [helper.make_tensor_value_info(n, F, ["B", HEADS, "S", HEAD]) for n in ("q", "k", "v")]
    inputs += [helper.make_tensor_value_info("attention_mask", I64, ["B", "S"]),
               helper.make_tensor_value_info("bias_in", F, None if bias_shape is None else list(bias_shape))]
    inits = [numpy_helper.from_array(np.array(HEAD ** -0.5, np.float32), "scale"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "lowest"),
             numpy_helper.from_array(np.array([1, 2], np.int64), "axes12"),
             # Over 1 kB: onnx_ir's shape inference moves such initializers to the end of the table.
             numpy_helper.from_array(np.zeros((HEAD, 80), np.float32), "unused_big"),
             numpy_helper.from_array(np.array(1.0, np.float32), "unused_small")]
    nodes = [helper.make_node("Cast", ["attention_mask"], ["mask_bool"], to=TensorProto.BOOL, name="mask_cast"),
             helper.make_node("Unsqueeze", ["mask_bool", "axes12"], ["mask4"], name="mask_unsqueeze"),
             helper.make_node("Where", ["mask4", "zero", "lowest"], ["bias"], name="mask_where"),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2], name="k_transpose")]
    outputs = [helper.make_tensor_value_info("out", F, ["B", HEADS, "S", HEAD])]
    for layer in range(LAYERS):
        p, last = f"/encoder/layer.{layer}/attention/", layer == LAYERS - 1
        q = "q" if layer == 0 else f"ctx{layer - 1}"
        scores = [f"s{layer}"] if not (last and matmul_outputs == 2) else [f"s{layer}_first", f"s{layer}"]
        bias = "bias" if not last else "bias_side"
        z = f"z{layer}"
        nodes += [helper.make_node("MatMul", [q, "kt"], scores, name=p + "MatMul"),
                  helper.make_node("Mul", [f"s{layer}", "scale"], [f"sc{layer}"], name=p + "Mul"),
                  helper.make_node("Add", [f"sc{layer}", bias], [z], name=p + "Add")]
        if last:
            nodes.insert(len(nodes) - 3, helper.make_node("Identity", ["bias_in"], ["bias_side"], name=p + "bias"))
            nodes.append(helper.make_node("Cast", [z], [f"{z}_cast"], to=softmax_dtype, name=p + "Cast_in"))
            z = f"{z}_cast"
            if before_softmax:
                nodes.append(helper.make_node(before_softmax, [z], [f"{z}_op"], name=p + before_softmax))
                z = f"{z}_op"
        nodes.append(helper.make_node("Softmax", [z], [f"p{layer}"], axis=-1, name=p + "Softmax"))
        probs = f"p{layer}"
        if last:
            nodes.append(helper.make_node("Cast", [probs], [f"{probs}_cast"], to=F, name=p + "Cast_out"))
            probs = f"{probs}_cast"
            if after_softmax:
                nodes.append(helper.make_node(after_softmax, [probs], [f"{probs}_op"], name=p + after_softmax))
                probs = f"{probs}_op"
            if probs_output:
                outputs.append(helper.make_tensor_value_info(f"p{layer}", softmax_dtype, ["B", HEADS, "S", "S"]))
        nodes.append(helper.make_node("MatMul", [probs, "v"], [f"ctx{layer}"], name=p + "MatMul_1"))
    if ctx_output:
        outputs.append(helper.make_tensor_value_info(f"ctx{LAYERS - 1}", F, ["B", HEADS, "S", HEAD]))
    nodes.append(helper.make_node("Identity", [f"ctx{LAYERS - 1}"], ["out"], name="output"))
    # Annotated, as exports annotate some values: layer 0's checks need its rank even where shape
    # inference fails (the two-output MatMul).
    bias_info = helper.make_tensor_value_info("bias", F, ["B", 1, 1, "S"])
    return _model(nodes, inputs, outputs, inits, value_info=[bias_info])


def snapshot(model: ir.Model) -> tuple[bytes, list[tuple[str, int]]]:
    """The serialized model (nodes, initializers and their order, value_info, outputs, functions,
    opsets) and every value's reader count (a node built for the graph but never inserted still
    reads its inputs)."""
    readers = [(v.name, len(list(v.uses()))) for v in _values(model)]
    return ir.to_proto(model).SerializeToString(), readers


def _values(model: ir.Model) -> list[ir.Value]:
    graph = model.graph
    return [*graph.inputs, *graph.initializers.values(), *(o for n in graph for o in n.outputs)]


def assert_refused_unchanged(call, model: ir.Model, error: type[Exception], match: str) -> None:
    before = snapshot(model)
    with pytest.raises(error, match=match):
        call(model)
    after = snapshot(model)
    assert after[1] == before[1], "a refused placement left readers behind"
    assert after[0] == before[0], "a refused placement edited the graph"


def ops_of(model: ir.Model, domain: str = DOMAIN) -> list[str]:
    return [n.op_type for n in model.graph if n.domain == domain]


def check_valid(model: ir.Model) -> None:
    """The placed graph is well formed: ONNX's checker accepts it, and every initializer is read."""
    onnx.checker.check_model(ir.to_proto(model))
    used = {v.name for n in model.graph for v in n.inputs if v is not None}
    used |= {v.name for n in model.graph for a in n.attributes.values() if a.type == ir.AttributeType.GRAPH
             for m in a.value for v in m.inputs if v is not None}
    orphans = [name for name in model.graph.initializers if name not in used and not name.startswith("unused_")]
    assert not orphans, orphans


# ---------------------------------------------------------------------------------------------
# The builder: constants wait for the nodes
# ---------------------------------------------------------------------------------------------
def test_ops_registers_its_constants_only_with_its_nodes():
    model = plain_model()
    anchor = next(iter(model.graph))
    before = list(model.graph.initializers)
    ops = Ops(model.graph, "t")
    out = ops("Add", ops.const("a", np.float32(1.0)), ops.const("b", np.float32(2.0)))
    assert list(model.graph.initializers) == before and anchor is next(iter(model.graph))
    ops.insert_before(anchor)
    assert list(model.graph.initializers) == before + ["t/a", "t/b"]
    assert next(iter(model.graph)) is out.producer()


# ---------------------------------------------------------------------------------------------
# Fused graphs: the packed attention node's refusals (placement_base.fused_attention_parts)
# ---------------------------------------------------------------------------------------------
FUSED_PLACEMENTS = [("row", ROW, RowPlacementError), ("split", SPLIT, SplitPlacementError)]


@pytest.mark.parametrize("name,config,error", FUSED_PLACEMENTS)
def test_fused_placement_on_near_miss_graphs(name, config, error):
    """The graphs of the refusals below without their defect (an optional past input left empty, an
    allowed extra attribute): the placement applies to both layers and keeps the graph valid."""
    for model in (fused_model(), fused_model(attrs={"mask_filter_value": -10000.0})):
        result = place(name, model, config)
        assert result.layers == [0, 1]
        if name == "row":  # the fused nodes stay; the pooling row is recomputed beside each
            assert ops_of(model) == [POOLED_OP] * 2 and ops_of(model, "com.microsoft") == ["Attention"] * 2
        else:  # each fused node becomes a full-attention MultiHeadAttention and a Loop over baskets
            assert ops_of(model) == [] and ops_of(model, "com.microsoft") == ["MultiHeadAttention"] * 2
            assert ops_of(model, "").count("Loop") == 2
        check_valid(model)


@pytest.mark.parametrize("name,config,error", FUSED_PLACEMENTS)
@pytest.mark.parametrize("defect,match", [
    (dict(weight_input=True), r"fused Attention Attention_1: packed QKV weight and bias must be initializers"),
    (dict(past=True), r"fused Attention Attention_1 has a past state; not an encoder layer"),
    (dict(attrs={"unidirectional": 1}), r"fused Attention Attention_1 has unsupported attributes \['unidirectional'\]"),
])
def test_fused_attention_refusals_leave_the_graph_unchanged(name, config, error, defect, match):
    assert_refused_unchanged(lambda m: place(name, m, config), fused_model(**defect), error, match)


def test_split_fused_context_graph_output_is_refused_before_any_edit():
    assert_refused_unchanged(lambda m: place("split", m, SPLIT), fused_model(ctx_output=True), SplitPlacementError,
                             r"the context of Attention_1 is a graph output; cannot rewire it")


# ---------------------------------------------------------------------------------------------
# Plain graphs: the explicit attention's refusals (row and split placement)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,config", [("row", ROW), ("split", SPLIT)])
def test_plain_placement_on_near_miss_graph(name, config):
    """Float casts around the Softmax, a one-output scores MatMul, a context read only by the next
    node, a rank-4 side input of known shape: the placement applies to both layers."""
    model = plain_model()
    result = place(name, model, config)
    assert result.layers == [0, 1]
    assert ops_of(model) == ([POOLED_OP] * 2 if name == "row" else [])
    assert sum(n.name.startswith(f"attncal_{name}_layer1/") for n in model.graph) > 0
    check_valid(model)


@pytest.mark.parametrize("name,config,error", [("row", ROW, RowPlacementError), ("split", SPLIT, SplitPlacementError)])
def test_plain_chain_that_is_not_a_path_is_refused_before_any_edit(name, config, error):
    """`scores_chain` follows single-output ops, so only a malformed graph (a MatMul with a second
    output that the chain reads) reaches this refusal; the replay would calibrate the wrong scores."""
    assert_refused_unchanged(lambda m: place(name, m, config), plain_model(matmul_outputs=2), error,
                             r"unexpected graph between the scores MatMul and /encoder/layer\.1/attention/Softmax: "
                             r"Mul node '/encoder/layer\.1/attention/Mul' does not read s1_first")


def test_split_plain_float16_softmax_is_refused_before_any_edit():
    assert_refused_unchanged(lambda m: place("split", m, SPLIT), plain_model(softmax_dtype=F16), SplitPlacementError,
                             r"float32 only \(/encoder/layer\.1/attention/Softmax works on FLOAT16.*drop --fp16")


def test_split_plain_context_graph_output_is_refused_before_any_edit():
    assert_refused_unchanged(lambda m: place("split", m, SPLIT), plain_model(ctx_output=True), SplitPlacementError,
                             r"the attention context ctx1 is a graph output; cannot rewire it")


def test_split_plain_rank3_side_input_is_refused_before_any_edit():
    assert_refused_unchanged(lambda m: place("split", m, SPLIT), plain_model(bias_shape=(1, 1, "S")),
                             SplitPlacementError, r"unsupported rank-3 input bias_side of /encoder/layer\.1/attention/Add")


def test_row_plain_side_input_of_unknown_rank_is_refused_before_any_edit():
    assert_refused_unchanged(lambda m: place("row", m, ROW), plain_model(bias_shape=None), RowPlacementError,
                             r"unknown rank of bias_side feeding /encoder/layer\.1/attention/Add")


@pytest.mark.parametrize("name,config,error", [("row", ROW, RowPlacementError), ("split", SPLIT, SplitPlacementError)])
@pytest.mark.parametrize("defect,match", [
    (dict(before_softmax="Tanh"), r"could not find the scores MatMul before /encoder/layer\.1/attention/Softmax: "
                                  r"Tanh node '/encoder/layer\.1/attention/Tanh' is neither the scores MatMul"),
    (dict(after_softmax="Dropout"), r"could not find the value MatMul after /encoder/layer\.1/attention/Softmax: "
                                    r"p1_cast is read by Dropout node '/encoder/layer\.1/attention/Dropout' "
                                    r"\(input 0\)"),
])
def test_plain_walk_refusals_name_where_they_stopped(name, config, error, defect, match):
    """The walks stop at a soft-capping Tanh before the Softmax, and at a Dropout after its cast."""
    assert_refused_unchanged(lambda m: place(name, m, config), plain_model(**defect), error, match)


# ---------------------------------------------------------------------------------------------
# Softmax-fused ops and recalibration
# ---------------------------------------------------------------------------------------------
def test_fused_softmax_placement_on_near_miss_graph():
    model = plain_model()
    result = place("fused-softmax", model, FUSED_SOFTMAX)
    assert result.layers == [0, 1] and result.op_type == SOFTMAX_ALL_ROWS_OP
    assert ops_of(model) == [SOFTMAX_ALL_ROWS_OP] * 2 and "Softmax" not in [n.op_type for n in model.graph]
    check_valid(model)


def test_fused_softmax_probabilities_graph_output_is_refused_before_any_edit():
    """A graph output needs layer 1's plain probabilities, so its Softmax cannot be absorbed; the
    softmax placement (which this one starts with) must not have run either."""
    assert_refused_unchanged(lambda m: place("fused-softmax", m, FUSED_SOFTMAX), plain_model(probs_output=True),
                             SoftmaxPatternError,
                             r"fused-softmax placement: layer 1's Softmax /encoder/layer\.1/attention/Softmax cannot "
                             r"be fused with the calibration: its output p1 is also a graph output.*"
                             r"use --placement softmax")


def test_recalibration_refused_after_removal_leaves_the_old_calibration():
    """`replace=True` on a Softmax-fused graph: the pattern search that follows the removal runs on a
    copy, so a wrong layer count keeps the old calibration; with the right one the ops are replaced."""
    model = plain_model()
    place("fused-softmax", model, FUSED_SOFTMAX)
    assert_refused_unchanged(lambda m: insert_calibration(m, ROW, 3, replace=True), model, SoftmaxPatternError,
                             r"one attention Softmax -> MatMul per layer \(3 layers\) but found 2")
    result = insert_calibration(model, ROW, LAYERS, replace=True)
    assert result.op_type == POOLED_OP and ops_of(model) == [POOLED_OP] * 2
    check_valid(model)


def test_removal_of_a_calibration_that_is_a_graph_output_is_refused_before_any_edit():
    model = plain_model()
    place("softmax", model, SPLIT)
    assert ops_of(model) == [ALL_ROWS_OP] * 2
    kept = ir.from_proto(ir.to_proto(model))
    assert remove_calibration(kept) == 2 and ops_of(kept) == []
    last = [n for n in model.graph if n.domain == DOMAIN][-1]
    model.graph.outputs.append(last.outputs[0])
    assert_refused_unchanged(remove_calibration, model, SoftmaxPatternError,
                             r"the output p1_attncal of calibration node attncal_AllRowsCalibration_layer1 is a graph "
                             r"output")


# ---------------------------------------------------------------------------------------------
# The protocol: every placement's check makes no edit; the registry is the one list of names
# ---------------------------------------------------------------------------------------------
# Each tiny graph and the placements that take it: the plain graph every placement but the two that rewrite
# ONNX Runtime's fused attention, the fused graph the reverse; a defect in layer 1 is refused by the rules that
# meet it (the walk back from a Softmax stops at a Tanh; a past state is no encoder layer).
CHECK_CASES = {
    "plain": (plain_model, {}, {"softmax", "fused-softmax", "row", "split"}),
    "plain-tanh": (plain_model, dict(before_softmax="Tanh"), {"softmax", "fused-softmax"}),
    "fused": (fused_model, {}, {"row", "split", "attention", "projected-attention"}),
    "fused-past": (fused_model, dict(past=True), set()),
}


@pytest.mark.parametrize("case", sorted(CHECK_CASES))
@pytest.mark.parametrize("name", sorted(placements.PLACEMENTS))
def test_every_placement_checks_without_editing(name, case):
    """`check` leaves the model's bytes and readers as they were, accepted or refused (the plain rules'
    checks run ONNX shape inference and take it off again); its refusal is what `place` raises, and its
    plan applies to the model it checked."""
    make, options, accepting = CHECK_CASES[case]
    placement = placements.get(name)
    config = ROW if name == "row" else SPLIT
    model = make(**options)
    before = snapshot(model)
    outcome = placement.check(model, config, LAYERS)
    after = snapshot(model)
    assert after[1] == before[1], f"{name}'s check left readers behind on the {case} graph"
    assert after[0] == before[0], f"{name}'s check edited the {case} graph"
    if name not in accepting:
        assert isinstance(outcome, Refusal), outcome
        assert_refused_unchanged(lambda m: place(name, m, config), model, outcome.error, re.escape(outcome.message))
    else:
        assert isinstance(outcome, PlacementPlan), outcome
        assert placement.apply(model, outcome).layers == [0, 1]
        check_valid(model)


def test_plan_refuses_the_precisions_a_placement_does_not_list():
    rc = CalibrationConfig(pooling="cls").resolve()
    for name, placement in placements.PLACEMENTS.items():
        for precision in sorted(PRECISIONS - placement.precisions):
            with pytest.raises(ValueError, match=f"a {precision} export"):
                placements.plan(name, rc, precision)
        for precision in sorted(placement.precisions):
            assert placements.plan(name, rc, precision).optimized == name


def test_the_registry_is_the_one_list_of_placement_names():
    """The command lines' `--placement` choices and the exporter's are the registry's own tuple, not a copy,
    and the registry has one placement for each name of `placement_names`."""
    import argparse

    from attncal.cli import bench as bench_cli
    from attncal.cli import export as export_cli
    from attncal.exporting import exporter
    from attncal.graphs.placements import placement_names

    assert tuple(placements.PLACEMENTS) == placement_names.NAMES
    assert placements.CHOICES is placement_names.CHOICES and exporter.PLACEMENTS is placements.CHOICES
    for cli in (export_cli, bench_cli):
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        [choices] = [a.choices for a in parser._actions if "--placement" in a.option_strings]
        assert choices is placements.CHOICES, cli.__name__
