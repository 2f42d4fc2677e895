"""The instruction-set paths of the native CPU kernels (plugins/kernels/cpu/isa.h) that this CPU runs, and a
runner that runs a compiled host test under each of them (ATTNCAL_CPU_PATH), so that every machine checks
every path it can run, not only its widest."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Iterator, Sequence

from attncal.cpuinfo import cpu_flags
from attncal.runtime.oplib import CPU_PATH_ENV

# What each path needs of the CPU, as /proc/cpuinfo names it (isa.h's isa_supported).
_NEEDS = {"avx512": {"avx512f", "fma"}, "avx2": {"avx2", "fma"}}


def host_cpu_paths() -> list[str]:
    """The paths this CPU runs, widest first; "default" always (the only one off x86-64)."""
    if platform.machine() != "x86_64":
        return ["default"]
    flags = cpu_flags()
    return [p for p, needs in _NEEDS.items() if needs <= flags] + ["default"]


def run_on_each_path(cmd: Sequence[str], every: bool = True) -> Iterator[tuple[str, subprocess.CompletedProcess]]:
    """(path, result) of `cmd` run once per path this CPU runs, with ATTNCAL_CPU_PATH set; with `every` False,
    once with the variable unset (a build without the paths: path "build")."""
    for path in host_cpu_paths() if every else ["build"]:
        env = {k: v for k, v in os.environ.items() if k != CPU_PATH_ENV}
        if every:
            env[CPU_PATH_ENV] = path
        yield path, subprocess.run(list(cmd), capture_output=True, text=True, env=env)
