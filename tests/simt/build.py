"""Builds the CUDA simulator's library, libattncal_cuda_sim.so: the launcher files of plugins/kernels/cuda
(unmodified, compiled as C++20 with -DATTNCAL_SIMT) and the SIMT runtime (tests/simt/runtime.cpp) against the
stand-in CUDA headers of tests/simt/include.  Same C ABI as libattncal_cuda.so (tests/support/cuda.py loads
either), plus the simulator's controls (simt_configure_device, simt_set_seed, simt_take_launch_log).

Each object is cached in build/simt/obj under the hash of its compiler command and of every file it includes
(g++ -MM), and the library under the hash of its objects, so that reruns and the xdist workers compile nothing
twice and a mutant (tests/simt/test_simt_mutations.py) recompiles only the translation units its patch reaches.
-O1: the compile is part of the test budget, and the run is dominated by thread switches, not arithmetic."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import subprocess
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[2]
SIMT = ROOT / "tests" / "simt"
KERNELS = ROOT / "plugins" / "kernels"
CACHE = ROOT / "build" / "simt"
LAUNCHERS = ("calibration_cuda.cu", "calibrated_attention_cuda.cu")
# -fsanitize=bounds: an index past the end of a fixed-size array (a kernel's static __shared__ arrays, which
# share one section and have no guard page between them) traps, and the runtime reports the trap as the
# block's error (runtime.cpp, on_trap).
FLAGS = ("-std=c++20", "-O1", "-g0", "-fPIC", "-pthread", "-ffp-contract=off", "-fvisibility=hidden",
         "-fsanitize=bounds", "-fsanitize-undefined-trap-on-error",
         "-DATTNCAL_SIMT", "-Wall", "-Wno-unknown-pragmas", "-Werror")
TSAN_FLAGS = ("-fsanitize=thread", "-O1", "-g")


class BuildError(RuntimeError):
    pass


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()[:20]


def _includes(source: Path, cmd: Sequence[str]) -> list[Path]:
    """Every file `source` includes (g++ -MM: the project's own headers)."""
    out = subprocess.run([*cmd, "-MM", "-MT", "x", str(source)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise BuildError(f"g++ -MM {source.name} failed:\n{out.stderr[-3000:]}")
    deps = out.stdout.replace("\\\n", " ").split(":", 1)[1].split()
    return sorted({Path(d) for d in deps})


def _object(source: Path, kernels: Path, flags: Sequence[str]) -> tuple[Path, list[str] | None]:
    """(cached object path, the compile command or None when it is cached)."""
    base = ["g++", *flags, "-I", str(SIMT / "include"), "-I", str(kernels)]
    lang = ["-x", "c++"] if source.suffix == ".cu" else []
    deps = _includes(source, [*base, *lang])
    key = _digest(" ".join(flags).encode(), source.name.encode(), *(p.read_bytes() for p in deps))
    obj = CACHE / "obj" / f"{source.stem}-{key}.o"
    if obj.is_file():
        return obj, None
    return obj, [*base, *lang, "-c", str(source), "-o"]


def build(kernels: Path = KERNELS, tsan: bool = False, launchers: Sequence[str] = LAUNCHERS) -> Path:
    """The simulator's library for the kernel sources under `kernels` (a copy, for a mutant), built or taken
    from the cache; `tsan`: compiled with ThreadSanitizer; `launchers`: the launcher files to link (both by
    default; a mutant of the calibration kernels needs only calibration_cuda.cu)."""
    flags = FLAGS + (TSAN_FLAGS if tsan else ())
    sources = [SIMT / "runtime.cpp", *(kernels / "cuda" / name for name in launchers)]
    (CACHE / "obj").mkdir(parents=True, exist_ok=True)
    objs, jobs = [], []
    for src in sources:
        obj, cmd = _object(src, kernels, flags)
        objs.append(obj)
        if cmd is not None:
            tmp = obj.with_name(f".{obj.name}.{os.getpid()}")
            jobs.append((subprocess.Popen([*cmd, str(tmp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True), tmp, obj, src))
    failed = []
    for proc, tmp, obj, src in jobs:  # the translation units compile side by side
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            failed.append(f"{src.name}:\n{out[-6000:]}")
            tmp.unlink(missing_ok=True)
        else:
            os.replace(tmp, obj)
    if failed:
        raise BuildError("the simulator's library does not compile:\n" + "\n".join(failed))
    key = _digest(*(o.name.encode() for o in objs), b"tsan" if tsan else b"")
    lib = CACHE / key / "libattncal_cuda_sim.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.is_file():
            tmp = lib.with_name(f".{lib.name}.{os.getpid()}")
            link = subprocess.run(["g++", "-shared", "-pthread", *(["-fsanitize=thread"] if tsan else []),
                                   *map(str, objs), "-o", str(tmp)], capture_output=True, text=True, timeout=300)
            if link.returncode != 0:
                raise BuildError(f"linking the simulator's library failed:\n{link.stderr[-3000:]}")
            os.replace(tmp, lib)
    return lib


def load(path: Path):
    """The library through tests/support/cuda.py's declarations, with the simulator's controls declared."""
    from support import cuda

    lib = cuda.load(path)
    lib.simt_configure_device.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.simt_configure_device.restype = None
    lib.simt_set_seed.argtypes = [ctypes.c_ulonglong]
    lib.simt_set_seed.restype = None
    lib.simt_take_launch_log.restype = ctypes.c_char_p
    return lib


# The simulated devices: the opt-in shared memory per block of sm_80 (163 KiB), sm_86 / sm_89 (99 KiB) and
# sm_90 (227 KiB); the SM count only sizes the per-row kernel's grid (its grid-stride loop).
DEVICES = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_90": 227 * 1024}


def configure(lib, smem_optin: int, sms: int = 2) -> None:
    lib.simt_configure_device(smem_optin, sms)


def launch_log(lib) -> list[str]:
    """The kernels launched since the last call: 'name grid=x,y,z block=n smem=bytes' each."""
    return lib.simt_take_launch_log().decode().splitlines()
