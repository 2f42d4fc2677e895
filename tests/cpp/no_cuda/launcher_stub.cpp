// Test-binary-only stand-in for the CUDA launchers (kernels/cuda/calibration_cuda.cu)
// when nvcc is absent: validates like the real launchers, returns success where
// they have nothing to do without touching the GPU (empty tensor; in place with
// strength 0 for attncal_cuda_calibrate), then reports that there is no CUDA,
// which is what the real ones report on a machine without a GPU.
#include <cstdio>

#include "common/span_geometry.h"
#include "cuda/calibration_cuda.h"

namespace {
char g_error[256] = "";

int check(const AttncalParams* params, int dtype, int64_t B, int64_t H, int64_t Q, int64_t K) {
  g_error[0] = '\0';
  if (params == nullptr) {
    std::snprintf(g_error, sizeof g_error, "params is NULL");
    return ATTNCAL_ERR_INVALID_ARGUMENT;
  }
  if (attncal_validate_params(params, g_error, sizeof g_error) != ATTNCAL_OK) return ATTNCAL_ERR_INVALID_ARGUMENT;
  if (dtype != ATTNCAL_DTYPE_FLOAT32 && dtype != ATTNCAL_DTYPE_FLOAT16 && dtype != ATTNCAL_DTYPE_BFLOAT16) {
    std::snprintf(g_error, sizeof g_error, "dtype must be float32 (0), float16 (1) or bfloat16 (2)");
    return ATTNCAL_ERR_INVALID_ARGUMENT;
  }
  if (B < 0 || H < 0 || Q < 0 || K < 0) {
    std::snprintf(g_error, sizeof g_error, "negative dimension");
    return ATTNCAL_ERR_INVALID_ARGUMENT;
  }
  return ATTNCAL_OK;
}

int no_cuda() {
  std::snprintf(g_error, sizeof g_error, "built without CUDA (test stub)");
  return ATTNCAL_ERR_CUDA;
}
}  // namespace

extern "C" size_t attncal_cuda_workspace_bytes(int64_t B) { return attncal::span_workspace_bytes(B); }
extern "C" const char* attncal_cuda_last_error(void) { return g_error; }

extern "C" int attncal_cuda_calibrate(int dtype, const void* probs, void* out, const int64_t*, int64_t B, int64_t H,
                                      int64_t Q, int64_t K, const AttncalParams* params, void*, void*) {
  const int rc = check(params, dtype, B, H, Q, K);
  if (rc != ATTNCAL_OK) return rc;
  if (B == 0 || H == 0 || Q == 0 || K == 0) return ATTNCAL_OK;
  if (out == probs && params->strength == 0.0f) return ATTNCAL_OK;  // in place, nothing to change
  return no_cuda();
}

extern "C" int attncal_cuda_softmax_calibrate(int dtype, const void*, void*, const int64_t*, int64_t B, int64_t H,
                                              int64_t Q, int64_t K, const AttncalParams* params, void*, void*) {
  const int rc = check(params, dtype, B, H, Q, K);
  if (rc != ATTNCAL_OK) return rc;
  if (B == 0 || H == 0 || Q == 0 || K == 0) return ATTNCAL_OK;
  return no_cuda();  // the softmax always runs, even at strength 0
}
