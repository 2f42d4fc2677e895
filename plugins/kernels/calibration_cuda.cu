// CUDA implementation of the calibration ops (same math as calibration_cpu.h).
//
// attncal_cuda_calibrate (PooledRowCalibration / AllRowsCalibration, on probs):
//  1. span_kernel: one block per batch item derives the valid span
//     [start, end] and a "has holes" flag from attention_mask, once per batch.
//  2. calibrate_kernel: one block per row.  In place (out == probs) the grid
//     covers the candidate calibrated rows only and rows outside the spec are
//     never touched.  Out of place the grid covers every row: a block that owns
//     an untouched row copies it (16-byte vectors where its input and output
//     are equally aligned), so the tensor is read and written once and there is
//     no separate copy of the whole tensor.
//     A calibrated row: basket masses from a contiguous segmented reduction in
//     fp32 (a warp per basket for basket_size >= 32, a thread per basket below)
//     into shared memory; the row scalars (isolated shares, budget rescale,
//     normalisation) in double by one thread, dividing by `total` (a subnormal
//     fixed weight makes total subnormal and 1/total overflow); one multiplier
//     g_k per basket in shared memory; the second pass writes z * g_k (content),
//     the blended share (isolated keys) and 0 (masked keys), tracking the basket
//     index incrementally (no division per key).
//
// attncal_cuda_softmax_calibrate (SoftmaxPooledRowCalibration /
// SoftmaxAllRowsCalibration, on the softmax's input scores):
//  1. span_kernel as above (skipped when strength == 0).
//  2. softmax_calibrate_kernel: one block per row over all B*H*Q rows.  Block
//     max, then the sum of exp(x - max) in fp32 (expf, not __expf); for a
//     calibrated row the same pass also sums exp over the valid keys of each
//     basket, so basket mass A_k = E_k / sum and the calibration above applies
//     unchanged to z = exp(x - max) / sum.  Plain rows get the softmax.  The row
//     is read three times (max, sums, write) and written once; the re-reads are
//     served by L1/L2 (a row is at most a few KiB in practice).
//
// Rows that are fully masked or not finite (attncal/graphs/contract.py; the CPU
// kernel does the same and tests/test_masked_rows.py checks it there):
//  * the softmax is ONNX Softmax: the row max is an fmaxf reduction (NaN
//    ignored) starting at -inf, so scores that are all the lowest finite value
//    give exp(0) / K = 1/K at every key; scores that are all -inf give
//    expf(-inf - -inf) = NaN, and a NaN or +inf score gives a NaN term: the sum
//    is NaN and so is every key of the row, as ONNX Runtime's Softmax and
//    torch.softmax give.  A plain row gets that through exp / sum; a
//    calibrated row checks the (block-uniform) sum and writes NaN at every key.
//  * calibrate_kernel: a calibrated row holding a NaN or an infinity at any
//    key comes back NaN at every key: pass 1 also sums x * 0 over the keys
//    outside the content, the holes and the basket masses (0, or NaN), reduced
//    over the block before the first write.  Rows that are not calibrated are
//    not touched (in place) or copied bit for bit, NaN included.
//
// Aliasing: a block reads and writes only its own row; it finishes every read
// another thread depends on before the first write (each key is written by the
// thread that last reads it), so out == in is safe.  Partial overlap is not.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "calibration_cuda.h"
#include "row_scalars.h"

namespace {

constexpr int kMaxThreads = 256;
constexpr int kMaxWarps = kMaxThreads / 32;
constexpr int kSpanThreads = 256;
constexpr size_t kStaticSmemMargin = 256;  // the kernels' static shared memory, rounded up

// Threads per row block: a multiple of 32 (full warps for the shuffles), fewer for short rows.
int threads_for(int64_t K) { return K > 1024 ? 256 : (K > 256 ? 128 : 64); }

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

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const { return a + b; }
};

// Block-wide reduction (blockDim.x a multiple of 32, <= kMaxThreads); every
// thread gets the result, combined in the same fixed order.  Must be reached
// by every thread of the block.  s_red: kMaxWarps slots of shared memory.
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

// The geometry of one calibrated row (plan_rows of calibration_cpu.h).
struct RowPlan {
  int64_t start, end, c0, C, n;
  bool holes;
};

// True when the spec calibrates row q of batch item b.  geom == nullptr (the
// launchers pass it when strength == 0) means no row is calibrated.
__device__ __forceinline__ bool plan_row(const int* __restrict__ geom, int64_t b, int64_t q, int64_t Q,
                                         const AttncalParams& p, RowPlan* r) {
  if (geom == nullptr || p.strength == 0.f || q < 0 || q >= Q) return false;
  const int start = geom[3 * b], end = geom[3 * b + 1];
  if (start < 0) return false;
  if (p.all_rows) {
    if (q < start || q > end) return false;
  } else {
    // Q == 1 (row placement): the single row is the pooling row itself.
    const int64_t pool = (Q == 1) ? 0 : (p.pool_last ? end : start);
    if (q != pool) return false;
  }
  const int64_t n_iso = p.isolate_first + p.isolate_last;
  const int64_t S = p.basket_size;
  r->C = static_cast<int64_t>(end - start + 1) - n_iso;
  if (r->C <= 0 || (p.skip_short && r->C < S)) return false;
  r->start = start;
  r->end = end;
  r->c0 = start + p.isolate_first;
  r->n = (r->C + S - 1) / S;
  r->holes = geom[3 * b + 2] != 0;
  return true;
}

// Row scalars (row_scalars.h, shared with the CPU kernel), in double, from the nonempty basket
// count and the (masked) probabilities of the first/last valid keys: the content coefficient
// (g_k = coef / (A_k * t) + 1 - lambda) and the isolated outputs.
__device__ void row_scalars(const AttncalParams& p, const RowPlan& r, int nonempty, float z_first, float z_last,
                            float* coef, float* first_out, float* last_out) {
  const double t = static_cast<double>(r.n + p.isolate_first + p.isolate_last);
  const AttncalRowScalars rs = attncal_row_scalars(&p, nonempty, t, z_first, z_last);
  // Used only when some basket is nonempty; then total >= the content mass and coef <= t * lambda.
  *coef = static_cast<float>(rs.coef);
  *first_out = static_cast<float>(rs.first_out);
  *last_out = static_cast<float>(rs.last_out);
}

// Turns the basket masses in s_g[0, n) into multipliers g_k; t = baskets + isolated keys.
// A basket whose mass is below 2^-64 (a subnormal mass, say, behind a dominant key) would give a
// multiplier beyond the float range: it is stored negated and scaled by 2^-64, and the write
// computes (z * 2^64) * g', which is the same product with every factor in range (scaling by a
// power of two is exact).
__device__ __forceinline__ void masses_to_multipliers(float* s_g, int64_t n, float coef, float t, float keep) {
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    const float a = s_g[k];
    if (a == 0.f) {
      s_g[k] = keep;
    } else if (a < 0x1p-64f) {
      s_g[k] = -(coef / ((a * 0x1p64f) * t) + keep * 0x1p-64f);
    } else {
      s_g[k] = coef / (a * t) + keep;
    }
  }
}

// z * g_k for a multiplier from masses_to_multipliers (negative: the scaled form).
__device__ __forceinline__ float apply_multiplier(float z, float g) {
  return g >= 0.f ? z * g : (z * 0x1p64f) * -g;
}

// Writes NaN at every key of a row (a calibrated row that is not finite).
template <typename T>
__device__ __forceinline__ void write_nan_row(T* y, int64_t K) {
  const float nan = __int_as_float(0x7fc00000);
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) y[k] = from_f<T>(nan);
}

// Copies one row of K elements (rows of distinct, non-overlapping tensors).
template <typename T>
__device__ __forceinline__ void copy_row(const T* src, T* dst, int64_t K) {
  const uintptr_t s = reinterpret_cast<uintptr_t>(src), d = reinterpret_cast<uintptr_t>(dst);
  int64_t head = K;  // scalar prefix
  if (((s ^ d) & 15) == 0 && (s % sizeof(T)) == 0) {
    head = static_cast<int64_t>(((16 - (s & 15)) & 15) / sizeof(T));
    if (head > K) head = K;
  }
  for (int64_t k = threadIdx.x; k < head; k += blockDim.x) dst[k] = src[k];
  const int64_t per_vec = 16 / sizeof(T);
  const int64_t nvec = (K - head) / per_vec;
  const uint4* s4 = reinterpret_cast<const uint4*>(src + head);
  uint4* d4 = reinterpret_cast<uint4*>(dst + head);
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) d4[i] = s4[i];
  for (int64_t k = head + nvec * per_vec + threadIdx.x; k < K; k += blockDim.x) dst[k] = src[k];
}

// Writes a calibrated row: keys outside the content (zeros, but the isolated
// first/last keys get their blended share), then content keys as z * g_k with
// the basket index tracked incrementally.  zfun(k) gives z for a content key.
template <typename T, typename ZFun>
__device__ __forceinline__ void write_calibrated(T* y, int64_t K, const RowPlan& r, const AttncalParams& p,
                                                 const int64_t* __restrict__ mrow, const float* s_g,
                                                 float first_out, float last_out, ZFun zfun) {
  const int64_t outside = K - r.C;
  for (int64_t i = threadIdx.x; i < outside; i += blockDim.x) {
    const int64_t k = i < r.c0 ? i : i + r.C;
    float v = 0.f;
    if (p.isolate_first && k == r.start) {
      v = first_out;
    } else if (p.isolate_last && k == r.end) {
      v = last_out;
    }
    y[k] = from_f<T>(v);
  }
  const int64_t S = p.basket_size, step = blockDim.x;
  const int64_t dq = step / S, dr = step % S;
  int64_t bi = static_cast<int64_t>(threadIdx.x) / S, o = static_cast<int64_t>(threadIdx.x) % S;
  for (int64_t i = threadIdx.x; i < r.C; i += step) {
    const int64_t k = r.c0 + i;
    const float v = (r.holes && mrow[k] == 0) ? 0.f : apply_multiplier(zfun(k), s_g[bi]);
    y[k] = from_f<T>(v);
    bi += dq;
    o += dr;
    if (o >= S) {
      o -= S;
      ++bi;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads) calibrate_kernel(const T* in, T* out, const int64_t* __restrict__ mask,
                                                                const int* __restrict__ geom, int64_t H, int64_t Q,
                                                                int64_t K, AttncalParams p, int every_row) {
  extern __shared__ float s_g[];  // n basket masses, then multipliers
  __shared__ int s_redi[kMaxWarps];
  __shared__ float s_redf[kMaxWarps];
  __shared__ float s_sc[3];

  const int64_t b = blockIdx.z, h = blockIdx.y;
  int64_t q = blockIdx.x;
  if (!every_row) {  // in place: the grid covers the candidate rows only
    if (geom == nullptr) return;  // strength 0 in place: the launcher does not launch
    const int start = geom[3 * b], end = geom[3 * b + 1];
    if (start < 0) return;
    q = p.all_rows ? start + static_cast<int64_t>(blockIdx.x) : ((Q == 1) ? 0 : (p.pool_last ? end : start));
  }
  RowPlan r;
  const bool calibrated = plan_row(geom, b, q, Q, p, &r);  // uniform across the block
  if (!calibrated && !every_row) return;
  const int64_t off = ((b * H + h) * Q + q) * K;
  const T* x = in + off;
  T* y = out + off;
  if (!calibrated) {
    copy_row(x, y, K);  // out of place: an untouched row
    return;
  }

  const int64_t* mrow = mask + b * K;
  const int64_t S = p.basket_size, c_end = r.c0 + r.C;
  // Pass 1: contiguous segmented reduction of the content keys into baskets.  A hole adds x * 0
  // (0, or NaN when it is not finite), and `probe` sums x * 0 over the keys outside the content
  // and the masses: NaN when the row holds a NaN or an infinity anywhere.
  int nonempty = 0;
  float probe = 0.f;
  for (int64_t i = threadIdx.x; i < K - r.C; i += blockDim.x) probe += to_f(x[i < r.c0 ? i : i + r.C]) * 0.f;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (S >= 32) {
    for (int64_t k = warp; k < r.n; k += nw) {  // warp-uniform bounds: full-mask shuffles are safe
      const int64_t lo = r.c0 + k * S, hi = min(lo + S, c_end);
      float acc = 0.f;
      for (int64_t j = lo + lane; j < hi; j += 32) {
        const float v = to_f(x[j]);
        acc += (r.holes && mrow[j] == 0) ? v * 0.f : v;
      }
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) {
        s_g[k] = acc;
        nonempty += acc != 0.f;
        probe += acc * 0.f;
      }
    }
  } else {
    for (int64_t k = threadIdx.x; k < r.n; k += blockDim.x) {
      const int64_t lo = r.c0 + k * S, hi = min(lo + S, c_end);
      float acc = 0.f;
      for (int64_t j = lo; j < hi; ++j) {
        const float v = to_f(x[j]);
        acc += (r.holes && mrow[j] == 0) ? v * 0.f : v;
      }
      s_g[k] = acc;
      nonempty += acc != 0.f;
      probe += acc * 0.f;
    }
  }
  nonempty = block_reduce(nonempty, SumOp(), s_redi);  // also publishes s_g
  probe = block_reduce(probe, SumOp(), s_redf);  // the same value in every thread
  if (isnan(probe)) {  // NaN in, NaN out; every read of the row is done (block_reduce syncs)
    write_nan_row(y, K);
    return;
  }

  if (threadIdx.x == 0) {
    // start and end are valid keys by definition of the span.
    row_scalars(p, r, nonempty, to_f(x[r.start]), to_f(x[r.end]), &s_sc[0], &s_sc[1], &s_sc[2]);
  }
  __syncthreads();
  const float t = static_cast<float>(r.n + p.isolate_first + p.isolate_last), keep = 1.f - p.strength;
  masses_to_multipliers(s_g, r.n, s_sc[0], t, keep);
  __syncthreads();
  // Pass 2: write the calibrated row (every key, masked ones as 0).
  write_calibrated(y, K, r, p, mrow, s_g, s_sc[1], s_sc[2], [&](int64_t k) { return to_f(x[k]); });
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
    softmax_calibrate_kernel(const T* in, T* out, const int64_t* __restrict__ mask, const int* __restrict__ geom,
                             int64_t H, int64_t Q, int64_t K, AttncalParams p) {
  extern __shared__ float s_g[];  // calibrated rows: n basket sums of exp, then masses, then multipliers
  __shared__ float s_redf[kMaxWarps];
  __shared__ int s_redi[kMaxWarps];
  __shared__ float s_sc[3];

  const int64_t b = blockIdx.z, h = blockIdx.y, q = blockIdx.x;
  RowPlan r;
  const bool calibrated = plan_row(geom, b, q, Q, p, &r);  // uniform across the block
  const int64_t off = ((b * H + h) * Q + q) * K;
  const T* x = in + off;
  T* y = out + off;

  // Pass 1: row max.
  float m = -INFINITY;
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) m = fmaxf(m, to_f(x[k]));
  m = block_reduce(m, MaxOp(), s_redf);

  if (!calibrated) {
    // Pass 2: softmax sum; pass 3: write exp(x - max) / sum.
    float acc = 0.f;
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) acc += expf(to_f(x[k]) - m);
    const float sum = block_reduce(acc, SumOp(), s_redf);
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) y[k] = from_f<T>(expf(to_f(x[k]) - m) / sum);
    return;
  }

  // Pass 2: softmax sum over every key and, per basket, the sum over its valid keys.
  const int64_t* mrow = mask + b * K;
  const int64_t S = p.basket_size, c_end = r.c0 + r.C;
  float acc = 0.f;
  const int64_t outside = K - r.C;  // keys before and after the content
  for (int64_t i = threadIdx.x; i < outside; i += blockDim.x) {
    const int64_t k = i < r.c0 ? i : i + r.C;
    acc += expf(to_f(x[k]) - m);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (S >= 32) {
    for (int64_t k = warp; k < r.n; k += nw) {  // warp-uniform bounds: full-mask shuffles are safe
      const int64_t lo = r.c0 + k * S, hi = min(lo + S, c_end);
      float eb = 0.f;
      for (int64_t j = lo + lane; j < hi; j += 32) {
        const float e = expf(to_f(x[j]) - m);
        acc += e;
        eb += (r.holes && mrow[j] == 0) ? 0.f : e;
      }
      for (int o = 16; o > 0; o >>= 1) eb += __shfl_xor_sync(0xffffffffu, eb, o);
      if (lane == 0) s_g[k] = eb;
    }
  } else {
    for (int64_t k = threadIdx.x; k < r.n; k += blockDim.x) {
      const int64_t lo = r.c0 + k * S, hi = min(lo + S, c_end);
      float eb = 0.f;
      for (int64_t j = lo; j < hi; ++j) {
        const float e = expf(to_f(x[j]) - m);
        acc += e;
        eb += (r.holes && mrow[j] == 0) ? 0.f : e;
      }
      s_g[k] = eb;
    }
  }
  const float sum = block_reduce(acc, SumOp(), s_redf);  // also publishes s_g
  if (isnan(sum)) {  // no softmax (all -inf, a NaN or +inf score): NaN at every key, as ONNX Softmax
    write_nan_row(y, K);
    return;
  }

  // Basket masses of the softmax row: A_k = E_k / sum.
  int nonempty = 0;
  for (int64_t k = threadIdx.x; k < r.n; k += blockDim.x) {
    const float a = s_g[k] / sum;
    s_g[k] = a;
    nonempty += a != 0.f;
  }
  nonempty = block_reduce(nonempty, SumOp(), s_redi);  // also publishes s_g

  if (threadIdx.x == 0) {
    const float z_first = expf(to_f(x[r.start]) - m) / sum, z_last = expf(to_f(x[r.end]) - m) / sum;
    row_scalars(p, r, nonempty, z_first, z_last, &s_sc[0], &s_sc[1], &s_sc[2]);
  }
  __syncthreads();
  const float t = static_cast<float>(r.n + p.isolate_first + p.isolate_last), keep = 1.f - p.strength;
  masses_to_multipliers(s_g, r.n, s_sc[0], t, keep);
  __syncthreads();
  // Pass 3: write the calibrated softmax row.
  write_calibrated(y, K, r, p, mrow, s_g, s_sc[1], s_sc[2], [&](int64_t k) { return expf(to_f(x[k]) - m) / sum; });
}

// Dynamic shared memory for the basket values of one row (at least 4 bytes),
// with the opt-in above 48 KiB; UNSUPPORTED when it cannot fit.
template <typename Kernel>
int prepare_smem(Kernel kernel, int64_t K, int32_t basket_size, size_t* smem_out) {
  const int64_t max_baskets = (K + basket_size - 1) / basket_size;
  const size_t smem = static_cast<size_t>(max_baskets > 0 ? max_baskets : 1) * sizeof(float);
  *smem_out = smem;
  if (smem + kStaticSmemMargin <= 48 * 1024) return ATTNCAL_OK;
  int dev = 0, optin = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaGetDevice", e);
  e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaDeviceGetAttribute", e);
  if (smem + kStaticSmemMargin > static_cast<size_t>(optin)) {
    return fail(ATTNCAL_ERR_UNSUPPORTED, "too many baskets per row for shared memory (raise basket_size)");
  }
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaFuncSetAttribute", e);
  return ATTNCAL_OK;
}

// geom == nullptr: strength 0 (no calibrated row, no span kernel).
template <typename T>
int launch_calibrate(const T* in, T* out, const int64_t* mask, int64_t B, int64_t H, int64_t Q, int64_t K,
                     const AttncalParams& p, int* geom, cudaStream_t stream) {
  const bool every_row = out != in;
  size_t smem = 0;
  if (geom != nullptr) {
    const int rc = prepare_smem(calibrate_kernel<T>, K, p.basket_size, &smem);
    if (rc != ATTNCAL_OK) return rc;
    span_kernel<<<static_cast<unsigned>(B), kSpanThreads, 0, stream>>>(mask, K, geom);
  }
  const int64_t rows = every_row ? Q : (p.all_rows ? (Q < K ? Q : K) : 1);
  dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(H), static_cast<unsigned>(B));
  calibrate_kernel<T><<<grid, threads_for(K), smem, stream>>>(in, out, mask, geom, H, Q, K, p, every_row ? 1 : 0);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "kernel launch", e);
  return ATTNCAL_OK;
}

template <typename T>
int launch_softmax(const T* in, T* out, const int64_t* mask, int64_t B, int64_t H, int64_t Q, int64_t K,
                   const AttncalParams& p, int* geom, cudaStream_t stream) {
  size_t smem = 0;
  if (geom != nullptr) {
    const int rc = prepare_smem(softmax_calibrate_kernel<T>, K, p.basket_size, &smem);
    if (rc != ATTNCAL_OK) return rc;
    span_kernel<<<static_cast<unsigned>(B), kSpanThreads, 0, stream>>>(mask, K, geom);
  }
  dim3 grid(static_cast<unsigned>(Q), static_cast<unsigned>(H), static_cast<unsigned>(B));
  softmax_calibrate_kernel<T><<<grid, threads_for(K), smem, stream>>>(in, out, mask, geom, H, Q, K, p);
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
  if (dtype != ATTNCAL_DTYPE_FLOAT32 && dtype != ATTNCAL_DTYPE_FLOAT16)
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "dtype must be float32 (0) or float16 (1)");
  if (B < 0 || H < 0 || Q < 0 || K < 0) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "negative dimension");
  if (B > 65535 || H > 65535 || Q > 0x7fffffff || K > 0x7fffffff)
    return fail(ATTNCAL_ERR_UNSUPPORTED, "B and H must be <= 65535, Q and K < 2^31");
  return ATTNCAL_OK;
}

// Runs one of the launchers with the span workspace (allocated stream-ordered
// when the caller passes none); strength 0 needs no workspace.
template <typename Launch>
int with_workspace(const AttncalParams* params, int64_t B, void* workspace, cudaStream_t stream, Launch launch) {
  if (params->strength == 0.0f) return launch(static_cast<int*>(nullptr));
  int* geom = static_cast<int*>(workspace);
  bool owned = false;
  if (geom == nullptr) {
    cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&geom), attncal_cuda_workspace_bytes(B), stream);
    if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaMallocAsync", e);
    owned = true;
  }
  int rc = launch(geom);
  if (owned) {
    cudaError_t e = cudaFreeAsync(geom, stream);
    if (e != cudaSuccess && rc == ATTNCAL_OK) rc = fail(ATTNCAL_ERR_CUDA, "cudaFreeAsync", e);
  }
  return rc;
}

}  // namespace

extern "C" size_t attncal_cuda_workspace_bytes(int64_t B) { return static_cast<size_t>(B > 0 ? B : 1) * 3 * sizeof(int); }

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
  return with_workspace(params, B, workspace, stream, [&](int* geom) {
    if (dtype == ATTNCAL_DTYPE_FLOAT32)
      return launch_calibrate(static_cast<const float*>(probs), static_cast<float*>(out), mask, B, H, Q, K, p, geom,
                              stream);
    return launch_calibrate(static_cast<const __half*>(probs), static_cast<__half*>(out), mask, B, H, Q, K, p, geom,
                            stream);
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
  return with_workspace(params, B, workspace, stream, [&](int* geom) {
    if (dtype == ATTNCAL_DTYPE_FLOAT32)
      return launch_softmax(static_cast<const float*>(scores), static_cast<float*>(out), mask, B, H, Q, K, p, geom,
                            stream);
    return launch_softmax(static_cast<const __half*>(scores), static_cast<__half*>(out), mask, B, H, Q, K, p, geom,
                          stream);
  });
}
