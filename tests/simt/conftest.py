"""Fixtures of the CUDA simulator's tests: the simulator's library, built once per source hash (build.py)."""

from __future__ import annotations

import os
import shutil

import pytest

from . import build

SEED = int(os.environ.get("SIMT_SEED", "20261207"))
"""The seed of the simulator's scheduling decisions within a block (thread start order, yields): fixed, so a
failure reruns the same way; SIMT_SEED=<n> draws other interleavings."""


def _worker_cpu() -> None:
    """Under pytest-xdist, worker gwN's simulated threads take the N-th CPU it may run on (SIMT_CPU), so that two
    workers' blocks never share one CPU while another idles (the runtime's own choice, by process id, can
    collide); SIMT_CPU set by the caller wins."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if "SIMT_CPU" in os.environ or not worker.startswith("gw") or not hasattr(os, "sched_getaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.environ["SIMT_CPU"] = str(cpus[int(worker[2:]) % len(cpus)])


@pytest.fixture(scope="session")
def simt_lib():
    """libattncal_cuda_sim.so, loaded, on the default simulated device (sm_90: 227 KiB of opt-in shared memory)."""
    _worker_cpu()
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
