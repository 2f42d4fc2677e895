#!/usr/bin/env bash
# Build and run benchmarks/gemm_shapes.cpp: the CPU attention kernel's GEMM shapes, OpenBLAS (the kernel's
# default), the kernel's built-in loops and, from PREFIX, Intel MKL and oneDNN, one thread each.
#
#   benchmarks/gemm_shapes.sh [PREFIX] [ROUNDS]
#
# PREFIX: a Python environment where `pip install mkl mkl-devel mkl-include onednn-cpu-gomp` ran (its lib/ and
# include/); without it, OpenBLAS and the built-in loops only.  PYTHON (default: python3) must have the
# scipy-openblas32 wheel, as the library's build does.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
prefix="${1:-}"
rounds="${2:-7}"
py="${PYTHON:-python3}"
read -r ob_inc ob_dir ob_lib < <("$py" -c "import scipy_openblas32 as s; print(s.get_include_dir(), s.get_lib_dir(), s.get_library())")
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
flags=(-O3 -std=c++17 -I"$here/../plugins/kernels" "$here/gemm_shapes.cpp" -L"$ob_dir" -l"$ob_lib" -Wl,-rpath,"$ob_dir")
if [[ -n "$prefix" ]]; then
  [[ -e "$prefix/lib/libmkl_rt.so.3" || -e "$prefix/lib/libmkl_rt.so" ]] || { echo "gemm_shapes.sh: no libmkl_rt in $prefix/lib" >&2; exit 2; }
  [[ -e "$prefix/lib/libdnnl.so" ]] || { echo "gemm_shapes.sh: no libdnnl.so in $prefix/lib" >&2; exit 2; }
  mkl="$(ls "$prefix"/lib/libmkl_rt.so* | head -1)"
  flags+=(-DGEMM_SHAPES_MKL -DGEMM_SHAPES_ONEDNN "$mkl" -L"$prefix/lib" -ldnnl -Wl,-rpath,"$prefix/lib")
fi
g++ "${flags[@]}" -o "$out/gemm_shapes"
MKL_THREADING_LAYER=SEQUENTIAL OMP_NUM_THREADS=1 "$out/gemm_shapes" "$rounds"
