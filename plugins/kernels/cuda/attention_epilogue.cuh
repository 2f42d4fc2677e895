// The epilogue of the tiled attention kernel (cuda/attention_tiled.cuh has the whole design): the
// block's context rows from the per-row state the main loop leaves.  A plain block's row is O / l.  A
// calibration block's calibrated row, with LSE = m + log l:
//   out = (1-lambda)*O/l + (coef/t)*acc + w_first*v[start] + w_last*v[end]
// coef, w_first, w_last from common/row_scalars.h (the scalars every implementation shares) with the
// non-empty basket count and z_first/z_last = exp(s - LSE) at the first/last valid key; the isolated
// keys' scores are recomputed by one dot product per row, with the relative position bias and the
// window's bias where the row does not see the key (needed only for `original` shares), their
// values read from global memory.  A calibration block's rows that the tiled pass cannot decide
// exactly in float32 are queued for the per-row kernel (cuda/attention_rows.cuh), which overwrites
// them.  A block of the other launch skips the rows the calibration launch writes (skip).
#ifndef ATTNCAL_CUDA_ATTENTION_EPILOGUE_CUH_
#define ATTNCAL_CUDA_ATTENTION_EPILOGUE_CUH_

#include <cstdint>

#include "common/attncal_params.h"
#include "common/row_scalars.h"
#include "cuda/attention_common.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/mma.cuh"

namespace attncal {
namespace {

// skip: the rows [lo, hi) another launch writes (empty for a calibration block).
template <typename T, int HD, int NW, int STAGES>
__device__ __forceinline__ void write_context(const TiledBlock<T>& blk, const Args& a, const RowState<HD>& st,
                                              const RowRange& skip) {
  using R = TileRegions<T, HD, NW, STAGES>;
  constexpr int LD = R::LD, NV = HD / 8, NTHREADS = R::NTHREADS;
  const int64_t N = a.N, N_kv = a.N_kv, D = a.D, Dv = a.D_v;
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int tid = blk.tid, tq = blk.tq;
  const float4* Of = R::Of();
  const float4* Acc = R::Acc();
  const int nv = static_cast<int>((Dv + 7) / 8);
  const AttncalParams& p = a.p;
  const ItemPlan& it = blk.it;
  const bool calib = blk.calib;
  T* og = static_cast<T*>(a.out);
  const T* Qrow[2] = {R::Qs() + blk.rloc[0] * LD, R::Qs() + blk.rloc[1] * LD};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t r = blk.q0 + blk.rloc[i];
    const bool live = r < a.S_q && !(r >= skip.lo && r < skip.hi);
    float o_scale, c_scale = 0.f, w_first = 0.f, w_last = 0.f;
    bool calibrated = false, queue = false;
    if (!calib) {
      o_scale = 1.f / quad_sum(st.l_s[i]);  // 0 / 0 = NaN for a row of -inf scores, as ONNX Softmax
    } else {
      o_scale = 1.f / st.l_r[i];
      queue = !(st.m_r[i] > kLowest);  // no valid score above the lowest value: let the per-row kernel decide
      calibrated = r < a.S_q && row_calibrated(it, p, blk.mg, r);
      // A row whose own key is isolated (isolate_self: landmark rows, a few per item) needs its own key out of
      // its basket, which the block's shared basket terms do not give: the per-row kernel computes it.
      if (calibrated && own_key(it.s, p, r) != ATTNCAL_OWN_NONE) queue = true;
      if (calibrated) {
        const float lse = st.m_r[i] + logf(st.l_r[i]);
        if (st.n_ne[i] > 0 && expf(st.min_mb[i] - lse) == 0.f) queue = true;  // a counted basket lost its mass
        float z_first = 0.f, z_last = 0.f;
        // The isolated keys' probabilities (needed for `original` shares): one dot product each.
        for (int w = 0; w < 2; ++w) {
          const bool need = w == 0 ? (p.isolate_first && p.first_mode == ATTNCAL_MODE_ORIGINAL)
                                   : (p.isolate_last && p.last_mode == ATTNCAL_MODE_ORIGINAL);
          if (!need) continue;
          const int64_t key = w == 0 ? it.s.start : it.s.end;
          const T* kr = blk.kg + key * N_kv * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot = fmaf(to_f(Qrow[i][d]), to_f(kr[d]), dot);
          const float sc = add_relative(dot * a.scale, blk.rel[i], key);
          const float z = expf((in_window(a, r, key) ? sc : sc + kLowest) - st.m_r[i]) / st.l_r[i];
          (w == 0 ? z_first : z_last) = z;
        }
        const double t = it.rp.t;
        const AttncalRowScalars rs = attncal_row_scalars(&p, st.n_ne[i], t, z_first, z_last, ATTNCAL_OWN_NONE, 0.0);
        o_scale = static_cast<float>(rs.keep) / st.l_r[i];
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
    const T* vf = blk.vg + (calibrated ? it.s.start : 0) * N_kv * Dv;
    const T* vl = blk.vg + (calibrated ? it.s.end : 0) * N_kv * Dv;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if (j >= nv) break;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t col = 8 * j + 2 * tq + e;
        if (col >= Dv) continue;
        float val;
        if (!calib) {
          val = st.O[j][2 * i + e] * o_scale;
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

}  // namespace
}  // namespace attncal

#endif  // ATTNCAL_CUDA_ATTENTION_EPILOGUE_CUH_
