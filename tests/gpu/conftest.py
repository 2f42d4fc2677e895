"""Fixtures of the GPU tests: what each needs, or a skip saying what is missing.

The checks run in the fixtures, never at import or collection time, so that a machine without a GPU
collects these tests quickly and skips each with its reason.  A build that is possible but fails is a
failure, not a skip.
"""

from __future__ import annotations

import pytest

from attncal.runtime import oplib
from support import cuda


@pytest.fixture(scope="session")
def cuda_torch():
    """torch, with a CUDA device it can use."""
    reason = cuda.torch_cuda_unavailable()
    if reason:
        pytest.skip(reason)
    import torch

    return torch


@pytest.fixture(scope="session")
def launchers(cuda_torch, tmp_path_factory):
    """The CUDA launchers (both launcher files) compiled with nvcc for this GPU and loaded through ctypes."""
    if oplib.find_nvcc() is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME, /usr/local/cuda): the CUDA launchers are compiled with it")
    try:
        path = cuda.compile_launchers(tmp_path_factory.mktemp("cuda") / oplib.CUDA_LIBRARY, cuda.device_archs())
    except oplib.BuildError as exc:
        pytest.fail(str(exc))
    return cuda.load(path)


def require_cuda_device() -> None:
    """Skips unless the NVIDIA driver reports a CUDA device (the checks that need no CUDA build of torch)."""
    if cuda.driver_device_count() == 0:
        pytest.skip("no CUDA device: the NVIDIA driver (libcuda.so.1) is missing or reports none")


@pytest.fixture(scope="session")
def ort_cuda():
    """onnxruntime with its CUDA provider (onnxruntime-gpu) and a device to run it on."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        pytest.skip(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (providers: {', '.join(available)}); "
                    "onnxruntime-gpu provides it")
    require_cuda_device()
    return ort


@pytest.fixture(scope="session")
def ort_cuda_library(ort_cuda):
    """The ORT custom-op library built with its CUDA kernels (the checkout's build, as the CPU tests use)."""
    if oplib.find_nvcc() is None:
        pytest.skip("nvcc not found: the ORT library's CUDA kernels are compiled with it")
    try:
        library = oplib.build_library(cuda="on")
    except oplib.BuildError as exc:
        pytest.fail(str(exc))
    return library
