"""The CUDA launchers through ctypes, for the GPU tests (tests/gpu) and the GPU timing (benchmarks/gpu_check.py).

The launchers are compiled with nvcc by `attncal.runtime.oplib.compile_cuda_kernel` (no CMake, no ONNX
Runtime headers), both launcher files into one library: the calibrated attention launchers report their
errors through the calibration launchers' `attncal_cuda_last_error`, so they never build alone.  The
AttncalParams struct they take is mirrored by `attncal.runtime.attributes_def`, built from the attribute
table, never restated here.  Tensors are torch CUDA tensors; every launch goes on torch's current stream.

Nothing here touches CUDA at import time: torch's CUDA state and the driver are asked inside the functions.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Sequence

from attncal.graphs.ops.contract import FULL_ATTENTION, AttentionGeometry, is_all_rows, op_spec
from attncal.runtime import attributes_def, oplib

CUDA_SOURCES = ("calibration_cuda.cu", "calibrated_attention_cuda.cu")
"""The launcher files, by name: compile_cuda_kernel finds them among the kernels' sources."""

# The ctypes mirror of AttncalParams, generated from the attribute table (attncal_attributes.def), so that
# it follows the struct.
Params = attributes_def.params_structure()

DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}
"""ATTNCAL_DTYPE_* (attncal_params.h), by torch dtype name."""


def params_of(rc) -> ctypes.Structure:
    """The launchers' AttncalParams for resolved calibration `rc`: its node's attributes (op_spec).  An instance
    of `Params` itself, the class the launchers' argtypes name: make_params' class is built from the same table
    but may be another class object (params_structure is cached on its arguments as passed), which ctypes
    refuses for a POINTER(Params) argument; the bytes are the same."""
    spec = op_spec(rc, 0)  # the op decides all_rows: mean, landmark and mean-every pooling take the all-rows op
    return Params.from_buffer_copy(attributes_def.make_params(is_all_rows(spec.op_type), spec.attrs))


def dtype_name(dtype) -> str:
    """"float32", "float16" or "bfloat16" for a torch dtype."""
    return str(dtype).replace("torch.", "")


def torch_cuda_unavailable() -> str | None:
    """Why torch cannot run CUDA tensors here (a CPU build, no device visible), or None when it can."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build (torch.version.cuda is None); a CUDA build of torch is needed"
    if not torch.cuda.is_available():
        return f"no CUDA device visible to torch {torch.__version__} (CUDA {torch.version.cuda})"
    return None


def driver_device_count() -> int:
    """CUDA devices the NVIDIA driver reports (libcuda's cuDeviceGetCount), 0 without a driver; for the
    checks that run on ONNX Runtime or TensorRT, which need no CUDA build of torch."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def device_archs() -> list[int]:
    """The SM architecture of torch's current CUDA device, e.g. [90] on a Hopper GPU."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return [major * 10 + minor]


def compile_launchers(out: str | os.PathLike, archs: Sequence[int]) -> Path:
    """Both launcher files compiled with nvcc into the shared library `out`, for `archs` (oplib.BuildError
    when nvcc is missing or fails)."""
    return oplib.compile_cuda_kernel(Path(out), archs=list(archs), sources=CUDA_SOURCES)


def load(path: str | os.PathLike) -> ctypes.CDLL:
    """The compiled library, with the launchers' signatures declared."""
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.attncal_cuda_calibrate, lib.attncal_cuda_softmax_calibrate):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ptr, ptr, ptr] + [i64] * 4 + [ctypes.POINTER(Params), ptr, ptr]
    lib.attncal_cuda_last_error.restype = ctypes.c_char_p
    lib.attncal_cuda_workspace_bytes.restype = ctypes.c_size_t
    lib.attncal_cuda_workspace_bytes.argtypes = [i64]
    # The calibrated attention launchers (calibrated_attention_cuda.h).
    lib.attncal_cuda_calibrated_attention.restype = ctypes.c_int
    # (dtype, q, k, v, mask, out, B, S_q, S_k, N, D, D_v, scale, relative_bias, num_buckets, params, ...)
    lib.attncal_cuda_calibrated_attention.argtypes = [ctypes.c_int] + [ptr] * 5 + [i64] * 6 + [
        ctypes.c_float, ptr, i64, ctypes.POINTER(Params), ptr, ptr]
    lib.attncal_cuda_calibrated_attention_reference.restype = ctypes.c_int
    lib.attncal_cuda_calibrated_attention_reference.argtypes = [ctypes.c_int] + [ptr] * 5 + [i64] * 6 + [
        ctypes.c_float, ptr, i64, ctypes.POINTER(Params), ptr]
    lib.attncal_cuda_attention_workspace_bytes.restype = ctypes.c_size_t
    lib.attncal_cuda_attention_workspace_bytes.argtypes = [i64, i64, i64, i64]  # B, S_q, N, num_buckets
    return lib


def _stream(tensor) -> int | None:
    """torch's current CUDA stream for a CUDA tensor; None (the legacy default stream) for a CPU tensor, which only
    the CUDA simulator's library (tests/simt) takes: its device memory is host memory."""
    import torch

    return torch.cuda.current_stream().cuda_stream if tensor.is_cuda else None


def _contiguous(**tensors) -> None:
    """The launchers take data pointers of dense row-major tensors: a strided view (a head slice, say) would be read
    as if it were one (on the GPU `.to("cuda")` copies it densely; a CPU tensor passes as it is)."""
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous: pass .contiguous()")


def _check(lib, rc: int, name: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{name} failed ({rc}): {lib.attncal_cuda_last_error().decode()}")


def launch(lib, probs, out, mask, p, workspace=None, softmax: bool = False) -> None:
    """attncal_cuda_calibrate(probs -> out), or with softmax=True attncal_cuda_softmax_calibrate(scores -> out):
    probs [B,H,Q,K], mask int64 [B,K], `p` the AttncalParams (params_of); out may be probs (in place)."""
    B, H, Q, K = probs.shape
    stream = _stream(probs)
    _contiguous(probs=probs, out=out, mask=mask)
    fn = lib.attncal_cuda_softmax_calibrate if softmax else lib.attncal_cuda_calibrate
    rc = fn(DTYPE_CODE[dtype_name(probs.dtype)], probs.data_ptr(), out.data_ptr(), mask.data_ptr(), B, H, Q, K,
            ctypes.byref(p), None if workspace is None else workspace.data_ptr(), stream)
    _check(lib, rc, "attncal_cuda_softmax_calibrate" if softmax else "attncal_cuda_calibrate")


def attention_workspace_bytes(lib, B: int, S_q: int, num_heads: int, num_buckets: int = 0) -> int:
    """attncal_cuda_attention_workspace_bytes: the launcher's workspace for B items of S_q query rows and
    `num_heads` heads, with a relative position bias table of `num_buckets` rows (0 = none)."""
    return lib.attncal_cuda_attention_workspace_bytes(B, S_q, num_heads, num_buckets)


def attention_launch(lib, q, k, v, mask, out, rc, num_heads: int, scale: float, workspace=None,
                     reference: bool = False, geometry: AttentionGeometry = FULL_ATTENTION, check: bool = True,
                     relative_bias=None) -> int:
    """attncal_cuda_calibrated_attention (or, with reference=True, the exact per-row launcher) for resolved
    calibration `rc` and `geometry`: q [B,S_q,N*D], k [B,S_k,N_kv*D], v [B,S_k,N_kv*D_v] (N_kv: the geometry's
    key/value heads, N by default), mask int64 [B,S_k] -> out [B,S_q,N*D_v]; `relative_bias`: the relative
    position bias table [num_buckets,N] of q's dtype, on the device, for a geometry with relative_max_distance
    (None: no table, num_buckets 0).  Returns the launcher's status; with `check` a non-zero one raises with the
    library's message (without, a refusal can be examined)."""
    B, S_q, hidden = q.shape
    S_k = k.shape[1]
    stream = _stream(q)
    _contiguous(q=q, k=k, v=v, mask=mask, out=out, relative_bias=relative_bias)
    p = params_of(rc)
    # Every geometry field, defaults included: params_of leaves the fields of attributes the calibration op does
    # not take at 0, and a window bound of 0 is a window (the default is -1).
    for name, value in vars(geometry).items():
        setattr(p, name, value)
    n_kv = geometry.num_kv_heads or num_heads
    table, buckets = (None, 0) if relative_bias is None else (relative_bias.data_ptr(), relative_bias.shape[0])
    args = (DTYPE_CODE[dtype_name(q.dtype)], q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(),
            out.data_ptr(), B, S_q, S_k, num_heads, hidden // num_heads, v.shape[2] // n_kv, float(scale), table,
            buckets, ctypes.byref(p))
    if reference:
        name = "attncal_cuda_calibrated_attention_reference"
        status = lib.attncal_cuda_calibrated_attention_reference(*args, stream)
    else:
        name = "attncal_cuda_calibrated_attention"
        status = lib.attncal_cuda_calibrated_attention(*args, None if workspace is None else workspace.data_ptr(),
                                                       stream)
    if check:
        _check(lib, status, name)
    return status
