// The segment merge of the tiled attention kernel's calibration blocks (cuda/attention_tiled.cuh has
// the whole design).  A calibration block cuts the keys into segments (before the content, each
// content basket, after the content), and each segment keeps its own flash state (m_s, l_s, O_s)
// over its valid keys.  When a segment closes:
//   full term:    (m_r, l_r, O) <- online-softmax merge of (m_r, l_r, O) and (m_s, l_s, O_s)
//   basket term:  a basket adds O_s / l_s = Attn(q; basket) to acc and counts as non-empty, unless
//                 its probability mass is already 0 in float32 (exp(m_s - LSE so far) underflows;
//                 the LSE only grows, so that is final)
// O and acc live in shared memory, one private slot per thread (touched once per segment); O_s is the
// mma accumulator, reset here for the next segment.
#ifndef ATTNCAL_CUDA_ATTENTION_MERGE_CUH_
#define ATTNCAL_CUDA_ATTENTION_MERGE_CUH_

#include <cstdint>

#include "cuda/attention_common.cuh"
#include "cuda/mma.cuh"

namespace attncal {
namespace {

// nv: the 8-column groups of the value head.
template <typename T, int HD, int NW, int STAGES>
__device__ __forceinline__ void close_segment(const TiledBlock<T>& blk, const Tile& cur, int nv, RowState<HD>& st) {
  using R = TileRegions<T, HD, NW, STAGES>;
  constexpr int NV = HD / 8, NTHREADS = R::NTHREADS;
  const int tid = blk.tid;
  float4* Of = R::Of();
  float4* Acc = R::Acc();
  float fa[2], fb[2], inv[2];
  bool take[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float l_tot = quad_sum(st.l_s[i]);
    const float M = fmaxf(st.m_r[i], st.m_s[i]), Mu = M == -INFINITY ? 0.f : M;
    fa[i] = expf(st.m_r[i] - Mu);
    fb[i] = expf(st.m_s[i] - Mu);
    st.l_r[i] = st.l_r[i] * fa[i] + l_tot * fb[i];
    st.m_r[i] = M;
    take[i] = false;
    if (cur.basket) {
      // Mass 0 in float32 against the LSE so far stays 0 (the LSE only grows); otherwise count
      // it and remember the smallest counted max for the final check.
      // A basket without a finite valid score (all holes, or -inf) is empty whatever the LSE.
      const float chk = expf(st.m_s[i] - (st.m_r[i] + logf(st.l_r[i])));
      take[i] = st.m_s[i] != -INFINITY && !(chk == 0.f);
      if (take[i]) {
        ++st.n_ne[i];
        st.min_mb[i] = fminf(st.min_mb[i], st.m_s[i]);
      }
    }
    inv[i] = take[i] ? 1.f / l_tot : 0.f;
  }
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    if (j >= nv) break;
    float4 o = Of[j * NTHREADS + tid];
    o.x = o.x * fa[0] + st.O[j][0] * fb[0];
    o.y = o.y * fa[0] + st.O[j][1] * fb[0];
    o.z = o.z * fa[1] + st.O[j][2] * fb[1];
    o.w = o.w * fa[1] + st.O[j][3] * fb[1];
    Of[j * NTHREADS + tid] = o;
    if (take[0] || take[1]) {
      float4 c = Acc[j * NTHREADS + tid];
      if (take[0]) {
        c.x += st.O[j][0] * inv[0];
        c.y += st.O[j][1] * inv[0];
      }
      if (take[1]) {
        c.z += st.O[j][2] * inv[1];
        c.w += st.O[j][3] * inv[1];
      }
      Acc[j * NTHREADS + tid] = c;
    }
  }
#pragma unroll
  for (int j = 0; j < NV; ++j) st.O[j][0] = st.O[j][1] = st.O[j][2] = st.O[j][3] = 0.f;
  st.m_s[0] = st.m_s[1] = -INFINITY;
  st.l_s[0] = st.l_s[1] = 0.f;
}

}  // namespace
}  // namespace attncal

#endif  // ATTNCAL_CUDA_ATTENTION_MERGE_CUH_
