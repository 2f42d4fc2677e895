"""The TensorRT plugins' `enqueue` on the simulator (marker `simt`), against both public TensorRT header sets
(10.5.0 and 11.1, named by $ATTNCAL_TENSORRT_HEADERS as for tests/test_native_trt.py; without them the test skips
and says how to provide them, as in CI).  tests/simt/trt_enqueue.cpp drives a plugin as TensorRT does
(getCreators, createPlugin with the node's attributes as fields, configurePlugin, getWorkspaceSize, onShapeChange,
enqueue with the workspace it asked for), built as CMake builds libattncal_trt_plugin.so (both plugin files,
ATTNCAL_TRT_WITH_ATTENTION) and linked with the simulator's library, so the CUDA launchers and kernels behind
the plugins run on the CPU.  The outputs are checked against the float64 oracle with the GPU tests' bounds: the
four calibration op types (float32 and float16, in place and out of place) and the two calibrated attention op
types (float32, float16 and bfloat16)."""

from __future__ import annotations

import random
import subprocess

import numpy as np
import pytest
import torch

from attncal.calibration import reference
from attncal.calibration.oracle import attention_reference
from attncal.graphs.ops.contract import attention_op_spec, op_spec
from attncal.runtime import oplib
from gpu.test_calibrated_attention_cuda import ATTN_TOL
from gpu.test_calibration_cuda import TOL
from support.cases import random_config
from support.masks import mixed_mask
from support.tensors import random_probs, random_qkv, random_scores

from . import build

pytestmark = pytest.mark.simt

VERSIONS = ("10.5.0", "11.1")
CPP = build.ROOT / "tests" / "cpp"
CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int64: 3}


@pytest.fixture(params=VERSIONS)
def driver(request, tmp_path_factory):
    headers = oplib.tensorrt_headers(request.param)
    if headers is None:
        pytest.skip(f"TensorRT headers not given: {oplib.TENSORRT_HEADERS_HELP}")
    lib = build.build()
    exe = tmp_path_factory.mktemp("trt") / "trt_enqueue"
    cmd = ["g++", "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-deprecated-declarations",
           "-DATTNCAL_TRT_WITH_ATTENTION", "-I", str(headers), "-I", str(CPP / "no_cuda"), "-I", str(CPP),
           "-I", str(build.KERNELS), str(build.SIMT / "trt_enqueue.cpp"),
           str(build.ROOT / "plugins/tensorrt/attncal_trt_plugin.cpp"),
           str(build.ROOT / "plugins/tensorrt/attncal_trt_attention_plugin.cpp"), str(lib),
           f"-Wl,-rpath,{lib.parent}", "-o", str(exe)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return exe


def enqueue(exe, tmp_path, op_type: str, attrs: dict, inputs: list, out_like: torch.Tensor, in_place: bool):
    """Runs the plugin of `op_type` on `inputs`; its output, shaped and typed as out_like."""
    lines = [op_type, str(len(inputs))]
    for t in inputs:
        lines.append(f"{CODE[t.dtype]} {t.dim()} {' '.join(map(str, t.shape))}")
        t.contiguous().view(torch.uint8 if t.dtype != torch.int64 else torch.int64).numpy().tofile(
            tmp_path / f"in{len(lines) - 3}.bin")
    lines.append(f"{CODE[out_like.dtype]} {out_like.dim()} {' '.join(map(str, out_like.shape))}")
    lines.append(str(int(in_place)))
    lines += [f"{k} {'f' if isinstance(v, float) else 'i'} {float(v)!r}" for k, v in attrs.items()]
    (tmp_path / "case.txt").write_text("\n".join(lines) + "\n")
    r = subprocess.run([str(exe), str(tmp_path / "case.txt"), str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    raw = np.fromfile(tmp_path / "out.bin", dtype=np.uint8)
    return torch.from_numpy(raw).view(out_like.dtype).reshape(out_like.shape)


def test_calibration_plugin_enqueue(driver, tmp_path):
    rng, gen = random.Random(300), torch.Generator().manual_seed(300)
    seen = set()
    for i in range(16):
        pooling = ("cls", "mean")[(i // 4) % 2]  # the pooled and the all-rows ops, both separate and fused
        rc = random_config(rng, rng.choice([1, 2, 3, 8, 33]), weights_first=True, random_strengths=1)
        rc = type(rc)(**{**vars(rc), "pooling": pooling}).resolve()
        softmax = i % 2 == 1
        spec = op_spec(rc, 0, fused_softmax=softmax)
        K = rng.randint(2, 20 if rc.all_rows else 90)
        B, H = rng.randint(1, 2), rng.randint(1, 2)
        mask = mixed_mask(rng, B, K)
        dt = (torch.float32, torch.float16)[(i // 2) % 2]
        if softmax:
            x = random_scores(gen, mask, H, dt, Q=K)
            ref = reference(torch.softmax(x.double(), -1), mask, rc)
        else:
            x = random_probs(gen, mask, H, dt, Q=K)
            ref = reference(x.double(), mask, rc)
        in_place = i % 4 >= 2
        y = enqueue(driver, tmp_path, spec.op_type, spec.attrs, [x, mask], x, in_place)
        name = str(dt).replace("torch.", "")
        err = float((y.double() - ref).abs().max())
        assert err <= TOL[name], f"{spec.op_type} {name} in_place={in_place}: err {err:.3g} > {TOL[name]}"
        seen.add(spec.op_type)
    assert len(seen) == 4, seen  # PooledRow / AllRows, separate and Softmax-fused


def test_attention_plugin_enqueue(driver, tmp_path):
    rng, gen = random.Random(310), torch.Generator().manual_seed(310)
    seen = set()
    for i in range(9):
        rc = random_config(rng, rng.choice([2, 5, 16, 64])).resolve()
        N, D = rng.choice([1, 2]), rng.choice([16, 64, 128])
        S = rng.randint(2, 40)
        B = rng.randint(1, 2)
        name = ("float32", "float16", "bfloat16")[i % 3]
        dt = getattr(torch, name)
        mask = mixed_mask(rng, B, S, holes=0.2)
        q, k, v = random_qkv(gen, B, S, S, N, D, D, dt, temp=1.0, exact=True)
        spec = attention_op_spec(rc, 0, N, 0.125)
        y = enqueue(driver, tmp_path, spec.op_type, spec.attrs, [q, k, v, mask], q, False)
        err = float((y.double() - attention_reference(q, k, v, mask, rc, N, 0.125)).abs().max())
        assert err <= ATTN_TOL[name], f"{spec.op_type} {name}: err {err:.3g} > {ATTN_TOL[name]}"
        seen.add(spec.op_type)
    assert len(seen) == 2, seen
