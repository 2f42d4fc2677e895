"""Build and locate the native plugins (plugins/): the ONNX Runtime custom-op
library, the CUDA kernel and, where TensorRT is installed, the TensorRT plugin.

There is one build entry point, CMake (plugins/CMakeLists.txt); this module
drives it so that tests, `make plugins` and benchmarks share one build directory
(default: <repo>/build/plugins, git-ignored) and repeated runs reuse it.  The
ORT library is CPU-only when no CUDA compiler is found and CPU+CUDA when nvcc
is present.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal, Sequence

from ..graphs.ops.inplace_shapes import annotate_inplace_shapes  # noqa: F401  (re-exported)
from ..native import (BUILD_INFO, CHECKOUT, CUDA_LIBRARY, ORT_LIBRARY, PACKAGE_LIB_DIR,  # noqa: F401 (re-exported)
                      TRT_LIBRARY, default_build_dir, find_library, library_dirs)

NATIVE_ENV = "ATTNCAL_NATIVE"
"""Environment variable that turns the native library off ("0", "off", "false", "no")."""
FALLBACK_MESSAGE = ("attncal: native kernel library not installed (`pip install .` builds it into the package; "
                    "`make plugins` in a source checkout); using the ONNX function body")
_OFF_VALUES = frozenset({"0", "off", "false", "no"})

PLUGINS_DIR = CHECKOUT / "plugins"

CPU_PATH_ENV = "ATTNCAL_CPU_PATH"
"""Environment variable that makes the library's CPU kernels take one instruction-set path ("avx512", "avx2" or
"default": baseline x86-64, the only path off x86-64) instead of the widest this CPU runs; read when the library
loads (plugins/kernels/cpu/isa.h).  A path the CPU lacks is refused: registering the library fails, naming it."""
CPU_PATHS = ("avx512", "avx2", "default")

TENSORRT_HEADERS_ENV = "ATTNCAL_TENSORRT_HEADERS"
"""The one setting for TensorRT's public headers, read by the CMake build and the tests: a
directory holding `NvInferRuntime.h`, its parent (`<dir>/include`), or a root of per-version
sets `<root>/<version>/include` (docs/install.md)."""
TENSORRT_HEADERS_HELP = (
    f"set {TENSORRT_HEADERS_ENV} to TensorRT's public headers (a folder of <version>/include sets, "
    "e.g. trt-headers/10.5.0/include, fetched from NVIDIA/TensorRT's include/ as "
    "docs/install.md describes), or pass -DATTNCAL_TENSORRT_INCLUDE_DIR=... to CMake"
)


GEMM_CHOICES = ("auto", "openblas", "eigen", "builtin")
"""The calibrated-attention kernel's GEMM (plugins/kernels/cpu/gemm.h, chosen by plugins/cmake/Gemm.cmake):
auto = OpenBLAS where the scipy-openblas32 wheel is installed, else the built-in loops."""


class BuildError(RuntimeError):
    """The native build failed; the message ends with the tail of the build log."""


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else -1 for p in name.split("."))


def tensorrt_headers(version: str | None = None) -> Path | None:
    """The TensorRT include directory named by $ATTNCAL_TENSORRT_HEADERS, or None when unset.

    With a root of per-version sets, `version` picks one (None: the newest).  A set path that
    lacks `NvInferRuntime.h` raises FileNotFoundError naming it: a wrong setting is an error,
    not a silent skip."""
    env = os.environ.get(TENSORRT_HEADERS_ENV)
    if not env:
        return None
    root = Path(env)
    for inc in (root, root / "include"):
        if (inc / "NvInferRuntime.h").is_file():
            return inc  # a single header set: its version is whatever it is
    sets = {d.name: d / "include" for d in root.iterdir() if (d / "include" / "NvInferRuntime.h").is_file()} \
        if root.is_dir() else {}
    if not sets:
        raise FileNotFoundError(f"{TENSORRT_HEADERS_ENV}={env}: no NvInferRuntime.h there, in include/ "
                                "or in <version>/include/")
    if version is None:
        return sets[max(sets, key=_version_key)]
    if version not in sets:
        raise FileNotFoundError(f"{TENSORRT_HEADERS_ENV}={env}: no TensorRT {version} headers "
                                f"({root / version / 'include'}); found {', '.join(sorted(sets))}")
    return sets[version]


def default_library_path() -> Path | None:
    """The ORT custom-op library: $ATTNCAL_ORT_LIBRARY if set, else the installed package's
    (a platform wheel's ``attncal/lib``), else a source checkout's build (:func:`default_build_dir`);
    None when none exists (nothing is built here)."""
    env = os.environ.get("ATTNCAL_ORT_LIBRARY")
    if env:
        return Path(env) if Path(env).is_file() else None
    found = find_library(ORT_LIBRARY)
    if found is None and (default_build_dir() / BUILD_LOCK).is_file():
        # A build of the checkout's library may be running (another process's build_library): the linker
        # writes the library anew, so it is missing until the build ends.  Wait for it, then look again.
        _wait_for_build(default_build_dir())
        found = find_library(ORT_LIBRARY)
    return found


_fallback_lock = threading.Lock()
_fallback_said = False


def _say_fallback_once() -> None:
    """Tell the user (stderr, once per process) that the function body is used
    because nothing is built: silent fallbacks hide a 10-40 % latency change."""
    global _fallback_said
    with _fallback_lock:
        if _fallback_said:
            return
        _fallback_said = True
    print(FALLBACK_MESSAGE, file=sys.stderr, flush=True)


def native_disabled_by_env() -> bool:
    """True when $ATTNCAL_NATIVE is one of "0", "off", "false", "no" (any case)."""
    return os.environ.get(NATIVE_ENV, "").strip().lower() in _OFF_VALUES


def resolve_library(enabled: bool | None = None, *, notice: bool = True) -> Path | None:
    """Which ORT custom-op library a session should register, by policy:

    * ``enabled=False``: None (the ONNX function body).
    * ``enabled=None`` (the default everywhere): None when $ATTNCAL_NATIVE turns it
      off; else the built library (:func:`default_library_path`), or None with a
      one-time notice on stderr when nothing is built.
    * ``enabled=True``: the built library; FileNotFoundError naming the expected
      path when it is missing (an explicit request must not silently fall back).

    `notice=False` skips the one-time notice: for a caller that only chooses between graphs (the
    native graph or the split graph, which has no custom op), where no function body runs instead.
    """
    if enabled is False:
        return None
    if enabled is None and native_disabled_by_env():
        return None
    lib = default_library_path()
    if lib is not None:
        return _settled(lib)
    if enabled:
        expected = os.environ.get("ATTNCAL_ORT_LIBRARY") or " or ".join(str(d / ORT_LIBRARY) for d in library_dirs())
        raise FileNotFoundError(f"attncal native kernel library not found at {expected} (install a platform wheel "
                                "with `pip install .`, or build it in a source checkout: make plugins)")
    if notice:
        _say_fallback_once()
    return None


def _cpu_path_api(library: str | os.PathLike) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library))  # the same handle as ONNX Runtime's when it has loaded the library
    lib.attncal_cpu_path.restype = ctypes.c_char_p
    lib.attncal_cpu_path_supported.argtypes = lib.attncal_set_cpu_path.argtypes = [ctypes.c_char_p]
    return lib


def cpu_path(library: str | os.PathLike) -> str:
    """The instruction-set path the library's CPU kernels take now (one of CPU_PATHS)."""
    return _cpu_path_api(library).attncal_cpu_path().decode()


def cpu_paths(library: str | os.PathLike) -> list[str]:
    """The instruction-set paths of CPU_PATHS this CPU runs, widest first ("default" always)."""
    lib = _cpu_path_api(library)
    return [p for p in CPU_PATHS if lib.attncal_cpu_path_supported(p.encode())]


def set_cpu_path(library: str | os.PathLike, path: str) -> None:
    """Make the library's CPU kernels take `path` from now on, in this process (tests and benchmarks run every
    path this way); ValueError when it is no path or this CPU lacks it."""
    if _cpu_path_api(library).attncal_set_cpu_path(path.encode()) != 0:
        raise ValueError(f"CPU path {path!r} is not one of {', '.join(cpu_paths(library))} (the paths this CPU runs)")


BLAS_CORE_ENV = "OPENBLAS_CORETYPE"
"""OpenBLAS's own setting of the kernels it runs (read once, when it loads); unset, it picks by the CPU it finds."""


def blas_core() -> str | None:
    """The kernels of the OpenBLAS the native library's GEMMs call (scipy-openblas32's `scipy_openblas_get_corename`,
    e.g. "SkylakeX" for its AVX-512 ones, "Haswell" for AVX2), where this process has loaded it, else None.  A
    figure of the native graph depends on it: $OPENBLAS_CORETYPE set to an older core slows the projections."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    found = {fields[-1] for fields in map(str.split, maps.splitlines())
             if len(fields) >= 6 and Path(fields[-1]).name.startswith("libscipy_openblas.")}
    if len(found) != 1:
        return None
    core = ctypes.CDLL(found.pop()).scipy_openblas_get_corename  # the loaded copy's handle
    core.restype = ctypes.c_char_p
    return core().decode()


def blas_record() -> dict:
    """{"blas_core": `blas_core()`, "blas_core_forced": whether $OPENBLAS_CORETYPE is set}: what `attncal bench`'s
    results.json and `attncal doctor` say of the kernels under the native library's GEMMs."""
    return {"blas_core": blas_core(), "blas_core_forced": bool(os.environ.get(BLAS_CORE_ENV))}


def find_nvcc() -> str | None:
    """nvcc on PATH, or under $CUDA_HOME / /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def build_info(build_dir: str | os.PathLike | None = None) -> dict | None:
    """What the build in `build_dir` produced: {"ort", "gemm", "cuda", "cuda_archs", "tensorrt"}.
    Default: the folder of the library sessions register (:func:`default_library_path`), else the
    checkout's build folder."""
    if build_dir is None:
        lib = default_library_path()
        build_dir = lib.parent if lib is not None else default_build_dir()
    path = Path(build_dir) / BUILD_INFO
    return json.loads(path.read_text()) if path.is_file() else None


BUILD_LOCK = ".attncal-build.lock"  # held by a build of its directory (`_locked`), waited on by `_settled`


@contextmanager
def _locked(build_dir: Path) -> Iterator[None]:
    """Serialises concurrent builds of one directory (parallel test workers)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / BUILD_LOCK, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _settled(lib: Path) -> Path:
    """`lib` once no build of its directory is running: the linker writes the library in place, so one handed out
    mid-link (a parallel test worker building while another loads it) fails to load.  Waits on the build's lock
    (`_locked`), shared; a library outside a build directory has no lock and is returned at once."""
    _wait_for_build(lib.parent)
    return lib


def _wait_for_build(build_dir: Path) -> None:
    """Returns once no build of `build_dir` is running (its `_locked` lock, taken shared); at once where it has
    no lock."""
    lock = build_dir / BUILD_LOCK
    if lock.is_file():
        with open(lock) as fh:
            fcntl.flock(fh, fcntl.LOCK_SH)
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: Sequence[str], log: Path, quiet: bool) -> None:
    if not quiet:
        print("+", " ".join(cmd), flush=True)
    with open(log, "a") as fh:
        proc = subprocess.run(list(cmd), stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT,
                              text=True)
        if proc.stdout:
            fh.write(proc.stdout)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise BuildError(f"{cmd[0]} failed (exit {proc.returncode}); see {log}:\n{tail}")


CUDA_ARCHS_ENV = "ATTNCAL_CUDA_ARCHS"


def default_cuda_archs() -> tuple[int, ...]:
    """The CUDA architectures build_library compiles for: $ATTNCAL_CUDA_ARCHS ("80;90", the CMake option's own
    form; commas are taken too), else 80 and 90.  ValueError names a malformed setting."""
    env = os.environ.get(CUDA_ARCHS_ENV, "").strip()
    if not env:
        return (80, 90)
    parts = [p.strip() for p in env.replace(",", ";").split(";") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"{CUDA_ARCHS_ENV}={env!r}: expected architectures like '80;90'")
    return tuple(int(p) for p in parts)


def build_library(
    build_dir: str | os.PathLike | None = None,
    *,
    cuda: Literal["auto", "on", "off"] = "auto",
    ort: bool = True,
    tensorrt: Literal["auto", "on", "off"] = "auto",
    cuda_archs: Sequence[int] | None = None,
    jobs: int = 2,
    quiet: bool = True,
    gemm: Literal["auto", "openblas", "eigen", "builtin"] = "auto",
) -> Path:
    """Configure and build plugins/ with CMake; return the ORT library's path
    (or the CUDA library's when `ort=False`).  Incremental: a second call only
    re-runs what changed.  Needs cmake and a C++17 compiler; the first build
    fetches the ONNX Runtime headers with npm (see plugins/cmake/OrtHeaders.cmake).  `cuda_archs`: the CUDA
    architectures (default_cuda_archs: $ATTNCAL_CUDA_ARCHS, else 80 and 90)."""
    if cuda_archs is None:
        cuda_archs = default_cuda_archs()
    if cuda not in ("auto", "on", "off") or tensorrt not in ("auto", "on", "off"):
        raise ValueError("cuda and tensorrt must be 'auto', 'on' or 'off'")
    if gemm not in GEMM_CHOICES:
        raise ValueError(f"gemm must be one of {', '.join(GEMM_CHOICES)}, got {gemm!r}")
    if not ort and cuda == "off":
        raise ValueError("nothing to build: ort=False and cuda='off'")
    if not (PLUGINS_DIR / "CMakeLists.txt").is_file():
        raise BuildError(f"no plugins/ sources at {PLUGINS_DIR}: building needs a source checkout; an installed "
                         "platform wheel carries its libraries already (attncal.get_library_path())")
    cmake = shutil.which("cmake")
    if cmake is None:
        raise BuildError("cmake was not found on PATH; it is needed to build plugins/")
    out = Path(build_dir or default_build_dir()).resolve()
    with _locked(out):
        log = out / "build.log"
        log.write_text("")
        configure = [
            cmake, "-S", str(PLUGINS_DIR), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
            f"-DATTNCAL_WITH_ORT={'ON' if ort else 'OFF'}",
            f"-DATTNCAL_WITH_CUDA={cuda.upper()}",
            f"-DATTNCAL_WITH_TENSORRT={tensorrt.upper()}",
            f"-DATTNCAL_CUDA_ARCHS={';'.join(str(a) for a in cuda_archs)}",
            "-DATTNCAL_ORT_HEADER_CACHE=" + str(CHECKOUT / "build" / "ort-headers"),
            # The calibrated-attention kernel's GEMM (plugins/cmake/Gemm.cmake); OpenBLAS comes from this
            # interpreter's scipy-openblas32 wheel.
            f"-DATTNCAL_GEMM={gemm.upper() if gemm == 'auto' else gemm}",
            f"-DATTNCAL_PYTHON={sys.executable}",
        ]
        # Always passed, so the CMake cache follows the setting when it is unset again.
        trt_headers = tensorrt_headers() if tensorrt != "off" else None
        configure.append(f"-DATTNCAL_TENSORRT_INCLUDE_DIR={trt_headers or ''}")
        nvcc = find_nvcc()
        if nvcc and cuda != "off":
            configure.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        _run(configure, log, quiet)
        _run([cmake, "--build", str(out), "-j", str(max(1, jobs))], log, quiet)
    lib = out / (ORT_LIBRARY if ort else CUDA_LIBRARY)
    if not lib.is_file():
        raise BuildError(f"the build finished but {lib} is missing; see {log}")
    return lib


def compile_cuda_kernel(
    out: str | os.PathLike,
    archs: Sequence[int] = (80, 90),
    nvcc: str | None = None,
    sources: Sequence[str] = ("calibration_cuda.cu",),
) -> Path:
    """Compile CUDA translation units of plugins/kernels/cuda (`sources`, names in that folder;
    default calibration_cuda.cu, the calibration ops' launchers) into one shared library with nvcc
    (no CMake, no ONNX Runtime headers), for ctypes on a GPU machine.  Every other file of the folder
    is a header the two translation units include (plugins/kernels on the include path).  For the
    calibrated attention launchers pass ("calibration_cuda.cu", "calibrated_attention_cuda.cu"): the
    second reports its errors through the first's attncal_cuda_last_error, so it never builds alone.
    Written to a temp name, then renamed."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc was not found (PATH, $CUDA_HOME, /usr/local/cuda)")
    if not sources:
        raise ValueError("sources must name at least one .cu file of plugins/kernels/cuda")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    cmd = [nvcc, "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC", "-cudart=static",
           "-I", str(PLUGINS_DIR / "kernels")]
    for a in archs:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    cmd += [str(PLUGINS_DIR / "kernels" / "cuda" / name) for name in sources]
    cmd += ["-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"nvcc failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    os.replace(tmp, out)
    return out
