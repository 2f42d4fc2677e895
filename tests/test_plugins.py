"""The native plugins (plugins/): the ORT custom-op library's CPU kernel against
the oracle, on exported models, the native-kernel-wins guarantee, bad inputs,
and the CUDA compile check.  The build is cached in build/plugins."""

from __future__ import annotations

import ctypes
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from attncal.calibration import CalibrationConfig, reference
from attncal.graphs.ops.contract import ALL_ROWS_OP, DOMAIN, POOLED_OP, VERSION, op_spec, resolved_from_attrs
from attncal.graphs.ops.single_op import single_op_model
from attncal.runtime import oplib
from support.cases import calibrated_rows, random_config
from support.masks import random_mask
from support.tensors import random_probs


@pytest.fixture(scope="module")
def library() -> Path:
    try:
        return oplib.build_library()
    except oplib.BuildError as exc:  # a real failure, reported with the build log's tail
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def counter(library):
    fn = ctypes.CDLL(str(library)).attncal_debug_compute_count
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_int]
    return lambda: fn(0)


def session(model: onnx.ModelProto, library: Path | None, profile: bool = False) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if library is not None:
        so.register_custom_ops_library(str(library))
    so.enable_profiling = profile
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("float16,n_configs,per_config,tol", [(False, 200, 8, 1e-6), (True, 100, 8, 2e-3)],
                         ids=["fp32", "fp16"])
def test_cpu_kernel_matches_reference(library, counter, float16, n_configs, per_config, tol):
    rng = random.Random(61 if float16 else 60)
    gen = torch.Generator().manual_seed(7)
    worst, cases, before = 0.0, 0, counter()
    for _ in range(n_configs):
        S = rng.choice([1, 2, 3, 4, 8, 16])
        spec = op_spec(random_config(rng, S).resolve(), layer=rng.randint(0, 30))
        rc = resolved_from_attrs(spec.op_type, spec.attrs)
        # The model carries the function body too: the library must win over it.
        sess = session(single_op_model(spec, opset=rng.choice([18, 20]), float16=float16), library)
        for _ in range(per_config):
            K = rng.randint(1, 64)
            mask = random_mask(rng, rng.randint(1, 4), K, left=rng.random() < 0.5)
            if rng.random() < 0.1 and K > 4:  # holes inside the valid span
                mask[:, rng.randrange(1, K - 1)] = 0
            probs = random_probs(gen, mask, rng.randint(1, 3), torch.float16 if float16 else torch.float32,
                                 temp=rng.choice([0.5, 2.0, 6.0]))
            if rng.random() < 0.2:
                probs[..., rng.randrange(K):][..., : 2 * S] = 0  # empty baskets
            (out,) = sess.run(None, {"probs": probs.numpy(), "attention_mask": mask.numpy()})
            ref = reference(probs.double(), mask, rc).numpy()
            err = float(np.abs(out.astype(np.float64) - ref).max())
            assert err <= tol, (err, spec, K)
            untouched = (~calibrated_rows(mask, rc))[:, None, :].expand(out.shape[:3]).numpy()
            assert np.array_equal(out[untouched].view(np.uint8), probs.numpy()[untouched].view(np.uint8))
            worst, cases = max(worst, err), cases + 1
    assert counter() - before == cases, "every run must execute the native kernel"
    print(f"\n{'fp16' if float16 else 'fp32'}: {cases} cases, {n_configs} attribute sets, max abs err {worst:.3g}")
    assert cases >= (800 if float16 else 1600)


def _profiled_ops(sess: ort.InferenceSession) -> set[str]:
    path = Path(sess.end_profiling())
    try:
        events = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)
    return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_native_kernel_wins_over_function_body(library, counter, pooling, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # profiles land here
    spec = op_spec(CalibrationConfig(pooling=pooling, basket_size=2).resolve(), 0)
    model = single_op_model(spec)
    assert model.functions and model.functions[0].name == spec.op_type
    mask = torch.ones(2, 9, dtype=torch.long)
    feeds = {"probs": random_probs(torch.Generator().manual_seed(0), mask, 2, torch.float32).numpy(),
             "attention_mask": mask.numpy()}
    with_lib = session(model, library, profile=True)
    before = counter()
    a = with_lib.run(None, feeds)[0]
    assert counter() == before + 1
    assert _profiled_ops(with_lib) == {spec.op_type}  # one node, the custom op itself
    without = session(model, None, profile=True)
    b = without.run(None, feeds)[0]
    assert counter() == before + 1
    inlined = _profiled_ops(without)
    assert spec.op_type not in inlined and len(inlined) > 5  # the function body's standard ops
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch,pooling", [("bert", "cls"), ("xlm-roberta", "mean"), ("qwen3", "last")])
def test_exported_model_same_embeddings_with_and_without_library(library, counter, tiny_models, tmp_path, arch,
                                                                   pooling):
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.runtime import Encoder
    from attncal.synthetic import synthetic_text

    cfg = CalibrationConfig(pooling=pooling, basket_size=4, strength=0.7)
    # `auto` gives mean pooling the split placement, which has no op: ask for the softmax placement,
    # and its portable graph (its optimized graph carries the inlined function body, not the op).
    mean = pooling == "mean"
    opts = ExportOptions(config=cfg, exporter="torchscript", placement="softmax" if mean else "auto")
    meta = export(tiny_models[arch], tmp_path / "m", opts, quiet=True)
    # BERT's optimized graph with the row placement's op (`auto` would pick the native graph, where the
    # calibrated attention op runs instead of the calibration op this test counts).
    graph = "optimized" if arch == "bert" else "portable"
    texts = [synthetic_text(n, seed=i) for i, n in enumerate([5, 17, 40, 90, 150, 230])]
    plain = Encoder(tmp_path / "m", graph=graph, providers=["CPUExecutionProvider"]).encode(texts, batch_size=3)
    before = counter()
    native = Encoder(tmp_path / "m", graph=graph, providers=["CPUExecutionProvider"],
                     custom_op_library=library).encode(texts, batch_size=3)
    calls = counter() - before
    # One native call per calibrated layer per batch: the function body never ran instead.
    assert calls == 2 * len(meta["calibrated_layers"]), calls
    err = float(np.abs(native - plain).max())
    print(f"\n{arch}/{pooling}: {calls} native calls, max |emb diff| {err:.3g} ({meta.get('calibrated_layers')})")
    assert err <= 1e-6


BAD_INPUTS = textwrap.dedent("""
    import json, sys
    import numpy as np, onnxruntime as ort
    from onnx import TensorProto, helper
    lib = sys.argv[1]
    good = dict(pool_last=0, basket_size=2, strength=0.5, isolate_first=1, isolate_last=0, first_mode=1,
                last_mode=0, first_weight=0.0, last_weight=0.0, skip_short=1, layer=0)
    def run(op="PooledRowCalibration", probs_shape=(1, 2, 6, 6), mask_shape=(1, 6), **override):
        attrs = {**good, **override}
        if op == "AllRowsCalibration":
            attrs.pop("pool_last")
        attrs = {k: v for k, v in attrs.items() if v is not None}
        node = helper.make_node(op, ["probs", "attention_mask"], ["out"], domain="ai.attncal", **attrs)
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("probs", TensorProto.FLOAT, None),
                                            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, None)],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.attncal", 1)])
        m.ir_version = 10
        so = ort.SessionOptions()
        so.register_custom_ops_library(lib)
        try:
            s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
            s.run(None, {"probs": np.full(probs_shape, 0.1, np.float32),
                         "attention_mask": np.ones(mask_shape, np.int64)})
        except Exception as exc:
            return type(exc).__name__ + ": " + str(exc)
        return None
    print(json.dumps({
        "ok": run(),
        "ok_all_rows": run("AllRowsCalibration"),
        "rank3": run(probs_shape=(2, 6, 6)),
        "rank5": run(probs_shape=(1, 1, 2, 6, 6)),
        "mask_len": run(mask_shape=(1, 7)),
        "mask_batch": run(mask_shape=(2, 6)),
        "mask_rank": run(mask_shape=(6,)),
        "basket0": run(basket_size=0),
        "basket_neg": run("AllRowsCalibration", basket_size=-3),
        "first_mode": run(first_mode=3),
        "last_mode": run(last_mode=-1),
        "missing_attr": run(strength=None),
    }))
""")


def test_bad_inputs_give_ort_errors_not_crashes(library):
    proc = subprocess.run([sys.executable, "-c", BAD_INPUTS, str(library)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"the process died (exit {proc.returncode}): {proc.stderr[-2000:]}"
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res.pop("ok") is None and res.pop("ok_all_rows") is None
    expect = {"rank3": "rank 4", "rank5": "rank 4", "mask_len": "attention_mask must be [B,K]=[1,6]",
              "mask_batch": "attention_mask must be [B,K]", "mask_rank": "attention_mask must be [B,K]",
              "basket0": "basket_size must be >= 1", "basket_neg": "basket_size must be >= 1",
              "first_mode": "first_mode must be", "last_mode": "last_mode must be", "missing_attr": "'strength'"}
    for case, needle in expect.items():
        assert res[case] is not None, f"{case}: no error"
        assert needle in res[case], (case, res[case])
        assert "attncal" in res[case], (case, res[case])


def test_library_registers_contract_domain_and_ops(library):
    """Both op types in domain ai.attncal v1 resolve without a function body."""
    for op in (POOLED_OP, ALL_ROWS_OP):
        pooling = "mean" if op == ALL_ROWS_OP else "last"
        spec = op_spec(CalibrationConfig(pooling=pooling).resolve(), 3)
        assert spec.op_type == op
        session(single_op_model(spec, with_function=False, float16=True), library)
        with pytest.raises(Exception):  # nothing implements it without the library or a function body
            session(single_op_model(spec, with_function=False), None)
    assert (DOMAIN, VERSION) == ("ai.attncal", 1)


def test_default_library_path(library, monkeypatch):
    monkeypatch.delenv("ATTNCAL_ORT_LIBRARY", raising=False)
    monkeypatch.delenv("ATTNCAL_PLUGIN_BUILD_DIR", raising=False)
    assert oplib.default_library_path() == library
    monkeypatch.setenv("ATTNCAL_ORT_LIBRARY", "/nonexistent/libattncal_ort.so")
    assert oplib.default_library_path() is None


def test_cuda_sources_compile_for_the_configured_archs(library):
    """The checkout's build compiles the CUDA sources for oplib.default_cuda_archs(): the suite sets
    ATTNCAL_CUDA_ARCHS=90 (tests/conftest.py), and the wheel test builds sm_80, so each of the default
    architectures is compiled once per run."""
    if oplib.find_nvcc() is None:
        pytest.skip("nvcc is not installed: the CUDA kernel cannot be compiled here")
    archs = oplib.default_cuda_archs()
    info = oplib.build_info()
    assert info["cuda"] and info["cuda_archs"] == ";".join(map(str, archs)), info
    blob = (library.parent / oplib.CUDA_LIBRARY).read_bytes()
    for arch in archs:
        assert f"-arch sm_{arch} ".encode() in blob, f"no sm_{arch} code in {oplib.CUDA_LIBRARY}"
    fn = ctypes.CDLL(str(library.parent / oplib.CUDA_LIBRARY)).attncal_cuda_workspace_bytes
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_int64]
    assert fn(32) == 32 * 3 * 4
    lib = ctypes.CDLL(str(library))
    assert lib.attncal_has_cuda() == 1  # the ORT library carries the CUDA kernels


@pytest.mark.parametrize("value,archs", [("", (80, 90)), ("90", (90,)), ("80;90", (80, 90)), ("75, 86", (75, 86))])
def test_cuda_archs_setting(monkeypatch, value, archs):
    monkeypatch.setenv(oplib.CUDA_ARCHS_ENV, value)
    assert oplib.default_cuda_archs() == archs


def test_cuda_archs_setting_refuses_a_malformed_value(monkeypatch):
    monkeypatch.setenv(oplib.CUDA_ARCHS_ENV, "sm_90")
    with pytest.raises(ValueError, match=r"ATTNCAL_CUDA_ARCHS='sm_90': expected architectures like '80;90'"):
        oplib.default_cuda_archs()


def test_gpu_check_rejects_bad_arguments():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_check

    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--arch", "0"])  # an architecture below sm_50: refused
    assert exc.value.code == 2
