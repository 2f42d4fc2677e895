// CUDA implementation of the calibration op (same math as calibration_cpu.h).
//
// Two launches on the caller's stream:
//  1. span_kernel: one block per batch item derives the valid span
//     [start, end] and a "has holes" flag from attention_mask, once per batch.
//  2. calibrate_kernel: one block per calibrated (b, h, row).  Basket masses
//     come from a contiguous segmented reduction in fp32 (a warp per basket for
//     basket_size >= 32, a thread per basket below), kept in shared memory;
//     the budget rescale and normalisation reduce to block-wide scalars; the
//     second pass writes z * g_k (content), the blended share (isolated keys)
//     and 0 (masked keys).  Rows outside the spec are never touched, so in
//     place works directly; out-of-place copies the input first with one
//     cudaMemcpyAsync (copy bandwidth) and then overwrites the calibrated rows.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "calibration_cuda.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

thread_local char g_last_error[256] = "";

int fail(int code, const char* what, cudaError_t err = cudaSuccess) {
  if (err != cudaSuccess) {
    snprintf(g_last_error, sizeof g_last_error, "%s: %s", what, cudaGetErrorString(err));
  } else {
    snprintf(g_last_error, sizeof g_last_error, "%s", what);
  }
  return code;
}

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

// geom[3*b] = start (-1: no valid token), geom[3*b+1] = end, geom[3*b+2] = has holes.
__global__ void span_kernel(const int64_t* __restrict__ mask, int64_t K, int* __restrict__ geom) {
  __shared__ long long s_start, s_end, s_count;
  const int64_t b = blockIdx.x;
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
    geom[3 * b] = any ? static_cast<int>(s_start) : -1;
    geom[3 * b + 1] = any ? static_cast<int>(s_end) : -1;
    geom[3 * b + 2] = any && s_count != s_end - s_start + 1;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) calibrate_kernel(const T* __restrict__ in, T* out,
                                                             const int64_t* __restrict__ mask,
                                                             const int* __restrict__ geom, int H, int64_t Q,
                                                             int64_t K, AttncalParams p) {
  extern __shared__ float s_basket[];  // n basket masses
  __shared__ int s_nonempty;
  __shared__ float s_coef[6];

  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int start = geom[3 * b], end = geom[3 * b + 1];
  const bool holes = geom[3 * b + 2] != 0;
  if (start < 0) return;
  int64_t q;
  if (p.all_rows) {
    q = start + static_cast<int64_t>(blockIdx.x);
    if (q > end) return;
  } else {
    // Q == 1 (row placement): the single row is the pooling row itself.
    q = (Q == 1) ? 0 : (p.pool_last ? end : start);
  }
  if (q >= Q) return;
  const int n_iso = p.isolate_first + p.isolate_last;
  const int64_t S = p.basket_size;
  const int64_t c0 = start + p.isolate_first;
  const int64_t C = static_cast<int64_t>(end - start + 1) - n_iso;
  if (C <= 0 || (p.skip_short && C < S)) return;
  const int64_t n = (C + S - 1) / S;
  const float t = static_cast<float>(n + n_iso);

  const int64_t off = ((b * H + h) * Q + q) * K;
  const T* row_in = in + off;
  T* row_out = out + off;
  const int64_t* mrow = mask + b * K;
  auto z = [&](int64_t k) -> float {
    if (k < start || k > end || (holes && mrow[k] == 0)) return 0.f;
    return to_f(row_in[k]);
  };

  if (threadIdx.x == 0) s_nonempty = 0;
  // Pass 1: contiguous segmented reduction of the content keys into baskets.
  int local_nonempty = 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (S >= 32) {
    for (int64_t k = warp; k < n; k += kWarps) {
      const int64_t lo = c0 + k * S, hi = min(lo + S, c0 + C);
      float acc = 0.f;
      for (int64_t j = lo + lane; j < hi; j += 32) acc += z(j);
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) {
        s_basket[k] = acc;
        local_nonempty += acc != 0.f;
      }
    }
  } else {
    for (int64_t k = threadIdx.x; k < n; k += kThreads) {
      const int64_t lo = c0 + k * S, hi = min(lo + S, c0 + C);
      float acc = 0.f;
      for (int64_t j = lo; j < hi; ++j) acc += z(j);
      s_basket[k] = acc;
      local_nonempty += acc != 0.f;
    }
  }
  for (int o = 16; o > 0; o >>= 1) local_nonempty += __shfl_xor_sync(0xffffffffu, local_nonempty, o);
  __syncthreads();  // s_nonempty initialised
  if (lane == 0 && local_nonempty) atomicAdd(&s_nonempty, local_nonempty);
  __syncthreads();

  // Block-wide scalars: isolated shares, budget rescale, normalisation.
  if (threadIdx.x == 0) {
    const float inv_t = 1.f / t;
    auto share_of = [&](int mode, float weight, int64_t pos) -> float {
      if (mode == ATTNCAL_MODE_EQUAL) return inv_t;
      if (mode == ATTNCAL_MODE_ORIGINAL) return z(pos);
      return weight;
    };
    const float fs = p.isolate_first ? share_of(p.first_mode, p.first_weight, start) : 0.f;
    const float ls = p.isolate_last ? share_of(p.last_mode, p.last_weight, end) : 0.f;
    const bool non_equal = (p.isolate_first && p.first_mode != ATTNCAL_MODE_EQUAL) ||
                           (p.isolate_last && p.last_mode != ATTNCAL_MODE_EQUAL);
    float content_mass = static_cast<float>(s_nonempty) * inv_t;
    float scale = 1.f;
    if (non_equal && content_mass != 0.f) {
      const float budget = fmaxf(0.f, 1.f - (fs + ls));
      scale = budget / content_mass;
      content_mass = budget;
    }
    const float total = content_mass + fs + ls;
    const float inv_total = total != 0.f ? 1.f / total : 1.f;
    s_coef[0] = p.strength * scale * inv_total;  // content: times f_k
    s_coef[1] = p.strength * fs * inv_total;     // isolated first: blended share
    s_coef[2] = p.strength * ls * inv_total;     // isolated last
  }
  __syncthreads();
  const float content_coef = s_coef[0], first_val = s_coef[1], last_val = s_coef[2];
  const float keep = 1.f - p.strength;

  // Pass 2: write the calibrated row (every key, masked ones as 0).
  for (int64_t k = threadIdx.x; k < K; k += kThreads) {
    float v;
    if (k < start || k > end || (holes && mrow[k] == 0)) {
      v = 0.f;
    } else if (p.isolate_first && k == start) {
      v = first_val + keep * to_f(row_in[k]);
    } else if (p.isolate_last && k == end) {
      v = last_val + keep * to_f(row_in[k]);
    } else {
      const float a = s_basket[(k - c0) / S];
      const float g = a != 0.f ? content_coef / (a * t) + keep : keep;
      v = to_f(row_in[k]) * g;
    }
    row_out[k] = from_f<T>(v);
  }
}

template <typename T>
int launch(const T* in, T* out, const int64_t* mask, int64_t B, int64_t H, int64_t Q, int64_t K,
           const AttncalParams& p, int* geom, cudaStream_t stream) {
  const int64_t max_baskets = (K + p.basket_size - 1) / p.basket_size;
  const size_t smem = static_cast<size_t>(max_baskets > 0 ? max_baskets : 1) * sizeof(float);
  if (smem > 48 * 1024) {
    int dev = 0, optin = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (smem + 64 > static_cast<size_t>(optin)) {
      return fail(ATTNCAL_ERR_UNSUPPORTED, "too many baskets per row for shared memory (raise basket_size)");
    }
    cudaError_t e = cudaFuncSetAttribute(calibrate_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaFuncSetAttribute", e);
  }
  span_kernel<<<static_cast<unsigned>(B), kThreads, 0, stream>>>(mask, K, geom);
  const int64_t rows = p.all_rows ? (Q < K ? Q : K) : 1;
  dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(H), static_cast<unsigned>(B));
  calibrate_kernel<T><<<grid, kThreads, smem, stream>>>(in, out, mask, geom, static_cast<int>(H), Q, K, p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "kernel launch", e);
  return ATTNCAL_OK;
}

}  // namespace

extern "C" size_t attncal_cuda_workspace_bytes(int64_t B) { return static_cast<size_t>(B > 0 ? B : 1) * 3 * sizeof(int); }

extern "C" const char* attncal_cuda_last_error(void) { return g_last_error; }

extern "C" int attncal_cuda_calibrate(int dtype, const void* probs, void* out, const int64_t* mask, int64_t B,
                                      int64_t H, int64_t Q, int64_t K, const AttncalParams* params,
                                      void* workspace, void* stream_ptr) {
  g_last_error[0] = '\0';
  if (params == nullptr) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "params is NULL");
  char msg[200];
  if (attncal_validate_params(params, msg, sizeof msg) != ATTNCAL_OK) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, msg);
  if (dtype != ATTNCAL_DTYPE_FLOAT32 && dtype != ATTNCAL_DTYPE_FLOAT16)
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "dtype must be float32 (0) or float16 (1)");
  if (B < 0 || H < 0 || Q < 0 || K < 0) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "negative dimension");
  if (B > 65535 || H > 65535 || Q > 0x7fffffff || K > 0x7fffffff)
    return fail(ATTNCAL_ERR_UNSUPPORTED, "B and H must be <= 65535, Q and K < 2^31");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const size_t elem = dtype == ATTNCAL_DTYPE_FLOAT16 ? 2 : 4;
  const size_t count = static_cast<size_t>(B * H * Q * K);
  if (out != probs && count > 0) {
    cudaError_t e = cudaMemcpyAsync(out, probs, count * elem, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaMemcpyAsync", e);
  }
  if (count == 0 || params->strength == 0.0f) return ATTNCAL_OK;
  int* geom = static_cast<int*>(workspace);
  bool owned = false;
  if (geom == nullptr) {
    cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&geom), attncal_cuda_workspace_bytes(B), stream);
    if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaMallocAsync", e);
    owned = true;
  }
  int rc;
  if (dtype == ATTNCAL_DTYPE_FLOAT32) {
    rc = launch(static_cast<const float*>(probs), static_cast<float*>(out), mask, B, H, Q, K, *params, geom, stream);
  } else {
    rc = launch(static_cast<const __half*>(probs), static_cast<__half*>(out), mask, B, H, Q, K, *params, geom, stream);
  }
  if (owned) {
    cudaError_t e = cudaFreeAsync(geom, stream);
    if (e != cudaSuccess && rc == ATTNCAL_OK) rc = fail(ATTNCAL_ERR_CUDA, "cudaFreeAsync", e);
  }
  return rc;
}
