// What the calibrated attention kernels share (the tiled kernel, cuda/attention_tiled.cuh, and the
// per-row kernel, cuda/attention_rows.cuh): the launch arguments, an item's plan read from the span
// workspace, and which query rows the calibration launch of the tiled kernel computes; and what the
// tiled kernel's pieces (main loop, segment merge, epilogue) share: a thread's row state, a block's
// view of its shared memory, and the tiles.
//
// Layout per thread (mma.m16n8k16's accumulator, which the float32 path reuses so that all row
// bookkeeping is one piece of code): each warp owns 16 rows, each thread two rows (g and g+8 of its
// warp, g = lane/4) and, per 8-column group, two columns (2*(lane%4) and +1).
#ifndef ATTNCAL_CUDA_ATTENTION_COMMON_CUH_
#define ATTNCAL_CUDA_ATTENTION_COMMON_CUH_

#include <cstdint>

#include "common/attncal_params.h"
#include "common/span_geometry.h"
#include "cuda/cuda_common.cuh"
#include "cuda/launch_config.h"

namespace attncal {
namespace {

constexpr float kLowest = -3.40282347e38f;  // float32's lowest finite value: the contract's mask bias

struct Args {
  const void* q;
  const void* k;
  const void* v;
  const int64_t* mask;
  void* out;
  const int* spans;       // the span records (common/span_geometry.h); NULL when strength == 0
  uint32_t* queue_count;  // rows queued for the per-row kernel
  uint32_t* queue;        // (b*N + h)*S_q + row
  const float* rel;       // the relative position bias per head and key-minus-query offset, [N, 2*S_k-1]
                          // (the launcher's, from the model's table; S_q == S_k), or NULL without one
  int64_t B, S_q, S_k, N, D, D_v;
  int64_t N_kv;  // key/value heads, resolved (divides N): K is [B,S_k,N_kv*D], V [B,S_k,N_kv*D_v]
  float scale;  // resolved (never 0 unless D == 0)
  int vec16;    // 16-byte cp.async loads allowed (aligned pointers, D and D_v rows of 16-byte multiples)
  AttncalParams p;
};

// The key/value head that query head h reads (AttentionShape::kv_head, which is host-only).
__device__ __forceinline__ int64_t kv_head(const Args& a, int64_t h) { return h / (a.N / a.N_kv); }

// Whether query row q sees key k: q - window_left <= k <= q + window_right, a bound of -1 absent
// (AttentionShape's window; a window needs S_q == S_k).  A key it hides gets the contract's additive
// mask bias, kLowest, as a padding key does (once: a padding key already holds it).
__device__ __forceinline__ bool in_window(const Args& a, int64_t q, int64_t k) {
  return (a.p.window_left < 0 || k >= q - a.p.window_left) && (a.p.window_right < 0 || k <= q + a.p.window_right);
}

// Head h's relative position bias for query row q (q < S_q == S_k), indexed by key: entry k is the bias at
// (q, k), rel[h*(2*S_k-1) + k - q + S_k - 1].  NULL without a bias.
__device__ __forceinline__ const float* relative_row(const Args& a, int64_t h, int64_t q) {
  return a.rel == nullptr ? nullptr : a.rel + h * (2 * a.S_k - 1) + (a.S_k - 1) - q;
}

// Score s (scale*q.k, rounded) plus the relative position bias at key k of row `rel_row` (relative_row),
// before the mask bias, as the contract orders them.  __fadd_rn is never contracted with the score's
// product into an FMA, so the sum is rounded as the CPU kernel's: (scale*q.k) + bias, each step in float32.
__device__ __forceinline__ float add_relative(float s, const float* rel_row, int64_t k) {
  return rel_row == nullptr ? s : __fadd_rn(s, __ldg(rel_row + k));
}

// Item b's plan (common/span_geometry.h): which query rows are calibrated, its span and baskets.
__device__ __forceinline__ ItemPlan item_plan(const Args& a, int64_t b) {
  if (a.spans == nullptr) return ItemPlan{};
  return plan_item(span_at(a.spans, b), a.p, a.S_q);
}

// The query rows [lo, hi) that the calibration launch computes for an item: the blocks of block_rows
// rows that hold a calibrated row (block_rows == 1: the per-row kernel computes the calibrated rows
// themselves); empty for an item without calibrated rows.
struct RowRange {
  int64_t lo, hi;
};

__device__ __forceinline__ RowRange calibration_rows(const ItemPlan& it, int block_rows, int64_t S_q) {
  if (!it.active) return RowRange{0, 0};
  const int64_t lo = it.q_lo / block_rows * block_rows, hi = (it.q_hi / block_rows + 1) * block_rows;
  return RowRange{lo, imin(hi, S_q)};
}

// One launch of the tiled kernel (its configuration is the kernel's template arguments): which block
// class it computes (calibration: the blocks holding an item's calibrated rows; else every other
// block), and the calibration class's block height, so that the other launch leaves those rows to it.
struct TiledLaunch {
  int calibration;
  int calibration_block_rows;  // 16 * the calibration launch's warps; 1 when the per-row kernel computes them
};

// ------------------------------------------------------------------ the tiled kernel's pieces
// This thread's two rows (all four threads of a quad hold the same values once reduced).
template <int HD>
struct RowState {
  // The open segment: its max, this thread's part of its sum, and its P*V (the mma accumulator).
  float m_s[2], l_s[2];
  float O[HD / 8][4];
  // Calibration blocks: the full term's max and sum (its P*V is in the Of slots), the smallest max of
  // a basket counted as non-empty, and the count.
  float m_r[2], l_r[2], min_mb[2];
  int n_ne[2];
};

// The tiled kernel's dynamic shared memory (laid out by cuda/launch_config.h's tile_layout).
__device__ __forceinline__ unsigned char* tile_smem() {
  ATTNCAL_DYNAMIC_SHARED(unsigned char, attention_smem);
  return attention_smem;
}

// The shared-memory regions of a block of configuration (NW warps, STAGES stages), at compile-time
// offsets.
template <typename T, int HD, int NW, int STAGES>
struct TileRegions {
  static constexpr TileLayout L = tile_layout(static_cast<int>(sizeof(T)), HD, TileConfig{NW, STAGES});
  static constexpr int BR = 16 * NW, NTHREADS = 32 * NW, LD = HD + 16 / static_cast<int>(sizeof(T));
  static __device__ __forceinline__ T* Qs() { return reinterpret_cast<T*>(tile_smem()); }
  static __device__ __forceinline__ T* Ks() { return reinterpret_cast<T*>(tile_smem() + L.off_k); }
  static __device__ __forceinline__ T* Vs() { return reinterpret_cast<T*>(tile_smem() + L.off_v); }
  static __device__ __forceinline__ float* Ps() { return reinterpret_cast<float*>(tile_smem() + L.off_p); }
  static __device__ __forceinline__ unsigned char* Ms() { return tile_smem() + L.off_mask; }
  static __device__ __forceinline__ float4* Of() { return reinterpret_cast<float4*>(tile_smem() + L.off_of); }
  static __device__ __forceinline__ float4* Acc() { return reinterpret_cast<float4*>(tile_smem() + L.off_acc); }
};

// One block's rows and item (set up by the kernel).
template <typename T>
struct TiledBlock {
  int tid, warp, lane, g, tq, rloc[2];  // rloc: this thread's two rows in the block
  const T* qg;        // the block's first query row of head h
  const T* kg;        // key 0 of head h of item b
  const T* vg;
  const int64_t* mg;  // item b's mask row
  const float* rel[2];  // head h's relative position bias of this thread's two rows (relative_row); NULL
                        // without a bias, and for a row past S_q (computed and dropped)
  int64_t q0;         // the block's first query row
  bool calib;         // a calibration block
  ItemPlan it;
};

// The tile starting at key `pos`: its length and whether it closes its segment (and the segment is a
// content basket).  Outside calibration blocks the whole key range is one segment.
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
    const int64_t c0 = it.rp.c0, c_end = it.rp.c0 + it.rp.C;
    if (pos < c0) {
      seg_end = c0;
    } else if (pos < c_end) {
      const int64_t k = (pos - c0) / S;
      seg_end = imin(c0 + (k + 1) * S, c_end);
      t.basket = true;
    }
  }
  t.len = static_cast<int>(imin(kKeyTile, seg_end - pos));
  t.closes = pos + t.len == seg_end;
  return t;
}

}  // namespace
}  // namespace attncal

#endif  // ATTNCAL_CUDA_ATTENTION_COMMON_CUH_
