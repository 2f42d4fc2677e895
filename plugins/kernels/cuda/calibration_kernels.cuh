// The CUDA kernels of the calibration ops (the same math as cpu/row_calibration.h); the launchers and
// the C ABI are calibration_cuda.cu.
//
// calibrate_kernel (PooledRowCalibration / AllRowsCalibration, on probs): one block per row.  In place
// (out == probs) the grid covers the candidate calibrated rows only and rows outside the spec are
// never touched.  Out of place the grid covers every row: a block that owns an untouched row copies it
// (16-byte vectors where its input and output are equally aligned), so the tensor is read and written
// once and there is no separate copy of the whole tensor.  A calibrated row: basket masses from a
// contiguous segmented reduction in fp32 (a warp per basket for basket_size >= 32, a thread per basket
// below; for_each_basket); the row scalars (isolated shares, budget rescale, normalisation) in double
// by one thread (common/row_scalars.h), dividing by `total` (a subnormal fixed weight makes total
// subnormal and 1/total overflow); one multiplier g_k per basket; the second pass writes z * g_k
// (content), the blended share (isolated keys) and 0 (masked keys).
//
// softmax_calibrate_kernel (SoftmaxPooledRowCalibration / SoftmaxAllRowsCalibration, on the softmax's
// input scores): one block per row over all B*H*Q rows.  Block max, then the sum of exp(x - max) in
// fp32 (expf, not __expf); for a calibrated row the same pass also sums exp over the valid keys of
// each basket, so basket mass A_k = E_k / sum and the calibration above applies unchanged to
// z = exp(x - max) / sum.  Plain rows get the softmax.  The row is read three times (max, sums, write)
// and written once; the re-reads are served by L1/L2 (a row is at most a few KiB in practice).
//
// Where the basket values live.  A row's n = ceil(K / basket_size) basket values are kept in dynamic
// shared memory when they fit (BasketsConfig::kept, cuda/launch_config.h: n floats against the
// device's opt-in limit); otherwise nothing proportional to n is kept: pass 1 only counts the
// non-empty baskets, and the write pass recomputes each basket's mass (for_each_basket, the same
// partition and order as pass 1, so the same float) just before it writes that basket's keys, one
// more read of the row.  Either way the result is the same, and no shape is refused for shared memory.
//
// Rows that are fully masked or not finite (attncal/graphs/contract.py; the CPU kernel does the same
// and tests/test_masked_rows.py checks it there):
//  * the softmax is ONNX Softmax: the row max is an fmaxf reduction (NaN ignored) starting at -inf, so
//    scores that are all the lowest finite value give exp(0) / K = 1/K at every key; scores that are
//    all -inf give expf(-inf - -inf) = NaN, and a NaN or +inf score gives a NaN term: the sum is NaN
//    and so is every key of the row, as ONNX Runtime's Softmax and torch.softmax give.  A plain row
//    gets that through exp / sum; a calibrated row checks the (block-uniform) sum and writes NaN at
//    every key.
//  * calibrate_kernel: a calibrated row holding a NaN or an infinity at any key comes back NaN at
//    every key: pass 1 also sums x * 0 over the keys outside the content, the holes and the basket
//    masses (0, or NaN), reduced over the block before the first write.  Rows that are not
//    calibrated are not touched (in place) or copied bit for bit, NaN included.
//
// Aliasing: a block reads and writes only its own row; it finishes every read another thread depends
// on before the first write (each key is written by the thread that last reads it, and a recomputed
// basket is read and written by its own warp or thread), so out == in is safe.  Partial overlap is not.
#ifndef ATTNCAL_CUDA_CALIBRATION_KERNELS_CUH_
#define ATTNCAL_CUDA_CALIBRATION_KERNELS_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/attncal_params.h"
#include "common/row_scalars.h"
#include "common/span_geometry.h"
#include "cuda/cuda_common.cuh"

namespace attncal {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kMaxWarps = kMaxThreads / 32;

// Threads per row block: a multiple of 32 (full warps for the shuffles), fewer for short rows.
inline int threads_for(int64_t K) { return K > 1024 ? 256 : (K > 256 ? 128 : 64); }

// Whether the spec calibrates row q of batch item b (with marked_rows, a row its mask row `mrow` marks), and the
// item's plan.  spans == nullptr (the launchers pass it when strength == 0) means no row is calibrated.
__device__ __forceinline__ bool calibrated_row(const int* __restrict__ spans, const int64_t* __restrict__ mrow,
                                               int64_t b, int64_t q, int64_t Q, const AttncalParams& p, ItemPlan* it) {
  if (spans == nullptr) return false;
  *it = plan_item(span_at(spans, b), p, Q);
  return row_calibrated(*it, p, mrow, q);
}

// One basket as for_each_basket hands it over: basket k = keys [lo, hi), its sum, and the keys this
// thread owns in it (first, first + step, ... below hi): every key of the basket for a thread per
// basket, the lane's stride-32 share for a warp per basket.  owner(): the one thread that records
// the basket (the thread, or lane 0 of the warp; every lane of the warp holds the sum).
struct BasketVisit {
  int64_t k, lo, hi, first, step;
  float sum;
  __device__ __forceinline__ bool owner() const { return first == lo; }
};

// Visits the baskets of a calibrated row: a warp per basket when basket_size >= 32 (lanes stride over
// its keys, then a butterfly sum; warp-uniform bounds, so the full-mask shuffles are safe), a thread
// per basket below, summing term(j) over the basket's keys j.  visit(BasketVisit) then runs on every
// thread that took part.  The partition and the order of the sum depend only on the row plan, so a
// basket's sum is the same float in every pass that recomputes it.
template <typename Term, typename Visit>
__device__ __forceinline__ void for_each_basket(const ItemPlan& it, int64_t S, Term term, Visit visit) {
  const int64_t c_end = it.rp.c0 + it.rp.C;
  if (S >= 32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int64_t k = warp; k < it.rp.n; k += nw) {
      const int64_t lo = it.rp.c0 + k * S, hi = min(lo + S, c_end);
      float acc = 0.f;
      for (int64_t j = lo + lane; j < hi; j += 32) acc += term(j);
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      visit(BasketVisit{k, lo, hi, lo + lane, 32, acc});
    }
  } else {
    for (int64_t k = threadIdx.x; k < it.rp.n; k += blockDim.x) {
      const int64_t lo = it.rp.c0 + k * S, hi = min(lo + S, c_end);
      float acc = 0.f;
      for (int64_t j = lo; j < hi; ++j) acc += term(j);
      visit(BasketVisit{k, lo, hi, lo, 1, acc});
    }
  }
}

// Row scalars (common/row_scalars.h, shared with the CPU kernel), in double, from the nonempty basket
// count and the (masked) probabilities of the first/last valid keys and of the row's own key (`own`: where it
// sits, ATTNCAL_OWN_*): the content coefficient (g_k = coef / (A_k * t) + 1 - lambda), the isolated outputs
// and the row's t, into sc[0..5): coef, first_out, last_out, own_out, t.
__device__ void row_scalars(const AttncalParams& p, const ItemPlan& it, int nonempty, float z_first, float z_last,
                            int own, float z_own, float* sc) {
  const AttncalRowScalars rs = attncal_row_scalars(&p, nonempty, it.rp.t, z_first, z_last, own, z_own);
  // Used only when some basket is nonempty; then total >= the content mass and coef <= t * lambda.
  sc[0] = static_cast<float>(rs.coef);
  sc[1] = static_cast<float>(rs.first_out);
  sc[2] = static_cast<float>(rs.last_out);
  sc[3] = static_cast<float>(rs.own_out);
  sc[4] = static_cast<float>(rs.t);
}

// The multiplier g_k of a basket of mass a; t = baskets + isolated keys.  A basket whose mass is below
// 2^-64 (a subnormal mass, say, behind a dominant key) would give a multiplier beyond the float range:
// it is stored negated and scaled by 2^-64, and the write computes (z * 2^64) * g', which is the same
// product with every factor in range (scaling by a power of two is exact).
__device__ __forceinline__ float multiplier_of(float a, float coef, float t, float keep) {
  if (a == 0.f) return keep;
  if (a < 0x1p-64f) return -(coef / ((a * 0x1p64f) * t) + keep * 0x1p-64f);
  return coef / (a * t) + keep;
}

// Turns the basket masses in s_g[0, n) into multipliers.
__device__ __forceinline__ void masses_to_multipliers(float* s_g, int64_t n, float coef, float t, float keep) {
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) s_g[k] = multiplier_of(s_g[k], coef, t, keep);
}

// z * g_k for a multiplier from multiplier_of (negative: the scaled form).
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

// The outputs of a calibrated row's isolated keys: the first and last keys', and the own key's (at `own_at`,
// -1 without isolate_self), which takes the place of either where it is that key.
struct IsolatedOut {
  float first, last, own;
  int64_t own_at;
};

// Writes the keys of a calibrated row outside its content: zeros, but the isolated first/last keys (and an own
// key among them) get their blended share.
template <typename T>
__device__ __forceinline__ void write_outside(T* y, int64_t K, const ItemPlan& it, const AttncalParams& p,
                                              const IsolatedOut& io) {
  const float first_out = io.first, last_out = io.last;
  const int64_t outside = K - it.rp.C;
  for (int64_t i = threadIdx.x; i < outside; i += blockDim.x) {
    const int64_t k = i < it.rp.c0 ? i : i + it.rp.C;
    float v = 0.f;
    if (k == io.own_at) {
      v = io.own;
    } else if (p.isolate_first && k == it.s.start) {
      v = first_out;
    } else if (p.isolate_last && k == it.s.end) {
      v = last_out;
    }
    y[k] = from_f<T>(v);
  }
}

// Writes a calibrated row whose multipliers are in s_g: the keys outside the content, then content
// keys as z * g_k with the basket index tracked incrementally (no division per key).  zfun(k) gives z
// for a content key.
template <typename T, typename ZFun>
__device__ __forceinline__ void write_calibrated(T* y, int64_t K, const ItemPlan& it, const AttncalParams& p,
                                                 const int64_t* __restrict__ mrow, const float* s_g,
                                                 const IsolatedOut& io, ZFun zfun) {
  write_outside(y, K, it, p, io);
  const int64_t S = p.basket_size, step = blockDim.x;
  const int64_t dq = step / S, dr = step % S;
  int64_t bi = static_cast<int64_t>(threadIdx.x) / S, o = static_cast<int64_t>(threadIdx.x) % S;
  for (int64_t i = threadIdx.x; i < it.rp.C; i += step) {
    const int64_t k = it.rp.c0 + i;
    const float v = k == io.own_at ? io.own : (it.s.holes && mrow[k] == 0) ? 0.f : apply_multiplier(zfun(k), s_g[bi]);
    y[k] = from_f<T>(v);
    bi += dq;
    o += dr;
    if (o >= S) {
      o -= S;
      ++bi;
    }
  }
}

// Writes a calibrated row whose basket values are not kept: the keys outside the content, then each
// basket by the threads that sum it, its value recomputed just before its keys are written: term(j) is
// key j's term of the basket's sum, to_mass(sum) the basket's probability mass.
template <typename T, typename Term, typename ToMass, typename ZFun>
__device__ __forceinline__ void write_calibrated_recomputed(T* y, int64_t K, const ItemPlan& it,
                                                            const AttncalParams& p, const int64_t* __restrict__ mrow,
                                                            float coef, float t, float keep, const IsolatedOut& io,
                                                            Term term, ToMass to_mass, ZFun zfun) {
  write_outside(y, K, it, p, io);
  for_each_basket(it, p.basket_size, term, [&](const BasketVisit& bv) {
    const float g = multiplier_of(to_mass(bv.sum), coef, t, keep);
    for (int64_t k = bv.first; k < bv.hi; k += bv.step) {
      const float v = k == io.own_at ? io.own : (it.s.holes && mrow[k] == 0) ? 0.f : apply_multiplier(zfun(k), g);
      y[k] = from_f<T>(v);
    }
  });
}

// kept: the basket values are in the dynamic shared memory s_g (n floats); else recomputed.
template <typename T>
__global__ void __launch_bounds__(kMaxThreads) calibrate_kernel(const T* in, T* out, const int64_t* __restrict__ mask,
                                                                const int* __restrict__ spans, int64_t H, int64_t Q,
                                                                int64_t K, AttncalParams p, int every_row, int kept) {
  ATTNCAL_DYNAMIC_SHARED(float, s_g);  // n basket masses, then multipliers
  __shared__ int s_redi[kMaxWarps];
  __shared__ float s_redf[kMaxWarps];
  __shared__ float s_sc[5];

  const int64_t b = blockIdx.z, h = blockIdx.y;
  int64_t q = blockIdx.x;
  if (!every_row) {  // in place: the grid covers the candidate rows only
    if (spans == nullptr) return;  // strength 0 in place: the launcher does not launch
    const Span s = span_at(spans, b);
    if (s.start < 0) return;
    q = p.all_rows ? s.start + static_cast<int64_t>(blockIdx.x) : ((Q == 1) ? 0 : (p.pool_last ? s.end : s.start));
  }
  ItemPlan it;
  const int64_t* mrow = mask + b * K;
  const bool calibrated = calibrated_row(spans, mrow, b, q, Q, p, &it);  // uniform across the block
  if (!calibrated && !every_row) return;
  const int64_t off = ((b * H + h) * Q + q) * K;
  const T* x = in + off;
  T* y = out + off;
  if (!calibrated) {
    copy_row(x, y, K);  // out of place: an untouched row
    return;
  }

  const int64_t S = p.basket_size;
  const bool holes = it.s.holes;
  // The row's own key (isolate_self): out of its basket where it is a content key.
  const int own = own_key(it.s, p, q);
  const int64_t own_skip = own == ATTNCAL_OWN_CONTENT ? q : -1;
  // A content key's term of its basket's mass: a hole, or the own key out of its basket, adds x * 0 (0, or NaN
  // when it is not finite, which the probe then sees).
  auto mass = [&](int64_t j) {
    const float v = to_f(x[j]);
    return ((holes && mrow[j] == 0) || j == own_skip) ? v * 0.f : v;
  };
  // Pass 1: contiguous segmented reduction of the content keys into baskets, and `probe`, the sum of
  // x * 0 over the keys outside the content and the masses: NaN when the row holds a NaN or an
  // infinity anywhere.
  int nonempty = 0;
  float probe = 0.f;
  for (int64_t i = threadIdx.x; i < K - it.rp.C; i += blockDim.x)
    probe += to_f(x[i < it.rp.c0 ? i : i + it.rp.C]) * 0.f;
  for_each_basket(it, S, mass, [&](const BasketVisit& bv) {
    if (!bv.owner()) return;
    if (kept) s_g[bv.k] = bv.sum;
    nonempty += bv.sum != 0.f;
    probe += bv.sum * 0.f;
  });
  nonempty = block_reduce(nonempty, SumOp(), s_redi);  // also publishes s_g
  probe = block_reduce(probe, SumOp(), s_redf);  // the same value in every thread
  if (isnan(probe)) {  // NaN in, NaN out; every read of the row is done (block_reduce syncs)
    write_nan_row(y, K);
    return;
  }

  if (threadIdx.x == 0) {
    // start and end are valid keys by definition of the span, and the own key a valid row's.
    row_scalars(p, it, nonempty, to_f(x[it.s.start]), to_f(x[it.s.end]), own,
                own != ATTNCAL_OWN_NONE ? to_f(x[q]) : 0.f, s_sc);
  }
  __syncthreads();
  const float t = s_sc[4], keep = 1.f - p.strength;
  const IsolatedOut io{s_sc[1], s_sc[2], s_sc[3], own != ATTNCAL_OWN_NONE ? q : -1};
  auto z = [&](int64_t k) { return to_f(x[k]); };
  if (!kept) {  // Pass 2, recomputing each basket's mass.
    write_calibrated_recomputed(y, K, it, p, mrow, s_sc[0], t, keep, io, mass, [](float a) { return a; }, z);
    return;
  }
  masses_to_multipliers(s_g, it.rp.n, s_sc[0], t, keep);
  __syncthreads();
  // Pass 2: write the calibrated row (every key, masked ones as 0).
  write_calibrated(y, K, it, p, mrow, s_g, io, z);
}

// kept: as calibrate_kernel's.
template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
    softmax_calibrate_kernel(const T* in, T* out, const int64_t* __restrict__ mask, const int* __restrict__ spans,
                             int64_t H, int64_t Q, int64_t K, AttncalParams p, int kept) {
  ATTNCAL_DYNAMIC_SHARED(float, s_g);  // calibrated rows: n basket sums of exp, then masses, then multipliers
  __shared__ float s_redf[kMaxWarps];
  __shared__ int s_redi[kMaxWarps];
  __shared__ float s_sc[5];

  const int64_t b = blockIdx.z, h = blockIdx.y, q = blockIdx.x;
  ItemPlan it;
  const int64_t* mrow = mask + b * K;
  const bool calibrated = calibrated_row(spans, mrow, b, q, Q, p, &it);  // uniform across the block
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

  // Pass 2: softmax sum over every key and, per basket, the sum over its valid keys (the own key of an
  // isolate_self row left out of its basket, and kept in the softmax sum).
  const int64_t S = p.basket_size;
  const bool holes = it.s.holes;
  const int own = own_key(it.s, p, q);
  const int64_t own_skip = own == ATTNCAL_OWN_CONTENT ? q : -1;
  float acc = 0.f;
  const int64_t outside = K - it.rp.C;  // keys before and after the content
  for (int64_t i = threadIdx.x; i < outside; i += blockDim.x) {
    const int64_t k = i < it.rp.c0 ? i : i + it.rp.C;
    acc += expf(to_f(x[k]) - m);
  }
  // A content key's term of its basket's exp sum (0 at a hole).
  auto basket_exp = [&](int64_t j) {
    const float e = expf(to_f(x[j]) - m);
    return ((holes && mrow[j] == 0) || j == own_skip) ? 0.f : e;
  };
  for_each_basket(
      it, S,
      [&](int64_t j) {  // basket_exp, and every key's exp into the softmax sum
        const float e = expf(to_f(x[j]) - m);
        acc += e;
        return ((holes && mrow[j] == 0) || j == own_skip) ? 0.f : e;
      },
      [&](const BasketVisit& bv) {
        if (kept && bv.owner()) s_g[bv.k] = bv.sum;
      });
  const float sum = block_reduce(acc, SumOp(), s_redf);  // also publishes s_g
  if (isnan(sum)) {  // no softmax (all -inf, a NaN or +inf score): NaN at every key, as ONNX Softmax
    write_nan_row(y, K);
    return;
  }

  // Basket masses of the softmax row: A_k = E_k / sum.
  int nonempty = 0;
  if (kept) {
    for (int64_t k = threadIdx.x; k < it.rp.n; k += blockDim.x) {
      const float a = s_g[k] / sum;
      s_g[k] = a;
      nonempty += a != 0.f;
    }
  } else {
    for_each_basket(it, S, basket_exp, [&](const BasketVisit& bv) {
      if (bv.owner()) nonempty += (bv.sum / sum) != 0.f;
    });
  }
  nonempty = block_reduce(nonempty, SumOp(), s_redi);  // also publishes s_g

  if (threadIdx.x == 0) {
    const float z_first = expf(to_f(x[it.s.start]) - m) / sum, z_last = expf(to_f(x[it.s.end]) - m) / sum;
    const float z_own = own != ATTNCAL_OWN_NONE ? expf(to_f(x[q]) - m) / sum : 0.f;
    row_scalars(p, it, nonempty, z_first, z_last, own, z_own, s_sc);
  }
  __syncthreads();
  const float t = s_sc[4], keep = 1.f - p.strength;
  const IsolatedOut io{s_sc[1], s_sc[2], s_sc[3], own != ATTNCAL_OWN_NONE ? q : -1};
  auto z = [&](int64_t k) { return expf(to_f(x[k]) - m) / sum; };
  if (!kept) {  // Pass 3, recomputing each basket's mass A_k = E_k / sum.
    write_calibrated_recomputed(y, K, it, p, mrow, s_sc[0], t, keep, io, basket_exp,
                                [&](float e) { return e / sum; }, z);
    return;
  }
  masses_to_multipliers(s_g, it.rp.n, s_sc[0], t, keep);
  __syncthreads();
  // Pass 3: write the calibrated softmax row.
  write_calibrated(y, K, it, p, mrow, s_g, io, z);
}

}  // namespace
}  // namespace attncal

#endif  // ATTNCAL_CUDA_CALIBRATION_KERNELS_CUH_
