// What both CUDA translation units (calibration_cuda.cu, calibrated_attention_cuda.cu) share: the
// library's error string, element conversions, block reductions, the span kernel that writes the one
// span workspace layout (common/span_geometry.h), and the per-device facts and per-kernel shared-
// memory opt-ins, queried and set once per device rather than on every launch.
//
// Compiled with nvcc for sm_80 and sm_90 wherever it is found; run only on a GPU machine.
#ifndef ATTNCAL_CUDA_COMMON_CUH_
#define ATTNCAL_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <vector>

#include "common/attncal_params.h"
#include "common/span_geometry.h"

// A kernel launch and a kernel's dynamic shared memory, written through these two macros so that the CUDA
// simulator of the tests (tests/simt, which compiles these sources with g++) can give its own; under nvcc
// they are the plain forms.
#ifndef ATTNCAL_LAUNCH
#define ATTNCAL_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#endif
#ifndef ATTNCAL_DYNAMIC_SHARED
#define ATTNCAL_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
#endif

// Defined in calibration_cuda.cu: the library's one error string, read by attncal_cuda_last_error.
extern "C" void attncal_cuda_set_error(const char* msg);

namespace attncal {
namespace {

// Records why a call failed (attncal_cuda_last_error) and returns `code`.
inline int fail(int code, const char* what, cudaError_t err = cudaSuccess) {
  char buf[256];
  if (err != cudaSuccess) {
    snprintf(buf, sizeof buf, "%s: %s", what, cudaGetErrorString(err));
  } else {
    snprintf(buf, sizeof buf, "%s", what);
  }
  attncal_cuda_set_error(buf);
  return code;
}

// ------------------------------------------------------------------ element types
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fffffff); }
__host__ __device__ __forceinline__ int64_t imin(int64_t x, int64_t y) { return x < y ? x : y; }

// ------------------------------------------------------------------ block reductions
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const { return a + b; }
};

// Block-wide reduction (blockDim.x a multiple of 32, at most 32 warps); every thread gets the result,
// combined in the same fixed order (a butterfly in each warp, then the warps in order), so it is
// deterministic.  Must be reached by every thread of the block.  s_red: one slot per warp of shared
// memory.
template <typename V, typename Op>
__device__ __forceinline__ V block_reduce(V v, Op op, V* s_red) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();  // earlier readers of s_red (and writers of other shared data) are done
  if (lane == 0) s_red[warp] = v;
  __syncthreads();
  V r = s_red[0];
  for (int w = 1; w < nw; ++w) r = op(r, s_red[w]);
  return r;
}

// ------------------------------------------------------------------ the span workspace
constexpr int kSpanThreads = 256;

// One block per batch item: the item's span record (start, end, holes; common/span_geometry.h).
// queue_count, when given, is zeroed by block 0 (kernels on one stream run in order, so the counter
// is reset before the next kernel reads or writes it).
__global__ void span_kernel(const int64_t* __restrict__ mask, int64_t K, int* __restrict__ spans,
                            uint32_t* queue_count) {
  __shared__ long long s_start, s_end, s_count;
  const int64_t b = blockIdx.x;
  if (b == 0 && threadIdx.x == 0 && queue_count != nullptr) *queue_count = 0u;
  if (threadIdx.x == 0) {
    s_start = K;
    s_end = -1;
    s_count = 0;
  }
  __syncthreads();
  long long lo = K, hi = -1, cnt = 0;
  const int64_t* row = mask + b * K;
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    if (row[k] != 0) {
      lo = min(lo, (long long)k);
      hi = max(hi, (long long)k);
      ++cnt;
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    lo = min(lo, __shfl_down_sync(0xffffffffu, lo, off));
    hi = max(hi, __shfl_down_sync(0xffffffffu, hi, off));
    cnt += __shfl_down_sync(0xffffffffu, cnt, off);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMin(&s_start, lo);
    atomicMax(&s_end, hi);
    atomicAdd(reinterpret_cast<unsigned long long*>(&s_count), static_cast<unsigned long long>(cnt));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool any = s_end >= 0;
    int* rec = spans + kSpanInts * b;
    rec[0] = any ? static_cast<int>(s_start) : -1;
    rec[1] = any ? static_cast<int>(s_end) : -1;
    rec[2] = any && s_count != s_end - s_start + 1;
  }
}

// Launches span_kernel for B items on `stream`.
inline int launch_spans(const int64_t* mask, int64_t B, int64_t K, int* spans, uint32_t* queue_count,
                        cudaStream_t stream) {
  ATTNCAL_LAUNCH(span_kernel, static_cast<unsigned>(B), kSpanThreads, 0, stream)(mask, K, spans, queue_count);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ATTNCAL_OK : fail(ATTNCAL_ERR_CUDA, "span kernel launch", e);
}

// ------------------------------------------------------------------ per-device facts, cached
// Queried once per device, not on every launch: the attributes do not change while the process runs.
// Thread-safe (one mutex; only successful queries are kept, so a failure is reported again next time).
struct DeviceFacts {
  int device = -1;
  int smem_optin = 0;  // the most shared memory one block may opt in to (static + dynamic)
  int sms = 0;         // streaming multiprocessors
};

struct KernelFacts {
  const void* kernel = nullptr;
  int device = -1;
  size_t dynamic_limit = 0;  // the kernel's dynamic shared memory allowed on that device
};

inline std::mutex& facts_mutex() {
  static std::mutex m;
  return m;
}

// The current device's facts.
inline int current_device(DeviceFacts* out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaGetDevice", e);
  static std::vector<DeviceFacts> known;
  std::lock_guard<std::mutex> lock(facts_mutex());
  for (const DeviceFacts& f : known) {
    if (f.device == dev) {
      *out = f;
      return ATTNCAL_OK;
    }
  }
  DeviceFacts f;
  f.device = dev;
  e = cudaDeviceGetAttribute(&f.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaDeviceGetAttribute", e);
  known.push_back(f);
  *out = f;
  return ATTNCAL_OK;
}

// The dynamic shared memory `kernel` may use on device dev.f: the opt-in limit less the kernel's static
// shared memory.  The first call per (kernel, device) opts the kernel in to all of it
// (cudaFuncAttributeMaxDynamicSharedMemorySize; a launch still takes only what it asks for), later
// calls only look it up.
inline int kernel_smem_limit(const void* kernel, const DeviceFacts& dev, size_t* limit) {
  static std::vector<KernelFacts> known;
  std::lock_guard<std::mutex> lock(facts_mutex());
  for (const KernelFacts& k : known) {
    if (k.kernel == kernel && k.device == dev.device) {
      *limit = k.dynamic_limit;
      return ATTNCAL_OK;
    }
  }
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, kernel);
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaFuncGetAttributes", e);
  const size_t optin = static_cast<size_t>(dev.smem_optin);
  KernelFacts k;
  k.kernel = kernel;
  k.device = dev.device;
  k.dynamic_limit = optin > attr.sharedSizeBytes ? optin - attr.sharedSizeBytes : 0;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(k.dynamic_limit));
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaFuncSetAttribute", e);
  known.push_back(k);
  *limit = k.dynamic_limit;
  return ATTNCAL_OK;
}

}  // namespace
}  // namespace attncal

#endif  // ATTNCAL_CUDA_COMMON_CUH_
