"""ONNX Runtime's CUDA provider (onnxruntime-gpu):

* the attncal library's CUDA kernels of the six ai.attncal ops (the calibration ops, separate and
  Softmax-fused, and the calibrated attention ops), float32 and float16, on one-node models without the
  function body and with the CPU fallback disabled, so that the session runs the CUDA kernel or is not
  created; against the float64 oracle; the calibrated attention ops also with grouped key/value heads,
  windows and a relative position bias (the fifth input, the bias table);
* the `attncal export --fp16` exports of all-MiniLM-L6-v2 (benchmarks/fp16_exports.py): every graph against
  the fp32 PyTorch reference with `attncal check`'s fp16 tolerances (the Encoder's time is the GPU timing's,
  benchmarks/gpu_check.py).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attncal.calibration import CalibrationConfig, reference
from attncal.calibration.oracle import attention_reference
from attncal.graphs.ops.contract import (ATTENTION_OP_TYPES, OP_TYPES, RELATIVE_BIAS_INPUT, attention_op_spec,
                                         is_all_rows, is_attention, op_spec, takes_scores)
from attncal.graphs.ops.single_op import single_op_model
from support.cases import random_config
from support.masks import mixed_mask
from support.oracle_loop import (attention_oracle_errors, random_attention_batch, random_geometry, random_relative_bias,
                                 relative_table)
from support.tensors import random_probs, random_qkv, random_scores, softmax_reference

from .test_calibrated_attention_cuda import ATTN_TOL
from .test_calibration_cuda import TOL

pytestmark = pytest.mark.gpu

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def cuda_session(ort, model, library):
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # the CUDA kernel, or no session
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CUDAExecutionProvider"])


def draws(seed: int, float16: bool):
    """A test's random streams and dtype: (random.Random, torch.Generator, dtype name, torch dtype)."""
    return (random.Random(seed), torch.Generator().manual_seed(seed), "float16" if float16 else "float32",
            torch.float16 if float16 else torch.float32)


@pytest.mark.parametrize("float16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("op_type", OP_TYPES + ATTENTION_OP_TYPES)
def test_ort_cuda_kernel_matches_oracle(ort_cuda, ort_cuda_library, op_type, float16):
    """Eight random attribute sets and batches per op and dtype: both padding sides, holes, items with no
    valid key, Q = 1 for the pooled ops; the attention ops on exact float32 scores (q and k on a grid,
    scale 1/8), so the bound is the kernel's own."""
    rng, gen, name, dtype = draws(100 * (OP_TYPES + ATTENTION_OP_TYPES).index(op_type) + float16, float16)
    for _ in range(8):
        pooling = "mean" if is_all_rows(op_type) else rng.choice(["cls", "last"])
        rc = CalibrationConfig(**{**random_config(rng, rng.choice([1, 2, 4, 8, 16, 64])).to_dict(),
                                  "pooling": pooling}).resolve()
        B, K = rng.randint(2, 6), rng.randint(1, 300)
        mask = mixed_mask(rng, B, K, holes=0.2)
        Q = 1 if not rc.all_rows and rng.random() < 0.3 else K
        if is_attention(op_type):
            N, D = rng.randint(1, 3), rng.choice([8, 16, 32, 64])
            spec = attention_op_spec(rc, 0, num_heads=N, scale=0.125)
            q, k, v = random_qkv(gen, B, Q, K, N, D, D, dtype, temp=1.0, exact=True)
            feeds = {"query": q.numpy(), "key": k.numpy(), "value": v.numpy(), "attention_mask": mask.numpy()}
            ref, tol = attention_reference(q, k, v, mask, rc, N, 0.125), ATTN_TOL[name]
        else:
            spec = op_spec(rc, 0, fused_softmax=takes_scores(op_type))
            H, temp = rng.randint(1, 3), rng.choice([0.5, 2.0, 6.0])
            if takes_scores(op_type):
                x = random_scores(gen, mask, H, dtype, temp=temp, Q=Q)
                ref = softmax_reference(x, mask, rc)
            else:
                x = random_probs(gen, mask, H, dtype, temp=temp, Q=Q)
                ref = reference(x.double(), mask, rc)
            feeds, tol = {"scores" if takes_scores(op_type) else "probs": x.numpy(), "attention_mask": mask.numpy()}, TOL[name]
        assert spec.op_type == op_type
        sess = cuda_session(ort_cuda, single_op_model(spec, float16=float16, with_function=False), ort_cuda_library)
        (out,) = sess.run(None, feeds)
        assert out.shape == tuple(ref.shape) and out.dtype == (np.float16 if float16 else np.float32)
        assert np.all(np.isfinite(out)), (spec, K)
        err = float(np.abs(out.astype(np.float64) - ref.numpy()).max()) if out.size else 0.0
        assert err <= tol, (err, spec, B, Q, K, mask.tolist())


@pytest.mark.parametrize("float16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("op_type", ATTENTION_OP_TYPES)
def test_ort_cuda_attention_geometry_matches_oracle(ort_cuda, ort_cuda_library, op_type, float16):
    """Twelve random attribute sets and batches per op and dtype with a random geometry (`random_geometry`:
    grouped key/value heads, causal, sliding and one-sided windows; every other one with a relative position
    bias, `random_relative_bias`, its random table fed as the op's fifth input), on exact float32 scores
    (scale 1/8, the table on a grid of 1/8), so the bound is the kernel's own: the CUDA op's shape checks
    accept K and V of N_kv heads and the table, and the kernel reads them and applies the window and the bias."""
    rng, gen, name, dtype = draws(300 + 10 * ATTENTION_OP_TYPES.index(op_type) + float16, float16)
    relative_cases = 0
    for i in range(12):
        pooling = "mean" if is_all_rows(op_type) else rng.choice(["cls", "last"])
        S = rng.choice([1, 2, 4, 8, 16, 64])
        rc = CalibrationConfig(**{**random_config(rng, S).to_dict(), "pooling": pooling}).resolve()
        N, D = rng.choice([2, 3, 4]), rng.choice([8, 16, 32, 64])
        geo = random_geometry(rng, N)
        geo, buckets = random_relative_bias(rng, geo) if i % 2 else (geo, 0)
        B, K = rng.randint(2, 6), rng.randint(1, 160 if rc.all_rows else 300)  # as random_attention_case
        mask, _, _, q, k, v = random_attention_batch(rng, gen, rc, S, N, D, D, True, dtype, B, K, 0.2, geo)
        table = relative_table(gen, buckets, N, dtype) if geo.relative else None
        spec = attention_op_spec(rc, 0, num_heads=N, scale=0.125, geometry=geo)
        assert spec.op_type == op_type
        feeds = {"query": q.numpy(), "key": k.numpy(), "value": v.numpy(), "attention_mask": mask.numpy()}
        if table is not None:
            feeds[RELATIVE_BIAS_INPUT] = table.numpy()
            relative_cases += 1
        sess = cuda_session(ort_cuda, single_op_model(spec, float16=float16, with_function=False), ort_cuda_library)
        (out,) = sess.run(None, feeds)
        assert np.all(np.isfinite(out)), (spec, K)
        err, rounding = attention_oracle_errors(out, q, k, v, mask, rc, N, 0.125, True, float16, geo, table)
        assert np.all(err <= ATTN_TOL[name] + rounding), (err, spec, buckets, B, q.shape[1], K, mask.tolist())
    assert relative_cases == 6


def test_fp16_exports_on_the_cuda_provider(ort_cuda, ort_cuda_library, tmp_path):
    from attncal.modelinfo import ModelNotFoundError, default_model_path

    try:
        model = default_model_path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import fp16_exports
    finally:
        sys.path.remove(str(BENCHMARKS))
    res = fp16_exports.run(model, tmp_path, provider="CUDAExecutionProvider", texts=8, tokens=64, rounds=1)
    assert "skipped" not in res, res
    assert set(res["parity"]) == {"onnx/model.onnx", "onnx/model_optimized.onnx", "onnx/model_optimized_native.onnx"}
    for graph, p in res["parity"].items():
        assert p["ok"] and p["max_abs"] <= p["tol_max_abs"], (graph, p)
