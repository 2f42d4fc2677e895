// The main loop of the tiled attention kernel (cuda/attention_tiled.cuh): K and V stream through
// shared memory tile by tile, and each tile's scores, row maxima, exp and P*V update the block's
// per-row state in registers.  A calibration block's tiles never cross a segment boundary, and at
// each segment's end the segment is merged (cuda/attention_merge.cuh).  Warps (NW) and K/V stages
// (STAGES) are template arguments, the key tile is kKeyTile (cuda/launch_config.h).
#ifndef ATTNCAL_CUDA_ATTENTION_MAINLOOP_CUH_
#define ATTNCAL_CUDA_ATTENTION_MAINLOOP_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/span_geometry.h"
#include "cuda/attention_common.cuh"
#include "cuda/attention_merge.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/launch_config.h"
#include "cuda/mma.cuh"

namespace attncal {
namespace {

// Loads rows [0, rows_valid) of one head of a [*, row_stride] tensor into `dst` (nrows rows of LD
// elements), columns [0, cols) of HD; the rest of the HD x nrows block is zero.  16-byte cp.async
// chunks when allowed, else element by element (then it is complete at the next __syncthreads).
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

// Runs the block over every key: loads the Q block and its fragments, sets up st, then per tile the scores
// S = scale * Q K^T with the relative position bias and the mask, the online softmax of the open segment
// and its P*V, and at a calibration block's segment ends the merge.  Returns with st holding the block's rows.
template <typename T, int HD, int NW, int STAGES>
__device__ __forceinline__ void run_tiles(const TiledBlock<T>& blk, const Args& a, RowState<HD>& st) {
  using R = TileRegions<T, HD, NW, STAGES>;
  constexpr int LD = R::LD, BC = kKeyTile, BR = R::BR, NTHREADS = R::NTHREADS, NT = BC / 8, NV = HD / 8;
  constexpr bool kF32 = std::is_same<T, float>::value;
  const int64_t S_k = a.S_k, N = a.N, N_kv = a.N_kv, D = a.D, Dv = a.D_v, S = a.p.basket_size;
  const int tid = blk.tid, lane = blk.lane, warp = blk.warp, tq = blk.tq;
  const bool vec16 = a.vec16 != 0, calib = blk.calib, windowed = a.p.window_left >= 0 || a.p.window_right >= 0;
  T* Qs = R::Qs();
  T* Ks = R::Ks();
  T* Vs = R::Vs();
  unsigned char* Ms = R::Ms();

  auto issue = [&](const Tile& t, int buf) {
    load_rows<T, HD, LD, NTHREADS>(Ks + buf * BC * LD, blk.kg + t.pos * N_kv * D, N_kv * D, BC, t.len, D, vec16);
    load_rows<T, HD, LD, NTHREADS>(Vs + buf * BC * LD, blk.vg + t.pos * N_kv * Dv, N_kv * Dv, BC, t.len, Dv, vec16);
    for (int c = tid; c < BC; c += NTHREADS) Ms[buf * BC + c] = (c < t.len && blk.mg[t.pos + c] != 0) ? 1 : 0;
  };

  // Q block (rows past S_q are zero; they are computed and dropped).
  load_rows<T, HD, LD, NTHREADS>(Qs, blk.qg, N * D, BR, static_cast<int>(imin(BR, a.S_q - blk.q0)), D, vec16);
  Tile cur = tile_at(0, calib, blk.it, S_k, S);
  issue(cur, 0);
  cp_async_commit();

  for (int i = 0; i < 2; ++i) {
    st.m_s[i] = -INFINITY;
    st.l_s[i] = 0.f;
    st.m_r[i] = -INFINITY;
    st.l_r[i] = 0.f;
    st.min_mb[i] = INFINITY;
    st.n_ne[i] = 0;
  }
#pragma unroll
  for (int j = 0; j < NV; ++j) st.O[j][0] = st.O[j][1] = st.O[j][2] = st.O[j][3] = 0.f;
  if (calib) {  // the full term's O and the basket term, in shared memory
    float4* Of = R::Of();
    float4* Acc = R::Acc();
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
    if (has_next) nxt = tile_at(cur.pos + cur.len, calib, blk.it, S_k, S);
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
      const float* q0r = reinterpret_cast<const float*>(Qs) + blk.rloc[0] * LD;
      const float* q1r = reinterpret_cast<const float*>(Qs) + blk.rloc[1] * LD;
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

    // ---- scale, relative position bias, mask, tile row max.  A key outside the row's window is masked
    // as a padding key is (in_window); every tile is computed: none is skipped for the window.
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * j + 2 * tq + (e & 1);
        float s = Sc[j][e] * a.scale;
        if (c >= cur.len) {
          s = -INFINITY;  // not a key of this tile
        } else {
          s = add_relative(s, blk.rel[e >> 1], cur.pos + c);
          if (!Mt[c] || (windowed && !in_window(a, blk.q0 + blk.rloc[e >> 1], cur.pos + c))) {
            const float sb = s + kLowest;  // the contract's additive mask
            // Calibration blocks exclude masked keys (padding or window) from their statistics, keeping
            // NaN/+inf as NaN: their float32 probability is 0 in a row with a valid score above the lowest
            // value, and a row without one is queued for the per-row kernel (the epilogue's check).
            s = calib ? ((sb == sb && sb != INFINITY) ? -INFINITY : nan_f()) : sb;
          }
        }
        Sc[j][e] = s;
        mt[e >> 1] = fmaxf(mt[e >> 1], s);
      }
    }
    float alpha[2], m_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(st.m_s[i], quad_max(mt[i]));
      m_use[i] = m_new == -INFINITY ? 0.f : m_new;  // a segment of -inf only: exp(-inf - 0) = 0, not NaN
      alpha[i] = kF32 ? expf(st.m_s[i] - m_use[i]) : __expf(st.m_s[i] - m_use[i]);
      st.m_s[i] = m_new;
      st.l_s[i] *= alpha[i];
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      st.O[j][0] *= alpha[0];
      st.O[j][1] *= alpha[0];
      st.O[j][2] *= alpha[1];
      st.O[j][3] *= alpha[1];
    }

    // ---- P = exp(S - m) and P V
    if constexpr (!kF32) {
#pragma unroll
      for (int kc = 0; kc < NT / 2; ++kc) {
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
          st.l_s[0] += s[0] + s[1];
          st.l_s[1] += s[2] + s[3];
        }
        const uint32_t a_frag[4] = {pa[0], pa[1], pa[2], pa[3]};
#pragma unroll
        for (int jp = 0; jp < NV / 2; ++jp) {
          if (2 * jp >= nv) break;
          // .trans matrices (keys 16kc..+7, cols 16jp..+7), (keys +8, cols 16jp..), (keys 16kc.., cols +8), (keys +8, cols +8)
          const int m = lane >> 3;
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, Vt + (16 * kc + (m & 1) * 8 + (lane & 7)) * LD + 16 * jp + (m >> 1) * 8);
          mma16816<T>(st.O[2 * jp], a_frag, bf[0], bf[1]);
          mma16816<T>(st.O[2 * jp + 1], a_frag, bf[2], bf[3]);
        }
      }
    } else {
      float* Ps = R::Ps();
      constexpr int ldp = R::L.ldp;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (j >= nt) break;
        const int c = 8 * j + 2 * tq;
        const float p00 = expf(Sc[j][0] - m_use[0]), p01 = expf(Sc[j][1] - m_use[0]);
        const float p10 = expf(Sc[j][2] - m_use[1]), p11 = expf(Sc[j][3] - m_use[1]);
        st.l_s[0] += p00 + p01;
        st.l_s[1] += p10 + p11;
        Ps[blk.rloc[0] * ldp + c] = p00;
        Ps[blk.rloc[0] * ldp + c + 1] = p01;
        Ps[blk.rloc[1] * ldp + c] = p10;
        Ps[blk.rloc[1] * ldp + c + 1] = p11;
      }
      __syncwarp();  // a warp's P rows are read by that warp only
      const float* Vf = reinterpret_cast<const float*>(Vt);
      for (int key = 0; key < cur.len; ++key) {
        const float p0 = Ps[blk.rloc[0] * ldp + key], p1 = Ps[blk.rloc[1] * ldp + key];
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          if (j >= nv) break;
          const float2 vv = *reinterpret_cast<const float2*>(Vf + key * LD + 8 * j + 2 * tq);
          st.O[j][0] = fmaf(p0, vv.x, st.O[j][0]);
          st.O[j][1] = fmaf(p0, vv.y, st.O[j][1]);
          st.O[j][2] = fmaf(p1, vv.x, st.O[j][2]);
          st.O[j][3] = fmaf(p1, vv.y, st.O[j][3]);
        }
      }
    }

    // ---- segment end (calibration blocks): merge into the full term, add a basket's own attention
    if (calib && cur.closes) close_segment<T, HD, NW, STAGES>(blk, cur, nv, st);

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
}

}  // namespace
}  // namespace attncal

#endif  // ATTNCAL_CUDA_ATTENTION_MAINLOOP_CUH_
