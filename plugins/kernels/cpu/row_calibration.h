// The calibration math of one row on the host, at memory speed: the spec is
// attncal.calibration.oracle.reference; the CUDA kernels (cuda/calibration_kernels.cuh)
// use the same formulation.  The batch planner that splits a call into work units is
// cpu/batch_plan.h; the geometry of an item (its span, baskets, calibrated rows) is
// common/span_geometry.h, shared with the CUDA kernels.
//
// Per calibrated row:
//   z = probs masked to the valid keys; content = the valid span minus the
//   isolated first/last tokens, split into baskets of `basket_size`;
//   A_k = basket mass; f_k = 1 / (A_k * t) (0 for an empty basket), t = baskets
//   + isolated tokens.  The content mass of the calibrated row is therefore
//   n_nonempty / t, so the budget rescale and the normalisation reduce to
//   scalars, and the output is z * g_k on content keys with one constant
//   g_k = (f_k * scale) / total * lambda + 1 - lambda per basket,
//   lambda * (share / total) + (1 - lambda) * z on isolated keys, and 0 on
//   masked keys.  Rows the spec leaves alone are not touched.  The row scalars
//   are common/row_scalars.h's, shared with the CUDA kernels.  With isolate_self
//   (landmark rows) the row's own key is summed out of its basket and written
//   last with its own share: O(1) more per row, no third pass.
//
// Why it is shaped like this:
// * Each row is two streaming passes over its keys, both per basket: one sum
//   and one scale by a constant (no per-element branch or division); the sums
//   and maxima are written on 8-float vectors (the compiler leaves lane loops
//   over arrays scalar), the maps are vectorised by it.  The per-row scalars are computed in double and
//   divide by `total` rather than multiplying by its reciprocal: a subnormal
//   fixed weight makes `total` subnormal and 1/total overflow.
// * float16 is computed in float32 (a per-thread row buffer; cpu/half.h).
// * The Softmax-fused ops (softmax_calibrate) take the scores: every row gets
//   its softmax, and a calibrated row is calibrated while it is still in the
//   cache, so calibration adds no memory traffic to the softmax's own.  exp is
//   cpu/exp.h's branch-free polynomial, so the row loop vectorises; on x86-64
//   the row routines are compiled for AVX-512, AVX2 and baseline and called
//   through the active instruction-set path (cpu/isa.h).
//
// Rows that are fully masked or not finite (the contract, attncal/graphs/contract.py;
// tests/test_masked_rows.py checks every op against the oracle):
// * softmax_row is ONNX Softmax(axis=-1): scores that are all the dtype's lowest finite value
//   (how transformers masks) give 1/K at every key, and a calibrated such row is then calibrated
//   as usual (masked keys are excluded by attention_mask, not by the scores); scores that are all
//   -inf, or hold a NaN or +inf, give NaN at every key, as ONNX Runtime's Softmax and
//   torch.softmax do, whether the row is calibrated or not.  Partly -inf rows are ordinary
//   (exp(-inf) = 0).
// * calibrate_row_f32 (both op families): a calibrated row holding a NaN or an infinity at any
//   of its K keys comes back NaN at every key, masked keys included (a probe of the keys outside
//   the content plus the basket masses, before the first write).  Rows that are not calibrated
//   (other query rows, padding query rows, short items, strength 0) are not touched in place and
//   copied bit for bit out of place, NaN included.  No NaN turns finite, no finite row turns NaN,
//   and a row's NaN never reaches another row.
// * The one-pass calibrated attention ops (cpu/calibrated_attention.h) state their own rule in the
//   contract (a fully masked item: the mean of V over all keys, as the lowest-value additive mask
//   gives; not 0 as in FlashAttention) and reach it through these same row routines.
#ifndef ATTNCAL_CPU_ROW_CALIBRATION_H_
#define ATTNCAL_CPU_ROW_CALIBRATION_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common/attncal_params.h"
#include "common/row_scalars.h"
#include "common/span_geometry.h"
#include "cpu/exp.h"
#include "cpu/half.h"
#include "cpu/lanes.h"

namespace attncal {

// The row scalars of the last calibrated row a thread computed, with everything they were computed from
// (row_scalars).  The scalars are a chain of divisions in double, about as long as the softmax of a 128-key row
// itself; the rows of one item mostly share them (an all-rows item without isolated or own keys: every row whose
// baskets all hold mass), so a row that asks for the same inputs takes them from here.
struct RowScalarsMemo {
  bool valid = false;
  int own = 0;
  int64_t nonempty = 0;
  uint64_t t, z_first, z_last, z_own;  // the bits of t_item and of the probabilities that enter the scalars
  AttncalParams p;                      // a byte copy of the parameters it was asked with
  AttncalRowScalars rs;
};

// Per-thread scratch: basket masses and multipliers, a float row for fp16, the last row scalars.
struct Scratch {
  std::vector<float> baskets, coef, row;
  RowScalarsMemo scalars;
};

inline uint64_t double_bits(double x) {
  uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// attncal_row_scalars (common/row_scalars.h) of a row, or the thread's last answer where it was asked for the
// same: the same parameter bytes (every field, more than the scalars read), t and nonempty, and the same bits of
// each probability the written outputs use (z_first with isolate_first, z_last with isolate_last, z_own with an
// own key; the others leave only outputs that are not written).  So every row gets exactly the bits attncal_row_scalars gives it.
inline const AttncalRowScalars& row_scalars(Scratch& sc, const AttncalParams& p, int64_t nonempty, double t_item,
                                            double z_first, double z_last, int own, double z_own) {
  RowScalarsMemo& m = sc.scalars;
  const uint64_t zf = p.isolate_first ? double_bits(z_first) : 0, zl = p.isolate_last ? double_bits(z_last) : 0;
  const uint64_t zo = own != ATTNCAL_OWN_NONE ? double_bits(z_own) : 0, t = double_bits(t_item);
  if (!(m.valid && m.nonempty == nonempty && m.own == own && m.t == t && m.z_first == zf && m.z_last == zl &&
        m.z_own == zo && std::memcmp(&m.p, &p, sizeof p) == 0)) {
    m.rs = attncal_row_scalars(&p, nonempty, t_item, z_first, z_last, own, z_own);
    m.valid = true;
    m.nonempty = nonempty;
    m.own = own;
    m.t = t;
    m.z_first = zf;
    m.z_last = zl;
    m.z_own = zo;
    std::memcpy(&m.p, &p, sizeof p);
  }
  return m.rs;
}

inline Scratch& thread_scratch() {
  static thread_local Scratch s;
  return s;
}

// Per-thread room for n basket masses and multipliers.
inline void ensure_baskets(Scratch& sc, int64_t n) {
  if (static_cast<int64_t>(sc.baskets.size()) < n) {
    sc.baskets.resize(static_cast<size_t>(n));
    sc.coef.resize(static_cast<size_t>(n));
  }
}

// A basket's multiplier g as stored.  A basket whose mass is below 2^-64 (`tiny`: e.g. subnormal
// probabilities behind a dominant key) has a multiplier beyond the float range; it is kept scaled by
// 2^-64, flagged by a negative sign, and applied as (x * 2^64) * g' (scaling by a power of two is exact).
inline float encode_multiplier(double g, bool tiny) {
  return tiny ? -static_cast<float>(g * 0x1p-64) : static_cast<float>(g);
}

// y = x * (0/1 mask m, when the row has holes) * g over one basket, g as encode_multiplier stores it.
ATTNCAL_ISA_BODY void scale_basket_isa(const float* x, float* y, int64_t n, float g, const float* m) {
  if (g < 0.f) {  // the scaled multiplier of a tiny basket (rare)
    for (int64_t k = 0; k < n; ++k) y[k] = (x[k] * (m ? m[k] : 1.0f) * 0x1p64f) * -g;
  } else if (m) {
    for (int64_t k = 0; k < n; ++k) y[k] = x[k] * m[k] * g;
  } else {
    for (int64_t k = 0; k < n; ++k) y[k] = x[k] * g;
  }
}
ATTNCAL_ISA_DISPATCH(void, scale_basket, (const float* x, float* y, int64_t n, float g, const float* m),
                     (x, y, n, g, m))

// The mass of keys [lo, lo + len) of x (times the 0/1 mask m where the row has holes), without key `own` where
// it lies among them (the own key of an isolate_self row leaves its basket): the sums on either side of it.
// Inlined into each path's row routines, as the lane sums are (cpu/lanes.h).
inline float basket_mass(const float* x, const float* m, int64_t lo, int64_t len, int64_t own) {
  if (own < lo || own >= lo + len) return m ? sum_masked_lanes(x + lo, m + lo, len) : sum_lanes(x + lo, len);
  const int64_t a = own - lo, b = lo + len - own - 1;
  return m ? sum_masked_lanes(x + lo, m + lo, a) + sum_masked_lanes(x + own + 1, m + own + 1, b)
           : sum_lanes(x + lo, a) + sum_lanes(x + own + 1, b);
}

// Calibrates one float row x, query row q of its item, into y (y may alias x); keep: the item's 0/1 key mask
// when its span has holes, else null (cpu/batch_plan.h: plan_items).  With isolate_self, key q is the row's own
// key (common/span_geometry.h: own_key).  A row holding a NaN or an infinity at any of its K keys comes back
// NaN at every key (the contract's "NaN in, NaN out"; see the file comment).
ATTNCAL_ISA_BODY void calibrate_row_f32_isa(const float* x, float* y, int64_t K, int64_t q, const ItemPlan& it,
                                            const float* keep, const AttncalParams& p, Scratch& sc) {
  const Span& s = it.s;
  const RowPlan& rp = it.rp;
  const int64_t S = p.basket_size, c_end = rp.c0 + rp.C, n = rp.n;
  const float* m = keep;
  const int own = own_key(s, p, q);
  const int64_t out_of_basket = own == ATTNCAL_OWN_CONTENT ? q : -1;
  ensure_baskets(sc, n);
  float* A = sc.baskets.data();
  float* g = sc.coef.data();
  // Pass 1: basket masses (reads only).
  int64_t nonempty = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t lo = rp.c0 + b * S, len = std::min(S, c_end - lo);
    const float a = basket_mass(x, m, lo, len, out_of_basket);
    A[b] = a;
    nonempty += a != 0.f;
  }
  // NaN in, NaN out: pass 1 summed the content keys (a NaN or an infinity there, holes included,
  // makes its basket's mass NaN or infinite); the keys outside the content, and an own key taken out of its
  // basket, are probed here, all before the first write (y may alias x).
  float probe = nonfinite_probe(x, rp.c0) + nonfinite_probe(x + c_end, K - c_end);
  if (out_of_basket >= 0) probe += x[q] * 0.f;
  for (int64_t b = 0; b < n; ++b) probe += A[b] * 0.f;
  if (probe != probe) {
    std::fill(y, y + K, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const double z_own = own != ATTNCAL_OWN_NONE ? x[q] : 0.0;
  const AttncalRowScalars& rs = row_scalars(sc, p, nonempty, rp.t, x[s.start], x[s.end], own, z_own);
  const double t = rs.t;
  for (int64_t b = 0; b < n; ++b) {
    const double gb = A[b] != 0.f ? rs.coef / (static_cast<double>(A[b]) * t) + rs.keep : rs.keep;
    g[b] = encode_multiplier(gb, A[b] != 0.f && A[b] < 0x1p-64f);
  }
  // Pass 2: one scale by a constant per basket; zeros outside the valid span.
  std::fill(y, y + s.start, 0.f);
  std::fill(y + s.end + 1, y + K, 0.f);
  for (int64_t b = 0; b < n; ++b) {
    const int64_t lo = rp.c0 + b * S, len = std::min(S, c_end - lo);
    scale_basket(x + lo, y + lo, len, g[b], m ? m + lo : nullptr);
  }
  if (p.isolate_first) y[s.start] = static_cast<float>(rs.first_out);
  if (p.isolate_last) y[s.end] = static_cast<float>(rs.last_out);
  if (own != ATTNCAL_OWN_NONE) y[q] = static_cast<float>(rs.own_out);
}
ATTNCAL_ISA_DISPATCH(void, calibrate_row_f32, (const float* x, float* y, int64_t K, int64_t q, const ItemPlan& it,
                     const float* keep, const AttncalParams& p, Scratch& sc),
                     (x, y, K, q, it, keep, p, sc))

// ---------------------------------------------------------------- softmax

// max over a row of n > 0 floats in 8 lanes (a single running maximum is a serial chain the
// compiler may not reorder: ~4 cycles per key).  A NaN score may or may not win the
// maximum, depending on its lane; either way x - max is NaN at that key, so the softmax sum is NaN.
ATTNCAL_ISA_BODY float row_max_isa(const float* x, int64_t n) {
  Lanes8 mx = {x[0], x[0], x[0], x[0], x[0], x[0], x[0], x[0]};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    ATTNCAL_LANES8_LOAD(v, x + i);
    mx = v > mx ? v : mx;
  }
  float m = mx[0];
  for (int j = 1; j < 8; ++j) m = mx[j] > m ? mx[j] : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}
ATTNCAL_ISA_DISPATCH(float, row_max, (const float* x, int64_t n), (x, n))

// y = exp(x - max(x)) / sum over a row of n > 0 floats (y may alias x): ONNX Softmax(axis=-1) of
// it.  A row whose entries are all equal (e.g. fully masked with the dtype's lowest value) becomes
// uniform, 1/n at every key.  A row with no finite maximum (all -inf) or holding a NaN or +inf
// becomes NaN at every key, as ONNX Runtime's Softmax and torch.softmax give: x - max is NaN at
// some key, exp_nonpos keeps it, and the NaN sum spreads it over the row.
ATTNCAL_ISA_BODY void softmax_row_isa(const float* x, float* y, int64_t n) {
  exp_shifted_row(x, y, n, row_max(x, n));
  const float sum = sum_lanes(y, n);
  const float inv = 1.0f / sum;  // sum >= 1 (the max term is exp(0)), or NaN
  for (int64_t i = 0; i < n; ++i) y[i] *= inv;
}
ATTNCAL_ISA_DISPATCH(void, softmax_row, (const float* x, float* y, int64_t n), (x, y, n))

// Widen / narrow float16 rows (vectorisable).
ATTNCAL_ISA_BODY void widen_row_isa(const uint16_t* x, float* y, int64_t n) {
  for (int64_t k = 0; k < n; ++k) y[k] = half_to_float(x[k]);
}
ATTNCAL_ISA_DISPATCH(void, widen_row, (const uint16_t* x, float* y, int64_t n), (x, y, n))
ATTNCAL_ISA_BODY void narrow_row_isa(const float* x, uint16_t* y, int64_t n) {
  for (int64_t k = 0; k < n; ++k) y[k] = float_to_half(x[k]);
}
ATTNCAL_ISA_DISPATCH(void, narrow_row, (const float* x, uint16_t* y, int64_t n), (x, y, n))

inline void softmax_row(const uint16_t* x, uint16_t* y, int64_t n, Scratch& sc) {
  if (static_cast<int64_t>(sc.row.size()) < n) sc.row.resize(static_cast<size_t>(n));
  float* r = sc.row.data();
  widen_row(x, r, n);
  softmax_row(r, r, n);
  narrow_row(r, y, n);
}
inline void softmax_row(const float* x, float* y, int64_t n, Scratch&) { softmax_row(x, y, n); }

// Softmax and calibration of one calibrated row (y may alias x), in the passes of the softmax alone:
// the max; e = exp(x - max); the row sum, taken as the sum of the basket sums of e and of the keys
// outside the content (the basket masses come with it: A_b = sum_b(e) / sum); one scale per basket,
// e * (g_b / sum), where the unfused form (softmax_row, then calibrate_row_f32) scales by 1 / sum and
// then by g_b in two more passes and sums the baskets in a third.  Same arithmetic otherwise: the row
// scalars of common/row_scalars.h, g_b in double; a basket of mass below 2^-64 is scaled as (e * 2^64) * h'
// (exact powers of two).  A row whose softmax is NaN (all -inf, a NaN or +inf score) has a NaN sum
// and comes back NaN at every key, as softmax followed by the separate op gives.
ATTNCAL_ISA_BODY void softmax_calibrate_row_f32_isa(const float* x, float* y, int64_t K, int64_t q,
                                                    const ItemPlan& it, const float* keep, const AttncalParams& p,
                                                    Scratch& sc) {
  const Span& s = it.s;
  const RowPlan& rp = it.rp;
  const int64_t S = p.basket_size, c_end = rp.c0 + rp.C, n = rp.n;
  const float* m = keep;
  const int own = own_key(s, p, q);
  const int64_t out_of_basket = own == ATTNCAL_OWN_CONTENT ? q : -1;
  exp_shifted_row(x, y, K, row_max(x, K));  // NaN scores: caught by the sum below
  ensure_baskets(sc, n);
  float* A = sc.baskets.data();
  float* h = sc.coef.data();
  // Masked keys count in the softmax's sum (the scores decide them), not in the basket masses; an own key
  // taken out of its basket counts in the sum.
  float total = sum_lanes(y, rp.c0) + sum_lanes(y + c_end, K - c_end);
  for (int64_t b = 0; b < n; ++b) {
    const int64_t lo = rp.c0 + b * S, len = std::min(S, c_end - lo);
    A[b] = basket_mass(y, m, lo, len, out_of_basket);
    total += m ? sum_lanes(y + lo, len) : A[b];
  }
  if (out_of_basket >= 0 && !m) total += y[q];
  if (total != total) {  // NaN softmax: NaN at every key
    std::fill(y, y + K, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const float inv = 1.0f / total;  // total >= 1 (the max term is exp(0))
  int64_t nonempty = 0;
  for (int64_t b = 0; b < n; ++b) nonempty += A[b] * inv != 0.f;
  const double z_own = own != ATTNCAL_OWN_NONE ? y[q] * inv : 0.0;
  const AttncalRowScalars& rs = row_scalars(sc, p, nonempty, rp.t, y[s.start] * inv, y[s.end] * inv, own, z_own);
  const double t = rs.t;
  for (int64_t b = 0; b < n; ++b) {
    const double a = static_cast<double>(A[b] * inv);  // the basket's probability mass, as the unfused form
    const double gb = a != 0.0 ? rs.coef / (a * t) + rs.keep : rs.keep;
    const double hb = gb * static_cast<double>(inv);
    h[b] = encode_multiplier(hb, a != 0.0 && A[b] < 0x1p-64f);
  }
  for (int64_t b = 0; b < n; ++b) {
    const int64_t lo = rp.c0 + b * S, len = std::min(S, c_end - lo);
    scale_basket(y + lo, y + lo, len, h[b], m ? m + lo : nullptr);
  }
  std::fill(y, y + s.start, 0.f);
  std::fill(y + s.end + 1, y + K, 0.f);
  if (p.isolate_first) y[s.start] = static_cast<float>(rs.first_out);
  if (p.isolate_last) y[s.end] = static_cast<float>(rs.last_out);
  if (own != ATTNCAL_OWN_NONE) y[q] = static_cast<float>(rs.own_out);
}
ATTNCAL_ISA_DISPATCH(void, softmax_calibrate_row_f32, (const float* x, float* y, int64_t K, int64_t q,
                     const ItemPlan& it, const float* keep, const AttncalParams& p, Scratch& sc),
                     (x, y, K, q, it, keep, p, sc))

// Softmax, then calibration of row q while it is in the cache.
inline void softmax_calibrate_row(const float* x, float* y, int64_t K, int64_t q, const ItemPlan& it,
                                  const float* keep, const AttncalParams& p, Scratch& sc) {
  softmax_calibrate_row_f32(x, y, K, q, it, keep, p, sc);
}
inline void softmax_calibrate_row(const uint16_t* x, uint16_t* y, int64_t K, int64_t q, const ItemPlan& it,
                                  const float* keep, const AttncalParams& p, Scratch& sc) {
  if (static_cast<int64_t>(sc.row.size()) < K) sc.row.resize(static_cast<size_t>(K));
  float* r = sc.row.data();
  widen_row(x, r, K);
  softmax_calibrate_row_f32(r, r, K, q, it, keep, p, sc);
  narrow_row(r, y, K);
}

inline void calibrate_row(const float* x, float* y, int64_t K, int64_t q, const ItemPlan& it, const float* keep,
                          const AttncalParams& p, Scratch& sc) {
  calibrate_row_f32(x, y, K, q, it, keep, p, sc);
}

// float16 (as raw uint16 bits): widen the row, calibrate in float, narrow.
inline void calibrate_row(const uint16_t* x, uint16_t* y, int64_t K, int64_t q, const ItemPlan& it,
                          const float* keep, const AttncalParams& p, Scratch& sc) {
  if (static_cast<int64_t>(sc.row.size()) < K) sc.row.resize(static_cast<size_t>(K));
  float* r = sc.row.data();
  widen_row(x, r, K);
  calibrate_row_f32(r, r, K, q, it, keep, p, sc);
  narrow_row(r, y, K);
}

}  // namespace attncal

#endif  // ATTNCAL_CPU_ROW_CALIBRATION_H_
