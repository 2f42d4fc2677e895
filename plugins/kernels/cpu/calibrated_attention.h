// PooledRowCalibratedAttention / AllRowsCalibratedAttention on the host: the whole attention of one
// layer with the calibration inside, in one pass over a block of query rows (the op contract is
// attncal/graphs/contract.py; the float64 spec is attncal.calibration.oracle.attention_reference).
//
// Per work unit (batch item b, head h, a block of R query rows):
//   1. scores[R,S_k] = scale * Q_blk * K_h^T          one GEMM (cpu/gemm.h) into per-thread scratch
//   2. + the mask bias (float32's lowest finite value at masked keys, added as the contract says)
//   3. per row: softmax, and for the rows the calibration selects, the calibration, in place while
//      the row is in cache: the Softmax-fused op's own routines (cpu/row_calibration.h), so the
//      arithmetic, the fully-masked and non-finite rules are the ones that op already proves
//   4. context[R,D_v] = P * V_h                          one GEMM, written into the output
// Why this shape:
// * No [B,H,S,S] tensor exists: scratch is R x S_k floats per thread (plus the widened Q, K, V
//   blocks for float16).  R is chosen so that the block stays in L2 (1 MiB), which is what
//   ONNX Runtime's fused CPU Attention does not do: it computes every head's probabilities into
//   one B*N*S*S buffer first (see ../shared/notes/one-pass-attention.md).
// * The units are independent and each row is computed by exactly one unit whose size depends
//   only on the shapes, so results are bit-identical at any thread count.
// * float16 is computed in float32: the block of Q and the head's K and V are widened per unit
//   (K and V once per unit: O(S_k*D) against the unit's O(R*S_k*D) work), the context rounded once.
#ifndef ATTNCAL_CPU_CALIBRATED_ATTENTION_H_
#define ATTNCAL_CPU_CALIBRATED_ATTENTION_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/attention_shape.h"
#include "common/span_geometry.h"
#include "cpu/batch_plan.h"
#include "cpu/gemm.h"
#include "cpu/half.h"
#include "cpu/row_calibration.h"

namespace attncal {

struct AttentionUnit {
  int64_t b, h, q0, q1;
};

// Per-thread scratch of the attention kernel (separate from Scratch: the row routines use that).
struct AttentionScratch {
  std::vector<float> scores, q, k, v, ctx;
};

inline AttentionScratch& thread_attention_scratch() {
  static thread_local AttentionScratch s;
  return s;
}

inline void ensure(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
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

  AttentionPlan(const int64_t* mask, const AttentionShape& shape, const AttncalParams& p) : sh_(shape) {
    const int64_t B = sh_.B, Q = sh_.S_q, K = sh_.S_k;
    if (B * Q * K * sh_.N == 0) return;
    plan_items(mask, B, Q, K, p, &items_, &keep_, &keep_of_);
    // The additive mask bias, one row per item: 0 at valid keys, float32's lowest at masked ones.
    bias_.assign(static_cast<size_t>(B * K), 0.f);
    masked_.assign(static_cast<size_t>(B), 0);
    for (int64_t i = 0; i < B * K; ++i)
      if (mask[i] == 0) {
        bias_[i] = std::numeric_limits<float>::lowest();
        masked_[i / K] = 1;
      }
    rows_ = std::max<int64_t>(1, std::min<int64_t>({Q, kMaxRows, kBlockBytes / (4 * K)}));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < sh_.N; ++h)
        for (int64_t q = 0; q < Q; q += rows_) units_.push_back({b, h, q, std::min(q + rows_, Q)});
  }

  size_t size() const { return units_.size(); }
  int64_t rows_per_unit() const { return rows_; }

  // Unit i: T is float or uint16_t (float16 bits).
  template <typename T>
  void run(size_t i, const T* query, const T* key, const T* value, T* context, const AttncalParams& p) const {
    const AttentionUnit& u = units_[i];
    const ItemPlan& it = items_[u.b];
    const float* keep = keep_of_[u.b];
    const int64_t K = sh_.S_k, D = sh_.D, Dv = sh_.D_v, R = u.q1 - u.q0;
    const int64_t ldq = sh_.ld_q ? sh_.ld_q : sh_.N * D, ldk = sh_.ld_k ? sh_.ld_k : sh_.N * D;
    const int64_t ldv = sh_.ld_v ? sh_.ld_v : sh_.N * Dv, ldo = sh_.N * Dv;
    AttentionScratch& as = thread_attention_scratch();
    Scratch& sc = thread_scratch();
    ensure(as.scores, R * K);
    float* s = as.scores.data();
    const T* q_src = query + (u.b * sh_.S_q + u.q0) * ldq + u.h * D;
    const T* k_src = key + u.b * K * ldk + u.h * D;
    const T* v_src = value + u.b * K * ldv + u.h * Dv;
    const float *qf, *kf, *vf;
    int64_t lq = ldq, lk = ldk, lv = ldv;
    if constexpr (std::is_same<T, float>::value) {
      qf = q_src;
      kf = k_src;
      vf = v_src;
    } else {
      ensure(as.q, R * D);
      ensure(as.k, K * D);
      ensure(as.v, K * Dv);
      widen_block(q_src, R, D, ldq, as.q.data());
      widen_block(k_src, K, D, ldk, as.k.data());
      widen_block(v_src, K, Dv, ldv, as.v.data());
      qf = as.q.data();
      kf = as.k.data();
      vf = as.v.data();
      lq = lk = D;
      lv = Dv;
    }
    gemm_nt(R, K, D, sh_.scale, qf, lq, kf, lk, s, K);
    const float* bias = bias_.data() + u.b * K;
    const int64_t c0 = it.active ? std::max(u.q0, it.q_lo) : u.q1;
    const int64_t c1 = it.active ? std::min(u.q1, it.q_hi + 1) : u.q1;
    // An item without masked keys has a zero bias row: skipping the pass is exact (s + 0 == s).
    const bool add_bias = masked_[u.b] != 0;
    for (int64_t r = 0; r < R; ++r) {
      float* row = s + r * K;
      if (add_bias) add_row(row, bias, K);
      const int64_t q = u.q0 + r;
      if (q >= c0 && q < c1) {
        softmax_calibrate_row(row, row, K, it, keep, p, sc);
      } else {
        softmax_row(row, row, K, sc);
      }
    }
    T* out = context + (u.b * sh_.S_q + u.q0) * ldo + u.h * Dv;
    if constexpr (std::is_same<T, float>::value) {
      gemm_nn(R, Dv, K, s, K, vf, lv, out, ldo);
    } else {
      ensure(as.ctx, R * Dv);
      gemm_nn(R, Dv, K, s, K, vf, lv, as.ctx.data(), Dv);
      for (int64_t r = 0; r < R; ++r) narrow_row(as.ctx.data() + r * Dv, out + r * ldo, Dv);
    }
  }

 private:
  ATTNCAL_CLONES static void add_row(float* x, const float* b, int64_t n) {
    for (int64_t k = 0; k < n; ++k) x[k] += b[k];
  }

  AttentionShape sh_;
  int64_t rows_ = 1;
  std::vector<ItemPlan> items_;
  std::vector<const float*> keep_of_;
  std::vector<float> keep_, bias_;
  std::vector<char> masked_;  // per item: 1 when some key is masked
  std::vector<AttentionUnit> units_;
};

// The whole op, serially (the ORT kernel runs the same units on the intra-op pool).
template <typename T>
void calibrated_attention(const T* query, const T* key, const T* value, const int64_t* mask, T* context,
                          const AttentionShape& shape, const AttncalParams& p) {
  gemm_init();
  const AttentionPlan plan(mask, shape, p);
  for (size_t i = 0; i < plan.size(); ++i) plan.run(i, query, key, value, context, p);
}

}  // namespace attncal

#endif  // ATTNCAL_CPU_CALIBRATED_ATTENTION_H_
