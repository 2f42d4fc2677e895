"""The TensorRT calibration plugin's `enqueue` on the simulator (marker `simt`), against both public TensorRT
header sets (10.5.0 and 11.1, named by $ATTNCAL_TENSORRT_HEADERS as for tests/test_native_trt.py; without them
the test skips and says how to provide them, as in CI).  tests/simt/trt_enqueue.cpp drives the plugin as TensorRT
does (getCreators, createPlugin with the node's attributes as fields, configurePlugin, getWorkspaceSize,
onShapeChange, enqueue), linked with the simulator's library, so the CUDA launchers and kernels behind the
plugin run on the CPU; the output is checked against the float64 oracle with the GPU tests' bounds, for the four
op types, float32 and float16, in place and out of place."""

from __future__ import annotations

import random
import subprocess

import numpy as np
import pytest
import torch

from attncal.calibration import reference
from attncal.graphs.contract import op_spec
from attncal.runtime import oplib
from gpu.test_calibration_cuda import TOL
from support.cases import random_config
from support.masks import mixed_mask
from support.tensors import random_probs, random_scores

from . import build

pytestmark = pytest.mark.simt

VERSIONS = ("10.5.0", "11.1")
CPP = build.ROOT / "tests" / "cpp"


@pytest.mark.parametrize("version", VERSIONS)
def test_calibration_plugin_enqueue_on_the_simulator(version, tmp_path, simt_lib):
    headers = oplib.tensorrt_headers(version)
    if headers is None:
        pytest.skip(f"TensorRT headers not given: {oplib.TENSORRT_HEADERS_HELP}")
    lib = build.build()
    exe = tmp_path / "trt_enqueue"
    cmd = ["g++", "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-deprecated-declarations", "-I", str(headers),
           "-I", str(CPP / "no_cuda"), "-I", str(CPP), "-I", str(build.KERNELS), str(build.SIMT / "trt_enqueue.cpp"),
           str(build.ROOT / "plugins/tensorrt/attncal_trt_plugin.cpp"), str(lib), f"-Wl,-rpath,{lib.parent}",
           "-o", str(exe)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    rng, gen = random.Random(300), torch.Generator().manual_seed(300)
    seen = {}
    for i in range(24):
        rc = random_config(rng, rng.choice([1, 2, 3, 8, 33]), weights_first=True, random_strengths=1).resolve()
        softmax = i % 2 == 1
        spec = op_spec(rc, 0, fused_softmax=softmax)
        K = rng.randint(2, 20 if rc.all_rows else 90)
        B, H = rng.randint(1, 2), rng.randint(1, 2)
        Q = K
        mask = mixed_mask(rng, B, K)
        dt = (torch.float32, torch.float16)[(i // 2) % 2]
        if softmax:
            x = random_scores(gen, mask, H, dt, Q=Q)
            ref = reference(torch.softmax(x.double(), -1), mask, rc)
        else:
            x = random_probs(gen, mask, H, dt, Q=Q)
            ref = reference(x.double(), mask, rc)
        in_place = i % 4 >= 2
        lines = [f"{spec.op_type} {0 if dt == torch.float32 else 1} {B} {H} {Q} {K} {int(in_place)}"]
        for name, value in spec.attrs.items():
            lines.append(f"{name} {'f' if isinstance(value, float) else 'i'} {float(value)!r}")
        (tmp_path / "case.txt").write_text("\n".join(lines) + "\n")
        x.numpy().tofile(tmp_path / "x.bin")
        mask.numpy().tofile(tmp_path / "mask.bin")
        r = subprocess.run([str(exe), *(str(tmp_path / n) for n in ("case.txt", "x.bin", "mask.bin", "y.bin"))],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        y = torch.from_numpy(np.fromfile(tmp_path / "y.bin", dtype=x.numpy().dtype).reshape(x.shape))
        err = float((y.double() - ref).abs().max())
        name = str(dt).replace("torch.", "")
        assert err <= TOL[name], f"{spec.op_type} {name} in_place={in_place}: err {err:.3g} > {TOL[name]}"
        seen[spec.op_type] = seen.get(spec.op_type, 0) + 1
    assert len(seen) == 4, seen  # PooledRow / AllRows, separate and Softmax-fused
