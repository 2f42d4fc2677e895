// The calibration math on the host, at memory speed: the spec is
// attncal.calibration.oracle.reference; the CUDA kernel (calibration_cuda.cu)
// uses the same formulation.
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
//   are row_scalars.h's, shared with the CUDA kernels.
//
// Why it is shaped like this:
// * Each row is two streaming passes over its keys, both per basket: one sum
//   and one scale by a constant (no per-element branch or division); the sums
//   and maxima are written on 8-float vectors (the compiler leaves lane loops
//   over arrays scalar), the maps are vectorised by it.  The per-row scalars are computed in double and
//   divide by `total` rather than multiplying by its reciprocal: a subnormal
//   fixed weight makes `total` subnormal and 1/total overflow.
// * float16 is computed in float32 (a per-thread row buffer).
// * The work is split into units of whole rows; a row is always computed the
//   same way by one thread, so results do not depend on the thread count.
// * In place (out == probs), only calibrated rows are read and written; out of
//   place, untouched rows are copied in the same pass, row range by row range,
//   never as a separate copy of the whole tensor.
// * The Softmax-fused ops (softmax_calibrate) take the scores: every row gets
//   its softmax, and a calibrated row is calibrated while it is still in the
//   cache, so calibration adds no memory traffic to the softmax's own.  exp is
//   a branch-free Cephes-style polynomial (about 1 ulp) so the row loop
//   vectorises; on x86-64 GCC/Clang compile it for AVX-512, AVX2 and baseline
//   and pick one at load time (target_clones).
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
// * The one-pass calibrated attention ops (calibrated_attention_cpu.h) state their own rule in the
//   contract (a fully masked item: the mean of V over all keys, as the lowest-value additive mask
//   gives; not 0 as in FlashAttention) and reach it through these same row routines.
#ifndef ATTNCAL_CALIBRATION_CPU_H_
#define ATTNCAL_CALIBRATION_CPU_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attncal_params.h"
#include "row_scalars.h"

namespace attncal {

// ---------------------------------------------------------------- float16
// IEEE binary16 <-> binary32 by bit manipulation (round to nearest even,
// NaN/Inf/subnormals preserved), branch-free so that row loops vectorise.
inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  // Normal numbers: move the exponent/mantissa into place and rebias by a multiply.
  const float normal = bits_to_float((two_w >> 4) + (0xE0u << 23)) * bits_to_float(0x07800000u);  // * 2^-112
  // Subnormals: build 0.5 + m * 2^-24 and subtract 0.5.
  const float subnormal = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t mag = two_w < (1u << 27) ? float_to_bits(subnormal) : float_to_bits(normal);
  return bits_to_float(sign | mag);
}

inline uint16_t float_to_half(float f) {
  // Scaling up then down rounds the mantissa to 10 bits (nearest even) in the FPU.
  float base = (std::fabs(f) * bits_to_float(0x77800000u)) * bits_to_float(0x08800000u);  // * 2^112 * 2^-110
  const uint32_t w = float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// ---------------------------------------------------------------- geometry
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

// Row geometry shared by every calibrated row of one batch item.
struct RowPlan {
  int64_t c0 = 0, C = 0, n = 0;
  double t = 1.0;
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
  plan->t = static_cast<double>(plan->n + n_iso);
  return true;
}

// One batch item: its geometry, which query rows are calibrated, and (only
// when the mask has holes inside the valid span) a 0/1 float mask of length K.
struct ItemPlan {
  Span s;
  RowPlan rp;
  bool active = false;
  int64_t q_lo = 0, q_hi = -1;  // calibrated query rows, inclusive
  const float* keep = nullptr;  // holes only
};

// Per-thread scratch: basket masses and multipliers, and a float row for fp16.
struct Scratch {
  std::vector<float> baskets, coef, row;
};

inline Scratch& thread_scratch() {
  static thread_local Scratch s;
  return s;
}

// ---------------------------------------------------------------- row math
// The row reductions run in 8 independent lanes, in a fixed order (so results do not depend on
// the thread count), as a GCC/Clang vector: written as loops over a float[8], GCC 12 keeps them
// scalar (one vaddss / vmaxss per key; the timings are in docs/native-kernels.md); the arithmetic
// per lane is the same either way.
#if !defined(__GNUC__)
#error "attncal's CPU kernels need GCC or Clang (vector extensions)"
#endif
typedef float Lanes8 __attribute__((vector_size(32)));

// Declares Lanes8 v holding x[0..8), loaded through memcpy (x need not be aligned).  A macro, not a
// function: passing a 32-byte vector by value has a target-dependent ABI (GCC's -Wpsabi).
#define ATTNCAL_LANES8_LOAD(v, x) \
  Lanes8 v;                       \
  std::memcpy(&v, (x), sizeof v)

inline float combine8(const Lanes8& a, float tail) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])) + tail;
}

// Sum of n floats in 8 lanes.
inline float sum_lanes(const float* x, int64_t n) {
  Lanes8 acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    ATTNCAL_LANES8_LOAD(v, x + i);
    acc += v;
  }
  float tail = 0.f;
  for (; i < n; ++i) tail += x[i];
  return combine8(acc, tail);
}

inline float sum_masked_lanes(const float* x, const float* m, int64_t n) {
  Lanes8 acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    ATTNCAL_LANES8_LOAD(v, x + i);
    ATTNCAL_LANES8_LOAD(w, m + i);
    acc += v * w;
  }
  float tail = 0.f;
  for (; i < n; ++i) tail += x[i] * m[i];
  return combine8(acc, tail);
}

// Sum of x[k] * 0 over n floats in 8 lanes: 0 when every x[k] is finite, NaN when one is NaN or
// infinite.
inline float nonfinite_probe(const float* x, int64_t n) {
  Lanes8 acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    ATTNCAL_LANES8_LOAD(v, x + i);
    acc += v * 0.f;
  }
  float tail = 0.f;
  for (; i < n; ++i) tail += x[i] * 0.f;
  return combine8(acc, tail);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__INTEL_COMPILER) && !defined(ATTNCAL_NO_CLONES)
#define ATTNCAL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define ATTNCAL_CLONES
#endif

// The row routines below are ATTNCAL_CLONES themselves, not only their innermost loops: the 8-lane sums
// (sum_lanes and its kin) are inlined into their caller and compiled for its target, and for baseline x86-64
// GCC lowers a 32-byte vector to two SSE halves kept on the stack, which costs several times the AVX2 form
// (see docs/native-kernels.md).

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
ATTNCAL_CLONES static void scale_basket(const float* x, float* y, int64_t n, float g, const float* m) {
  if (g < 0.f) {  // the scaled multiplier of a tiny basket (rare)
    for (int64_t k = 0; k < n; ++k) y[k] = (x[k] * (m ? m[k] : 1.0f) * 0x1p64f) * -g;
  } else if (m) {
    for (int64_t k = 0; k < n; ++k) y[k] = x[k] * m[k] * g;
  } else {
    for (int64_t k = 0; k < n; ++k) y[k] = x[k] * g;
  }
}

// Calibrates one float row x into y (y may alias x).  A row holding a NaN or an infinity at any of
// its K keys comes back NaN at every key (the contract's "NaN in, NaN out"; see the file comment).
ATTNCAL_CLONES static void calibrate_row_f32(const float* x, float* y, int64_t K, const ItemPlan& it,
                                             const AttncalParams& p, Scratch& sc) {
  const Span& s = it.s;
  const RowPlan& rp = it.rp;
  const int64_t S = p.basket_size, c_end = rp.c0 + rp.C, n = rp.n;
  const float* m = it.keep;
  ensure_baskets(sc, n);
  float* A = sc.baskets.data();
  float* g = sc.coef.data();
  // Pass 1: basket masses (reads only).
  int64_t nonempty = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t lo = rp.c0 + b * S, len = std::min(S, c_end - lo);
    const float a = m ? sum_masked_lanes(x + lo, m + lo, len) : sum_lanes(x + lo, len);
    A[b] = a;
    nonempty += a != 0.f;
  }
  // NaN in, NaN out: pass 1 summed the content keys (a NaN or an infinity there, holes included,
  // makes its basket's mass NaN or infinite); the keys outside the content are probed here, all
  // before the first write (y may alias x).
  float probe = nonfinite_probe(x, rp.c0) + nonfinite_probe(x + c_end, K - c_end);
  for (int64_t b = 0; b < n; ++b) probe += A[b] * 0.f;
  if (probe != probe) {
    std::fill(y, y + K, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const double t = rp.t;
  const AttncalRowScalars rs = attncal_row_scalars(&p, nonempty, t, x[s.start], x[s.end]);
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
}


// ---------------------------------------------------------------- softmax

typedef int32_t Ints8 __attribute__((vector_size(32)));

// exp(x) for x <= 0 (x - row max), subnormal results included (like expf and ONNX Runtime's
// Softmax); exactly 0 below -104 (under half the smallest subnormal) and for -inf; NaN for NaN
// (x - max is NaN for a NaN score and for a row of -inf or with +inf scores: ONNX Softmax gives
// NaN there).  n = round(x log2 e) by the 1.5 * 2^23 trick, r = x - n ln 2 in two parts, a
// degree-6 polynomial for e^r on [-ln2/2, ln2/2] (Cephes expf), times 2^n as two normal powers of
// two (n >= -150).  The clamp maps NaN to -104, so the integer conversion sees a finite value.
// F is float (I = int32_t) or Lanes8 (I = Ints8): one formula for the scalar and the 8-lane form, its
// branches written as selects.
template <typename F, typename I>
inline void exp_nonpos(const F& x, F& out) {
  const F zero = {};
  const F lo = zero - 104.0f;
  const F xc = x > lo ? x : lo;
  const F n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const F r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  F q = zero + 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  const F e = (q * r * r + r) + 1.0f;
  I ni;
  if constexpr (std::is_same<F, float>::value) {
    ni = static_cast<int32_t>(n);
  } else {
    ni = __builtin_convertvector(n, I);
  }
  const I n1 = ni >> 1, n2 = ni - n1;
  const I b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  const F v = (e * __builtin_bit_cast(F, b1)) * __builtin_bit_cast(F, b2);
  out = x < lo ? zero : (x == x ? v : x);
}

inline float exp_nonpos(float x) {
  float y;
  exp_nonpos<float, int32_t>(x, y);
  return y;
}

// max over a row of n > 0 floats in 8 lanes (a single running maximum is a serial chain the
// compiler may not reorder: ~4 cycles per key).  A NaN score may or may not win the
// maximum, depending on its lane; either way x - max is NaN at that key, so the softmax sum is NaN.
ATTNCAL_CLONES static float row_max(const float* x, int64_t n) {
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

// exp(x - m) over a row of n floats, 8 lanes at a time and the tail one by one.
__attribute__((always_inline)) inline void exp_shifted_row_lanes8(const float* x, float* y, int64_t n, float m) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    ATTNCAL_LANES8_LOAD(v, x + i);
    Lanes8 e;
    exp_nonpos<Lanes8, Ints8>(v - m, e);
    std::memcpy(y + i, &e, sizeof e);
  }
  for (; i < n; ++i) y[i] = exp_nonpos(x[i] - m);
}

// exp(x - m) over a row, one body per instruction set, picked at load time.  GCC 12 vectorises the scalar
// loop for AVX-512 (16 lanes, masks for the tail), but not for AVX2 or baseline x86-64 ("control flow in
// loop": it does not if-convert the exp's selects without masks), so those run the 8-lane form, one ymm
// register a step (a 16-lane form, two registers a step, was slower on an AVX2-only core).  The AVX2 version
// also asks for FMA, which AVX2 does not imply (a target_clones "avx2" clone has none): fused multiply-adds
// shorten the polynomial's dependency chain.  A CPU with AVX2 and no FMA runs the baseline version.  The
// measurements behind these choices: see docs/native-kernels.md.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__INTEL_COMPILER) && !defined(ATTNCAL_NO_CLONES)
__attribute__((target("avx512f"))) static void exp_shifted_row(const float* x, float* y, int64_t n, float m) {
  for (int64_t i = 0; i < n; ++i) y[i] = exp_nonpos(x[i] - m);
}
__attribute__((target("avx2,fma"))) static void exp_shifted_row(const float* x, float* y, int64_t n, float m) {
  exp_shifted_row_lanes8(x, y, n, m);
}
__attribute__((target("default"))) static void exp_shifted_row(const float* x, float* y, int64_t n, float m) {
  exp_shifted_row_lanes8(x, y, n, m);
}
#else
static void exp_shifted_row(const float* x, float* y, int64_t n, float m) { exp_shifted_row_lanes8(x, y, n, m); }
#endif

// y = exp(x - max(x)) / sum over a row of n > 0 floats (y may alias x): ONNX Softmax(axis=-1) of
// it.  A row whose entries are all equal (e.g. fully masked with the dtype's lowest value) becomes
// uniform, 1/n at every key.  A row with no finite maximum (all -inf) or holding a NaN or +inf
// becomes NaN at every key, as ONNX Runtime's Softmax and torch.softmax give: x - max is NaN at
// some key, exp_nonpos keeps it, and the NaN sum spreads it over the row.
ATTNCAL_CLONES static void softmax_row(const float* x, float* y, int64_t n) {
  exp_shifted_row(x, y, n, row_max(x, n));
  const float sum = sum_lanes(y, n);
  const float inv = 1.0f / sum;  // sum >= 1 (the max term is exp(0)), or NaN
  for (int64_t i = 0; i < n; ++i) y[i] *= inv;
}

// Widen / narrow float16 rows (vectorisable).
ATTNCAL_CLONES static void widen_row(const uint16_t* x, float* y, int64_t n) {
  for (int64_t k = 0; k < n; ++k) y[k] = half_to_float(x[k]);
}
ATTNCAL_CLONES static void narrow_row(const float* x, uint16_t* y, int64_t n) {
  for (int64_t k = 0; k < n; ++k) y[k] = float_to_half(x[k]);
}

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
// scalars of row_scalars.h, g_b in double; a basket of mass below 2^-64 is scaled as (e * 2^64) * h'
// (exact powers of two).  A row whose softmax is NaN (all -inf, a NaN or +inf score) has a NaN sum
// and comes back NaN at every key, as softmax followed by the separate op gives.
ATTNCAL_CLONES static void softmax_calibrate_row_f32(const float* x, float* y, int64_t K, const ItemPlan& it,
                                                     const AttncalParams& p, Scratch& sc) {
  const Span& s = it.s;
  const RowPlan& rp = it.rp;
  const int64_t S = p.basket_size, c_end = rp.c0 + rp.C, n = rp.n;
  const float* m = it.keep;
  exp_shifted_row(x, y, K, row_max(x, K));  // NaN scores: caught by the sum below
  ensure_baskets(sc, n);
  float* A = sc.baskets.data();
  float* h = sc.coef.data();
  // Masked keys count in the softmax's sum (the scores decide them), not in the basket masses.
  float total = sum_lanes(y, rp.c0) + sum_lanes(y + c_end, K - c_end);
  for (int64_t b = 0; b < n; ++b) {
    const int64_t lo = rp.c0 + b * S, len = std::min(S, c_end - lo);
    A[b] = m ? sum_masked_lanes(y + lo, m + lo, len) : sum_lanes(y + lo, len);
    total += m ? sum_lanes(y + lo, len) : A[b];
  }
  if (total != total) {  // NaN softmax: NaN at every key
    std::fill(y, y + K, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const float inv = 1.0f / total;  // total >= 1 (the max term is exp(0))
  int64_t nonempty = 0;
  for (int64_t b = 0; b < n; ++b) nonempty += A[b] * inv != 0.f;
  const double t = rp.t;
  const AttncalRowScalars rs = attncal_row_scalars(&p, nonempty, t, y[s.start] * inv, y[s.end] * inv);
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
}

// Softmax, then calibration of the row while it is in the cache.
inline void softmax_calibrate_row(const float* x, float* y, int64_t K, const ItemPlan& it, const AttncalParams& p,
                                  Scratch& sc) {
  softmax_calibrate_row_f32(x, y, K, it, p, sc);
}
inline void softmax_calibrate_row(const uint16_t* x, uint16_t* y, int64_t K, const ItemPlan& it,
                                  const AttncalParams& p, Scratch& sc) {
  if (static_cast<int64_t>(sc.row.size()) < K) sc.row.resize(static_cast<size_t>(K));
  float* r = sc.row.data();
  widen_row(x, r, K);
  softmax_calibrate_row_f32(r, r, K, it, p, sc);
  narrow_row(r, y, K);
}

inline void calibrate_row(const float* x, float* y, int64_t K, const ItemPlan& it, const AttncalParams& p,
                          Scratch& sc) {
  calibrate_row_f32(x, y, K, it, p, sc);
}

// float16 (as raw uint16 bits): widen the row, calibrate in float, narrow.
inline void calibrate_row(const uint16_t* x, uint16_t* y, int64_t K, const ItemPlan& it, const AttncalParams& p,
                          Scratch& sc) {
  if (static_cast<int64_t>(sc.row.size()) < K) sc.row.resize(static_cast<size_t>(K));
  float* r = sc.row.data();
  widen_row(x, r, K);
  calibrate_row_f32(r, r, K, it, p, sc);
  narrow_row(r, y, K);
}

// ---------------------------------------------------------------- batch driver
// Per-item geometry of a call: which items are calibrated, which query rows, and (only when a
// calibrated item's mask has holes inside its valid span) a 0/1 float mask of its keys in `keep`.
// Shared by the calibration ops (Plan) and the calibrated attention op (AttentionPlan).
inline void plan_items(const int64_t* mask, int64_t B, int64_t Q, int64_t K, const AttncalParams& p,
                       std::vector<ItemPlan>* items, std::vector<float>* keep) {
  items->assign(static_cast<size_t>(B), ItemPlan{});
  keep->clear();
  bool any_holes = false;
  for (int64_t b = 0; b < B; ++b) {
    ItemPlan& it = (*items)[b];
    it.s = span_of(mask + b * K, K);
    it.active = plan_rows(it.s, p, &it.rp);
    if (!it.active) continue;
    if (p.all_rows) {
      it.q_lo = it.s.start;
      it.q_hi = std::min(it.s.end, Q - 1);
    } else {
      // Q == 1 (row placement): the single row is the pooling row itself.
      it.q_lo = it.q_hi = (Q == 1) ? 0 : (p.pool_last ? it.s.end : it.s.start);
      if (it.q_lo >= Q) it.q_hi = it.q_lo - 1;
    }
    it.active = it.q_lo <= it.q_hi;
    any_holes = any_holes || (it.active && it.s.holes);
  }
  if (!any_holes) return;
  keep->assign(static_cast<size_t>(B * K), 0.f);  // never resized again: the pointers below stay valid
  for (int64_t b = 0; b < B; ++b) {
    ItemPlan& it = (*items)[b];
    if (!it.active || !it.s.holes) continue;
    for (int64_t k = 0; k < K; ++k) (*keep)[b * K + k] = mask[b * K + k] != 0 ? 1.f : 0.f;
    it.keep = keep->data() + b * K;
  }
}

// A unit of work: query rows [q0, q1) of heads [h0, h1) of batch item b.
struct Unit {
  int64_t b, h0, h1, q0, q1;
};

// Whole-call plan: per-item geometry and the work units.  Built once per
// call by the calling thread; the units then run in any order on any thread.
class Plan {
 public:
  static constexpr int64_t kUnitElems = 32768;  // ~128 KiB of float32 per unit

  // every_row: units cover every row (out of place: untouched rows are copied; fused with the
  // softmax: every row gets its softmax); otherwise only the calibrated rows.
  Plan(const int64_t* mask, int64_t B, int64_t H, int64_t Q, int64_t K, const AttncalParams& p, bool every_row)
      : B_(B), H_(H), Q_(Q), K_(K), items_(static_cast<size_t>(B)) {
    if (B * H * Q * K == 0) return;
    plan_items(mask, B, Q, K, p, &items_, &keep_);
    for (int64_t b = 0; b < B; ++b) {
      const ItemPlan& it = items_[b];
      int64_t r0 = 0, r1 = Q;
      if (!every_row) {
        if (!it.active) continue;
        r0 = it.q_lo;
        r1 = it.q_hi + 1;
      }
      const int64_t per_head = (r1 - r0) * K;
      if (per_head >= kUnitElems) {
        const int64_t rows = std::max<int64_t>(1, kUnitElems / K);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t q = r0; q < r1; q += rows) units_.push_back({b, h, h + 1, q, std::min(q + rows, r1)});
      } else {
        const int64_t heads = std::max<int64_t>(1, kUnitElems / std::max<int64_t>(1, per_head));
        for (int64_t h = 0; h < H; h += heads) units_.push_back({b, h, std::min(h + heads, H), r0, r1});
      }
    }
  }

  size_t size() const { return units_.size(); }

  // Runs unit i: calibrates its calibrated rows, copies the others when out != in.  With
  // Softmax, `in` holds scores: every row of the unit gets its softmax, calibrated rows as well.
  template <bool Softmax, typename T>
  void run(size_t i, const T* in, T* out, const AttncalParams& p) const {
    const Unit& u = units_[i];
    const ItemPlan& it = items_[u.b];
    const int64_t c0 = it.active ? std::max(u.q0, it.q_lo) : u.q1;
    const int64_t c1 = it.active ? std::min(u.q1, it.q_hi + 1) : u.q1;
    const size_t row_bytes = sizeof(T) * static_cast<size_t>(K_);
    Scratch& sc = thread_scratch();
    for (int64_t h = u.h0; h < u.h1; ++h) {
      const int64_t base = (u.b * H_ + h) * Q_;
      if (Softmax) {
        for (int64_t q = u.q0; q < u.q1; ++q) {
          const int64_t off = (base + q) * K_;
          if (q >= c0 && q < c1) {
            softmax_calibrate_row(in + off, out + off, K_, it, p, sc);
          } else {
            softmax_row(in + off, out + off, K_, sc);
          }
        }
        continue;
      }
      if (out != in) {  // untouched row ranges before and after the calibrated ones
        const int64_t pre_end = std::min(u.q1, std::max(u.q0, c0));
        if (pre_end > u.q0)
          std::memcpy(out + (base + u.q0) * K_, in + (base + u.q0) * K_, row_bytes * (pre_end - u.q0));
        const int64_t post_begin = std::max(u.q0, std::max(c0, c1));
        if (u.q1 > post_begin)
          std::memcpy(out + (base + post_begin) * K_, in + (base + post_begin) * K_, row_bytes * (u.q1 - post_begin));
      }
      for (int64_t q = c0; q < c1; ++q) {
        const int64_t off = (base + q) * K_;
        calibrate_row(in + off, out + off, K_, it, p, sc);
      }
    }
  }

 private:
  int64_t B_, H_, Q_, K_;
  std::vector<ItemPlan> items_;
  std::vector<float> keep_;
  std::vector<Unit> units_;
};

// Calibrates probs[B,H,Q,K] into out (which may alias probs), serially.  T is
// float or uint16_t (float16 bits).  The ORT kernel runs the same Plan units
// on the intra-op thread pool.
template <typename T>
void calibrate(const T* probs, T* out, const int64_t* mask, int64_t B, int64_t H, int64_t Q, int64_t K,
               const AttncalParams& p) {
  const Plan plan(mask, B, H, Q, K, p, out != probs);
  for (size_t i = 0; i < plan.size(); ++i) plan.run<false>(i, probs, out, p);
}

// The Softmax-fused op: out = calibrate(softmax(scores)); out may alias scores.
template <typename T>
void softmax_calibrate(const T* scores, T* out, const int64_t* mask, int64_t B, int64_t H, int64_t Q, int64_t K,
                       const AttncalParams& p) {
  const Plan plan(mask, B, H, Q, K, p, true);
  for (size_t i = 0; i < plan.size(); ++i) plan.run<true>(i, scores, out, p);
}

}  // namespace attncal

#endif  // ATTNCAL_CALIBRATION_CPU_H_
