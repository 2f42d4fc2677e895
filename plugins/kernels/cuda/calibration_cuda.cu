// The launchers and C ABI of the calibration ops' CUDA kernels (calibration_cuda.h; the kernels and
// their design: calibration_kernels.cuh).  Also the home of the library's one error string, which the
// calibrated-attention launchers (calibrated_attention_cuda.cu) write too.
//
// attncal_cuda_calibrate / attncal_cuda_softmax_calibrate:
//  1. span_kernel (cuda_common.cuh): one block per batch item writes its span record (start, end,
//     holes; common/span_geometry.h) into the workspace, once per batch (not when strength == 0).
//  2. one block per row: calibrate_kernel (in place: the candidate calibrated rows only; out of
//     place: every row) or softmax_calibrate_kernel (every row).  Its dynamic shared memory holds the
//     row's basket values when they fit in the device's opt-in limit (cuda/launch_config.h:
//     choose_baskets); otherwise the kernel recomputes them, so no shape is refused for shared memory.
//     The device's limit and each kernel's opt-in are queried and set once per device (cuda_common.cuh).
//
// Compiled with nvcc for sm_80 and sm_90 wherever it is found; it has not run on a GPU (none where the
// library is built and tested), so its correctness there rests on benchmarks/gpu_check.py.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "common/span_geometry.h"
#include "cuda/calibration_cuda.h"
#include "cuda/calibration_kernels.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/launch_config.h"

namespace {

thread_local char g_last_error[256] = "";

using attncal::fail;

// The dynamic shared memory of `kernel` for rows of K keys: the basket values when they fit.
int prepare_baskets(const void* kernel, int64_t K, int32_t basket_size, attncal::BasketsConfig* out) {
  attncal::DeviceFacts dev;
  int rc = attncal::current_device(&dev);
  if (rc != ATTNCAL_OK) return rc;
  size_t limit = 0;
  rc = attncal::kernel_smem_limit(kernel, dev, &limit);
  if (rc != ATTNCAL_OK) return rc;
  *out = attncal::choose_baskets(K, basket_size, limit);
  return ATTNCAL_OK;
}

// spans == nullptr: strength 0 (no calibrated row, no span kernel).
template <typename T>
int launch_calibrate(const T* in, T* out, const int64_t* mask, int64_t B, int64_t H, int64_t Q, int64_t K,
                     const AttncalParams& p, int* spans, cudaStream_t stream) {
  const bool every_row = out != in;
  attncal::BasketsConfig baskets;
  if (spans != nullptr) {
    int rc = prepare_baskets(reinterpret_cast<const void*>(attncal::calibrate_kernel<T>), K, p.basket_size, &baskets);
    if (rc == ATTNCAL_OK) rc = attncal::launch_spans(mask, B, K, spans, nullptr, stream);
    if (rc != ATTNCAL_OK) return rc;
  }
  const int64_t rows = every_row ? Q : (p.all_rows ? (Q < K ? Q : K) : 1);
  dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(H), static_cast<unsigned>(B));
  ATTNCAL_LAUNCH(attncal::calibrate_kernel<T>, grid, attncal::threads_for(K), baskets.smem_bytes, stream)(
      in, out, mask, spans, H, Q, K, p, every_row ? 1 : 0, baskets.kept ? 1 : 0);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "kernel launch", e);
  return ATTNCAL_OK;
}

template <typename T>
int launch_softmax(const T* in, T* out, const int64_t* mask, int64_t B, int64_t H, int64_t Q, int64_t K,
                   const AttncalParams& p, int* spans, cudaStream_t stream) {
  attncal::BasketsConfig baskets;
  if (spans != nullptr) {
    int rc = prepare_baskets(reinterpret_cast<const void*>(attncal::softmax_calibrate_kernel<T>), K, p.basket_size,
                             &baskets);
    if (rc == ATTNCAL_OK) rc = attncal::launch_spans(mask, B, K, spans, nullptr, stream);
    if (rc != ATTNCAL_OK) return rc;
  }
  dim3 grid(static_cast<unsigned>(Q), static_cast<unsigned>(H), static_cast<unsigned>(B));
  ATTNCAL_LAUNCH(attncal::softmax_calibrate_kernel<T>, grid, attncal::threads_for(K), baskets.smem_bytes, stream)(
      in, out, mask, spans, H, Q, K, p, baskets.kept ? 1 : 0);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "kernel launch", e);
  return ATTNCAL_OK;
}

// Argument checks shared by both entry points.
int check_args(int dtype, const AttncalParams* params, int64_t B, int64_t H, int64_t Q, int64_t K) {
  g_last_error[0] = '\0';
  if (params == nullptr) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "params is NULL");
  char msg[200];
  if (attncal_validate_params(params, msg, sizeof msg) != ATTNCAL_OK) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, msg);
  if (dtype != ATTNCAL_DTYPE_FLOAT32 && dtype != ATTNCAL_DTYPE_FLOAT16 && dtype != ATTNCAL_DTYPE_BFLOAT16)
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "dtype must be float32 (0), float16 (1) or bfloat16 (2)");
  if (B < 0 || H < 0 || Q < 0 || K < 0) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "negative dimension");
  if (B > 65535 || H > 65535 || Q > 0x7fffffff || K > 0x7fffffff)
    return fail(ATTNCAL_ERR_UNSUPPORTED, "B and H must be <= 65535, Q and K < 2^31");
  return ATTNCAL_OK;
}

// Calls f with a value of the element type of ATTNCAL_DTYPE_* `dtype` (check_args accepted it).
template <typename F>
int by_dtype(int dtype, F f) {
  if (dtype == ATTNCAL_DTYPE_FLOAT32) return f(0.0f);
  if (dtype == ATTNCAL_DTYPE_FLOAT16) return f(__half());
  return f(__nv_bfloat16());
}

// Runs one of the launchers with the span workspace (allocated stream-ordered when the caller passes
// none); strength 0 needs no workspace.
template <typename Launch>
int with_workspace(const AttncalParams* params, int64_t B, void* workspace, cudaStream_t stream, Launch launch) {
  if (params->strength == 0.0f) return launch(static_cast<int*>(nullptr));
  int* spans = static_cast<int*>(workspace);
  bool owned = false;
  if (spans == nullptr) {
    cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&spans), attncal_cuda_workspace_bytes(B), stream);
    if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaMallocAsync", e);
    owned = true;
  }
  int rc = launch(spans);
  if (owned) {
    cudaError_t e = cudaFreeAsync(spans, stream);
    if (e != cudaSuccess && rc == ATTNCAL_OK) rc = fail(ATTNCAL_ERR_CUDA, "cudaFreeAsync", e);
  }
  return rc;
}

}  // namespace

extern "C" size_t attncal_cuda_workspace_bytes(int64_t B) { return attncal::span_workspace_bytes(B); }

extern "C" const char* attncal_cuda_last_error(void) { return g_last_error; }

// The library's one error string is also written by the calibrated-attention launchers
// (calibrated_attention_cuda.cu), so attncal_cuda_last_error answers for every entry point.
// Not exported: the library is built with hidden visibility.
extern "C" void attncal_cuda_set_error(const char* msg) { snprintf(g_last_error, sizeof g_last_error, "%s", msg); }

extern "C" int attncal_cuda_calibrate(int dtype, const void* probs, void* out, const int64_t* mask, int64_t B,
                                      int64_t H, int64_t Q, int64_t K, const AttncalParams* params,
                                      void* workspace, void* stream_ptr) {
  int rc = check_args(dtype, params, B, H, Q, K);
  if (rc != ATTNCAL_OK) return rc;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (B == 0 || H == 0 || Q == 0 || K == 0) return ATTNCAL_OK;  // nothing to launch
  if (out == probs && params->strength == 0.0f) return ATTNCAL_OK;  // in place, nothing to change
  const AttncalParams& p = *params;
  return with_workspace(params, B, workspace, stream, [&](int* spans) {
    return by_dtype(dtype, [&](auto zero) {
      using T = decltype(zero);
      return launch_calibrate(static_cast<const T*>(probs), static_cast<T*>(out), mask, B, H, Q, K, p, spans, stream);
    });
  });
}

extern "C" int attncal_cuda_softmax_calibrate(int dtype, const void* scores, void* out, const int64_t* mask,
                                              int64_t B, int64_t H, int64_t Q, int64_t K,
                                              const AttncalParams* params, void* workspace, void* stream_ptr) {
  int rc = check_args(dtype, params, B, H, Q, K);
  if (rc != ATTNCAL_OK) return rc;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (B == 0 || H == 0 || Q == 0 || K == 0) return ATTNCAL_OK;  // nothing to launch
  const AttncalParams& p = *params;
  return with_workspace(params, B, workspace, stream, [&](int* spans) {
    return by_dtype(dtype, [&](auto zero) {
      using T = decltype(zero);
      return launch_softmax(static_cast<const T*>(scores), static_cast<T*>(out), mask, B, H, Q, K, p, spans, stream);
    });
  });
}
