"""Fixtures of the CUDA simulator's tests: the simulator's library, built once per source hash (build.py)."""

from __future__ import annotations

import os
import shutil

import pytest

from . import build

SEED = int(os.environ.get("SIMT_SEED", "20261207"))
"""The seed of the simulator's scheduling decisions within a block (thread start order, yields): fixed, so a
failure reruns the same way; SIMT_SEED=<n> draws other interleavings."""


@pytest.fixture(scope="session")
def simt_lib():
    """libattncal_cuda_sim.so, loaded, on the default simulated device (sm_90: 227 KiB of opt-in shared memory)."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler (g++): the simulator compiles the CUDA sources with it")
    lib = build.load(build.build())
    lib.simt_set_seed(SEED)
    build.configure(lib, build.DEVICES["sm_90"])
    return lib


@pytest.fixture()
def sim(simt_lib):
    """The library, its device reset to sm_90 after the test, and its launch log emptied before."""
    build.launch_log(simt_lib)
    yield simt_lib
    build.configure(simt_lib, build.DEVICES["sm_90"])
