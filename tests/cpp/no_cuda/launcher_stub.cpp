// Test-binary-only stand-in for the CUDA launcher (kernels/calibration_cuda.cu)
// when nvcc is absent: validates like the real launcher, then reports that
// there is no CUDA, which is what the real one reports on a machine without a GPU.
#include <cstdio>

#include "calibration_cuda.h"

namespace {
char g_error[256] = "";
}

extern "C" size_t attncal_cuda_workspace_bytes(int64_t B) { return static_cast<size_t>(B > 0 ? B : 1) * 3 * sizeof(int); }
extern "C" const char* attncal_cuda_last_error(void) { return g_error; }
extern "C" int attncal_cuda_calibrate(int, const void*, void*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                                      const AttncalParams* params, void*, void*) {
  if (params == nullptr || attncal_validate_params(params, g_error, sizeof g_error) != ATTNCAL_OK)
    return ATTNCAL_ERR_INVALID_ARGUMENT;
  std::snprintf(g_error, sizeof g_error, "built without CUDA (test stub)");
  return ATTNCAL_ERR_CUDA;
}
