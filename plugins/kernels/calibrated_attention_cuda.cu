// CUDA kernels of the calibrated attention ops, ai.attncal::PooledRowCalibratedAttention and
// ai.attncal::AllRowsCalibratedAttention (attncal/graphs/contract.py, "Calibrated attention (issue
// 20)"; the float64 spec is attncal.calibration.oracle.attention_reference; the arithmetic is
// ../shared/notes/one-pass-attention.md).  Semantics: per item b and head h, in float32,
//   scores = scale*q*k^T + (0 at valid keys, float32's lowest finite value at masked keys, added)
//   probs  = Softmax-fused calibration op of the scores (same attributes, same calibrated rows)
//   context = probs * v
//
// THE TILED KERNEL (attention_kernel): flash attention with the calibration folded in.
// * One block per (b, h, 16*NW query rows): NW = 4 warps for float16/bfloat16, 2 for float32; each
//   warp owns 16 rows, each thread two rows (g and g+8 of its warp, g = lane/4) and, per 8-column
//   group, two columns (2*(lane%4) and +1): the accumulator layout of mma.m16n8k16, which the
//   float32 path reuses so that all row bookkeeping is one piece of code.
// * K and V stream through shared memory in tiles of at most BC = 64 keys (cp.async, double
//   buffered for 16-bit types; plain loads when rows are not 16-byte aligned).  Scores, the row
//   maxima, exp and the row sums stay in registers; K and V are read once per block and nothing of
//   size S_q*S_k exists anywhere: memory is O(S) (the output plus ~4 bytes per query row and head
//   of workspace).
// * float16 / bfloat16: Q*K^T and P*V on the tensor cores (mma.sync m16n8k16, fp32 accumulation;
//   fragments by ldmatrix from padded, conflict-free shared rows).  P is rounded to the input type
//   for P*V, as FlashAttention does; this is the one place the kernel is not float32 arithmetic
//   (a relative 2^-11 per weight in float16, 2^-8 in bfloat16, the same order as the rounding of
//   the context itself).  The row sums add the rounded P, so each context row is a convex
//   combination of V.  float32: the same tiles with scalar FMAs from shared memory (exact
//   float32, no TF32), slower.
// * Blocks with no calibrated row (strength 0, every block but one per head for the pooled op
//   with S_q == S_k, padding-only blocks, items too short to calibrate, items with no valid key)
//   are plain flash attention over all S_k keys with the additive mask: exactly the contract,
//   fully masked items included (every score is the lowest value, the softmax is uniform and
//   the context the mean of V over all keys).
// * Blocks holding a calibrated row ("calibration blocks") cut the keys into segments: the keys
//   before the content (left padding, isolated first token), each content basket, the keys after
//   it (isolated last token, right padding).  A tile never crosses a segment boundary (a basket
//   of more than 64 keys is several tiles: exact divisors of it; a shorter one is one shorter
//   tile), and each segment keeps its own flash state (m_s, l_s, O_s): max, sum and P*V relative
//   to its own max, over its valid keys only (masked keys, holes included, are excluded: score
//   -inf, or NaN when their score is NaN or +inf, so that the contract's NaN rules survive).
//   When a segment closes:
//     full term:    (m, l, O) <- online-softmax merge of (m, l, O) and (m_s, l_s, O_s)
//     basket term:  a basket adds O_s / l_s = Attn(q; basket) to acc and counts as non-empty,
//                   unless its probability mass is already 0 in float32 (exp(m_s - LSE_so_far)
//                   underflows; LSE only grows, so that is final)
//   O and acc live in shared memory, one private slot per thread (touched once per segment);
//   O_s is the mma accumulator.  K and V are still read once, and one P*V product per tile
//   serves both terms (the note's "each KV tile one basket or an exact divisor of one").
//   At the end, with LSE = m + log l:
//     out = (1-lambda)*O/l + (coef/t)*acc + w_first*v[start] + w_last*v[end]
//   coef, w_first, w_last from row_scalars.h (the scalars every implementation shares) with the
//   non-empty basket count and z_first/z_last = exp(s - LSE) at the first/last valid key; the
//   isolated keys' scores are recomputed by one dot product per row (needed only for
//   `original` shares), their values read from global memory.
// * Exactness and the per-row kernel.  A row of a calibration block is handed to the per-row
//   kernel (rows_kernel: the contract written out directly, three passes over K and V for that
//   row) when the tiled kernel cannot be sure: (a) a basket counted as non-empty when it closed
//   turns out to have mass 0 in float32 once the final LSE is known (its max is ~104 below a
//   larger score that came later: the smallest counted basket max is checked), or (b) the row's
//   largest valid score is not above float32's lowest value (all valid scores -inf: then the
//   masked keys carry the softmax).  Such rows are queued in the workspace (a counter and a list)
//   and recomputed by a second launch on the same stream, which overwrites them.  Neither happens
//   for scores of ordinary size; the queue costs one near-empty launch otherwise.
//   Within the kernel's scope the result is the contract's: fully masked items (uniform over all
//   S_k keys, never calibrated), padding query rows (plain attention over the valid keys), holes
//   (excluded from the basket sums, counted in the basket count as the oracle does), empty
//   baskets (not counted in the non-empty count), NaN: a NaN or +inf score anywhere in a row,
//   masked keys included, makes the row NaN; a NaN or an infinity in V makes every row of that
//   item and head non-finite (0 * NaN in the product).  Not matched: masked-key scores only round
//   to the lowest value while |scale*q.k| < ~1e31 (true of any float16 input); beyond that the
//   contract's float32 sum and this kernel may differ.
// * Basket emptiness follows the float32 op (the Softmax-fused op, the ORT CPU kernel): a basket
//   whose float32 probabilities all underflow (max score ~104 below the LSE) is empty.  The
//   float64 oracle only empties baskets ~745 below; between the two the results differ (as
//   attncal.calibration.split notes for its own, float64-like, rule).
//
// THE PER-ROW KERNEL (rows_kernel) also runs the whole op when a head size exceeds 128 (correct,
// O(S_q*S_k*D) global reads: slow), and alone through attncal_cuda_calibrated_attention_reference
// (benchmarks/gpu_check.py cross-checks the two).
//
// SPEED: NEVER MEASURED (no GPU was available when this was written; benchmarks/gpu_check.py
// measures it against torch's flash SDPA).  What to expect from the design, not from a run:
// float16/bfloat16 with head size 64 does the same tensor-core work per tile as FlashAttention-2
// plus, in calibration blocks, one merge of O (HD/8 float4 in shared memory per thread) per
// segment; what it lacks against FA2 is tuning (no swizzle beyond padding, no register-level
// pipelining of ldmatrix, 64-key tiles, 2 blocks of 4 warps per SM at HD=64 and 1 at HD=128 for
// shared memory).  Baskets shorter than 64 keys make tiles shorter (basket_size 8: 1/8 of the
// tensor-core width used), so small baskets are several times slower than large ones.  float32
// runs on FMAs (no tensor cores): an order of magnitude slower than the 16-bit path.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "calibrated_attention_cuda.h"
#include "row_scalars.h"

// Defined in calibration_cuda.cu: the library's one error string, read by attncal_cuda_last_error.
extern "C" void attncal_cuda_set_error(const char* msg);

namespace {

constexpr int BC = 64;               // keys per tile
constexpr float kLowest = -3.40282347e38f;  // float32's lowest finite value: the contract's mask bias
constexpr int kRowThreads = 128;     // threads of a per-row block

int fail(int code, const char* what, cudaError_t err = cudaSuccess) {
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

// Two floats rounded to the 16-bit type and packed as an mma operand register (lower column in
// the low half).  The rounded values come back in a, b, so the row sums add what P*V multiplies.
template <typename T>
__device__ __forceinline__ uint32_t pack_round(float& a, float& b) {
  if constexpr (std::is_same<T, __half>::value) {
    __half2 h = __floats2half2_rn(a, b);
    a = __low2float(h);
    b = __high2float(h);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    a = __low2float(h);
    b = __high2float(h);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// ------------------------------------------------------------------ PTX wrappers
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronous; src_bytes == 0 writes 16 zero bytes (rows past the tile
// or columns past the head size).  src must be a valid address either way.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 b16 matrices from shared memory: lane l gives the address of row l%8 of matrix l/8 and
// receives in r[i] (row l/4, columns 2*(l%4), +1) of matrix i (with .trans: rows 2*(l%4), +1 of
// column l/4).
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
}

// c += A(16x16, row major) * B(16x8, "col": k-major per column), fp32 accumulate.
// A: a[0] = (row g, k 2t..2t+1), a[1] = (row g+8, k 2t..), a[2] = (row g, k 2t+8..), a[3] = (row g+8, k 2t+8..)
// B: b0 = (k 2t..2t+1, col g), b1 = (k 2t+8.., col g);  C: c[0..1] = (row g, cols 2t, 2t+1), c[2..3] = row g+8.
template <typename T>
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fffffff); }
__host__ __device__ __forceinline__ int64_t imin(int64_t x, int64_t y) { return x < y ? x : y; }

// ------------------------------------------------------------------ arguments and geometry
struct Args {
  const void* q;
  const void* k;
  const void* v;
  const int64_t* mask;
  void* out;
  const int* geom;        // [2*B]: start, end of each item's valid span (-1: none); NULL when strength == 0
  uint32_t* queue_count;  // rows queued for the per-row kernel
  uint32_t* queue;        // (b*N + h)*S_q + row
  int64_t B, S_q, S_k, N, D, D_v;
  float scale;  // resolved (never 0 unless D == 0)
  int vec16;    // 16-byte cp.async loads allowed (aligned pointers, D and D_v rows of 16-byte multiples)
  AttncalParams p;
};

// Span of each item's mask: geom[2b] = first valid key (-1 if none), geom[2b+1] = last.  Block 0
// also zeroes the queue counter (kernels on one stream run in order, so the counter is reset
// before the attention kernel reads or writes it).
__global__ void span_kernel(const int64_t* __restrict__ mask, int64_t S_k, int* __restrict__ geom,
                            uint32_t* queue_count) {
  __shared__ long long s_lo[32], s_hi[32];
  const int64_t b = blockIdx.x;
  if (b == 0 && threadIdx.x == 0 && queue_count != nullptr) *queue_count = 0u;
  long long lo = S_k, hi = -1;
  for (int64_t j = threadIdx.x; j < S_k; j += blockDim.x) {
    if (mask[b * S_k + j] != 0) {
      lo = min(lo, (long long)j);
      hi = max(hi, (long long)j);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    s_lo[warp] = lo;
    s_hi[warp] = hi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < nw; ++w) {
      lo = min(lo, s_lo[w]);
      hi = max(hi, s_hi[w]);
    }
    geom[2 * b] = hi >= 0 ? static_cast<int>(lo) : -1;
    geom[2 * b + 1] = hi >= 0 ? static_cast<int>(hi) : -1;
  }
}

// What calibration_cpu.h's plan_rows computes for one item, plus which query rows are calibrated.
struct ItemPlan {
  bool active;          // the item has calibrated rows
  int64_t start, end;   // valid span (start = -1: no valid key)
  int64_t c0, c_end;    // content [c0, c_end)
  int64_t n;            // baskets
  int64_t q_lo, q_hi;   // calibrated query rows (inclusive; empty when q_lo > q_hi)
};

__device__ __forceinline__ ItemPlan plan_item(const Args& a, int64_t b) {
  ItemPlan it{};
  it.active = false;
  it.start = it.end = -1;
  it.q_lo = 0;
  it.q_hi = -1;
  if (a.geom == nullptr) return it;
  it.start = a.geom[2 * b];
  it.end = a.geom[2 * b + 1];
  const AttncalParams& p = a.p;
  if (it.start < 0 || p.strength == 0.f) return it;
  const int64_t S = p.basket_size;
  const int64_t C = it.end - it.start + 1 - p.isolate_first - p.isolate_last;
  if (C <= 0 || (p.skip_short && C < S)) return it;
  it.c0 = it.start + p.isolate_first;
  it.c_end = it.c0 + C;
  it.n = (C + S - 1) / S;
  if (p.all_rows) {
    it.q_lo = it.start;
    it.q_hi = imin(it.end, a.S_q - 1);
  } else {
    // S_q == 1 (row placement): the single row is the pooling row itself.
    it.q_lo = it.q_hi = (a.S_q == 1) ? 0 : (p.pool_last ? it.end : it.start);
    if (it.q_lo >= a.S_q) it.q_hi = it.q_lo - 1;
  }
  it.active = it.q_lo <= it.q_hi;
  return it;
}

// The tile starting at key `pos`: its length and whether it closes its segment (and the segment
// is a content basket).  Outside calibration blocks the whole key range is one segment.
struct Tile {
  int64_t pos;
  int len;
  bool closes, basket;
};

__device__ __forceinline__ Tile tile_at(int64_t pos, bool calib, const ItemPlan& it, int64_t S_k, int64_t S) {
  Tile t;
  t.pos = pos;
  t.basket = false;
  int64_t seg_end = S_k;
  if (calib) {
    if (pos < it.c0) {
      seg_end = it.c0;
    } else if (pos < it.c_end) {
      const int64_t k = (pos - it.c0) / S;
      seg_end = imin(it.c0 + (k + 1) * S, it.c_end);
      t.basket = true;
    }
  }
  t.len = static_cast<int>(imin(BC, seg_end - pos));
  t.closes = pos + t.len == seg_end;
  return t;
}

// ------------------------------------------------------------------ shared memory
template <typename T, int HD, int NW, int STAGES>
struct Smem {
  static constexpr int BR = 16 * NW;
  static constexpr int PAD = 16 / sizeof(T);  // one 16-byte chunk per row: conflict-free ldmatrix/float4 rows
  static constexpr int LD = HD + PAD;
  static constexpr bool kF32 = std::is_same<T, float>::value;
  static constexpr int LDP = BC + 4;          // float32 path: P rows
  static constexpr size_t q_bytes = sizeof(T) * BR * LD;
  static constexpr size_t kv_bytes = sizeof(T) * BC * LD;  // one K or V tile
  static constexpr size_t p_bytes = kF32 ? sizeof(float) * BR * LDP : 0;
  static constexpr size_t mask_bytes = 16 * ((STAGES * BC + 15) / 16);
  static constexpr size_t acc_bytes = sizeof(float4) * (HD / 8) * (NW * 32);  // one private float4 per thread per 8 columns
  static constexpr size_t off_k = q_bytes;
  static constexpr size_t off_v = off_k + STAGES * kv_bytes;
  static constexpr size_t off_p = off_v + STAGES * kv_bytes;
  static constexpr size_t off_mask = off_p + p_bytes;
  static constexpr size_t base_bytes = off_mask + mask_bytes;  // enough for blocks without calibration
  static constexpr size_t off_of = base_bytes;
  static constexpr size_t off_acc = off_of + acc_bytes;
  static constexpr size_t calib_bytes = off_acc + acc_bytes;  // with the O and acc slots
};

// Loads rows [row0, row0 + rows_valid) of one head of a [*, N*ld_cols] tensor into `dst`
// (BR_or_BC rows of LD elements), columns [0, cols) of HD; the rest of the HD x nrows block is
// zero.  16-byte cp.async chunks when allowed, else element by element (then it is complete at
// the next __syncthreads).
template <typename T, int HD, int LD, int NTHREADS>
__device__ __forceinline__ void load_rows(T* dst, const T* __restrict__ src, int64_t row_stride, int nrows,
                                          int rows_valid, int64_t cols, bool vec16) {
  if (vec16) {
    constexpr int CH = 16 / sizeof(T);  // elements per chunk
    constexpr int CPR = HD / CH;        // chunks per row
    for (int i = threadIdx.x; i < nrows * CPR; i += NTHREADS) {
      const int r = i / CPR, c = (i % CPR) * CH;
      const bool ok = r < rows_valid && c < cols;
      const T* s = ok ? src + r * row_stride + c : src;
      cp_async16(dst + r * LD + c, s, ok ? 16 : 0);
    }
  } else {
    for (int i = threadIdx.x; i < nrows * HD; i += NTHREADS) {
      const int r = i / HD, c = i % HD;
      dst[r * LD + c] = (r < rows_valid && c < cols) ? src[r * row_stride + c] : from_f<T>(0.f);
    }
  }
}

// ------------------------------------------------------------------ the tiled kernel
template <typename T, int HD, int NW, int STAGES>
__global__ void __launch_bounds__(NW * 32) attention_kernel(Args a) {
  using L = Smem<T, HD, NW, STAGES>;
  constexpr int BR = L::BR, LD = L::LD, NT = BC / 8, NV = HD / 8, NTHREADS = NW * 32;
  constexpr bool kF32 = L::kF32;
  extern __shared__ __align__(16) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = reinterpret_cast<T*>(smem + L::off_k);
  T* Vs = reinterpret_cast<T*>(smem + L::off_v);
  float* Ps = reinterpret_cast<float*>(smem + L::off_p);
  unsigned char* Ms = smem + L::off_mask;
  float4* Of = reinterpret_cast<float4*>(smem + L::off_of);
  float4* Acc = reinterpret_cast<float4*>(smem + L::off_acc);

  const int64_t b = blockIdx.z, h = blockIdx.y, q0 = static_cast<int64_t>(blockIdx.x) * BR;
  const int64_t S_k = a.S_k, N = a.N, D = a.D, Dv = a.D_v;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int rloc[2] = {16 * warp + g, 16 * warp + g + 8};  // this thread's two rows in the block
  const AttncalParams& p = a.p;

  const ItemPlan it = plan_item(a, b);
  // A calibration block holds at least one calibrated row.
  const bool calib = it.active && it.q_lo <= q0 + BR - 1 && it.q_hi >= q0;
  const int64_t S = p.basket_size;

  const T* qg = static_cast<const T*>(a.q) + ((b * a.S_q + q0) * N + h) * D;
  const T* kg = static_cast<const T*>(a.k) + (b * S_k * N + h) * D;
  const T* vg = static_cast<const T*>(a.v) + (b * S_k * N + h) * Dv;
  const int64_t* mg = a.mask + b * S_k;
  const bool vec16 = a.vec16 != 0;

  auto issue = [&](const Tile& t, int buf) {
    load_rows<T, HD, LD, NTHREADS>(Ks + buf * BC * LD, kg + t.pos * N * D, N * D, BC, t.len, D, vec16);
    load_rows<T, HD, LD, NTHREADS>(Vs + buf * BC * LD, vg + t.pos * N * Dv, N * Dv, BC, t.len, Dv, vec16);
    for (int c = tid; c < BC; c += NTHREADS) Ms[buf * BC + c] = (c < t.len && mg[t.pos + c] != 0) ? 1 : 0;
  };

  // Q block (rows past S_q are zero; they are computed and dropped).
  load_rows<T, HD, LD, NTHREADS>(Qs, qg, N * D, BR, static_cast<int>(imin(BR, a.S_q - q0)), D, vec16);
  Tile cur = tile_at(0, calib, it, S_k, S);
  issue(cur, 0);
  cp_async_commit();

  // Per-row state (this thread's two rows; all four threads of a quad hold the same values once
  // reduced).  Segment: m_s, l_s (thread-partial sum), O_s (the accumulator fragment).
  float m_s[2] = {-INFINITY, -INFINITY}, l_s[2] = {0.f, 0.f};
  float O[NV][4];
#pragma unroll
  for (int j = 0; j < NV; ++j) O[j][0] = O[j][1] = O[j][2] = O[j][3] = 0.f;
  // Calibration blocks: the full term (m_r, l_r; O in Of) and the basket term (acc in Acc).
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f}, min_mb[2] = {INFINITY, INFINITY};
  int n_ne[2] = {0, 0};
  if (calib) {
    for (int j = 0; j < NV; ++j) {
      Of[j * NTHREADS + tid] = make_float4(0.f, 0.f, 0.f, 0.f);
      Acc[j * NTHREADS + tid] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  const int kd = static_cast<int>((D + 15) / 16);  // 16-column chunks of the head (mma k steps)
  const int nv = static_cast<int>((Dv + 7) / 8);   // 8-column groups of the value head
  uint32_t qa[HD / 16][4];                          // Q fragments (16-bit path)
  int buf = 0;
  bool first = true;

  for (;;) {
    const bool has_next = cur.pos + cur.len < S_k;
    Tile nxt{};
    if (has_next) nxt = tile_at(cur.pos + cur.len, calib, it, S_k, S);
    if (STAGES == 2 && has_next) {
      issue(nxt, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (!kF32) {
      if (first) {  // Q fragments once: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (0-7, 8-15), (8-15, 8-15)
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          const int m = lane >> 3;
          ldmatrix_x4(qa[kk], Qs + (16 * warp + (m & 1) * 8 + (lane & 7)) * LD + 16 * kk + (m >> 1) * 8);
        }
      }
    }
    first = false;
    const T* Kt = Ks + buf * BC * LD;
    const T* Vt = Vs + buf * BC * LD;
    const unsigned char* Mt = Ms + buf * BC;
    const int nt = (cur.len + 7) / 8;  // 8-key groups holding keys of this tile

    // ---- scores S = Q K^T (unscaled), accumulator layout
    float Sc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) Sc[j][0] = Sc[j][1] = Sc[j][2] = Sc[j][3] = 0.f;
    if constexpr (!kF32) {
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        if (kk >= kd) break;
#pragma unroll
        for (int jj = 0; jj < NT / 2; ++jj) {
          if (2 * jj >= nt) break;
          // matrices (keys 16jj..+7, k 16kk..+7), (keys 16jj..+7, k +8), (keys 16jj+8.., k 16kk..), (keys 16jj+8.., k +8)
          const int m = lane >> 3;
          uint32_t bf[4];
          ldmatrix_x4(bf, Kt + (16 * jj + (m >> 1) * 8 + (lane & 7)) * LD + 16 * kk + (m & 1) * 8);
          mma16816<T>(Sc[2 * jj], qa[kk], bf[0], bf[1]);
          mma16816<T>(Sc[2 * jj + 1], qa[kk], bf[2], bf[3]);
        }
      }
    } else {
      const float* q0r = reinterpret_cast<const float*>(Qs) + rloc[0] * LD;
      const float* q1r = reinterpret_cast<const float*>(Qs) + rloc[1] * LD;
      const float* Kf = reinterpret_cast<const float*>(Kt);
      for (int d = 0; d < static_cast<int>(D); d += 4) {
        const float4 x0 = *reinterpret_cast<const float4*>(q0r + d);
        const float4 x1 = *reinterpret_cast<const float4*>(q1r + d);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          if (j >= nt) break;
          const float4 k0 = *reinterpret_cast<const float4*>(Kf + (8 * j + 2 * tq) * LD + d);
          const float4 k1 = *reinterpret_cast<const float4*>(Kf + (8 * j + 2 * tq + 1) * LD + d);
          Sc[j][0] = fmaf(x0.w, k0.w, fmaf(x0.z, k0.z, fmaf(x0.y, k0.y, fmaf(x0.x, k0.x, Sc[j][0]))));
          Sc[j][1] = fmaf(x0.w, k1.w, fmaf(x0.z, k1.z, fmaf(x0.y, k1.y, fmaf(x0.x, k1.x, Sc[j][1]))));
          Sc[j][2] = fmaf(x1.w, k0.w, fmaf(x1.z, k0.z, fmaf(x1.y, k0.y, fmaf(x1.x, k0.x, Sc[j][2]))));
          Sc[j][3] = fmaf(x1.w, k1.w, fmaf(x1.z, k1.z, fmaf(x1.y, k1.y, fmaf(x1.x, k1.x, Sc[j][3]))));
        }
      }
    }

    // ---- scale, mask, tile row max
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * j + 2 * tq + (e & 1);
        float s = Sc[j][e] * a.scale;
        if (c >= cur.len) {
          s = -INFINITY;  // not a key of this tile
        } else if (!Mt[c]) {
          const float sb = s + kLowest;  // the contract's additive mask
          // Calibration blocks exclude masked keys from their statistics, keeping NaN/+inf as NaN.
          s = calib ? ((sb == sb && sb != INFINITY) ? -INFINITY : nan_f()) : sb;
        }
        Sc[j][e] = s;
        mt[e >> 1] = fmaxf(mt[e >> 1], s);
      }
    }
    float alpha[2], m_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(m_s[i], quad_max(mt[i]));
      m_use[i] = m_new == -INFINITY ? 0.f : m_new;  // a segment of -inf only: exp(-inf - 0) = 0, not NaN
      alpha[i] = kF32 ? expf(m_s[i] - m_use[i]) : __expf(m_s[i] - m_use[i]);
      m_s[i] = m_new;
      l_s[i] *= alpha[i];
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      O[j][0] *= alpha[0];
      O[j][1] *= alpha[0];
      O[j][2] *= alpha[1];
      O[j][3] *= alpha[1];
    }

    // ---- P = exp(S - m) and P V
    if constexpr (!kF32) {
#pragma unroll
      for (int kc = 0; kc < BC / 16; ++kc) {
        if (2 * kc >= nt) break;
        uint32_t pa[4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float* s = Sc[2 * kc + half];
          s[0] = __expf(s[0] - m_use[0]);
          s[1] = __expf(s[1] - m_use[0]);
          s[2] = __expf(s[2] - m_use[1]);
          s[3] = __expf(s[3] - m_use[1]);
          pa[2 * half] = pack_round<T>(s[0], s[1]);      // row g:   a[0] (keys 0-7 of the chunk), a[2] (8-15)
          pa[2 * half + 1] = pack_round<T>(s[2], s[3]);  // row g+8: a[1], a[3]
          l_s[0] += s[0] + s[1];
          l_s[1] += s[2] + s[3];
        }
        const uint32_t a_frag[4] = {pa[0], pa[1], pa[2], pa[3]};
#pragma unroll
        for (int jp = 0; jp < NV / 2; ++jp) {
          if (2 * jp >= nv) break;
          // .trans matrices (keys 16kc..+7, cols 16jp..+7), (keys +8, cols 16jp..), (keys 16kc.., cols +8), (keys +8, cols +8)
          const int m = lane >> 3;
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, Vt + (16 * kc + (m & 1) * 8 + (lane & 7)) * LD + 16 * jp + (m >> 1) * 8);
          mma16816<T>(O[2 * jp], a_frag, bf[0], bf[1]);
          mma16816<T>(O[2 * jp + 1], a_frag, bf[2], bf[3]);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (j >= nt) break;
        const int c = 8 * j + 2 * tq;
        const float p00 = expf(Sc[j][0] - m_use[0]), p01 = expf(Sc[j][1] - m_use[0]);
        const float p10 = expf(Sc[j][2] - m_use[1]), p11 = expf(Sc[j][3] - m_use[1]);
        l_s[0] += p00 + p01;
        l_s[1] += p10 + p11;
        Ps[rloc[0] * L::LDP + c] = p00;
        Ps[rloc[0] * L::LDP + c + 1] = p01;
        Ps[rloc[1] * L::LDP + c] = p10;
        Ps[rloc[1] * L::LDP + c + 1] = p11;
      }
      __syncwarp();  // a warp's P rows are read by that warp only
      const float* Vf = reinterpret_cast<const float*>(Vt);
      for (int key = 0; key < cur.len; ++key) {
        const float p0 = Ps[rloc[0] * L::LDP + key], p1 = Ps[rloc[1] * L::LDP + key];
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          if (j >= nv) break;
          const float2 vv = *reinterpret_cast<const float2*>(Vf + key * LD + 8 * j + 2 * tq);
          O[j][0] = fmaf(p0, vv.x, O[j][0]);
          O[j][1] = fmaf(p0, vv.y, O[j][1]);
          O[j][2] = fmaf(p1, vv.x, O[j][2]);
          O[j][3] = fmaf(p1, vv.y, O[j][3]);
        }
      }
    }

    // ---- segment end (calibration blocks): merge into the full term, add a basket's own attention
    if (calib && cur.closes) {
      float fa[2], fb[2], inv[2];
      bool take[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float l_tot = quad_sum(l_s[i]);
        const float M = fmaxf(m_r[i], m_s[i]), Mu = M == -INFINITY ? 0.f : M;
        fa[i] = expf(m_r[i] - Mu);
        fb[i] = expf(m_s[i] - Mu);
        l_r[i] = l_r[i] * fa[i] + l_tot * fb[i];
        m_r[i] = M;
        take[i] = false;
        if (cur.basket) {
          // Mass 0 in float32 against the LSE so far stays 0 (the LSE only grows); otherwise count
          // it and remember the smallest counted max for the final check.
          // A basket without a finite valid score (all holes, or -inf) is empty whatever the LSE.
          const float chk = expf(m_s[i] - (m_r[i] + logf(l_r[i])));
          take[i] = m_s[i] != -INFINITY && !(chk == 0.f);
          if (take[i]) {
            ++n_ne[i];
            min_mb[i] = fminf(min_mb[i], m_s[i]);
          }
        }
        inv[i] = take[i] ? 1.f / l_tot : 0.f;
      }
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if (j >= nv) break;
        float4 o = Of[j * NTHREADS + tid];
        o.x = o.x * fa[0] + O[j][0] * fb[0];
        o.y = o.y * fa[0] + O[j][1] * fb[0];
        o.z = o.z * fa[1] + O[j][2] * fb[1];
        o.w = o.w * fa[1] + O[j][3] * fb[1];
        Of[j * NTHREADS + tid] = o;
        if (take[0] || take[1]) {
          float4 c = Acc[j * NTHREADS + tid];
          if (take[0]) {
            c.x += O[j][0] * inv[0];
            c.y += O[j][1] * inv[0];
          }
          if (take[1]) {
            c.z += O[j][2] * inv[1];
            c.w += O[j][3] * inv[1];
          }
          Acc[j * NTHREADS + tid] = c;
        }
      }
#pragma unroll
      for (int j = 0; j < NV; ++j) O[j][0] = O[j][1] = O[j][2] = O[j][3] = 0.f;
      m_s[0] = m_s[1] = -INFINITY;
      l_s[0] = l_s[1] = 0.f;
    }

    __syncthreads();  // every warp is done with this buffer before it is refilled
    if (!has_next) break;
    if (STAGES == 1) {
      issue(nxt, 0);
      cp_async_commit();
    } else {
      buf ^= 1;
    }
    cur = nxt;
  }

  // ---- the context rows
  T* og = static_cast<T*>(a.out);
  const T* Qrow[2] = {Qs + rloc[0] * LD, Qs + rloc[1] * LD};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t r = q0 + rloc[i];
    const bool live = r < a.S_q;
    float o_scale, c_scale = 0.f, w_first = 0.f, w_last = 0.f;
    bool calibrated = false, queue = false;
    if (!calib) {
      o_scale = 1.f / quad_sum(l_s[i]);  // 0 / 0 = NaN for a row of -inf scores, as ONNX Softmax
    } else {
      o_scale = 1.f / l_r[i];
      queue = !(m_r[i] > kLowest);  // no valid score above the lowest value: let the per-row kernel decide
      calibrated = r >= it.q_lo && r <= it.q_hi;
      if (calibrated) {
        const float lse = m_r[i] + logf(l_r[i]);
        if (n_ne[i] > 0 && expf(min_mb[i] - lse) == 0.f) queue = true;  // a counted basket lost its mass
        float z_first = 0.f, z_last = 0.f;
        // The isolated keys' probabilities (needed for `original` shares): one dot product each.
        for (int w = 0; w < 2; ++w) {
          const bool need = w == 0 ? (p.isolate_first && p.first_mode == ATTNCAL_MODE_ORIGINAL)
                                   : (p.isolate_last && p.last_mode == ATTNCAL_MODE_ORIGINAL);
          if (!need) continue;
          const T* kr = kg + (w == 0 ? it.start : it.end) * N * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot = fmaf(to_f(Qrow[i][d]), to_f(kr[d]), dot);
          const float z = expf(dot * a.scale - m_r[i]) / l_r[i];
          (w == 0 ? z_first : z_last) = z;
        }
        const double t = static_cast<double>(it.n + p.isolate_first + p.isolate_last);
        const AttncalRowScalars rs = attncal_row_scalars(&p, n_ne[i], t, z_first, z_last);
        o_scale = static_cast<float>(rs.keep) / l_r[i];
        c_scale = static_cast<float>(rs.coef / t);
        // first_out/last_out are the isolated keys' calibrated probabilities; the (1 - lambda) part
        // of them is already in the full term.
        w_first = p.isolate_first ? static_cast<float>(rs.first_out - rs.keep * z_first) : 0.f;
        w_last = p.isolate_last ? static_cast<float>(rs.last_out - rs.keep * z_last) : 0.f;
      }
    }
    if (live && queue && tq == 0) {
      const uint32_t slot = atomicAdd(a.queue_count, 1u);
      a.queue[slot] = static_cast<uint32_t>((b * N + h) * a.S_q + r);
    }
    if (!live) continue;
    T* orow = og + ((b * a.S_q + r) * N + h) * Dv;
    const T* vf = vg + (calibrated ? it.start : 0) * N * Dv;
    const T* vl = vg + (calibrated ? it.end : 0) * N * Dv;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if (j >= nv) break;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t col = 8 * j + 2 * tq + e;
        if (col >= Dv) continue;
        float val;
        if (!calib) {
          val = O[j][2 * i + e] * o_scale;
        } else {
          const float4 of4 = Of[j * NTHREADS + tid];
          const float ofv = i == 0 ? (e == 0 ? of4.x : of4.y) : (e == 0 ? of4.z : of4.w);
          val = ofv * o_scale;
          if (calibrated) {
            const float4 ac4 = Acc[j * NTHREADS + tid];
            const float acv = i == 0 ? (e == 0 ? ac4.x : ac4.y) : (e == 0 ? ac4.z : ac4.w);
            val += c_scale * acv;
            if (p.isolate_first) val += w_first * to_f(vf[col]);
            if (p.isolate_last) val += w_last * to_f(vl[col]);
          }
        }
        orow[col] = from_f<T>(val);
      }
    }
  }
}

// ------------------------------------------------------------------ the per-row kernel
// One block per query row (b, h, r): the contract written out in float32, three passes over the
// item's keys (max; sum and basket sums; weights times V), scores recomputed in each.  Rows come
// from the queue (rows the tiled kernel leaves to it) or, with queue == NULL, are every row.
// Shared memory: q (D floats), the context accumulator (D_v floats, one owner thread per column),
// the basket sums (n floats) and one chunk of weights.
template <typename T>
__global__ void __launch_bounds__(kRowThreads) rows_kernel(Args a, const uint32_t* __restrict__ queue,
                                                          const uint32_t* __restrict__ queue_count) {
  extern __shared__ __align__(16) float rsm[];
  __shared__ float s_red[kRowThreads / 32];
  __shared__ float s_w[kRowThreads];
  const int64_t S_k = a.S_k, N = a.N, D = a.D, Dv = a.D_v, S_q = a.S_q;
  const AttncalParams& p = a.p;
  const int64_t total = queue ? static_cast<int64_t>(*queue_count) : a.B * N * S_q;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = kRowThreads / 32;
  float* qs = rsm;
  float* oacc = rsm + D;
  float* E = oacc + Dv;

  auto block_sum = [&](float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) s_red[warp] = v;
    __syncthreads();
    float r = s_red[0];
    for (int w = 1; w < nw; ++w) r += s_red[w];
    return r;
  };
  auto block_max = [&](float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) s_red[warp] = v;
    __syncthreads();
    float r = s_red[0];
    for (int w = 1; w < nw; ++w) r = fmaxf(r, s_red[w]);
    return r;
  };

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t id = queue ? static_cast<int64_t>(queue[item]) : item;
    const int64_t r = id % S_q, bh = id / S_q, h = bh % N, b = bh / N;
    const T* kg = static_cast<const T*>(a.k) + (b * S_k * N + h) * D;
    const T* vg = static_cast<const T*>(a.v) + (b * S_k * N + h) * Dv;
    const int64_t* mg = a.mask + b * S_k;
    const T* qg = static_cast<const T*>(a.q) + ((b * S_q + r) * N + h) * D;
    __syncthreads();  // the previous row's readers of shared memory are done
    for (int64_t d = tid; d < D; d += kRowThreads) qs[d] = to_f(qg[d]);
    for (int64_t d = tid; d < Dv; d += kRowThreads) oacc[d] = 0.f;
    __syncthreads();
    auto score = [&](int64_t j) {  // the contract's score: scale*q.k + the additive mask
      const T* kr = kg + j * N * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot = fmaf(qs[d], to_f(kr[d]), dot);
      const float s = dot * a.scale;
      return mg[j] != 0 ? s : s + kLowest;
    };

    const ItemPlan it = plan_item(a, b);
    const bool cal = it.active && r >= it.q_lo && r <= it.q_hi;
    // Pass 1: the row max (NaN ignored, as the softmax's max; a NaN still reaches the sum).
    float m = -INFINITY;
    for (int64_t j = tid; j < S_k; j += kRowThreads) m = fmaxf(m, score(j));
    m = block_max(m);
    // Pass 2: the softmax sum; NaN when a score is NaN or +inf, or every score is -inf.
    float acc = 0.f;
    for (int64_t j = tid; j < S_k; j += kRowThreads) acc += expf(score(j) - m);
    const float L = block_sum(acc);
    const int64_t S = p.basket_size;
    float coef_t = 0.f, keep = 1.f, first_out = 0.f, last_out = 0.f;
    if (cal && L == L) {
      // Basket sums over valid keys, a warp per basket (fixed order: deterministic).
      int cnt = 0;
      for (int64_t k = warp; k < it.n; k += nw) {
        const int64_t lo = it.c0 + k * S, hi = imin(lo + S, it.c_end);
        float e = 0.f;
        for (int64_t j = lo + lane; j < hi; j += 32) e += mg[j] != 0 ? expf(score(j) - m) : 0.f;
        for (int o = 16; o > 0; o >>= 1) e += __shfl_xor_sync(0xffffffffu, e, o);
        if (lane == 0) {
          E[k] = e;
          cnt += (e / L) != 0.f;  // the basket's float32 mass
        }
      }
      const int nonempty = static_cast<int>(block_sum(static_cast<float>(cnt)));  // also publishes E
      const float z_first = expf(score(it.start) - m) / L, z_last = expf(score(it.end) - m) / L;
      const double t = static_cast<double>(it.n + p.isolate_first + p.isolate_last);
      const AttncalRowScalars rs = attncal_row_scalars(&p, nonempty, t, z_first, z_last);
      coef_t = static_cast<float>(rs.coef / t);
      keep = static_cast<float>(rs.keep);
      first_out = static_cast<float>(rs.first_out);
      last_out = static_cast<float>(rs.last_out);
    }
    T* orow = static_cast<T*>(a.out) + ((b * S_q + r) * N + h) * Dv;
    if (L != L) {  // no softmax for this row: NaN at every column (the Softmax-fused op's NaN row, times V)
      for (int64_t d = tid; d < Dv; d += kRowThreads) orow[d] = from_f<T>(nan_f());
      continue;
    }
    // Pass 3: weights of a chunk of keys, then each column's owner adds them times V (every key,
    // weight 0 included: 0 * NaN keeps a non-finite V visible, as the MatMul does).
    for (int64_t j0 = 0; j0 < S_k; j0 += kRowThreads) {
      const int64_t j = j0 + tid;
      float w = 0.f;
      if (j < S_k) {
        const float e = expf(score(j) - m), pj = e / L;
        if (!cal) {
          w = pj;
        } else if (mg[j] == 0) {
          w = 0.f;  // the calibrated row is 0 at masked keys
        } else if (p.isolate_first && j == it.start) {
          w = first_out;
        } else if (p.isolate_last && j == it.end) {
          w = last_out;
        } else {  // a content key (the span minus the isolated keys)
          const float Ek = E[(j - it.c0) / S];
          w = (Ek / L) != 0.f ? (e / Ek) * coef_t + keep * pj : keep * pj;
        }
      }
      __syncthreads();  // the previous chunk's weights are consumed
      s_w[tid] = w;
      __syncthreads();
      const int cn = static_cast<int>(imin(kRowThreads, S_k - j0));
      for (int64_t d = tid; d < Dv; d += kRowThreads) {
        float o = oacc[d];
        for (int jj = 0; jj < cn; ++jj) o = fmaf(s_w[jj], to_f(vg[(j0 + jj) * N * Dv + d]), o);
        oacc[d] = o;
      }
    }
    for (int64_t d = tid; d < Dv; d += kRowThreads) orow[d] = from_f<T>(oacc[d]);
  }
}

// ------------------------------------------------------------------ launchers
// Opt in to more than 48 KiB of dynamic shared memory where needed.
template <typename Kernel>
int prepare_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return ATTNCAL_OK;
  int dev = 0, optin = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaGetDevice", e);
  e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaDeviceGetAttribute", e);
  if (bytes > static_cast<size_t>(optin)) {
    return fail(ATTNCAL_ERR_UNSUPPORTED, "calibrated attention: the kernel's shared memory exceeds this device's");
  }
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaFuncSetAttribute", e);
  return ATTNCAL_OK;
}

template <typename T, int HD>
int launch_tiled(const Args& a, cudaStream_t stream) {
  constexpr bool kF32 = std::is_same<T, float>::value;
  constexpr int NW = kF32 ? 2 : 4, STAGES = kF32 ? 1 : 2;
  using L = Smem<T, HD, NW, STAGES>;
  auto kernel = attention_kernel<T, HD, NW, STAGES>;
  const size_t smem = a.geom != nullptr ? L::calib_bytes : L::base_bytes;
  const int rc = prepare_smem(kernel, smem);
  if (rc != ATTNCAL_OK) return rc;
  const dim3 grid(static_cast<unsigned>((a.S_q + L::BR - 1) / L::BR), static_cast<unsigned>(a.N),
                  static_cast<unsigned>(a.B));
  kernel<<<grid, NW * 32, smem, stream>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "calibrated attention kernel launch", e);
  return ATTNCAL_OK;
}

// queue == NULL: every row; else the queued rows (a grid-stride loop over the device-side count).
template <typename T>
int launch_rows(const Args& a, const uint32_t* queue, const uint32_t* queue_count, cudaStream_t stream) {
  const int64_t n = (a.geom != nullptr && a.p.strength != 0.f) ? (a.S_k + a.p.basket_size - 1) / a.p.basket_size : 0;
  const size_t smem = sizeof(float) * static_cast<size_t>(a.D + a.D_v + (n > 0 ? n : 1));
  const int rc = prepare_smem(rows_kernel<T>, smem);
  if (rc != ATTNCAL_OK) return rc;
  int dev = 0, sms = 1;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  int64_t blocks = static_cast<int64_t>(sms) * 8;
  if (queue == nullptr) blocks = imin(blocks * 64, a.B * a.N * a.S_q);
  rows_kernel<T><<<static_cast<unsigned>(blocks > 0 ? blocks : 1), kRowThreads, smem, stream>>>(a, queue, queue_count);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "calibrated attention per-row kernel launch", e);
  return ATTNCAL_OK;
}

template <typename T>
int run_typed(const Args& a, bool reference_only, cudaStream_t stream) {
  if (reference_only) return launch_rows<T>(a, nullptr, nullptr, stream);
  const int64_t hd = a.D > a.D_v ? a.D : a.D_v;
  if (hd > 128) return launch_rows<T>(a, nullptr, nullptr, stream);  // beyond the tiled kernel's head size
  const int rc = hd <= 64 ? launch_tiled<T, 64>(a, stream) : launch_tiled<T, 128>(a, stream);
  if (rc != ATTNCAL_OK || a.geom == nullptr) return rc;
  return launch_rows<T>(a, a.queue, a.queue_count, stream);  // the rows the tiled kernel queued, if any
}

size_t align16(size_t x) { return (x + 15) & ~static_cast<size_t>(15); }

int check(int dtype, const AttncalParams* params, int64_t B, int64_t S_q, int64_t S_k, int64_t N, int64_t D,
          int64_t D_v) {
  attncal_cuda_set_error("");
  if (params == nullptr) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "params is NULL");
  char msg[200];
  if (attncal_validate_params(params, msg, sizeof msg) != ATTNCAL_OK) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, msg);
  if (dtype != ATTNCAL_DTYPE_FLOAT32 && dtype != ATTNCAL_DTYPE_FLOAT16 && dtype != ATTNCAL_DTYPE_BFLOAT16)
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "dtype must be float32 (0), float16 (1) or bfloat16 (2)");
  if (B < 0 || S_q < 0 || S_k < 0 || D < 0 || D_v < 0) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "negative dimension");
  if (N < 1) return fail(ATTNCAL_ERR_INVALID_ARGUMENT, "the number of heads N must be >= 1");
  if (params->all_rows && S_q != S_k) {
    snprintf(msg, sizeof msg, "AllRowsCalibratedAttention needs S_q == S_k, got S_q=%lld, S_k=%lld", (long long)S_q,
             (long long)S_k);
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, msg);
  }
  if (!params->all_rows && S_q != S_k && S_q != 1) {
    snprintf(msg, sizeof msg, "PooledRowCalibratedAttention needs S_q == S_k or S_q == 1, got S_q=%lld, S_k=%lld",
             (long long)S_q, (long long)S_k);
    return fail(ATTNCAL_ERR_INVALID_ARGUMENT, msg);
  }
  if (B > 65535 || N > 65535 || S_q > 0x7fffffff || S_k > 0x7fffffff || B * N * S_q >= (int64_t(1) << 32))
    return fail(ATTNCAL_ERR_UNSUPPORTED, "calibrated attention: B and N must be <= 65535, S_q and S_k < 2^31, "
                                         "B*N*S_q < 2^32");
  return ATTNCAL_OK;
}

int run(int dtype, const void* q, const void* k, const void* v, const int64_t* mask, void* out, int64_t B,
        int64_t S_q, int64_t S_k, int64_t N, int64_t D, int64_t D_v, float scale, const AttncalParams* params,
        void* workspace, void* stream_ptr, bool reference_only) {
  int rc = check(dtype, params, B, S_q, S_k, N, D, D_v);
  if (rc != ATTNCAL_OK) return rc;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const size_t esize = dtype == ATTNCAL_DTYPE_FLOAT32 ? 4 : 2;
  if (B == 0 || S_q == 0 || D_v == 0) return ATTNCAL_OK;  // an empty context
  if (S_k == 0) {  // no keys: an empty softmax times an empty V is 0
    const cudaError_t e =
        cudaMemsetAsync(out, 0, static_cast<size_t>(B * S_q * N * D_v) * esize, stream);
    return e == cudaSuccess ? ATTNCAL_OK : fail(ATTNCAL_ERR_CUDA, "cudaMemsetAsync", e);
  }
  Args a{};
  a.q = q;
  a.k = k;
  a.v = v;
  a.mask = mask;
  a.out = out;
  a.B = B;
  a.S_q = S_q;
  a.S_k = S_k;
  a.N = N;
  a.D = D;
  a.D_v = D_v;
  // scale 0 means 1/sqrt(D); with D == 0 every dot product is 0 and so is every score.
  a.scale = D == 0 ? 0.f : (scale == 0.f ? 1.f / sqrtf(static_cast<float>(D)) : scale);
  a.p = *params;
  auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  // 16-byte cp.async needs 16-byte aligned rows; a zero head size (possibly null pointers) takes the
  // element-wise path, which reads nothing.
  a.vec16 = D > 0 && aligned(q) && aligned(k) && aligned(v) && (D * esize) % 16 == 0 && (D_v * esize) % 16 == 0;

  const bool calibration = params->strength != 0.f;
  void* ws = workspace;
  bool owned = false;
  if (calibration) {
    if (ws == nullptr) {
      const cudaError_t e = cudaMallocAsync(&ws, attncal_cuda_attention_workspace_bytes(B, S_q, N), stream);
      if (e != cudaSuccess) return fail(ATTNCAL_ERR_CUDA, "cudaMallocAsync", e);
      owned = true;
    }
    unsigned char* w = static_cast<unsigned char*>(ws);
    a.geom = reinterpret_cast<const int*>(w);
    a.queue_count = reinterpret_cast<uint32_t*>(w + align16(sizeof(int) * 2 * B));
    a.queue = reinterpret_cast<uint32_t*>(w + align16(sizeof(int) * 2 * B) + 16);
    span_kernel<<<static_cast<unsigned>(B), 256, 0, stream>>>(mask, S_k, reinterpret_cast<int*>(w), a.queue_count);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) rc = fail(ATTNCAL_ERR_CUDA, "span kernel launch", e);
  }
  if (rc == ATTNCAL_OK) {
    if (dtype == ATTNCAL_DTYPE_FLOAT32) {
      rc = run_typed<float>(a, reference_only, stream);
    } else if (dtype == ATTNCAL_DTYPE_FLOAT16) {
      rc = run_typed<__half>(a, reference_only, stream);
    } else {
      rc = run_typed<__nv_bfloat16>(a, reference_only, stream);
    }
  }
  if (owned) {
    const cudaError_t e = cudaFreeAsync(ws, stream);
    if (e != cudaSuccess && rc == ATTNCAL_OK) rc = fail(ATTNCAL_ERR_CUDA, "cudaFreeAsync", e);
  }
  return rc;
}

}  // namespace

extern "C" size_t attncal_cuda_attention_workspace_bytes(int64_t B, int64_t S_q, int64_t N) {
  const int64_t b = B > 0 ? B : 1, rows = (B > 0 ? B : 0) * (N > 0 ? N : 0) * (S_q > 0 ? S_q : 0);
  return align16(sizeof(int) * 2 * static_cast<size_t>(b)) + 16 + sizeof(uint32_t) * static_cast<size_t>(rows > 0 ? rows : 1);
}

extern "C" int attncal_cuda_calibrated_attention(int dtype, const void* q, const void* k, const void* v,
                                                 const int64_t* mask, void* out, int64_t B, int64_t S_q,
                                                 int64_t S_k, int64_t N, int64_t D, int64_t D_v, float scale,
                                                 const AttncalParams* params, void* workspace, void* stream) {
  return run(dtype, q, k, v, mask, out, B, S_q, S_k, N, D, D_v, scale, params, workspace, stream, false);
}

extern "C" int attncal_cuda_calibrated_attention_reference(int dtype, const void* q, const void* k, const void* v,
                                                           const int64_t* mask, void* out, int64_t B, int64_t S_q,
                                                           int64_t S_k, int64_t N, int64_t D, int64_t D_v,
                                                           float scale, const AttncalParams* params, void* stream) {
  return run(dtype, q, k, v, mask, out, B, S_q, S_k, N, D, D_v, scale, params, nullptr, stream, true);
}
