// The calibration math on the host: one (batch, head, row) at a time, float32
// accumulation, the same formulation as the CUDA kernel (calibration_cuda.cu).
//
// Per calibrated row (the spec is attncal.calibration.oracle.reference):
//   z = probs masked to the valid keys; content = the valid span minus the
//   isolated first/last tokens, split into baskets of `basket_size`;
//   A_k = basket mass; f_k = 1 / (A_k * t) (0 for an empty basket), t = baskets
//   + isolated tokens.  The content mass of the calibrated row is therefore
//   n_nonempty / t, so the budget rescale and the normalisation reduce to two
//   scalars and the output is z * (lambda * f_k * scale / total + 1 - lambda)
//   on content keys, lambda * share / total + (1 - lambda) * z on isolated keys,
//   and 0 on masked keys.  Rows the spec leaves alone are not touched.
#ifndef ATTNCAL_CALIBRATION_CPU_H_
#define ATTNCAL_CALIBRATION_CPU_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attncal_params.h"

namespace attncal {

// Valid span of one mask row: [start, end], and whether it has masked holes.
struct Span {
  int64_t start = -1;
  int64_t end = -1;
  bool holes = false;
};

inline Span span_of(const int64_t* mask_row, int64_t K) {
  Span s;
  int64_t count = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (mask_row[k] != 0) {
      if (s.start < 0) s.start = k;
      s.end = k;
      ++count;
    }
  }
  s.holes = s.start >= 0 && count != s.end - s.start + 1;
  return s;
}

// Row geometry and the scalars every key of the row needs.
struct RowPlan {
  int64_t c0 = 0, C = 0, n = 0;
  float t = 1.f;
};

// False when the spec leaves the rows of this item untouched.
inline bool plan_rows(const Span& s, const AttncalParams& p, RowPlan* plan) {
  if (s.start < 0 || p.strength == 0.0f) return false;
  const int64_t length = s.end - s.start + 1;
  const int64_t n_iso = p.isolate_first + p.isolate_last;
  plan->c0 = s.start + p.isolate_first;
  plan->C = length - n_iso;
  if (plan->C <= 0 || (p.skip_short && plan->C < p.basket_size)) return false;
  plan->n = (plan->C + p.basket_size - 1) / p.basket_size;
  plan->t = static_cast<float>(plan->n + n_iso);
  return true;
}

// Calibrates one row; `load`/`store` convert between the I/O type and float.
template <typename T, typename Load, typename Store>
void calibrate_row(const T* in, T* out, const int64_t* mask_row, int64_t K, const Span& s, const RowPlan& rp,
                   const AttncalParams& p, std::vector<float>& baskets, Load load, Store store) {
  const int64_t S = p.basket_size;
  auto z = [&](int64_t k) -> float {
    if (k < s.start || k > s.end || (s.holes && mask_row[k] == 0)) return 0.f;
    return load(in[k]);
  };
  baskets.assign(static_cast<size_t>(rp.n), 0.f);
  int64_t n_nonempty = 0;
  for (int64_t b = 0; b < rp.n; ++b) {
    const int64_t lo = rp.c0 + b * S, hi = std::min(lo + S, rp.c0 + rp.C);
    float acc = 0.f;
    for (int64_t k = lo; k < hi; ++k) acc += z(k);
    baskets[b] = acc;
    n_nonempty += acc != 0.f;
  }
  const float inv_t = 1.f / rp.t;
  auto share_of = [&](int mode, float weight, int64_t pos) -> float {
    if (mode == ATTNCAL_MODE_EQUAL) return inv_t;
    if (mode == ATTNCAL_MODE_ORIGINAL) return z(pos);
    return weight;
  };
  const float first_share = p.isolate_first ? share_of(p.first_mode, p.first_weight, s.start) : 0.f;
  const float last_share = p.isolate_last ? share_of(p.last_mode, p.last_weight, s.end) : 0.f;
  const bool non_equal = (p.isolate_first && p.first_mode != ATTNCAL_MODE_EQUAL) ||
                         (p.isolate_last && p.last_mode != ATTNCAL_MODE_EQUAL);
  float content_mass = static_cast<float>(n_nonempty) * inv_t;
  float scale = 1.f;
  if (non_equal && content_mass != 0.f) {
    const float budget = std::max(0.f, 1.f - (first_share + last_share));
    scale = budget / content_mass;
    content_mass = budget;
  }
  const float total = content_mass + first_share + last_share;
  const float inv_total = total != 0.f ? 1.f / total : 1.f;
  const float lam = p.strength, keep = 1.f - p.strength;
  const float content_coef = lam * scale * inv_total;  // times f_k
  for (int64_t k = 0; k < K; ++k) {
    float v;
    if (k < s.start || k > s.end || (s.holes && mask_row[k] == 0)) {
      v = 0.f;
    } else if (p.isolate_first && k == s.start) {
      v = lam * first_share * inv_total + keep * load(in[k]);
    } else if (p.isolate_last && k == s.end) {
      v = lam * last_share * inv_total + keep * load(in[k]);
    } else {
      const float a = baskets[(k - rp.c0) / S];
      const float g = a != 0.f ? content_coef / (a * rp.t) + keep : keep;
      v = load(in[k]) * g;
    }
    out[k] = store(v);
  }
}

// Calibrates probs[B,H,Q,K] into out (which may alias probs); untouched rows
// are copied bit for bit when out != probs.
template <typename T, typename Load, typename Store>
void calibrate(const T* probs, T* out, const int64_t* mask, int64_t B, int64_t H, int64_t Q, int64_t K,
               const AttncalParams& p, Load load, Store store) {
  if (out != probs && B * H * Q * K > 0) std::memcpy(out, probs, sizeof(T) * static_cast<size_t>(B * H * Q * K));
  std::vector<float> baskets;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* mrow = mask + b * K;
    const Span s = span_of(mrow, K);
    RowPlan rp;
    if (!plan_rows(s, p, &rp)) continue;
    int64_t q_lo, q_hi;
    if (p.all_rows) {
      q_lo = s.start;
      q_hi = s.end;
    } else {
      // Q == 1 (row placement): the single row is the pooling row itself.
      q_lo = q_hi = (Q == 1) ? 0 : (p.pool_last ? s.end : s.start);
    }
    q_hi = std::min(q_hi, Q - 1);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t q = q_lo; q <= q_hi; ++q) {
        const int64_t off = ((b * H + h) * Q + q) * K;
        calibrate_row(probs + off, out + off, mrow, K, s, rp, p, baskets, load, store);
      }
    }
  }
}

}  // namespace attncal

#endif  // ATTNCAL_CALIBRATION_CPU_H_
