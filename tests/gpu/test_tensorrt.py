"""The TensorRT plugin (libattncal_trt_plugin.so) in a real engine: each of the six ai.attncal ops as a
one-node ONNX model (no function body, so that ONNX-TensorRT routes the node to the plugin's creator by op
type), parsed, built for the shapes of one random batch, run on torch CUDA tensors, against the float64
oracle; float32 and float16; the calibrated attention ops also with a relative position bias (its table a
fifth engine input).  The plugin is built with CMake (attncal.runtime.oplib.build_library) against
the installed TensorRT, whose headers come from TensorRT_ROOT, the system or $ATTNCAL_TENSORRT_HEADERS.
The host tests without TensorRT's runtime are tests/test_native_trt.py."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from attncal.calibration import CalibrationConfig, reference
from attncal.calibration.oracle import attention_reference
from attncal.graphs.ops.contract import (ATTENTION_OP_TYPES, OP_TYPES, AttentionGeometry, attention_op_spec,
                                         input_names, is_all_rows, is_attention, op_spec, takes_scores)
from attncal.graphs.ops.single_op import single_op_model
from attncal.runtime import oplib
from support import cuda
from support.masks import mixed_mask
from support.oracle_loop import relative_table
from support.tensors import random_probs, random_qkv, random_scores, softmax_reference

from .conftest import require_cuda_device
from .test_calibrated_attention_cuda import ATTN_TOL
from .test_calibration_cuda import TOL

pytestmark = pytest.mark.gpu


def _have_headers() -> bool:
    """TensorRT's NvInfer.h where the CMake build looks for it (attncal's setting, TensorRT_ROOT, the system)."""
    if oplib.tensorrt_headers() is not None:
        return True
    roots = [os.environ.get("TensorRT_ROOT"), "/usr", "/usr/local"]
    subdirs = ("include", "include/x86_64-linux-gnu", "include/aarch64-linux-gnu")
    return any(root and (Path(root) / sub / "NvInfer.h").is_file() for root in roots for sub in subdirs)


@pytest.fixture(scope="module")
def trt_plugin(request, tmp_path_factory):
    """(tensorrt, its logger) with the attncal plugin library loaded into the plugin registry."""
    trt = pytest.importorskip("tensorrt", reason="TensorRT's Python package (tensorrt) is not installed")
    require_cuda_device()
    request.getfixturevalue("cuda_torch")  # the inputs and outputs are torch CUDA tensors
    if oplib.find_nvcc() is None:
        pytest.skip("nvcc not found: the plugin links the CUDA launchers, compiled with it")
    if not _have_headers():
        pytest.skip(f"TensorRT's headers (NvInfer.h) were not found: {oplib.TENSORRT_HEADERS_HELP}")
    build = tmp_path_factory.mktemp("trt-build")
    try:
        oplib.build_library(build, ort=False, cuda="on", tensorrt="on", cuda_archs=cuda.device_archs())
    except oplib.BuildError as exc:
        pytest.fail(str(exc))
    logger = trt.Logger(trt.Logger.WARNING)
    trt.get_plugin_registry().load_library(str(build / oplib.TRT_LIBRARY))
    return trt, logger


def run_engine(trt, logger, model, inputs: dict[str, torch.Tensor], float16: bool) -> torch.Tensor:
    """Parses `model`, builds an engine for exactly these input shapes, runs it once; the output tensor."""
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString()):
        raise AssertionError("ONNX-TensorRT refused the model: "
                             + "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
    config = builder.create_builder_config()
    if float16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for name, x in inputs.items():
        profile.set_shape(name, tuple(x.shape), tuple(x.shape), tuple(x.shape))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None, "TensorRT could not build the engine (its log above says why)"
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    context = engine.create_execution_context()
    for name, x in inputs.items():
        context.set_input_shape(name, tuple(x.shape))
        context.set_tensor_address(name, x.data_ptr())
    out_name = network.get_output(0).name
    first = next(iter(inputs.values()))
    out = torch.full(tuple(context.get_tensor_shape(out_name)), float("nan"), dtype=first.dtype, device="cuda")
    context.set_tensor_address(out_name, out.data_ptr())
    assert context.execute_async_v3(torch.cuda.current_stream().cuda_stream), "execute_async_v3 failed"
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("float16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("op_type,relative", [(op, False) for op in OP_TYPES + ATTENTION_OP_TYPES]
                         + [(op, True) for op in ATTENTION_OP_TYPES])
def test_plugin_engine_matches_oracle(trt_plugin, op_type, relative, float16):
    """Each op through an engine against the oracle; `relative`: the calibrated attention ops with a relative
    position bias (relative_max_distance as a plugin field, the table T[num_buckets, N] as the plugin's fifth
    input; 200 keys reach every bucket of 32 with max distance 40)."""
    trt, logger = trt_plugin
    seed = 200 + 10 * (OP_TYPES + ATTENTION_OP_TYPES).index(op_type) + float16 + 200 * relative
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    name = "float16" if float16 else "float32"
    dtype = torch.float16 if float16 else torch.float32
    rc = CalibrationConfig(pooling="mean" if is_all_rows(op_type) else "cls", basket_size=8, strength=0.7,
                           skip_short=False).resolve()
    B, K = 3, 200
    mask = mixed_mask(rng, B, K, holes=0.2, min_len=1)
    if is_attention(op_type):
        N, D = 2, 32
        geo = AttentionGeometry(relative_max_distance=40 if relative else 0)
        spec = attention_op_spec(rc, 0, num_heads=N, scale=0.125, geometry=geo)
        q, k, v = random_qkv(gen, B, K, K, N, D, D, dtype, temp=1.0, exact=True)
        table = relative_table(gen, 32, N, dtype) if relative else None
        ref = attention_reference(q, k, v, mask, rc, N, 0.125, **vars(geo), relative_bias=table)
        tensors, tol = (q, k, v, mask) + ((table,) if relative else ()), ATTN_TOL[name]
    else:
        spec = op_spec(rc, 0, fused_softmax=takes_scores(op_type))
        if takes_scores(op_type):
            x = random_scores(gen, mask, 2, dtype)
            ref = softmax_reference(x, mask, rc)
        else:
            x = random_probs(gen, mask, 2, dtype)
            ref = reference(x.double(), mask, rc)
        tensors, tol = (x, mask), TOL[name]
    assert spec.op_type == op_type
    inputs = {n: t.cuda() for n, t in zip(input_names(op_type, relative), tensors)}
    out = run_engine(trt, logger, single_op_model(spec, float16=float16, with_function=False), inputs, float16)
    out = out.cpu().double()
    assert bool(torch.isfinite(out).all()), f"{op_type}: non-finite output"
    err = float((out - ref).abs().max())
    assert err <= tol, f"{op_type} {name}{' relative bias' if relative else ''}: err {err:.3g} > {tol}"
