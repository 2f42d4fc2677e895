// Test-binary-only stand-in for the calibrated-attention launcher (kernels/cuda/calibrated_attention_cuda.cu)
// when nvcc is absent, beside launcher_stub.cpp (which owns attncal_cuda_last_error): the same
// workspace size as the real launcher, and an error for every call that would reach the GPU, which
// is what the real launcher returns on a machine without one.  Never used for a real build.
#include <cstddef>
#include <cstdint>

#include "cuda/calibrated_attention_cuda.h"
#include "cuda/launch_config.h"

extern "C" size_t attncal_cuda_attention_workspace_bytes(int64_t B, int64_t S_q, int64_t N, int64_t num_buckets) {
  return attncal::attention_workspace(B, S_q, N, num_buckets > 0).bytes;
}

extern "C" int attncal_cuda_calibrated_attention(int, const void*, const void*, const void*, const int64_t*, void*,
                                                 int64_t B, int64_t S_q, int64_t, int64_t, int64_t, int64_t D_v,
                                                 float, const void*, int64_t, const AttncalParams* params, void*,
                                                 void*) {
  if (params == nullptr) return ATTNCAL_ERR_INVALID_ARGUMENT;
  if (B == 0 || S_q == 0 || D_v == 0) return ATTNCAL_OK;
  return ATTNCAL_ERR_CUDA;  // built without CUDA (test stub)
}
