"""Where attncal's native libraries are: inside the installed package, or in a source checkout's build.

A platform wheel (`pip install .`, `pip wheel .`; scikit-build-core drives plugins/CMakeLists.txt)
carries the libraries in ``attncal/lib/``:

* ``libattncal_ort.so``: the ONNX Runtime custom-op library (CPU kernels, plus CUDA kernels when nvcc
  was present at build time);
* ``libattncal_cuda.so``: the CUDA launchers alone, for ctypes (where nvcc was present);
* ``libattncal_trt_plugin.so``: the TensorRT plugin (where TensorRT or its headers were given).

A source checkout builds them into ``build/plugins`` instead (``make plugins``, or the tests on demand:
`attncal.runtime.oplib.build_library`).  The package comes first, then the checkout's build, so an
installed wheel never picks up a stale checkout build by accident.

The function names follow onnxruntime-extensions' ``get_library_path()``, the ecosystem's convention
for "the custom-op library this package ships"::

    so = onnxruntime.SessionOptions()
    so.register_custom_ops_library(attncal.get_library_path())

This module imports nothing from attncal, so every layer may use it.
"""

from __future__ import annotations

import os
from pathlib import Path

ORT_LIBRARY = "libattncal_ort.so"
CUDA_LIBRARY = "libattncal_cuda.so"
TRT_LIBRARY = "libattncal_trt_plugin.so"
BUILD_INFO = "attncal_build.json"

PACKAGE_LIB_DIR = Path(__file__).resolve().parent / "lib"
"""Where a platform wheel installs the libraries (plugins/CMakeLists.txt's install rules)."""

CHECKOUT = Path(__file__).resolve().parents[1]
"""The source checkout this package runs from (editable install); in an installed wheel, site-packages."""


def default_build_dir() -> Path:
    """A source checkout's build of plugins/: $ATTNCAL_PLUGIN_BUILD_DIR, else <repo>/build/plugins."""
    env = os.environ.get("ATTNCAL_PLUGIN_BUILD_DIR")
    return Path(env) if env else CHECKOUT / "build" / "plugins"


def library_dirs() -> list[Path]:
    """The folders searched for the native libraries, in order: the package's, then the checkout's build."""
    return [PACKAGE_LIB_DIR, default_build_dir()]


def find_library(name: str) -> Path | None:
    """The first `name` in :func:`library_dirs`, or None."""
    for folder in library_dirs():
        if (folder / name).is_file():
            return folder / name
    return None


def _require(name: str, what: str, how: str) -> str:
    found = find_library(name)
    if found is None:
        raise FileNotFoundError(
            f"attncal's {what} ({name}) is not installed: it is neither in the package ({PACKAGE_LIB_DIR}) nor in "
            f"a source checkout's build ({default_build_dir()}). {how}")
    return str(found)


_INSTALL_HINT = ("Install attncal from a platform wheel or from source with `pip install .` (CMake and a C++17 "
                 "compiler build it), or run `make plugins` in a source checkout.")


def get_library_path() -> str:
    """The ONNX Runtime custom-op library (the `ai.attncal` ops' CPU kernels, and CUDA kernels when the
    build had nvcc), for ``SessionOptions.register_custom_ops_library``.  FileNotFoundError when absent."""
    return _require(ORT_LIBRARY, "ONNX Runtime custom-op library", _INSTALL_HINT)


def get_cuda_library_path() -> str:
    """The CUDA kernels' C launchers (ctypes), built where nvcc was present.  FileNotFoundError when absent."""
    return _require(CUDA_LIBRARY, "CUDA kernel library",
                    "It is built only where nvcc is found at build time (CUDA_HOME, PATH or /usr/local/cuda). "
                    + _INSTALL_HINT)


def get_tensorrt_plugin_path() -> str:
    """The TensorRT plugin library (``IPluginV3`` creators), built where nvcc and TensorRT (or its public
    headers, $ATTNCAL_TENSORRT_HEADERS) were present.  FileNotFoundError when absent."""
    return _require(TRT_LIBRARY, "TensorRT plugin",
                    "It is built only where nvcc and TensorRT are found at build time; set ATTNCAL_TENSORRT_HEADERS "
                    "to TensorRT's public headers to build it without libnvinfer. " + _INSTALL_HINT)


__all__ = ["BUILD_INFO", "CHECKOUT", "CUDA_LIBRARY", "ORT_LIBRARY", "PACKAGE_LIB_DIR", "TRT_LIBRARY", "default_build_dir",
           "find_library", "get_cuda_library_path", "get_library_path", "get_tensorrt_plugin_path", "library_dirs"]
