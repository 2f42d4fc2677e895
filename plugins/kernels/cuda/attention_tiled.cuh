// The tiled CUDA kernel of the calibrated attention ops, ai.attncal::PooledRowCalibratedAttention and
// ai.attncal::AllRowsCalibratedAttention (attncal/graphs/contract.py, "Calibrated attention"; the
// float64 spec is attncal.calibration.oracle.attention_reference; the arithmetic is
// docs/native-kernels.md).  Semantics: per item b and head h, in float32,
//   scores = scale*q*k^T + rel_bias + (0 at valid keys, float32's lowest finite value at masked keys and
//            at keys outside the row's window, added once)   (k, v: key/value head h / (N / N_kv))
//   rel_bias[q,k] = the model's relative position bias of head h at offset k - q (0 without one): the
//            launcher builds it per head and offset (Args::rel, O(N*S_k) floats, never [S_q,S_k]), and
//            each score adds one entry of it, in float32, before the mask bias
//   probs  = Softmax-fused calibration op of the scores (same attributes, same calibrated rows)
//   context = probs * v
// Flash attention with the calibration folded in, in three pieces: the main loop over K/V tiles
// (cuda/attention_mainloop.cuh), the segment merge of calibration blocks (cuda/attention_merge.cuh)
// and the epilogue that writes the context rows (cuda/attention_epilogue.cuh).
//
// * One block per (b, h, 16*NW query rows); each warp owns 16 rows, each thread two rows and, per
//   8-column group, two columns: the accumulator layout of mma.m16n8k16, which the float32 path reuses
//   so that all row bookkeeping is one piece of code.  NW = 4 warps for float16/bfloat16, 2 for
//   float32, as designed; fewer where a device's shared memory requires (cuda/launch_config.h).
// * K and V stream through shared memory in tiles of at most 64 keys (cp.async, double buffered for
//   16-bit types in the design's configuration; plain loads when rows are not 16-byte aligned).
//   Scores, the row maxima, exp and the row sums stay in registers; K and V are read once per block
//   and nothing of size S_q*S_k exists anywhere: memory is O(S) (the output plus ~4 bytes per query
//   row and head of workspace).
// * float16 / bfloat16: Q*K^T and P*V on the tensor cores (mma.sync m16n8k16, fp32 accumulation;
//   fragments by ldmatrix from padded, conflict-free shared rows).  P is rounded to the input type
//   for P*V, as FlashAttention does; this is the one place the kernel is not float32 arithmetic
//   (a relative 2^-11 per weight in float16, 2^-8 in bfloat16, the same order as the rounding of
//   the context itself).  The row sums add the rounded P, so each context row is a convex
//   combination of V.  float32: the same tiles with scalar FMAs from shared memory (exact
//   float32, no TF32), slower.
// * Two block classes, two launches.  Blocks holding a calibrated row ("calibration blocks") need
//   two more float4 slots per thread and value column group in shared memory (the O and acc below),
//   which at head size 128 is more than an sm_86 or sm_89 block may hold with the largest
//   configuration; every other block needs none of it.  So the launcher runs the other blocks with
//   their own largest fitting configuration and base footprint, and the calibration blocks in a second
//   launch with theirs (TiledLaunch::calibration): a pooled op with S_q == S_k has one calibration
//   block per head and item, and no other block pays for the calibration's shared memory.  The first
//   launch leaves to the second the rows of the blocks that hold calibrated rows (calibration_rows:
//   blocks of the second launch's height, or the calibrated rows themselves when the per-row kernel
//   computes them because no tiled configuration of the calibration blocks fits).
// * The other blocks (strength 0, every block but one per head for the pooled op with S_q == S_k,
//   padding-only blocks, items too short to calibrate, items with no valid key) are plain flash
//   attention over all S_k keys with the additive mask: exactly the contract, fully masked items
//   included (every score is the lowest value, the softmax is uniform and the context the mean of V
//   over all keys).
// * Calibration blocks cut the keys into segments: the keys before the content (left padding,
//   isolated first token), each content basket, the keys after it (isolated last token, right
//   padding).  A tile never crosses a segment boundary (a basket of more than 64 keys is several
//   tiles: exact divisors of it; a shorter one is one shorter tile), and each segment keeps its own
//   flash state, merged when it closes (cuda/attention_merge.cuh).  K and V are still read once, and
//   one P*V product per tile serves both the full term and the basket term.  The context rows
//   (cuda/attention_epilogue.cuh): (1-lambda)*O/l + (coef/t)*acc + the isolated keys' values.
// * Exactness and the per-row kernel.  A row of a calibration block is handed to the per-row kernel
//   (cuda/attention_rows.cuh: the contract written out directly, three passes over K and V for that
//   row) when the tiled kernel cannot be sure: (a) a basket counted as non-empty when it closed
//   turns out to have mass 0 in float32 once the final LSE is known (its max is ~104 below a
//   larger score that came later: the smallest counted basket max is checked), or (b) the row's
//   largest valid score is not above float32's lowest value (all valid scores -inf: then the
//   masked keys carry the softmax).  Such rows are queued in the workspace (a counter and a list)
//   and recomputed by a launch on the same stream, which overwrites them.  Neither happens for
//   scores of ordinary size; the queue costs one near-empty launch otherwise.
//   Within the kernel's scope the result is the contract's: fully masked items (uniform over all
//   S_k keys, never calibrated), padding query rows (plain attention over the valid keys), holes
//   (excluded from the basket sums, counted in the basket count as the oracle does), empty
//   baskets (not counted in the non-empty count), NaN: a NaN or +inf score anywhere in a row,
//   masked keys included, makes the row NaN; a NaN or an infinity in V makes every row of that
//   item and head non-finite (0 * NaN in the product).  Not matched: masked-key scores only round
//   to the lowest value while |scale*q.k + rel_bias| < ~1e31 (true of any float16 input and table);
//   beyond that the contract's float32 sum and this kernel may differ.  No tile is skipped, so no bound
//   of the scores (and none of the bias) is assumed anywhere else.
// * Basket emptiness follows the float32 op (the Softmax-fused op, the ORT CPU kernel): a basket
//   whose float32 probabilities all underflow (max score ~104 below the LSE) is empty.  The
//   float64 oracle only empties baskets ~745 below; between the two the results differ (as
//   attncal.calibration.split notes for its own, float64-like, rule).
// * What a device changes.  sm_80 and sm_90 run the configuration the kernel was designed with for
//   both block classes.  A device with less shared memory (sm_86, sm_89 at head size 128) runs its
//   calibration blocks with fewer warps and one stage: a calibrated row is computed as on the others
//   (the key tile is the same), and a plain row that now shares a shorter calibration block, or no
//   longer does, is computed by the other path, the same value rounded another way.
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
#ifndef ATTNCAL_CUDA_ATTENTION_TILED_CUH_
#define ATTNCAL_CUDA_ATTENTION_TILED_CUH_

#include <cstdint>

#include "cuda/attention_common.cuh"
#include "cuda/attention_epilogue.cuh"
#include "cuda/attention_mainloop.cuh"
#include "cuda/launch_config.h"

namespace attncal {
namespace {

// HD: 64 or 128 (the head's D and D_v columns, zero-padded); NW warps, STAGES K/V tiles in flight
// (cuda/launch_config.h: tile_candidates); the block class: TiledLaunch.  Dynamic shared memory:
// tile_layout's base_bytes, or calib_bytes for the calibration launch.  No static shared memory.
template <typename T, int HD, int NW, int STAGES>
__global__ void __launch_bounds__(NW * 32) attention_kernel(Args a, TiledLaunch l) {
  constexpr int64_t BR = TileRegions<T, HD, NW, STAGES>::BR;
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const ItemPlan it = item_plan(a, b);

  // Which rows: the calibration launch's grid counts the blocks from the item's first calibrated row;
  // the other launch's the blocks from row 0, minus those the calibration launch computes entirely.
  int64_t q0 = 0;
  RowRange skip{0, 0};
  if (l.calibration) {
    if (!it.active) return;
    q0 = (it.q_lo / BR + static_cast<int64_t>(blockIdx.x)) * BR;
    if (q0 > it.q_hi) return;
  } else {
    q0 = static_cast<int64_t>(blockIdx.x) * BR;
    skip = calibration_rows(it, l.calibration_block_rows, a.S_q);
    if (q0 >= skip.lo && imin(q0 + BR, a.S_q) <= skip.hi) return;
  }

  TiledBlock<T> blk;
  blk.tid = threadIdx.x;
  blk.warp = blk.tid >> 5;
  blk.lane = blk.tid & 31;
  blk.g = blk.lane >> 2;
  blk.tq = blk.lane & 3;
  blk.rloc[0] = 16 * blk.warp + blk.g;
  blk.rloc[1] = 16 * blk.warp + blk.g + 8;
  blk.qg = static_cast<const T*>(a.q) + ((b * a.S_q + q0) * a.N + h) * a.D;
  blk.kg = static_cast<const T*>(a.k) + (b * a.S_k * a.N_kv + kv_head(a, h)) * a.D;
  blk.vg = static_cast<const T*>(a.v) + (b * a.S_k * a.N_kv + kv_head(a, h)) * a.D_v;
  blk.mg = a.mask + b * a.S_k;
  for (int i = 0; i < 2; ++i) blk.rel[i] = q0 + blk.rloc[i] < a.S_q ? relative_row(a, h, q0 + blk.rloc[i]) : nullptr;
  blk.q0 = q0;
  blk.calib = l.calibration != 0;
  blk.it = it;

  RowState<HD> st;
  run_tiles<T, HD, NW, STAGES>(blk, a, st);
  write_context<T, HD, NW, STAGES>(blk, a, st, skip);
}

}  // namespace
}  // namespace attncal

#endif  // ATTNCAL_CUDA_ATTENTION_TILED_CUH_
