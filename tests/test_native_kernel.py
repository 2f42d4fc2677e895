"""The native CPU kernel (plugins/kernels/cpu/row_calibration.h through the ORT
library): >= 20,000 random cases per dtype against the float64 oracle, thread
count independence, in place vs out of place, and the subnormal fixed weight.
Many cases share one session run (a batch of items with their own masks)."""

from __future__ import annotations

import ctypes
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from attncal.calibration import CalibrationConfig, reference
from attncal.graphs.ops.contract import DOMAIN, VERSION, op_spec, resolved_from_attrs
from attncal.graphs.ops.single_op import single_op_model
from attncal.runtime import oplib
from support.cases import calibrated_rows
from support.masks import mixed_mask
from support.oracle_loop import (random_calibration_batch, random_calibration_op, run_oracle_loop,
                                 tally_calibration_items)
from support.tensors import random_probs


@pytest.fixture(scope="module")
def library() -> Path:
    try:
        return oplib.build_library()
    except oplib.BuildError as exc:
        pytest.fail(str(exc))


@pytest.fixture(params=oplib.CPU_PATHS)
def cpu_path(request, library) -> str:
    """Each instruction-set path of the CPU kernels (plugins/kernels/cpu/isa.h) in turn, set in this process for
    the test and the widest restored after; a path this CPU lacks is skipped.  The widest is what the machine's
    users get; the others are what users of other CPUs get, so every machine checks every path it can run."""
    if request.param not in oplib.cpu_paths(library):
        pytest.skip(f"this CPU lacks the {request.param} path")
    widest = oplib.cpu_path(library)
    oplib.set_cpu_path(library, request.param)
    assert oplib.cpu_path(library) == request.param
    yield request.param
    oplib.set_cpu_path(library, widest)


@pytest.mark.parametrize("value,message", [
    ("sse9", "ATTNCAL_CPU_PATH=sse9 is not a CPU path: use avx512, avx2 or default"),
    *[(p, f"ATTNCAL_CPU_PATH={p}: this CPU (or build) lacks that path") for p in oplib.CPU_PATHS[:2]],
])
def test_a_forced_cpu_path_is_taken_or_refused_by_name(library, value, message):
    """ATTNCAL_CPU_PATH, read when the library loads: a path this CPU runs is the one the kernels take; a name that
    is no path, or a path this CPU lacks, makes registering the library fail with the reason (never run)."""
    code = ("import sys, onnxruntime as ort\n"
            "from attncal.runtime import oplib\n"
            "so = ort.SessionOptions()\n"
            "try:\n"
            f"    so.register_custom_ops_library({str(library)!r})\n"
            "except Exception as e:\n"
            "    sys.exit(str(e))\n"
            f"print(oplib.cpu_path({str(library)!r}))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, oplib.CPU_PATH_ENV: value})
    if value in oplib.cpu_paths(library):
        assert res.returncode == 0 and res.stdout.strip() == value, res.stdout + res.stderr
    else:
        assert res.returncode != 0 and message in res.stderr, res.stdout + res.stderr


def test_bench_records_the_cpu_path_that_runs(library, cpu_path, monkeypatch):
    """`attncal bench` names in results.json the path the kernels took (so a ratio that moves on one path shows), and
    whether ATTNCAL_CPU_PATH forced it."""
    from attncal.bench import harness

    monkeypatch.setenv("ATTNCAL_ORT_LIBRARY", str(library))
    monkeypatch.delenv(oplib.CPU_PATH_ENV, raising=False)
    machine = harness.machine_info(1)
    assert machine["cpu_path"] == cpu_path and machine["cpu_path_forced"] is False
    monkeypatch.setenv(oplib.CPU_PATH_ENV, cpu_path)
    assert harness.machine_info(1)["cpu_path_forced"] is True


@pytest.mark.parametrize("core", [None, "Haswell"])
def test_bench_and_doctor_name_the_blas_kernels_the_library_loaded(library, core):
    """The OpenBLAS kernels under the library's GEMMs are part of what a native-graph figure measured: none before the
    library loads; after, the kernels $OPENBLAS_CORETYPE names (forced) or OpenBLAS's own pick for this CPU, as
    `attncal bench` records them in results.json and `attncal doctor` shows them."""
    code = ("import json, onnxruntime as ort\n"
            "from attncal.bench import harness\n"
            "from attncal.runtime import oplib\n"
            "before = oplib.blas_core()\n"
            "so = ort.SessionOptions()\n"
            f"so.register_custom_ops_library({str(library)!r})\n"
            "m = harness.machine_info(1)\n"
            "print(json.dumps([before, m['blas_core'], m['blas_core_forced']]))\n")
    env = {k: v for k, v in os.environ.items() if k != oplib.BLAS_CORE_ENV}
    if core is not None:
        env[oplib.BLAS_CORE_ENV] = core
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    before, loaded, forced = json.loads(res.stdout.splitlines()[-1])
    assert before is None and forced is (core is not None)
    assert loaded == core if core is not None else loaded  # OpenBLAS's own pick: a core name, whichever this CPU gets


@pytest.fixture(scope="module")
def counters(library):
    lib = ctypes.CDLL(str(library))
    out = {}
    for name in ("attncal_debug_compute_count", "attncal_debug_inplace_count"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_int]
        out[name.split("_")[2]] = (lambda f=fn: f(0))
    return out  # {"compute": ..., "inplace": ...}


def session(model: onnx.ModelProto, library: Path, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def softmax_then_op(spec, float16: bool) -> onnx.ModelProto:
    """logits -> Softmax -> op -> Relu: the op's input and output are intermediates (as in an
    exported encoder), so ORT may run it in place (GetMayInplace); ORT never hands a graph
    output the buffer of an intermediate.  Relu keeps probabilities bit for bit."""
    dtype = TensorProto.FLOAT16 if float16 else TensorProto.FLOAT
    nodes = [helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
             helper.make_node(spec.op_type, ["probs", "attention_mask"], ["cal"], domain=DOMAIN, **spec.attrs),
             helper.make_node("Relu", ["cal"], ["calibrated"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("logits", dtype, ["B", "H", "Q", "K"]),
                                       helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "K"])],
                          [helper.make_tensor_value_info("calibrated", dtype, ["B", "H", "Q", "K"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, VERSION)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("float16,tol", [(False, 1e-6), (True, 2e-3)], ids=["fp32", "fp16"])
def test_kernel_matches_oracle_on_20000_cases(library, counters, float16, tol):
    """A case is one batch item (its own mask, padding side and length) under one attribute set,
    all of its heads and calibrated rows compared with the oracle.  Each batch runs on every instruction-set
    path this CPU runs (the `cpu_path` fixture's paths), against one float64 oracle."""
    rng = random.Random(1201 + float16)
    gen = torch.Generator().manual_seed(12)
    dtype = torch.float16 if float16 else torch.float32
    paths, widest = oplib.cpu_paths(library), oplib.cpu_path(library)
    before = counters["compute"]()

    def configure():
        S, spec, rc = random_calibration_op(rng)
        return S, spec, rc, session(single_op_model(spec, float16=float16), library)

    def run(config, seen):
        S, spec, rc, sess = config
        B, K, mask = random_calibration_batch(rng, rc)
        probs = random_probs(gen, mask, 1 if rc.all_rows else rng.randint(1, 2), dtype,
                             temp=rng.choice([0.5, 2.0, 6.0]))
        if not rc.all_rows and rng.random() < 0.3:  # Q == 1: the single row is the pooling row
            probs = probs[:, :, rng.randrange(K): , :][:, :, :1, :].contiguous()
            seen["q1"] += B
        if rng.random() < 0.2:
            probs[..., rng.randrange(K):][..., : 2 * S] = 0  # empty baskets
        outs = []
        try:
            for path in paths:
                oplib.set_cpu_path(library, path)
                assert oplib.cpu_path(library) == path
                outs.append(sess.run(None, {"probs": probs.numpy(), "attention_mask": mask.numpy()})[0])
        finally:
            oplib.set_cpu_path(library, widest)
        ref = reference(probs.double(), mask, rc).numpy()
        rows = probs.shape[2] == K  # then the rows the spec leaves alone are bit-identical
        untouched = (~calibrated_rows(mask, rc))[:, None, :].expand(outs[0].shape[:3]).numpy() if rows else None
        worst = 0.0
        for path, out in zip(paths, outs):
            err = np.abs(out.astype(np.float64) - ref).max(axis=(1, 2, 3))
            assert err.max() <= tol, (path, float(err.max()), spec, K, int(err.argmax()))
            if rows:
                assert np.array_equal(out[untouched].view(np.uint8), probs.numpy()[untouched].view(np.uint8)), path
            worst = max(worst, float(err.max()))
        tally_calibration_items(seen, mask, rc, S)
        return B, worst

    loop = run_oracle_loop(20000, configure, run, runs_per_config=2,
                           seen=("q1", "left", "right", "partial", "all_rows", "pooled"))
    assert counters["compute"]() - before == loop.runs * len(paths), "every run must execute the native kernel"
    print(f"\n{'fp16' if float16 else 'fp32'}: {loop.cases} cases in {loop.runs} runs on each of the paths {paths}, "
          f"max abs err {loop.worst:.3g}, {loop.seen}")
    assert min(loop.seen.values()) > 1000, loop.seen


@pytest.mark.parametrize("float16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_threads_and_in_place_are_bit_identical(library, cpu_path, counters, float16, pooling):
    """1, 2 and 4 intra-op threads, in place (after a Softmax) and out of place (graph input),
    give the same bits; the in-place model really runs in place."""
    spec = op_spec(CalibrationConfig(pooling=pooling, basket_size=16, variant="cls-soft").resolve(), 0)
    gen = torch.Generator().manual_seed(3)
    B, H, K = 5, 3, 200
    mask = mixed_mask(random.Random(5), B, K)
    mask[0] = 1
    logits = torch.randn(B, H, K, K, generator=gen) * 3
    logits = logits.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
    dtype = np.float16 if float16 else np.float32
    feeds = {"logits": logits.numpy().astype(dtype), "attention_mask": mask.numpy()}
    results = []
    for threads in (1, 2, 4):
        inplace_before = counters["inplace"]()
        (a,) = session(softmax_then_op(spec, float16), library, threads).run(None, feeds)
        assert counters["inplace"]() == inplace_before + 1, "ORT did not reuse the probs buffer"
        probs = np.nan_to_num(torch.softmax(torch.from_numpy(feeds["logits"]).float(), -1).numpy()).astype(dtype)
        (b,) = session(single_op_model(spec, float16=float16), library, threads).run(
            None, {"probs": probs, "attention_mask": feeds["attention_mask"]})
        results += [a, b]
        ref = reference(torch.from_numpy(probs).double(), mask, resolved_from_attrs(spec.op_type, spec.attrs))
        assert np.abs(b.astype(np.float64) - ref.numpy()).max() <= (2e-3 if float16 else 1e-6)
    for r in results[2::2]:
        assert np.array_equal(r.view(np.uint8), results[0].view(np.uint8))  # in place, any thread count
    for r in results[3::2]:
        assert np.array_equal(r.view(np.uint8), results[1].view(np.uint8))  # out of place, any thread count


@pytest.mark.parametrize("float16", [False, True], ids=["fp32", "fp16"])
def test_subnormal_fixed_weight_is_divided_not_inverted(library, cpu_path, float16):
    """An all-zero row with a subnormal cls-hard weight: total = w, and 1/total overflows float32;
    the kernel divides by total, so the pooling token gets exactly 1 (what the oracle gives)."""
    w = 1e-40  # float32 subnormal
    cfg = CalibrationConfig(variant="cls-hard", strength=1.0, basket_size=1, pooling="cls", self_weight=w,
                            skip_short=False)
    spec = op_spec(cfg.resolve(), 0)
    assert 0 < np.float32(spec.attrs["first_weight"]) < np.finfo(np.float32).tiny
    dtype = np.float16 if float16 else np.float32
    probs = np.zeros((1, 2, 3, 3), dtype)
    mask = np.ones((1, 3), np.int64)
    (out,) = session(single_op_model(spec, float16=float16), library).run(
        None, {"probs": probs, "attention_mask": mask})
    ref = reference(torch.from_numpy(probs).double(), torch.from_numpy(mask),
                    resolved_from_attrs(spec.op_type, spec.attrs)).numpy()
    assert np.all(np.isfinite(out))
    assert np.all(out[0, :, 0, 0] == 1.0), out[0, :, 0]
    assert np.array_equal(out.astype(np.float64), ref)


def test_exported_encoder_runs_the_kernel_in_place_once_annotated(library, counters, tmp_path, monkeypatch):
    """In a softmax-placed encoder the op follows the layer's Softmax (placement is explicit: `auto`
    gives mean pooling the split placement, which has no op; the portable graph, as the optimized
    one carries no op either).  With the probs shapes labelled (oplib.annotate_inplace_shapes)
    every native call runs in place, with the same bits as out of place; the embeddings match
    the function body."""
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.runtime import Encoder
    from attncal.synthetic import save_synthetic_model, synthetic_text

    model = save_synthetic_model("bert", tmp_path / "m", seed=2, max_positions=256)
    cfg = CalibrationConfig(pooling="mean", basket_size=8, strength=0.8)
    opts = ExportOptions(config=cfg, exporter="torchscript", placement="softmax", check=False)
    meta = export(str(model), tmp_path / "e", opts, quiet=True)
    n_layers = len(meta["calibrated_layers"])
    texts = [synthetic_text(n, seed=i) for i, n in enumerate([20, 60, 130, 200])]
    monkeypatch.setenv(oplib.NATIVE_ENV, "0")  # the function body, whatever the Encoder's default
    enc = Encoder(tmp_path / "e", graph="portable", providers=["CPUExecutionProvider"])
    plain = enc.encode(texts, batch_size=4)
    feeds = {k: v for k, v in enc.tokenize(texts).items() if k in enc.input_names}
    c0 = counters["compute"]()
    native = Encoder(tmp_path / "e", graph="portable", providers=["CPUExecutionProvider"],
                     custom_op_library=library).encode(texts, batch_size=4)
    assert counters["compute"]() - c0 == n_layers > 0
    assert float(np.abs(native - plain).max()) <= 1e-6

    exported = onnx.load(str(tmp_path / "e/onnx/model.onnx"))  # the exporter labels the shapes itself
    graph = onnx.load(str(tmp_path / "e/onnx/model.onnx"))
    op_inputs = {n.input[0] for n in graph.graph.node if n.domain == "ai.attncal"}
    kept = [vi for vi in graph.graph.value_info if vi.name not in op_inputs]
    del graph.graph.value_info[:]
    graph.graph.value_info.extend(kept)  # as torch.onnx writes it: unknown dims on the op's input
    outs = {}
    for name, g, expect_inplace in (("stripped", graph, 0), ("annotated", None, n_layers),
                                    ("exported", exported, n_layers)):
        if g is None:
            assert oplib.annotate_inplace_shapes(graph) == n_layers
            g = graph
        c0, i0 = counters["compute"](), counters["inplace"]()
        outs[name] = session(g, library, threads=2).run(None, feeds)
        assert counters["compute"]() - c0 == n_layers
        assert counters["inplace"]() - i0 == expect_inplace, name
    for other in ("annotated", "exported"):
        for a, b in zip(outs["stripped"], outs[other]):
            assert np.array_equal(a, b)


def row_placement_tail(spec) -> onnx.ModelProto:
    """The shape of what row placement builds around the pooled op (graphs/placements/row_placement.py):
    the [B,H,1,K] scores come out of an Expand whose target shape is computed at run time, so
    their dims are unknown *and unnamed*; then Softmax -> op -> MatMul(V) -> Shape -> Expand of
    the row index to that shape (what feeds ScatterElements in the real graph)."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Shape", ["scores"], ["scores_shape"]),
             helper.make_node("Expand", ["scores", "scores_shape"], ["scores_x"]),  # dims: rank 4, all anonymous
             helper.make_node("Softmax", ["scores_x"], ["probs"], axis=-1),
             helper.make_node(spec.op_type, ["probs", "attention_mask"], ["cal"], domain=DOMAIN, **spec.attrs),
             helper.make_node("MatMul", ["cal", "v"], ["ctx"]),
             helper.make_node("Shape", ["ctx"], ["ctx_shape"]),
             helper.make_node("Expand", ["row", "ctx_shape"], ["row_x"])]
    g = helper.make_graph(nodes, "tail", [
        helper.make_tensor_value_info("scores", f, ["B", 4, 1, "K"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "K"]),
        helper.make_tensor_value_info("v", f, ["B", 4, "K", 8]),
        helper.make_tensor_value_info("row", TensorProto.INT64, ["B", 1, 1, 1])],
        [helper.make_tensor_value_info("ctx", f, None),
         helper.make_tensor_value_info("row_x", TensorProto.INT64, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, VERSION)])
    m.ir_version = 10
    return m


def test_unnamed_unknown_dims_stay_unknown_after_the_op(library, counters):
    """Regression: output shape inference copied an anonymous unknown dim back as the known value
    -1, ORT folded Shape(ctx) to the constant [-1,4,-1,8] and the Expand failed with "invalid
    expand shape" (a row-placed cls encoder with the library registered).  The graph must run at
    every optimisation level and give op(probs) @ V."""
    spec = op_spec(CalibrationConfig(pooling="cls", basket_size=4, strength=0.8).resolve(), 2)
    assert spec.op_type == "PooledRowCalibration"
    gen = torch.Generator().manual_seed(11)
    B, K = 3, 13
    mask = torch.ones(B, K, dtype=torch.int64)
    mask[1, 9:] = 0
    scores = (torch.randn(B, 4, 1, K, generator=gen) * 2).masked_fill(mask[:, None, None, :] == 0, -1e4)
    feeds = {"scores": scores.numpy(), "attention_mask": mask.numpy(),
             "v": torch.randn(B, 4, K, 8, generator=gen).numpy(), "row": np.array([0, 1, 2]).reshape(B, 1, 1, 1)}
    probs = torch.softmax(scores, -1).numpy()
    (cal,) = session(single_op_model(spec), library).run(None, {"probs": probs, "attention_mask": mask.numpy()})
    assert np.abs(cal - probs).max() > 1e-3  # the op really rewrites the row
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        so.register_custom_ops_library(str(library))
        s = ort.InferenceSession(row_placement_tail(spec).SerializeToString(), so, providers=["CPUExecutionProvider"])
        c0 = counters["compute"]()
        ctx, row_x = s.run(None, feeds)
        assert counters["compute"]() - c0 == 1
        assert row_x.shape == (B, 4, 1, 8) and np.array_equal(row_x[:, :, 0, 0], np.repeat([[0], [1], [2]], 4, 1))
        np.testing.assert_allclose(ctx, cal @ feeds["v"], rtol=1e-5, atol=1e-6)
