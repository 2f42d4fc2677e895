"""The projected calibrated attention ops (PooledRowCalibratedProjectedAttention /
AllRowsCalibratedProjectedAttention: the calibrated attention op with the Q, K and V projection inside,
ONNX Runtime `Attention`'s packed weight layout; contract.py).  The native CPU kernel against the
unprojected op fed with the same projections and against the op's function body, on random shapes,
attribute sets and masks (both padding sides, holes, empty items); with the weight fed at run time
(cblas_sgemm) and as an initializer (packed once at kernel creation, as exports have it); bit-identical
at 1, 2 and 4 threads; refusals that name the bad shape."""

from __future__ import annotations

import ctypes
import random

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from attncal.graphs.ops.contract import attention_op_spec
from attncal.graphs.ops.single_op import single_op_model
from test_calibrated_attention import random_attention_spec
from support.computed_once import computed_once
from support.masks import mixed_mask
from test_native_kernel import cpu_path, library  # noqa: F401  (the built-library and CPU-path fixtures)


def session(model, library=None, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def constant_weight(model: onnx.ModelProto, feeds: dict) -> tuple[onnx.ModelProto, dict]:
    """The model with weight and bias as initializers (as in an export), and the feeds without them."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for name in ("weight", "bias"):
        (graph_input,) = [i for i in m.graph.input if i.name == name]
        m.graph.input.remove(graph_input)
        m.graph.initializer.append(numpy_helper.from_array(feeds[name], name))
    return m, {k: v for k, v in feeds.items() if k not in ("weight", "bias")}


def debug_counter(library, name: str):
    """One of the library's run counters (attncal_debug_*_count), as a function returning its value."""
    fn = getattr(ctypes.CDLL(str(library)), name)
    fn.restype, fn.argtypes = ctypes.c_uint64, []
    return fn


def packed_count(library) -> int:
    return int(debug_counter(library, "attncal_debug_packed_projection_count")())


def random_case(rng: random.Random, np_rng: np.random.Generator):
    """(projected spec, unprojected spec, feeds, q, k, v): one random item batch under one attribute set."""
    S, N, D, _, _, scale, rc, _, _ = random_attention_spec(rng, [1, 2, 3, 5, 8, 16], max_heads=4)
    layer = rng.randint(0, 30)
    proj = attention_op_spec(rc, layer, num_heads=N, scale=scale, projected=True)
    plain = attention_op_spec(rc, layer, num_heads=N, scale=scale)
    # Up to 3 * 67 rows: row blocks of the packed kernel (8 rows, 96-row blocks) cut in the middle, and
    # 3*N*D from 3 to 384 columns: panels (16 or 32 columns) cut too.
    B, K, h_in = rng.randint(1, 3), rng.randint(1, 4 * S + 3), rng.randint(1, 40)
    x = np_rng.standard_normal((B, K, h_in)).astype(np.float32)
    w = (np_rng.standard_normal((h_in, 3 * N * D)) / np.sqrt(h_in)).astype(np.float32)
    b = np_rng.standard_normal(3 * N * D).astype(np.float32)
    mask = mixed_mask(rng, B, K, holes=0.0 if rng.random() < 0.5 else 0.3).numpy()
    q, k, v = np.split(x @ w + b, 3, axis=-1)
    return proj, plain, {"input": x, "weight": w, "bias": b, "attention_mask": mask}, q, k, v


def body_output(spec, feeds: dict) -> np.ndarray:
    """The op's function body run by ONNX Runtime without the library (it inlines the body)."""
    return session(single_op_model(spec)).run(None, feeds)[0]


def test_native_matches_the_unprojected_op_and_the_function_body(library, cpu_path):
    rng, np_rng = random.Random(31), np.random.default_rng(31)
    worst_plain = worst_body = worst_packed = 0.0
    packed_before, packed_runs = packed_count(library), 0
    for _ in range(150):
        proj, plain, f, q, k, v = random_case(rng, np_rng)
        model = single_op_model(proj, with_function=False)
        native = session(model, library).run(None, f)[0]
        ref = session(single_op_model(plain, with_function=False), library).run(
            None, {"query": q, "key": k, "value": v, "attention_mask": f["attention_mask"]})[0]
        assert native.shape == ref.shape == q.shape
        worst_plain = max(worst_plain, float(np.abs(native - ref).max()))
        body = computed_once(body_output, proj, f)  # the same on every path
        worst_body = max(worst_body, float(np.abs(native - body).max()))
        const_model, const_feeds = constant_weight(model, f)
        packed = session(const_model, library).run(None, const_feeds)[0]
        packed_runs += 1
        worst_packed = max(worst_packed, float(np.abs(packed - ref).max()))
    # The projections are float32 GEMMs in all (numpy's here, OpenBLAS's or the packed kernel's): equal up
    # to their rounding.
    assert worst_plain <= 1e-5 and worst_body <= 1e-5 and worst_packed <= 1e-5, (worst_plain, worst_body, worst_packed)
    assert packed_count(library) - packed_before == packed_runs, "every initializer weight was packed"


def test_packed_weight_on_model_shapes(library, cpu_path):
    """MiniLM's projection shape (384 -> 3 x 384), both padding sides: the packed weight (taken below 256
    rows: a one-text request, 3 x 83 with a 96-row block cut short) against the weight fed at run time, and
    cblas_sgemm on the same initializer from 256 rows on."""
    from attncal.calibration import CalibrationConfig

    rng, np_rng = random.Random(5), np.random.default_rng(5)
    spec = attention_op_spec(CalibrationConfig(pooling="mean").resolve(), 3, num_heads=12, projected=True)
    model = single_op_model(spec, with_function=False)
    w = (np_rng.standard_normal((384, 1152)) / np.sqrt(384)).astype(np.float32)
    b = np_rng.standard_normal(1152).astype(np.float32)
    for B, K in ((1, 70), (3, 83), (1, 255), (1, 256), (8, 256)):
        f = {"input": np_rng.standard_normal((B, K, 384)).astype(np.float32), "weight": w, "bias": b,
             "attention_mask": mixed_mask(rng, B, K).numpy()}
        fed = session(model, library, 2).run(None, f)[0]
        before = packed_count(library)
        const_model, const_feeds = constant_weight(model, f)
        packed = session(const_model, library, 2).run(None, const_feeds)[0]
        assert packed_count(library) - before == (1 if B * K < 256 else 0), (B, K)
        assert np.abs(packed - fed).max() <= 1e-5, (B, K, float(np.abs(packed - fed).max()))


@pytest.mark.parametrize("constant", [False, True], ids=["weight-fed", "weight-packed"])
def test_native_is_bit_identical_across_threads_and_counts(library, cpu_path, constant):
    rng, np_rng = random.Random(7), np.random.default_rng(7)
    count = debug_counter(library, "attncal_debug_attention_count")
    from attncal.calibration import CalibrationConfig

    for pooling in ("mean", "cls", "last"):
        spec = attention_op_spec(CalibrationConfig(pooling=pooling, basket_size=64).resolve(), 3, num_heads=4,
                                 projected=True)
        # Several projection tiles and query-row units per head; the packed weight only below 256 rows.
        B, K, h_in = (1, 250, 48) if constant else (3, 700, 48)
        f = {"input": np_rng.standard_normal((B, K, h_in)).astype(np.float32),
             "weight": (np_rng.standard_normal((h_in, 3 * 4 * 16)) / 7).astype(np.float32),
             "bias": np_rng.standard_normal(3 * 4 * 16).astype(np.float32),
             "attention_mask": mixed_mask(rng, B, K, holes=0.5).numpy()}
        model = single_op_model(spec, with_function=False)
        if constant:
            model, f = constant_weight(model, f)
        before = count()
        outs = [session(model, library, t).run(None, f)[0] for t in (1, 2, 4)]
        assert count() - before == 3, "the native kernel ran"
        assert all(np.array_equal(outs[0], o) for o in outs[1:])
        assert np.isfinite(outs[0]).all()


@pytest.mark.parametrize("change,message", [
    (lambda f: f.update(weight=f["weight"][:, :-3]), "3\\*N\\*D divisible by 3\\*num_heads=6"),
    (lambda f: f.update(weight=f["weight"][:-1]), "H_in = input's last dimension"),
    (lambda f: f.update(bias=f["bias"][:-1]), "and bias \\[3\\*N\\*D\\]"),
    (lambda f: f.update(attention_mask=f["attention_mask"][:, :-1]), "attention_mask must be \\[B,S\\]=\\[2,9\\]"),
    (lambda f: f.update(input=f["input"][0]), "Invalid rank for input: input"),  # ONNX Runtime's own check
])
def test_bad_shapes_are_refused_with_the_shapes(library, change, message):
    from attncal.calibration import CalibrationConfig

    spec = attention_op_spec(CalibrationConfig(pooling="mean", basket_size=2).resolve(), 0, num_heads=2,
                             projected=True)
    rng = np.random.default_rng(0)
    f = {"input": rng.standard_normal((2, 9, 5)).astype(np.float32),
         "weight": rng.standard_normal((5, 3 * 2 * 4)).astype(np.float32),
         "bias": rng.standard_normal(3 * 2 * 4).astype(np.float32), "attention_mask": np.ones((2, 9), np.int64)}
    change(f)
    with pytest.raises(Exception, match=message):
        session(single_op_model(spec, with_function=False), library).run(None, f)
