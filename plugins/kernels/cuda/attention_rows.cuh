// The per-row kernel of the calibrated attention ops: one block of kRowThreads threads per query row
// (b, h, r), the contract written out in float32, three passes over the item's keys (max; sum and
// basket sums; weights times V), scores recomputed in each.  It computes the rows the tiled kernel
// queues (a row it cannot decide exactly in float32), the calibrated rows when no tiled configuration
// of the calibration blocks fits the device, every row for a head beyond the tiled kernel's 128
// columns, and every row for attncal_cuda_calibrated_attention_reference.  Correct, and slow:
// O(S_q*S_k*D) reads of K and V per head.
//
// Its shared memory (cuda/launch_config.h: choose_rows) holds the query row, the context accumulator
// of a chunk of value columns (one owner thread per column) and the row's basket sums, whatever of
// these fits: the query is otherwise read from global memory, the baskets that meet a chunk of keys
// are recomputed for that chunk, and the value columns are done a chunk at a time (the weights
// recomputed per chunk).  Every form computes the same sums in the same order, so the result does not
// depend on the device, and no head size or basket count is refused.
#ifndef ATTNCAL_CUDA_ATTENTION_ROWS_CUH_
#define ATTNCAL_CUDA_ATTENTION_ROWS_CUH_

#include <cstdint>

#include "common/attncal_params.h"
#include "common/row_scalars.h"
#include "cuda/attention_common.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/launch_config.h"

namespace attncal {
namespace {

// Which rows a launch computes: the queue (its count read on the device), or with queue == NULL every
// row, or only the calibrated ones.
struct RowsLaunch {
  RowsConfig cfg;
  const uint32_t* queue;
  const uint32_t* queue_count;
  int calibrated_only;
};

// At least one block per SM (the second bound): ptxas then keeps the row's state in registers, where
// left to its own occupancy heuristic it spilled on sm_90.
template <typename T>
__global__ void __launch_bounds__(kRowThreads, 1) rows_kernel(Args a, RowsLaunch l) {
  ATTNCAL_DYNAMIC_SHARED(float, rsm);
  __shared__ float s_red[kRowThreads / 32];
  __shared__ float s_w[kRowThreads];
  const int64_t S_k = a.S_k, N = a.N, N_kv = a.N_kv, D = a.D, Dv = a.D_v, S_q = a.S_q;
  const AttncalParams& p = a.p;
  const int64_t total = l.queue ? static_cast<int64_t>(*l.queue_count) : a.B * N * S_q;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = kRowThreads / 32;
  const bool q_kept = l.cfg.q_floats != 0, baskets_kept = l.cfg.baskets_kept;
  const int64_t chunk_cols = l.cfg.acc_floats;
  float* qs = rsm;                            // the query row, when kept
  float* oacc = rsm + l.cfg.q_floats;         // the context of one chunk of value columns
  float* E = oacc + l.cfg.acc_floats;         // the basket sums, or those of one chunk of keys
  auto block_sum = [&](float v) { return block_reduce(v, SumOp(), s_red); };

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t id = l.queue ? static_cast<int64_t>(l.queue[item]) : item;
    const int64_t r = id % S_q, bh = id / S_q, h = bh % N, b = bh / N;
    const ItemPlan it = item_plan(a, b);
    const int64_t* mg = a.mask + b * S_k;
    const bool cal = row_calibrated(it, p, mg, r);
    if (l.calibrated_only && !cal) continue;  // uniform across the block
    // The row's own key (isolate_self): left out of its basket where it is a content key, written own_out.
    const int own = cal ? own_key(it.s, p, r) : ATTNCAL_OWN_NONE;
    const int64_t own_skip = own == ATTNCAL_OWN_CONTENT ? r : -1;
    const T* kg = static_cast<const T*>(a.k) + (b * S_k * N_kv + kv_head(a, h)) * D;
    const T* vg = static_cast<const T*>(a.v) + (b * S_k * N_kv + kv_head(a, h)) * Dv;
    const T* qg = static_cast<const T*>(a.q) + ((b * S_q + r) * N + h) * D;
    const float* rel = relative_row(a, h, r);
    __syncthreads();  // the previous row's readers of shared memory are done
    if (q_kept)
      for (int64_t d = tid; d < D; d += kRowThreads) qs[d] = to_f(qg[d]);
    __syncthreads();
    auto score = [&](int64_t j) {  // the contract's score: scale*q.k + relative bias + the mask (padding or window)
      const T* kr = kg + j * N_kv * D;
      float dot = 0.f;
      if (q_kept) {
        for (int64_t d = 0; d < D; ++d) dot = fmaf(qs[d], to_f(kr[d]), dot);
      } else {
        for (int64_t d = 0; d < D; ++d) dot = fmaf(to_f(qg[d]), to_f(kr[d]), dot);
      }
      const float s = add_relative(dot * a.scale, rel, j);
      return mg[j] != 0 && in_window(a, r, j) ? s : s + kLowest;
    };

    // Pass 1: the row max (NaN ignored, as the softmax's max; a NaN still reaches the sum).
    float m = -INFINITY;
    for (int64_t j = tid; j < S_k; j += kRowThreads) m = fmaxf(m, score(j));
    m = block_reduce(m, MaxOp(), s_red);
    // Pass 2: the softmax sum; NaN when a score is NaN or +inf, or every score is -inf.
    float acc = 0.f;
    for (int64_t j = tid; j < S_k; j += kRowThreads) acc += expf(score(j) - m);
    const float L = block_sum(acc);
    const int64_t S = p.basket_size, c0 = it.rp.c0, c_end = it.rp.c0 + it.rp.C;
    // Basket k's sum of exp over its valid keys, by the calling warp (lanes stride over the keys, then
    // a butterfly: a fixed order, the same in every pass that computes it).
    auto basket_sum = [&](int64_t k) {
      const int64_t lo = c0 + k * S, hi = imin(lo + S, c_end);
      float e = 0.f;
      for (int64_t j = lo + lane; j < hi; j += 32) e += mg[j] != 0 && j != own_skip ? expf(score(j) - m) : 0.f;
      for (int o = 16; o > 0; o >>= 1) e += __shfl_xor_sync(0xffffffffu, e, o);
      return e;
    };
    float coef_t = 0.f, keep = 1.f, first_out = 0.f, last_out = 0.f, own_out = 0.f;
    if (cal && L == L) {
      // Basket sums over valid keys, a warp per basket (fixed order: deterministic).
      int cnt = 0;
      for (int64_t k = warp; k < it.rp.n; k += nw) {
        const float e = basket_sum(k);
        if (lane == 0) {
          if (baskets_kept) E[k] = e;
          cnt += (e / L) != 0.f;  // the basket's float32 mass
        }
      }
      const int nonempty = static_cast<int>(block_sum(static_cast<float>(cnt)));  // also publishes E
      const float z_first = expf(score(it.s.start) - m) / L, z_last = expf(score(it.s.end) - m) / L;
      const float z_own = own != ATTNCAL_OWN_NONE ? expf(score(r) - m) / L : 0.f;
      const AttncalRowScalars rs = attncal_row_scalars(&p, nonempty, it.rp.t, z_first, z_last, own, z_own);
      coef_t = static_cast<float>(rs.coef / rs.t);
      keep = static_cast<float>(rs.keep);
      first_out = static_cast<float>(rs.first_out);
      last_out = static_cast<float>(rs.last_out);
      own_out = static_cast<float>(rs.own_out);
    }
    T* orow = static_cast<T*>(a.out) + ((b * S_q + r) * N + h) * Dv;
    if (L != L) {  // no softmax for this row: NaN at every column (the Softmax-fused op's NaN row, times V)
      for (int64_t d = tid; d < Dv; d += kRowThreads) orow[d] = from_f<T>(nan_f());
      continue;
    }
    // Pass 3, per chunk of value columns: weights of a chunk of keys, then each column's owner adds them
    // times V (every key, weight 0 included: 0 * NaN keeps a non-finite V visible, as the MatMul does).
    for (int64_t d0 = 0; d0 < Dv; d0 += chunk_cols) {
      const int64_t dn = imin(chunk_cols, Dv - d0);
      for (int64_t d = tid; d < dn; d += kRowThreads) oacc[d] = 0.f;  // each column is its owner's
      for (int64_t j0 = 0; j0 < S_k; j0 += kRowThreads) {
        int64_t kb0 = 0;  // the first basket of E when it holds this chunk's baskets only
        if (cal && !baskets_kept) {
          const int64_t lo = j0 > c0 ? j0 : c0, hi = imin(j0 + kRowThreads, c_end);
          if (lo < hi) {
            kb0 = (lo - c0) / S;
            for (int64_t k = kb0 + warp; k <= (hi - 1 - c0) / S; k += nw) {
              const float e = basket_sum(k);
              if (lane == 0) E[k - kb0] = e;
            }
          }
          __syncthreads();  // E is complete; its readers of the previous chunk were done before s_w
        }
        const int64_t j = j0 + tid;
        float w = 0.f;
        if (j < S_k) {
          const float e = expf(score(j) - m), pj = e / L;
          if (!cal) {
            w = pj;
          } else if (mg[j] == 0) {
            w = 0.f;  // the calibrated row is 0 at masked keys
          } else if (own != ATTNCAL_OWN_NONE && j == r) {
            w = own_out;  // the own key, in the place of the first or last key where it is one
          } else if (p.isolate_first && j == it.s.start) {
            w = first_out;
          } else if (p.isolate_last && j == it.s.end) {
            w = last_out;
          } else {  // a content key (the span minus the isolated keys)
            const float Ek = E[(j - c0) / S - kb0];
            w = (Ek / L) != 0.f ? (e / Ek) * coef_t + keep * pj : keep * pj;
          }
        }
        __syncthreads();  // the previous chunk's weights are consumed
        s_w[tid] = w;
        __syncthreads();
        const int cn = static_cast<int>(imin(kRowThreads, S_k - j0));
        for (int64_t d = tid; d < dn; d += kRowThreads) {
          float o = oacc[d];
          for (int jj = 0; jj < cn; ++jj) o = fmaf(s_w[jj], to_f(vg[(j0 + jj) * N_kv * Dv + d0 + d]), o);
          oacc[d] = o;
        }
      }
      for (int64_t d = tid; d < dn; d += kRowThreads) orow[d0 + d] = from_f<T>(oacc[d]);
    }
  }
}

}  // namespace
}  // namespace attncal

#endif  // ATTNCAL_CUDA_ATTENTION_ROWS_CUH_
