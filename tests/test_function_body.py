"""The calibration op's standard-ONNX function body against the oracle, run by ONNX Runtime."""

from __future__ import annotations

import random

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from attncal.calibration import CalibrationConfig, reference
from attncal.graphs.ops.contract import (ALL_ROWS_OP, DOMAIN, POOLED_OP, ROW_SET_DEFAULTS, VERSION, op_spec,
                                         resolved_from_attrs)
from attncal.graphs.ops.function_body import make_function
from attncal.graphs.ops.single_op import single_op_model
from support.cases import calibrated_rows, random_config
from support.masks import random_mask
from support.tensors import random_probs


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("float16,n_configs,per_config,tol", [(False, 200, 8, 1e-6), (True, 100, 6, 2e-3)],
                         ids=["fp32", "fp16"])
def test_single_op_matches_reference(float16, n_configs, per_config, tol):
    rng = random.Random(11 if float16 else 10)
    gen = torch.Generator().manual_seed(3)
    worst, cases = 0.0, 0
    for _ in range(n_configs):
        S = rng.choice([1, 2, 3, 4, 8])
        cfg = random_config(rng, S)
        spec = op_spec(cfg.resolve(), layer=rng.randint(0, 30))
        sess = session(single_op_model(spec, opset=rng.choice([18, 20]), float16=float16))
        for _ in range(per_config):
            K = rng.randint(1, 48)
            mask = random_mask(rng, rng.randint(1, 4), K, left=rng.random() < 0.5)
            if rng.random() < 0.3:  # a hole inside an item's span: out of the baskets, 0 in calibrated rows
                b = rng.randrange(mask.shape[0])
                idx = mask[b].nonzero().flatten()
                if len(idx) > 2:
                    mask[b, int(idx[rng.randrange(1, len(idx) - 1)])] = 0
            probs = random_probs(gen, mask, rng.randint(1, 3), torch.float16 if float16 else torch.float32)
            if rng.random() < 0.2:
                probs[..., rng.randrange(K):][..., : 2 * S] = 0  # empty baskets
            (out,) = sess.run(None, {"probs": probs.numpy(), "attention_mask": mask.numpy()})
            ref = reference(probs.double(), mask, resolved_from_attrs(spec.op_type, spec.attrs)).numpy()
            err = float(np.abs(out.astype(np.float64) - ref).max()) if out.size else 0.0
            assert err <= tol, (err, spec, K)
            worst = max(worst, err)
            cases += 1
            rc = resolved_from_attrs(spec.op_type, spec.attrs)
            untouched = (~calibrated_rows(mask, rc))[:, None, :].expand(out.shape[:3]).numpy()
            assert np.array_equal(out[untouched], probs.numpy()[untouched]), "untouched rows must be bit-identical"
    print(f"\n{'fp16' if float16 else 'fp32'}: {cases} cases, {n_configs} attribute sets, max abs err {worst:.3g}")
    assert cases >= (600 if float16 else 1600)


@pytest.mark.parametrize("op_type", [POOLED_OP, ALL_ROWS_OP])
@pytest.mark.parametrize("opset", [18, 20, 21])
def test_function_checks_and_uses_model_opset(op_type, opset):
    pooling = "mean" if op_type == ALL_ROWS_OP else "cls"
    model = single_op_model(op_spec(CalibrationConfig(pooling=pooling).resolve(), 0), opset=opset)
    onnx.checker.check_model(model, full_check=True)
    (fn,) = model.functions
    assert (fn.domain, fn.name) == (DOMAIN, op_type)
    assert {o.domain: o.version for o in fn.opset_import}[""] == opset
    # Every attribute is read through a reference, so the body is generic; the optional ones carry their defaults
    # in the function.  The pooled-row op takes the marked-row attributes at their defaults only, and ignores them.
    refs = {a.ref_attr_name for n in fn.node for a in n.attribute if a.ref_attr_name}
    optional = {a.name for a in fn.attribute_proto}
    assert optional == set(ROW_SET_DEFAULTS)
    ignored = {"layer"} | (optional if op_type == POOLED_OP else set())
    assert refs == (set(fn.attribute) | optional) - ignored


def test_function_is_generic_over_attribute_values():
    """Two nodes with different attributes share one FunctionProto; each computes its own contract."""
    cfg_a = CalibrationConfig(pooling="cls", basket_size=2, strength=0.9, variant="uniform")
    cfg_b = CalibrationConfig(pooling="last", basket_size=5, strength=0.3, variant="cls-hard", self_weight=0.2)
    spec_a, spec_b = op_spec(cfg_a.resolve(), 0), op_spec(cfg_b.resolve(), 1)
    nodes = [
        helper.make_node(POOLED_OP, ["probs", "attention_mask"], ["a"], domain=DOMAIN, **spec_a.attrs),
        helper.make_node(POOLED_OP, ["probs", "attention_mask"], ["b"], domain=DOMAIN, **spec_b.attrs),
    ]
    graph = helper.make_graph(
        nodes, "two",
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["B", "H", "K", "K"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "K"])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["B", "H", "K", "K"]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["B", "H", "K", "K"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, VERSION)],
                              functions=[make_function(POOLED_OP, 18)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    rng = random.Random(0)
    mask = random_mask(rng, 3, 30, left=False, min_len=20)
    probs = random_probs(torch.Generator().manual_seed(0), mask, 2, torch.float32)
    a, b = session(model).run(None, {"probs": probs.numpy(), "attention_mask": mask.numpy()})
    assert np.abs(a - reference(probs.double(), mask, cfg_a).numpy()).max() <= 1e-6
    assert np.abs(b - reference(probs.double(), mask, cfg_b).numpy()).max() <= 1e-6
    assert np.abs(a - b).max() > 1e-3


def test_function_body_rejects_low_opset():
    with pytest.raises(ValueError, match="needs opset >= 18"):
        make_function(POOLED_OP, 17)
