"""Defined behaviour at the edges (attncal.graphs.ops.contract, "Rows that are fully masked or not
finite"): every implementation of the four ops against the float64 oracle on rows whose scores are
all -inf, all the dtype's lowest finite value, partly -inf or hold a NaN, on padding query rows,
and (separate ops) on probability rows holding a NaN or an infinity.

The contract: the ops follow the graph they replace.  A fused op is `<op>(Softmax(scores), mask)`
with ONNX Softmax, which gives an all-NaN row for scores that are all -inf (or hold a NaN or +inf);
a separate op returns an all-NaN row for a calibrated row that holds a NaN or an infinity at any
key and leaves every other row as it is (NaN included).  A row of the lowest finite value is the
uniform softmax row 1/K over all K keys, then calibrated as usual.  Nothing turns NaN into a finite
value and nothing turns a finite row into NaN: the other rows of the batch (and the other heads of
the same row) are bit for bit what the same implementation gives without the special rows.

Implementations: the oracle (`reference`; on Softmax in float64 for the fused ops), the PyTorch
efficient path (`apply`; after torch.softmax for the fused ops), the function body run by ONNX
Runtime without the native library, and the native CPU kernel out of place (graph input) and in
place (the op's input and output are intermediates)."""

from __future__ import annotations

import ctypes

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from attncal.calibration import CalibrationConfig, apply, reference
from attncal.graphs.ops.contract import (DOMAIN, OP_TYPES, VERSION, calibration_of, op_spec, resolved_from_attrs,
                                         takes_scores)
from attncal.graphs.ops.function_body import make_function
from attncal.graphs.ops.single_op import single_op_model
from attncal.runtime import oplib

B, H, K = 3, 2, 9
SCORE_KINDS = ("all_neg_inf", "all_lowest", "partly_neg_inf", "nan_score", "padding_row")
PROB_KINDS = ("nan_prob_valid", "nan_prob_masked", "inf_prob")  # separate ops only: no softmax gives these
NAN_KINDS = ("all_neg_inf", "nan_score", "padding_row") + PROB_KINDS  # the special rows come back all NaN
IMPLS = ("efficient", "body", "native_out", "native_in")
SEPARATE_OPS = tuple(o for o in OP_TYPES if not takes_scores(o))

# The mask: item 0 full, item 1 right-padded (6 tokens), item 2 left-padded (5 tokens).
MASK = torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [0] * 4 + [1] * 5], dtype=torch.int64)
# Pooled ops: `last` pooling isolates both end tokens (the first one `original`: budget rescale).
# All rows: mean pooling with an isolated `original` first token.
CONFIGS = {
    "pooled": CalibrationConfig(pooling="last", variant="cls-soft", basket_size=2, strength=0.7,
                                first_weight="original", skip_short=False),
    "all_rows": CalibrationConfig(pooling="mean", basket_size=3, strength=0.6, isolate_first=True,
                                  first_weight="original", skip_short=False),
}


def spec_for(op_type: str):
    rc = CONFIGS["all_rows" if "AllRows" in op_type else "pooled"].resolve()
    spec = op_spec(rc, 0, fused_softmax=takes_scores(op_type))
    assert spec.op_type == op_type
    return spec, resolved_from_attrs(spec.op_type, spec.attrs)


def special_rows(op_type: str, kind: str) -> list[tuple[int, int, int]]:
    """(b, h, q) of the rows `kind` rewrites: a calibrated row of items 1 and 2, head 0 only (head 1
    of the same row stays ordinary); for `padding_row` the padding query rows (every head)."""
    if kind == "padding_row":
        return [(1, h, q) for h in range(H) for q in (6, 8)] + [(2, h, q) for h in range(H) for q in (0, 3)]
    if "AllRows" in op_type:
        return [(1, 0, 2), (2, 0, 5)]
    return [(1, 0, 5), (2, 0, 8)]  # the pooling row: the last valid token


def make_scores(op_type: str, kind: str | None, dtype=torch.float32) -> torch.Tensor:
    """[B,H,K,K] scores as an encoder builds them (logits, masked keys at the dtype's lowest value)
    with the special rows of a score kind (None, or a probability kind: none)."""
    gen = torch.Generator().manual_seed(0)
    lowest = torch.finfo(dtype).min
    scores = (torch.randn(B, H, K, K, generator=gen) * 2).to(dtype).masked_fill(MASK[:, None, None, :] == 0, lowest)
    for b, h, q in special_rows(op_type, kind) if kind in SCORE_KINDS else ():
        row = scores[b, h, q]
        if kind in ("all_neg_inf", "padding_row"):
            row.fill_(float("-inf"))
        elif kind == "all_lowest":
            row.fill_(lowest)
        elif kind == "partly_neg_inf":
            row.masked_fill_(MASK[b] == 0, float("-inf"))
        elif kind == "nan_score":
            row[int(MASK[b].nonzero()[2])] = float("nan")  # a content key
    return scores


def op_input(op_type: str, kind: str | None, dtype=torch.float32) -> torch.Tensor:
    """What the op reads: the scores (fused ops) or their Softmax (separate ops; in float32, then
    `dtype`), with the special rows of `kind`."""
    scores = make_scores(op_type, kind, dtype)
    if takes_scores(op_type):
        return scores
    probs = torch.softmax(scores.float(), -1).to(dtype)
    for b, h, q in special_rows(op_type, kind) if kind in PROB_KINDS else ():
        valid = MASK[b].nonzero().flatten()
        if kind == "nan_prob_valid":
            probs[b, h, q, int(valid[2])] = float("nan")
        elif kind == "nan_prob_masked":
            probs[b, h, q, int((MASK[b] == 0).nonzero()[0])] = float("nan")
        else:
            probs[b, h, q, int(valid[-1])] = float("inf")  # the isolated last token (pooled) / content
    return probs


# ------------------------------------------------------------------ implementations
def plain_session(model: onnx.ModelProto, library=None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def chain_model(spec, first: str, separate_after_softmax: bool = False) -> onnx.ModelProto:
    """x -> first node -> op -> Add(0): the op's input and output are intermediates, so ORT may hand
    it its input's buffer (Add(0) keeps NaN and every finite value bit for bit).  `first` is "Add"
    (Add(0): the op reads x) or "Softmax"; with `separate_after_softmax` the op is the separate
    calibration of the fused `spec` (ORT's Softmax, then the separate op: the graph a fused op
    replaces)."""
    f = TensorProto.FLOAT
    op_type = calibration_of(spec.op_type) if separate_after_softmax else spec.op_type
    pre = helper.make_node("Softmax", ["x"], ["y"], axis=-1) if first == "Softmax" else \
        helper.make_node("Add", ["x", "zero"], ["y"])
    nodes = [pre, helper.make_node(op_type, ["y", "attention_mask"], ["cal"], domain=DOMAIN, **spec.attrs),
             helper.make_node("Add", ["cal", "zero"], ["out"])]
    dims = ["B", "H", "Q", "K"]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, dims),
                                       helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "K"])],
                          [helper.make_tensor_value_info("out", f, dims)],
                          initializer=[helper.make_tensor("zero", f, [], [0.0])],
                          value_info=[helper.make_tensor_value_info(n, f, dims) for n in ("y", "cal")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, VERSION)],
                          functions=[make_function(op_type, 18)])  # the native kernel wins when registered
    m.ir_version = 10
    return m


@pytest.fixture(scope="module")
def native():
    """The ORT library and its in-place counter; skips the native cases when it cannot be built."""
    try:
        lib = oplib.build_library()
    except oplib.BuildError as exc:
        pytest.skip(f"native library not built: {str(exc).splitlines()[0]}")
    fn = ctypes.CDLL(str(lib)).attncal_debug_inplace_count
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_int]
    return lib, (lambda: fn(0))


def run(impl: str, op_type: str, x: torch.Tensor, request=None) -> np.ndarray:
    """The op on `x` (its input, float32 or float16) by one implementation."""
    spec, rc = spec_for(op_type)
    fused = takes_scores(op_type)
    half = x.dtype == torch.float16
    if impl == "oracle":
        return reference(torch.softmax(x.double(), -1) if fused else x.double(), MASK, rc).numpy()
    if impl == "efficient":  # the PyTorch path: softmax (fused ops), then apply in place
        return apply(torch.softmax(x.float(), -1).to(x.dtype) if fused else x.clone(), MASK, rc).numpy()
    feeds = {"scores" if fused else "probs": x.numpy(), "attention_mask": MASK.numpy()}
    if impl == "body":
        return plain_session(single_op_model(spec, float16=half)).run(None, feeds)[0]
    lib, inplace_count = request.getfixturevalue("native")
    if impl == "native_out":
        return plain_session(single_op_model(spec, float16=half, with_function=False), lib).run(None, feeds)[0]
    assert not half
    before = inplace_count()
    (out,) = plain_session(chain_model(spec, "Add"), lib).run(None, {"x": x.numpy(), "attention_mask": MASK.numpy()})
    assert inplace_count() == before + 1, "ORT did not run the op in place"
    return out


def assert_same(got: np.ndarray, want: np.ndarray, what: str, tol: float = 1e-6) -> None:
    """NaN exactly where `want` has NaN; finite values within `tol` elsewhere."""
    got = got.astype(np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)), (what, np.argwhere(np.isnan(got) != np.isnan(want)))
    fin = ~np.isnan(want)
    assert np.all(np.isfinite(got[fin])), what
    err = float(np.abs(got[fin] - want[fin]).max()) if fin.any() else 0.0
    assert err <= tol, (what, err)


CASES = [(o, k) for o in OP_TYPES for k in SCORE_KINDS] + [(o, k) for o in SEPARATE_OPS for k in PROB_KINDS]


# ------------------------------------------------------------------ the contract, on the oracle
@pytest.mark.parametrize("op_type,kind", CASES)
def test_oracle_states_the_contract(op_type, kind):
    """What each row kind gives, read off the oracle's own output."""
    _, rc = spec_for(op_type)
    out = run("oracle", op_type, op_input(op_type, kind))
    for b, h, q in special_rows(op_type, kind):
        if kind in NAN_KINDS:
            # calibrated: NaN at every key, masked keys included; not calibrated (padding query
            # rows): left as it is, which is the NaN the softmax gave
            assert np.all(np.isnan(out[b, h, q])), (b, h, q, out[b, h, q])
        else:
            assert np.all(np.isfinite(out[b, h, q])), (b, h, q, out[b, h, q])
    if kind == "all_lowest":  # the softmax's uniform row over all K keys, then its calibration
        want = reference(torch.full((B, H, K, K), 1.0 / K, dtype=torch.float64), MASK, rc).numpy()
        for b, h, q in special_rows(op_type, kind):
            np.testing.assert_allclose(out[b, h, q], want[b, h, q], rtol=0, atol=1e-7)
            assert np.all(out[b, h, q][MASK[b].numpy() == 0] == 0)  # calibrated: masked keys are 0
            assert np.abs(out[b, h, q] - 1.0 / K).max() > 1e-3  # and it was calibrated


# ------------------------------------------------------------------ every implementation
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op_type,kind", CASES)
def test_implementation_matches_oracle_and_leaves_other_rows_alone(op_type, kind, impl, request):
    x = op_input(op_type, kind)
    got = run(impl, op_type, x, request)
    assert_same(got, run("oracle", op_type, x), f"{impl} vs oracle")
    # Every other row is bit for bit what the same implementation gives without the special rows.
    base = run(impl, op_type, op_input(op_type, None), request)
    other = np.ones((B, H, K), bool)
    for b, h, q in special_rows(op_type, kind):
        other[b, h, q] = False
    assert np.array_equal(got[other].view(np.uint32), base[other].view(np.uint32)), \
        np.argwhere((got != base).any(-1) & other)


@pytest.mark.parametrize("runtime", ["body", "native"])
@pytest.mark.parametrize("op_type", [o for o in OP_TYPES if takes_scores(o)])
def test_fused_op_is_onnx_softmax_then_the_separate_op(op_type, runtime, request):
    """The graph a fused op replaces, ORT's Softmax then the separate op (in place with the native
    library), gives the same NaN rows and the same values on every score kind."""
    spec, _ = spec_for(op_type)
    lib, inplace_count = request.getfixturevalue("native") if runtime == "native" else (None, lambda: 0)
    fused = plain_session(chain_model(spec, "Add"), lib)
    graph = plain_session(chain_model(spec, "Softmax", separate_after_softmax=True), lib)
    for kind in SCORE_KINDS:
        feeds = {"x": make_scores(op_type, kind).numpy(), "attention_mask": MASK.numpy()}
        before = inplace_count()
        assert_same(fused.run(None, feeds)[0], graph.run(None, feeds)[0].astype(np.float64), kind)
        assert inplace_count() - before == (2 if lib else 0)  # both ops ran natively, in place


@pytest.mark.parametrize("impl", ["efficient", "body", "native_out"])
@pytest.mark.parametrize("op_type", OP_TYPES)
def test_float16_rows_match_oracle(op_type, impl, request):
    """float16 (computed in float32 by every implementation): the same NaN rows, values within the
    float16 tolerance, other rows unchanged.  The lowest float16 value is -65504."""
    for kind in [k for o, k in CASES if o == op_type]:
        x = op_input(op_type, kind, torch.float16)
        got = run(impl, op_type, x, request)
        assert got.dtype == np.float16
        assert_same(got, run("oracle", op_type, x), f"{impl} {kind} vs oracle", tol=2e-3)
        base = run(impl, op_type, op_input(op_type, None, torch.float16), request)
        other = np.ones((B, H, K), bool)
        for b, h, q in special_rows(op_type, kind):
            other[b, h, q] = False
        assert np.array_equal(got[other].view(np.uint16), base[other].view(np.uint16)), kind
