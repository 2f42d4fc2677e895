// PooledRowCalibratedAttention / AllRowsCalibratedAttention on the host: the whole attention of one
// layer with the calibration inside, in one pass over a block of query rows (the op contract is
// attncal/graphs/contract.py; the float64 spec is attncal.calibration.oracle.attention_reference).
//
// Per work unit (batch item b, head h, a block of R query rows):
//   1. scores[R,S_k] = scale * Q_blk * K_h^T          one GEMM (cpu/gemm.h) into per-thread scratch
//   2. + the relative position bias where the op has one (per head, a row indexed by k - q, built once per
//      call from the table: no [N,S_q,S_k] tensor), + the mask bias (float32's lowest finite value at masked
//      keys), added as the contract says
//   3. per row: softmax, and for the rows the calibration selects, the calibration, in place while
//      the row is in cache: the Softmax-fused op's own routines (cpu/row_calibration.h), so the
//      arithmetic, the fully-masked and non-finite rules are the ones that op already proves
//   4. context[R,D_v] = P * V_h                          one GEMM, written into the output
// Why this shape:
// * No [B,H,S,S] tensor exists: scratch is R x S_k floats per thread (plus the widened Q, K, V
//   blocks for float16).  R is chosen so that the block stays in L2 (1 MiB) up to 2,048 keys, which is what
//   ONNX Runtime's fused CPU Attention does not do: it computes every head's probabilities into
//   one B*N*S*S buffer first (see docs/native-kernels.md).
// * The units are independent and each row is computed by exactly one unit whose size depends
//   only on the shapes, so results are bit-identical at any thread count.
// * float16 is computed in float32: the block of Q and the head's K and V are widened per unit
//   (K and V once per unit: O(S_k*D) against the unit's O(R*S_k*D) work), the context rounded once.
// * Long rows (float32): where a whole-row block would hold fewer than kMaxRows rows, the GEMMs get thin
//   (few rows against all of K and V, which the GEMM library packs anew for each block).  Units then take
//   kTiledRows rows, and the rows the calibration does not select run over key tiles with the online
//   softmax (FlashAttention's running max, sum and rescaled context), kTileBytes of scores per tile; the
//   calibrated rows, which need their whole row, run in whole-row blocks inside the unit as before.
#ifndef ATTNCAL_CPU_CALIBRATED_ATTENTION_H_
#define ATTNCAL_CPU_CALIBRATED_ATTENTION_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "common/attention_shape.h"
#include "common/relative_position.h"
#include "common/span_geometry.h"
#include "cpu/batch_plan.h"
#include "cpu/gemm.h"
#include "cpu/half.h"
#include "cpu/packed_gemm.h"
#include "cpu/row_calibration.h"

namespace attncal {

struct AttentionUnit {
  int64_t b, h, q0, q1;
};

// Per-thread scratch of the attention kernel (separate from Scratch: the row routines use that).
struct AttentionScratch {
  std::vector<float> scores, q, k, v, ctx, run_max, run_sum, first_max;
  std::vector<uint32_t> q_bits;  // per query row of a unit over key tiles, its largest |q| (scale_rows)
  PackedWeight k_panels, v_panels;  // a key tile's keys and values (pack_tile)
  std::vector<int64_t> bands;      // a tile's bands of rows: begin, end, first key, end key
  std::vector<int64_t> rows;       // a unit's marked rows (marked_rows, long rows)
};

inline AttentionScratch& thread_attention_scratch() {
  static thread_local AttentionScratch s;
  return s;
}

inline void ensure(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

// A key tile's keys (transposed) and values [n, D] / [n, Dv], packed into cpu/packed_gemm.h's panels in the
// thread's scratch for tile_scores and tile_context (where the plan has no shared store of packed tiles, or
// another thread is packing this one into it).  Every instruction-set path has a packed kernel (cpu/packed_gemm.h);
// false only for an empty tile.  Packing costs n x (D + Dv) copies against R x n x (D + Dv)
// multiply-adds.
// Why not OpenBLAS: its result for a row can depend on how many rows the call has (seen with 256-key tiles),
// and a row of the key tiles that is computed again alone, without skipping, must equal the same row computed
// in its unit; the packed kernel computes each element the same way whatever R is, reads its row operand (the
// unit's block of queries, P) in place where OpenBLAS copies it into its own layout on every call, and lets a
// band of rows take a range of keys.
inline bool pack_tile(int64_t n, int64_t D, int64_t Dv, const float* K, int64_t ldk, const float* V, int64_t ldv) {
  AttentionScratch& as = thread_attention_scratch();
  return as.k_panels.PackTransposed(K, n, D, ldk) && as.v_panels.Pack(V, n, Dv, ldv);
}

// Scores of keys [lo, hi) of a tile of n keys, s[R, lo:hi] = Q[R,D] * K[lo:hi, D]^T (Q dense and already scaled,
// s ld n).  Packed: lo and hi are multiples of the panel width, or n.
inline void tile_scores(const PackedWeight* packed, int64_t R, int64_t n, int64_t D, const float* Q, const float* K,
                        int64_t ldk, float* s, int64_t lo, int64_t hi) {
  if (packed != nullptr) {
    const PackedWeight& w = *packed;
    const int64_t nr = w.panel_width();
    packed_gemm_bias(w, R, Q, D, nullptr, lo / nr, (hi + nr - 1) / nr, s, n);
  } else {
    gemm_nt(R, hi - lo, D, 1.0f, Q, D, K + lo * ldk, ldk, s + lo, n);
  }
}

// The context of keys [lo, hi) of the tile, o[R,Dv] += P[R, lo:hi] * V[lo:hi, Dv] (P ld n, o dense).
inline void tile_context(const PackedWeight* packed, int64_t R, int64_t Dv, int64_t n, const float* P, const float* V,
                         int64_t ldv, float* o, int64_t lo, int64_t hi) {
  if (packed != nullptr) {
    packed_gemm(*packed, R, P, n, o, Dv, /*accumulate=*/true, lo, hi);
  } else {
    gemm_nn(R, Dv, hi - lo, P + lo, n, V + lo * ldv, ldv, o, Dv, /*accumulate=*/true);
  }
}

// Widens rows of a strided float16 matrix into a dense float matrix (ld = cols).
inline void widen_block(const uint16_t* x, int64_t rows, int64_t cols, int64_t ld, float* y) {
  for (int64_t r = 0; r < rows; ++r) widen_row(x + r * ld, y + r * cols, cols);
}

class AttentionPlan {
 public:
  // The scores block of a unit: 1 MiB, about half the per-core L2 of a server core, so that a unit takes more
  // rows per GEMM while its scores stay in L2; on cores with a smaller L2 smaller blocks gained nothing
  // (the measurements: see docs/native-kernels.md).
  static constexpr int64_t kBlockBytes = 1024 * 1024;
  static constexpr int64_t kMaxRows = 256;
  // Past 2,048 keys a whole-row block still takes kMinRows rows, and outgrows L2 (kMinRows * S_k floats of
  // scratch per thread: 4 MiB at 8,192 keys, 16 MiB at 32,768): below it the GEMMs get so thin that they
  // cost more than the cache misses (docs/native-kernels.md).
  static constexpr int64_t kMinRows = 128;
  // Long rows: the rows of a unit, and the scores of one key tile (see the header comment).
  static constexpr int64_t kTiledRows = 512;
  static constexpr int64_t kTileBytes = 256 * 1024;
  // Head size 64 or less without a window: twice that.  Per tile and row the online softmax has a fixed cost
  // (the maximum, the correction, the calls) that a small head's GEMM work does not hide; under a window or a
  // causal mask a wider tile computes more of what the mask hides, and larger heads gained nothing.
  static constexpr int64_t kWideTileBytes = 512 * 1024;
  static constexpr int64_t kWideTileMaxHead = 64;
  // Rows of a band of a tile under a window, and the multiple its key range is widened to: the packed kernel's
  // widest panel.
  static constexpr int64_t kBand = 32;
  // Masked scores are float32's lowest value plus a score far smaller than it: at or below half of it.
  static constexpr float kMaskedFloor = std::numeric_limits<float>::lowest() / 2;

  // `rel`: the relative position bias (needs S_q == S_k; the ORT op checks it), or none.
  AttentionPlan(const int64_t* mask, const AttentionShape& shape, const AttncalParams& p,
                const RelativeBias& rel = RelativeBias{})
      : sh_(shape) {
    const int64_t B = sh_.B, Q = sh_.S_q, K = sh_.S_k;
    if (B * Q * K * sh_.N == 0) return;
    if (rel.enabled()) plan_relative(rel);
    plan_items(mask, B, Q, K, p, &items_, &keep_, &keep_of_);
    if (p.marked_rows) {  // the marked rows that are calibrated, per item (Q == K: the all-rows op)
      marked_.assign(static_cast<size_t>(B * Q), 0);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t q = 0; q < Q; ++q) marked_[b * Q + q] = row_calibrated(items_[b], p, mask + b * K, q);
    }
    // The additive mask bias, one row per item: 0 at valid keys, float32's lowest at masked ones.
    bias_.assign(static_cast<size_t>(B * K), 0.f);
    masked_.assign(static_cast<size_t>(B), 0);
    for (int64_t i = 0; i < B * K; ++i)
      if (mask[i] == 0) {
        bias_[i] = std::numeric_limits<float>::lowest();
        masked_[i / K] = 1;
      }
    // Per item, the keys from the first valid one to the last: key tiles wholly outside it may be skipped.
    valid_.assign(static_cast<size_t>(2 * B), 0);
    for (int64_t b = 0; b < B; ++b) {
      int64_t lo = 0, hi = K;
      while (lo < K && mask[b * K + lo] == 0) ++lo;
      while (hi > lo && mask[b * K + hi - 1] == 0) --hi;
      if (lo == K) lo = 0, hi = K;  // no valid key: the row is uniform over all keys, nothing is skipped
      valid_[2 * b] = lo;
      valid_[2 * b + 1] = hi;
    }
    rows_ = std::max<int64_t>(1, std::min<int64_t>({Q, kMaxRows, std::max(kMinRows, kBlockBytes / (4 * K))}));
    // Long rows: units of whole-row blocks, about kTiledRows rows (bit-identical chunks at any thread count).
    tiled_ = rows_ < kMaxRows && Q > rows_;
    unit_rows_ = tiled_ ? rows_ * std::max<int64_t>(1, kTiledRows / rows_) : rows_;
    const int64_t tile_bytes = !shape.windowed() && shape.D <= kWideTileMaxHead ? kWideTileBytes : kTileBytes;
    key_tile_ = std::max<int64_t>(16, std::min(K, tile_bytes / (4 * unit_rows_)));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < sh_.N; ++h)
        for (int64_t q = 0; q < Q; q += unit_rows_) units_.push_back({b, h, q, std::min(q + unit_rows_, Q)});
    if (tiled_) {
      const size_t n = probe_slots();
      probes_.reset(new std::atomic<uint64_t>[n]);
      for (size_t i = 0; i < n; ++i) probes_[i].store(kNotProbed, std::memory_order_relaxed);
    }
  }

  // Long rows in float32: the floats of a store of packed key tiles that the units share (0 where they share
  // none: shares_tiles), a slot per item, KV head and key tile, as large as the layer's K and V together.  The
  // units of the query heads that share a KV head, and of each later block of query rows, compute over the same
  // tiles; packing them anew per unit means reading each key a row of every KV head apart (a 4 KiB page per key
  // at Qwen3's 8 KV heads of 128), which cost more than the copying itself.  Shared, each tile is read that way
  // once per call and then streamed from the store's contiguous panels.
  int64_t tile_store_floats() const {
    if (!shares_tiles()) return 0;
    return static_cast<int64_t>(probe_slots()) * (PackedWeight::StorageFloats(sh_.D, key_tile_) +
                                                  PackedWeight::StorageFloats(key_tile_, sh_.D_v));
  }

  // Lets the units share `store` (tile_store_floats() floats, alive while they run; nothing to do where that is
  // 0).  Without it each unit packs the tiles it computes into its thread's scratch; the results are the same
  // bits either way.
  void share_tiles(float* store) {
    const size_t slots = probe_slots();
    if (!shares_tiles() || store == nullptr || slots == 0) return;
    const int64_t kf = PackedWeight::StorageFloats(sh_.D, key_tile_);
    const int64_t vf = PackedWeight::StorageFloats(key_tile_, sh_.D_v);
    panels_.assign(2 * slots, PackedWeight{});
    state_.reset(new std::atomic<uint8_t>[slots]);
    for (size_t i = 0; i < slots; ++i) {
      panels_[2 * i].UseStorage(store + static_cast<int64_t>(i) * (kf + vf));
      panels_[2 * i + 1].UseStorage(store + static_cast<int64_t>(i) * (kf + vf) + kf);
      state_[i].store(kEmpty, std::memory_order_relaxed);
    }
  }

  size_t size() const { return units_.size(); }
  int64_t rows_per_unit() const { return unit_rows_; }

  // Unit i: T is float or uint16_t (float16 bits).
  template <typename T>
  void run(size_t i, const T* query, const T* key, const T* value, T* context, const AttncalParams& p) const {
    const AttentionUnit& u = units_[i];
    const ItemPlan& it = items_[u.b];
    // The rows the calibration selects, [c0, c1) within the unit: whole-row blocks; the others key tiles.
    const int64_t c0 = it.active ? std::min(std::max(u.q0, it.q_lo), u.q1) : u.q1;
    const int64_t c1 = it.active ? std::max(std::min(u.q1, it.q_hi + 1), c0) : u.q1;
    if (!tiled_ || !std::is_same<T, float>::value) {
      for (int64_t r = u.q0; r < u.q1; r += rows_) block(u, r, std::min(r + rows_, u.q1), query, key, value, context, p);
      return;
    }
    if constexpr (std::is_same<T, float>::value) {
      if (!marked_.empty()) {
        // Marked rows (landmarks: a few per item, spread over it): the unit's rows over key tiles, which leave the
        // marked rows' context unwritten (running the tiles in runs between them would stream every key tile
        // again per run); the item's first unit of each head then gathers every marked row of the item into
        // whole-row blocks, so that K and V are read once for them, as for the one pooling row of cls pooling.
        tiles(u, u.q0, u.q1, query, key, value, context);
        if (u.q0 != 0 || !it.active) return;
        std::vector<int64_t>& rows = thread_attention_scratch().rows;
        rows.clear();
        for (int64_t q = it.q_lo; q <= it.q_hi; ++q)
          if (marked_[u.b * sh_.S_q + q]) rows.push_back(q);
        for (size_t r = 0; r < rows.size(); r += static_cast<size_t>(rows_)) {
          const int64_t n = std::min<int64_t>(rows_, static_cast<int64_t>(rows.size() - r));
          block(u, rows[r], rows[r] + n, query, key, value, context, p, rows.data() + r);
        }
        return;
      }
      if (u.q0 < c0) tiles(u, u.q0, c0, query, key, value, context);
      for (int64_t r = c0; r < c1; r += rows_) block(u, r, std::min(r + rows_, c1), query, key, value, context, p);
      if (c1 < u.q1) tiles(u, c1, u.q1, query, key, value, context);
    }
  }

 private:
  // Whether query row q of item b is calibrated (common/span_geometry.h: row_calibrated).
  bool calibrated(int64_t b, int64_t q) const {
    const ItemPlan& it = items_[b];
    return it.active && q >= it.q_lo && q <= it.q_hi && (marked_.empty() || marked_[b * sh_.S_q + q]);
  }

  // Rows [r0, r1) of unit u against all keys in one block of scores: softmax, the calibration of the rows it
  // selects, then one GEMM with V.  With `gathered`, the block's R = r1 - r0 rows are gathered[0 .. R) instead
  // (ascending, r0 = gathered[0]): their queries are copied into one dense block, and their context is written
  // row by row.
  template <typename T>
  void block(const AttentionUnit& u, int64_t r0, int64_t r1, const T* query, const T* key, const T* value,
             T* context, const AttncalParams& p, const int64_t* gathered = nullptr) const {
    const ItemPlan& it = items_[u.b];
    const float* keep = keep_of_[u.b];
    const int64_t K = sh_.S_k, D = sh_.D, Dv = sh_.D_v, R = r1 - r0;
    if (gathered != nullptr) r1 = gathered[R - 1] + 1;  // the window's keys: from the first row to the last
    const auto row_of = [&](int64_t r) { return gathered != nullptr ? gathered[r] : r0 + r; };
    const int64_t ldq = sh_.ld_q ? sh_.ld_q : sh_.N * D, ldk = sh_.ld_k ? sh_.ld_k : sh_.kv_heads() * D;
    const int64_t ldv = sh_.ld_v ? sh_.ld_v : sh_.kv_heads() * Dv, ldo = sh_.N * Dv;
    AttentionScratch& as = thread_attention_scratch();
    Scratch& sc = thread_scratch();
    ensure(as.scores, R * K);
    float* s = as.scores.data();
    const T* q_src = query + (u.b * sh_.S_q + r0) * ldq + u.h * D;
    const T* k_src = key + u.b * K * ldk + sh_.kv_head(u.h) * D;
    const T* v_src = value + u.b * K * ldv + sh_.kv_head(u.h) * Dv;
    const float *qf, *kf, *vf;
    int64_t lq = ldq, lk = ldk, lv = ldv;
    if constexpr (std::is_same<T, float>::value) {
      qf = q_src;
      kf = k_src;
      vf = v_src;
      if (gathered != nullptr) {
        ensure(as.q, R * D);
        for (int64_t r = 0; r < R; ++r)
          std::memcpy(as.q.data() + r * D, query + (u.b * sh_.S_q + gathered[r]) * ldq + u.h * D, sizeof(float) * D);
        qf = as.q.data();
        lq = D;
      }
    } else {
      ensure(as.q, R * D);
      ensure(as.k, K * D);
      ensure(as.v, K * Dv);
      if (gathered != nullptr) {
        for (int64_t r = 0; r < R; ++r)
          widen_row(query + (u.b * sh_.S_q + gathered[r]) * ldq + u.h * D, as.q.data() + r * D, D);
      } else {
        widen_block(q_src, R, D, ldq, as.q.data());
      }
      widen_block(k_src, K, D, ldk, as.k.data());
      widen_block(v_src, K, Dv, ldv, as.v.data());
      qf = as.q.data();
      kf = as.k.data();
      vf = as.v.data();
      lk = D;
      lq = D;
      lv = Dv;
    }
    // Under a window, the keys no row of the block sees: [0, k_lo) and [k_hi, K).  Where they are provably
    // masked to exactly float32's lowest value (`outside_is_lowest`), their scores are written, not computed.
    int64_t k_lo = 0, k_hi = K;
    if (sh_.windowed()) {
      k_lo = sh_.window_left >= 0 ? std::min(K, std::max<int64_t>(0, r0 - sh_.window_left)) : 0;
      k_hi = sh_.window_right >= 0 ? std::max(k_lo, std::min(K, r1 + sh_.window_right)) : K;
      if ((k_lo > 0 || k_hi < K) && !outside_is_lowest(qf, lq, R, kf, lk, vf, lv, k_lo, k_hi)) k_lo = 0, k_hi = K;
    }
    const float lowest = std::numeric_limits<float>::lowest();
    gemm_nt(R, k_hi - k_lo, D, sh_.scale, qf, lq, kf + k_lo * lk, lk, s + k_lo, K);
    const float* bias = bias_.data() + u.b * K;
    // An item without masked keys has a zero bias row: skipping the pass is exact (s + 0 == s).
    const bool add_bias = masked_[u.b] != 0;
    bool narrow = k_lo > 0 || k_hi < K;  // P*V over [k_lo, k_hi) only: every row is 0 outside it
    for (int64_t r = 0; r < R; ++r) {
      float* row = s + r * K;
      const int64_t q = row_of(r);
      std::fill(row, row + k_lo, lowest);
      std::fill(row + k_hi, row + K, lowest);
      if (const float* rel = relative_row(u.h, q)) add_row(row + k_lo, rel + k_lo, k_hi - k_lo);
      if (add_bias) add_row(row + k_lo, bias + k_lo, k_hi - k_lo);
      if (sh_.windowed()) mask_window(row + k_lo, q, k_lo, k_hi - k_lo, bias + k_lo);
      if (calibrated(u.b, q)) {
        softmax_calibrate_row(row, row, K, q, it, keep, p, sc);
      } else {
        softmax_row(row, row, K, sc);
      }
      // A row that sees no valid key is uniform over all keys, and the calibration may give an isolated
      // token outside the window its share: then the block takes every key.
      if (narrow && !(all_zero(row, k_lo) && all_zero(row + k_hi, K - k_hi))) narrow = false;
    }
    const int64_t n0 = narrow ? k_lo : 0, n = narrow ? k_hi - k_lo : K;
    T* out = context + (u.b * sh_.S_q + r0) * ldo + u.h * Dv;
    if (gathered != nullptr) {
      ensure(as.ctx, R * Dv);
      gemm_nn(R, Dv, n, s + n0, K, vf + n0 * lv, lv, as.ctx.data(), Dv);
      for (int64_t r = 0; r < R; ++r) {
        T* dst = context + (u.b * sh_.S_q + gathered[r]) * ldo + u.h * Dv;
        if constexpr (std::is_same<T, float>::value) {
          std::memcpy(dst, as.ctx.data() + r * Dv, sizeof(float) * Dv);
        } else {
          narrow_row(as.ctx.data() + r * Dv, dst, Dv);
        }
      }
    } else if constexpr (std::is_same<T, float>::value) {
      gemm_nn(R, Dv, n, s + n0, K, vf + n0 * lv, lv, out, ldo);
    } else {
      ensure(as.ctx, R * Dv);
      gemm_nn(R, Dv, n, s + n0, K, vf + n0 * lv, lv, as.ctx.data(), Dv);
      for (int64_t r = 0; r < R; ++r) narrow_row(as.ctx.data() + r * Dv, out + r * ldo, Dv);
    }
  }

  // Whether the scores of keys outside [k_lo, k_hi) would all be exactly float32's lowest value, and their
  // values finite (so that probability 0 times V adds exactly 0): K and V rows there finite, the block's
  // queries finite, and |scale| * D * max|q| * max|k| at most 1e30, far below half a unit in the last place of
  // the lowest value (about 1.01e31), so that score + lowest rounds to lowest (a relative position bias adds
  // its largest |value| to the bound).
  bool outside_is_lowest(const float* q, int64_t lq, int64_t R, const float* k, int64_t lk, const float* v, int64_t lv,
                         int64_t k_lo, int64_t k_hi) const {
    const int64_t K = sh_.S_k, D = sh_.D, Dv = sh_.D_v;
    float qmax = 0.f, ka = 0.f, kb = 0.f;
    if (!finite_abs_max(q, R, D, lq, &qmax) || !finite_abs_max(k, k_lo, D, lk, &ka) ||
        !finite_abs_max(k + k_hi * lk, K - k_hi, D, lk, &kb) || !finite_abs_max(v, k_lo, Dv, lv, nullptr) ||
        !finite_abs_max(v + k_hi * lv, K - k_hi, Dv, lv, nullptr))
      return false;
    const double bound = std::fabs(static_cast<double>(sh_.scale)) * static_cast<double>(D) * qmax * std::max(ka, kb);
    return bound + rel_max_ <= 1e30;
  }

  static bool all_zero(const float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      if (x[i] != 0.f) return false;
    return true;
  }

  // Rows [r0, r1) of unit u, none of them calibrated, over key tiles with the online softmax: per tile the
  // scores, the running maximum m and sum l, the context so far rescaled by exp(m_old - m), and P*V added
  // onto it; the context divided by l at the end.  The float32 results equal softmax * V up to rounding; the
  // contract's special rows keep their outcome: a fully masked item (every score the lowest value plus a
  // negligible term) is uniform over its keys, and a NaN or +inf score, or a row of -inf, gives NaN.
  //
  // Padding and windows: a tile of keys that are all masked for a row (before the item's first valid key or
  // after its last, or outside the row's window) and whose K and V rows are finite is skipped by that row: by
  // every row of [r0, r1), or by the rows outside the run that the window lets see it (both GEMMs then take
  // only that run); within the run, a band of rows skips the keys of the tile that none of its rows' windows
  // reach (both GEMMs take the band's range of keys).  Each of its scores is at most
  // lowest + |scale| * D * max|q| * max|k|.  Let m0 be the row's running maximum where it first rose above
  // lowest / 2, i.e. past every masked score (the first real maximum).  Where the bound is far below m0, the
  // tile adds exactly nothing: after m0, exp(score - m) is exactly 0 in float32; before it, the unskipped
  // pass's sum and context are wiped by the rescale exp(m_old - m0) = 0 that both passes make when m0 arrives
  // (every earlier maximum is a masked score: at or below lowest / 2, or below the bound).  A row for which
  // that does not hold (no real maximum, or scores near float32's range) is computed again without skipping,
  // so every row equals the unskipped result.
  // Why m0 and not the first finite maximum: under a window a row's first computed tile may hold only keys
  // outside its own window, whose masked scores would otherwise send every such row to the recomputation.
  void tiles(const AttentionUnit& u, int64_t r0, int64_t r1, const float* query, const float* key,
             const float* value, float* context, bool skip_padding = true) const {
    const int64_t K = sh_.S_k, D = sh_.D, Dv = sh_.D_v, R = r1 - r0, T = key_tile_;
    const int64_t ldq = sh_.ld_q ? sh_.ld_q : sh_.N * D, ldk = sh_.ld_k ? sh_.ld_k : sh_.kv_heads() * D;
    const int64_t ldv = sh_.ld_v ? sh_.ld_v : sh_.kv_heads() * Dv, ldo = sh_.N * Dv;
    AttentionScratch& as = thread_attention_scratch();
    ensure(as.scores, R * T);
    ensure(as.ctx, R * Dv);
    ensure(as.run_max, R);
    ensure(as.run_sum, R);
    ensure(as.first_max, R);
    float *s = as.scores.data(), *o = as.ctx.data(), *m = as.run_max.data(), *l = as.run_sum.data();
    float* m0 = as.first_max.data();  // the running maximum where it first rose above kMaskedFloor (see above)
    std::fill(o, o + R * Dv, 0.f);
    std::fill(m, m + R, -std::numeric_limits<float>::infinity());
    std::fill(m0, m0 + R, -std::numeric_limits<float>::infinity());
    std::fill(l, l + R, 0.f);
    const float* q = query + (u.b * sh_.S_q + r0) * ldq + u.h * D;
    const float* k = key + u.b * K * ldk + sh_.kv_head(u.h) * D;
    const float* v = value + u.b * K * ldv + sh_.kv_head(u.h) * Dv;
    // The unit's queries, scaled, in one dense block that every tile reads: in place, the rows of one head lie
    // N * D floats apart, and a block of them maps onto a few sets of L2, from which it is evicted between tiles.
    ensure(as.q, R * D);
    if (static_cast<int64_t>(as.q_bits.size()) < R) as.q_bits.resize(static_cast<size_t>(R));
    float* qs = as.q.data();
    uint32_t* q_bits = as.q_bits.data();
    scale_rows(q, ldq, R, D, sh_.scale, qs, q_bits);
    const float* bias = bias_.data() + u.b * K;
    const bool add_bias = masked_[u.b] != 0;
    const int64_t lo = valid_[2 * u.b], hi = valid_[2 * u.b + 1];
    const int64_t wl = sh_.window_left, wr = sh_.window_right;
    float skipped_k = -1.f;  // max |k| over the skipped keys; < 0: none skipped
    for (int64_t k0 = 0; k0 < K; k0 += T) {
      const int64_t n = std::min(T, K - k0);
      // The rows [a, z) of [r0, r1) whose window reaches a key of the tile; the others skip it as a hidden tile
      // (under a causal mask, the rows before the tile's first key: the unit computes a staircase, not a square).
      int64_t a = skip_padding && wr >= 0 ? std::clamp(k0 - wr, r0, r1) : r0;
      int64_t z = skip_padding && wl >= 0 ? std::clamp(k0 + n + wl, a, r1) : r1;
      // Hidden from every row: padding outside the item's valid span, or keys outside every row's window.
      const bool hidden = (k0 + n <= lo || k0 >= hi) || a == z;
      // Seen in part by some rows of [a, z): a row whose window ends inside the tile, or starts inside it.
      const bool partial = skip_padding && ((wr >= 0 && a + wr < k0 + n - 1) || (wl >= 0 && z - 1 - wl > k0));
      bool may_skip = skip_padding && (hidden || a > r0 || z < r1 || partial);
      if (may_skip) {
        const uint64_t probe = probe_tile(u.b, sh_.kv_head(u.h), k0 / T, n, k + k0 * ldk, ldk, v + k0 * ldv, ldv);
        const uint32_t kbits = static_cast<uint32_t>(probe), vbits = static_cast<uint32_t>(probe >> 32);
        if (kbits < kInfBits && vbits < kInfBits) {
          float kmax;
          std::memcpy(&kmax, &kbits, sizeof kmax);
          skipped_k = std::max(skipped_k, kmax);
          if (hidden) continue;
        } else {  // a non-finite key or value is never skipped: every row computes the whole tile
          a = r0;
          z = r1;
          may_skip = false;
        }
      }
      const PackedWeight* kp = nullptr;
      const PackedWeight* vp = nullptr;
      const bool packed = tile_panels(u, k0 / T, n, k + k0 * ldk, ldk, v + k0 * ldv, ldv, &kp, &vp);
      if (!packed) kp = vp = nullptr;
      // The tile in bands of rows, each over the keys [c0, c1) that its rows' windows reach, widened to kBand
      // keys (the rest of the band's keys are masked for each of its rows, as skipped keys: see above): under a
      // causal mask the tile on the diagonal is computed as a staircase of bands, not as a square.
      std::vector<int64_t>& bands = as.bands;
      bands.clear();
      for (int64_t g = a; g < z; g += kBand) {
        const int64_t g1 = std::min(z, g + kBand);
        int64_t c0 = 0, c1 = n;
        if (may_skip && partial && packed) {
          if (wl >= 0) c0 = std::clamp(g - wl - k0, int64_t{0}, n) / kBand * kBand;
          if (wr >= 0) c1 = std::min(n, (std::clamp(g1 + wr - k0, c0, n) + kBand - 1) / kBand * kBand);
        }
        if (!bands.empty() && bands[bands.size() - 1] == c1 && bands[bands.size() - 2] == c0) {
          bands[bands.size() - 3] = g1;
        } else {
          bands.insert(bands.end(), {g, g1, c0, c1});
        }
      }
      const float* rel = relative_row(u.h, r0);
      for (size_t i = 0; i < bands.size(); i += 4) {
        const int64_t b0 = bands[i] - r0, b1 = bands[i + 1] - r0, c0 = bands[i + 2], c1 = bands[i + 3], w = c1 - c0;
        tile_scores(kp, b1 - b0, n, D, qs + b0 * D, k + k0 * ldk, ldk, s + b0 * n, c0, c1);
        for (int64_t r = b0; r < b1; ++r) {
          float* row = s + r * n + c0;
          if (rel != nullptr) add_row(row, rel + k0 + c0 - r, w);
          if (add_bias) add_row(row, bias + k0 + c0, w);
          if (sh_.windowed()) mask_window(row, r0 + r, k0 + c0, w, bias + k0 + c0);
          const float mt = row_max(row, w);
          const float mn = (mt > m[r] || mt != mt) ? mt : m[r];  // a NaN maximum stays: exp(x - NaN) is NaN
          if (mn == -std::numeric_limits<float>::infinity()) {  // nothing but -inf so far: adds nothing
            std::fill(row, row + w, 0.f);
            continue;
          }
          exp_shifted_row(row, row, w, mn);  // NaN scores stay NaN and reach l
          // 0 on the first finite tile, exactly 1 while the maximum holds (no exp for it: most tiles of a long row)
          const float corr = mn == m[r] ? 1.f : std::exp(m[r] - mn);
          if (!(m0[r] > kMaskedFloor) && mn > kMaskedFloor) m0[r] = mn;
          m[r] = mn;
          l[r] = l[r] * corr + sum_row(row, w);
          if (corr != 1.f) scale_row(o + r * Dv, Dv, corr);
        }
        tile_context(vp, b1 - b0, Dv, n, s + b0 * n, v + k0 * ldv, ldv, o + b0 * Dv, c0, c1);
      }
    }
    float* out = context + (u.b * sh_.S_q + r0) * ldo + u.h * Dv;
    std::vector<int64_t> again;
    for (int64_t r = 0; r < R; ++r) {
      if (!marked_.empty() && marked_[u.b * sh_.S_q + r0 + r]) continue;  // a gathered block writes it (run)
      if (skipped_k >= 0.f) {
        const bool finite_q = q_bits[r] < kInfBits;
        float qmax;
        std::memcpy(&qmax, &q_bits[r], sizeof qmax);
        const double bound =
            2.0 * std::fabs(static_cast<double>(sh_.scale)) * static_cast<double>(D) * qmax * skipped_k + rel_max_;
        const double lowest = std::numeric_limits<float>::lowest();
        // Against the first real maximum: what came before it, the unskipped pass rescaled away (by
        // exp(m_old - m0) = 0) when it arrived.
        if (!finite_q || !std::isfinite(m0[r]) || !std::isfinite(m[r]) ||
            lowest + bound - static_cast<double>(m0[r]) > -256.0) {
          again.push_back(r0 + r);
          continue;
        }
      }
      if (r + kAhead < R) prefetch_row(out + (r + kAhead) * ldo, Dv, /*write=*/true);
      const float inv = 1.0f / l[r];
      for (int64_t d = 0; d < Dv; ++d) out[r * ldo + d] = o[r * Dv + d] * inv;
    }
    for (int64_t r : again) tiles(u, r, r + 1, query, key, value, context, /*skip_padding=*/false);
  }

  // qs[r, :] = scale * q[r * ldq, :] for R rows, and the bits of each row's largest |q| in bits[r] (the bound of
  // the skipping, read at the end of the unit without reading q again).  A unit's rows of one head lie a row of
  // every head apart (a page each at Qwen3's 16 heads of 128), beyond the reach of the hardware's prefetcher,
  // which stops at a page: the rows kAhead ahead are asked for while one is copied.
  ATTNCAL_ISA_BODY void scale_rows_isa(const float* q, int64_t ldq, int64_t R, int64_t D, float scale, float* qs,
                                       uint32_t* bits) {
    for (int64_t r = 0; r < R; ++r) {
      if (r + kAhead < R) prefetch_row(q + (r + kAhead) * ldq, D, /*write=*/false);
      const float* src = q + r * ldq;
      for (int64_t d = 0; d < D; ++d) qs[r * D + d] = scale * src[d];
      bits[r] = abs_max_bits(src, D);
    }
  }
  ATTNCAL_ISA_DISPATCH(void, scale_rows, (const float* q, int64_t ldq, int64_t R, int64_t D, float scale, float* qs,
                       uint32_t* bits),
                       (q, ldq, R, D, scale, qs, bits))

  static constexpr int64_t kAhead = 4;
  static void prefetch_row(const float* x, int64_t n, bool write) {
    for (int64_t i = 0; i < n; i += 16) {
      if (write) {
        __builtin_prefetch(x + i, 1);
      } else {
        __builtin_prefetch(x + i, 0);
      }
    }
  }

  // Key tile t of item b and KV head g (n keys at k, their values at v): the bits of its largest |k| in the low
  // half and of its largest |v| in the high half (at or above kInfBits: not finite).  Read once per call, by
  // the first unit that asks, and kept for the others: every unit of the query heads that share the KV head
  // asks for the same tiles, and under a causal mask a unit asks for every tile past its rows, which it reads
  // only to skip them (key by key, a row of every KV head apart).  Two units that ask at once both read it and
  // store the same value.
  uint64_t probe_tile(int64_t b, int64_t g, int64_t t, int64_t n, const float* k, int64_t ldk, const float* v,
                      int64_t ldv) const {
    std::atomic<uint64_t>& slot = probes_[slot_of(b, g, t)];
    uint64_t probe = slot.load(std::memory_order_relaxed);
    if (probe == kNotProbed) {
      probe = abs_max_bits_of(k, n, sh_.D, ldk) | (static_cast<uint64_t>(abs_max_bits_of(v, n, sh_.D_v, ldv)) << 32);
      slot.store(probe, std::memory_order_relaxed);
    }
    return probe;
  }

  // Key tile t of unit u's item and KV head (n keys at k, their values at v) in packed panels, into *kp and *vp:
  // from the shared store, packed there by the first unit that asks (share_tiles); or, without a store, or while
  // another thread is packing it, into this thread's scratch (pack_tile).  False without a packed kernel.
  bool tile_panels(const AttentionUnit& u, int64_t t, int64_t n, const float* k, int64_t ldk, const float* v,
                   int64_t ldv, const PackedWeight** kp, const PackedWeight** vp) const {
    if (state_ != nullptr) {
      const size_t i = slot_of(u.b, sh_.kv_head(u.h), t);
      uint8_t st = state_[i].load(std::memory_order_acquire);
      if (st == kEmpty && state_[i].compare_exchange_strong(st, kPacking, std::memory_order_acq_rel)) {
        const bool ok = panels_[2 * i].PackTransposed(k, n, sh_.D, ldk) && panels_[2 * i + 1].Pack(v, n, sh_.D_v, ldv);
        st = ok ? kReady : kDeclined;
        state_[i].store(st, std::memory_order_release);
      }
      if (st == kReady) {
        *kp = &panels_[2 * i];
        *vp = &panels_[2 * i + 1];
        return true;
      }
    }
    AttentionScratch& as = thread_attention_scratch();
    *kp = &as.k_panels;
    *vp = &as.v_panels;
    return pack_tile(n, sh_.D, sh_.D_v, k, ldk, v, ldv);
  }

  // Whether the units share a store of packed key tiles (tile_store_floats): where a tile serves several query
  // heads (grouped KV heads), or kMinSharingBlocks blocks of query rows or more (no window on both sides).  With
  // fewer blocks and one query head per KV head the store saved too little for the memory it takes (the
  // measurements: docs/native-kernels.md).
  static constexpr int64_t kMinSharingBlocks = 8;
  bool shares_tiles() const {
    if (!tiled_) return false;
    if (sh_.kv_heads() < sh_.N) return true;
    const bool bounded = sh_.window_left >= 0 && sh_.window_right >= 0;
    return !bounded && (sh_.S_q + unit_rows_ - 1) / unit_rows_ >= kMinSharingBlocks;
  }

  // The slots of the tile probes and the tile store: per item, KV head and key tile (long rows only).
  size_t probe_slots() const {
    return tiled_ ? static_cast<size_t>(sh_.B * sh_.kv_heads() * ((sh_.S_k + key_tile_ - 1) / key_tile_)) : 0;
  }
  size_t slot_of(int64_t b, int64_t g, int64_t t) const {
    return static_cast<size_t>((b * sh_.kv_heads() + g) * ((sh_.S_k + key_tile_ - 1) / key_tile_) + t);
  }

  // The largest |x| over rows x[0..n) (each of `cols` floats, leading dimension ld), as its bits (lanes.h): at or
  // above kInfBits where one is not finite, which ends the scan.
  ATTNCAL_ISA_BODY uint32_t abs_max_bits_of_isa(const float* x, int64_t n, int64_t cols, int64_t ld) {
    uint32_t mx = 0;
    for (int64_t i = 0; i < n && mx < kInfBits; ++i) {
      const uint32_t m = abs_max_bits(x + i * ld, cols);
      mx = m > mx ? m : mx;
    }
    return mx;
  }
  ATTNCAL_ISA_DISPATCH(uint32_t, abs_max_bits_of, (const float* x, int64_t n, int64_t cols, int64_t ld),
                       (x, n, cols, ld))

  // Whether rows x[0..n) (each of `cols` floats, leading dimension ld) are all finite; their largest |x| in
  // *amax when it is given.
  static bool finite_abs_max(const float* x, int64_t n, int64_t cols, int64_t ld, float* amax) {
    const uint32_t mx = abs_max_bits_of(x, n, cols, ld);
    if (mx >= kInfBits) return false;
    if (amax != nullptr) std::memcpy(amax, &mx, sizeof mx);
    return true;
  }

  // Keys [k0, k0 + n) of query row q (scores `row`, the item's padding bias `bias` from k0): float32's lowest
  // added at those outside q's window, once (a padding key already holds it), as transformers' combined mask.
  void mask_window(float* row, int64_t q, int64_t k0, int64_t n, const float* bias) const {
    const float lowest = std::numeric_limits<float>::lowest();
    const int64_t end = k0 + n;
    if (sh_.window_left >= 0)
      for (int64_t k = k0, stop = std::min(end, q - sh_.window_left); k < stop; ++k)
        if (bias[k - k0] == 0.f) row[k - k0] += lowest;
    if (sh_.window_right >= 0)
      for (int64_t k = std::max(k0, q + sh_.window_right + 1); k < end; ++k)
        if (bias[k - k0] == 0.f) row[k - k0] += lowest;
  }

  // The relative position bias of every head at every offset: rel_[h * (2K - 1) + (k - q + K - 1)], built once
  // per call (O(N * S_k)) so that a score row adds a contiguous run of it; rel_max_ its largest |value|
  // (infinity when the table is not finite: then no key is skipped, and a NaN reaches its rows as the contract
  // says).
  void plan_relative(const RelativeBias& rel) {
    const int64_t K = sh_.S_k, width = 2 * K - 1, N = sh_.N;
    const float span = relative_log_span(rel.buckets, rel.max_distance);
    rel_.assign(static_cast<size_t>(N * width), 0.f);
    for (int64_t i = 0; i < rel.buckets * N; ++i) {
      const float a = std::fabs(rel.table[i]);
      rel_max_ = a <= std::numeric_limits<float>::max() ? std::max(rel_max_, static_cast<double>(a))
                                                          : std::numeric_limits<double>::infinity();
    }
    for (int64_t d = 0; d < width; ++d) {
      const float* bucket = rel.table + relative_bucket(d - (K - 1), rel.buckets, span) * N;
      for (int64_t h = 0; h < N; ++h) rel_[h * width + d] = bucket[h];
    }
  }

  // Head h's bias for query row q, indexed by key: entry k is the bias at (q, k); row q + r is this pointer
  // minus r.  nullptr without a relative position bias.
  const float* relative_row(int64_t h, int64_t q) const {
    if (rel_.empty()) return nullptr;
    const int64_t K = sh_.S_k;
    return rel_.data() + h * (2 * K - 1) + (K - 1) - q;
  }

  ATTNCAL_ISA_BODY void scale_row_isa(float* x, int64_t n, float a) {
    for (int64_t k = 0; k < n; ++k) x[k] *= a;
  }
  ATTNCAL_ISA_DISPATCH(void, scale_row, (float* x, int64_t n, float a), (x, n, a))

  // sum_lanes in a function of its own: inlined into tiles(), which is not multiversioned, it would be compiled
  // for baseline x86-64 (its 8-lane vector split into SSE halves on the stack; see cpu/lanes.h).
  ATTNCAL_ISA_BODY float sum_row_isa(const float* x, int64_t n) { return sum_lanes(x, n); }
                                     ATTNCAL_ISA_DISPATCH(float, sum_row, (const float* x, int64_t n), (x, n))
                                     
                                     ATTNCAL_ISA_BODY void add_row_isa(float* x, const float* b, int64_t n) {
    for (int64_t k = 0; k < n; ++k) x[k] += b[k];
  }
  ATTNCAL_ISA_DISPATCH(void, add_row, (float* x, const float* b, int64_t n), (x, b, n))

  AttentionShape sh_;
  int64_t rows_ = 1;  // rows of a whole-row block
  int64_t unit_rows_ = 1, key_tile_ = 1;
  bool tiled_ = false;
  std::vector<ItemPlan> items_;
  std::vector<const float*> keep_of_;
  std::vector<float> keep_, bias_;
  std::vector<float> rel_;  // the relative position bias per head and offset (plan_relative), or empty
  double rel_max_ = 0.0;
  std::vector<char> masked_;  // per item: 1 when some key is masked
  std::vector<char> marked_;  // with marked_rows, per item and query row: 1 where the row is calibrated
  std::vector<int64_t> valid_;  // per item: [first valid key, last valid key + 1)
  std::vector<AttentionUnit> units_;
  // Long rows: per item, KV head and key tile, probe_tile's answer once a unit has asked (kNotProbed before).
  static constexpr uint64_t kNotProbed = ~uint64_t{0};
  mutable std::unique_ptr<std::atomic<uint64_t>[]> probes_;
  // The shared store (share_tiles): per slot a tile's keys and values in packed panels, and its state.
  enum : uint8_t { kEmpty, kPacking, kReady, kDeclined };
  mutable std::vector<PackedWeight> panels_;
  mutable std::unique_ptr<std::atomic<uint8_t>[]> state_;
};

// The whole op, serially (the ORT kernel runs the same units on the intra-op pool, its key tiles' store in the
// session's arena).
template <typename T>
void calibrated_attention(const T* query, const T* key, const T* value, const int64_t* mask, T* context,
                          const AttentionShape& shape, const AttncalParams& p, const RelativeBias& rel = RelativeBias{}) {
  gemm_init();
  AttentionPlan plan(mask, shape, p, rel);
  std::vector<float> store;
  if (std::is_same<T, float>::value && plan.tile_store_floats() > 0) {
    store.resize(static_cast<size_t>(plan.tile_store_floats()));
    plan.share_tiles(store.data());
  }
  for (size_t i = 0; i < plan.size(); ++i) plan.run(i, query, key, value, context, p);
}

}  // namespace attncal

#endif  // ATTNCAL_CPU_CALIBRATED_ATTENTION_H_
