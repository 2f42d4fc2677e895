// Test-binary-only stand-in for the calibrated-attention launcher (kernels/calibrated_attention_cuda.cu)
// when nvcc is absent, beside launcher_stub.cpp (which owns attncal_cuda_last_error): the same
// workspace size as the real launcher, and an error for every call that would reach the GPU, which
// is what the real launcher returns on a machine without one.  Never used for a real build.
#include <cstddef>
#include <cstdint>

#include "calibrated_attention_cuda.h"

extern "C" size_t attncal_cuda_attention_workspace_bytes(int64_t B, int64_t S_q, int64_t N) {
  const int64_t b = B > 0 ? B : 1, rows = (B > 0 ? B : 0) * (N > 0 ? N : 0) * (S_q > 0 ? S_q : 0);
  return ((sizeof(int) * 2 * static_cast<size_t>(b) + 15) & ~static_cast<size_t>(15)) + 16 +
         sizeof(uint32_t) * static_cast<size_t>(rows > 0 ? rows : 1);
}

extern "C" int attncal_cuda_calibrated_attention(int, const void*, const void*, const void*, const int64_t*, void*,
                                                 int64_t B, int64_t S_q, int64_t, int64_t, int64_t, int64_t D_v,
                                                 float, const AttncalParams* params, void*, void*) {
  if (params == nullptr) return ATTNCAL_ERR_INVALID_ARGUMENT;
  if (B == 0 || S_q == 0 || D_v == 0) return ATTNCAL_OK;
  return ATTNCAL_ERR_CUDA;  // built without CUDA (test stub)
}
