// The softmax's exp on the host: exp(x) for x <= 0 (x - the row max) as a branch-free Cephes-style
// polynomial (about 1 ulp), one formula for a scalar and for the 8-lane vector of cpu/lanes.h, and
// exp_shifted_row, exp(x - m) over a row, one body per instruction-set path (cpu/isa.h).  Why not
// expf: a branch-free exp lets the row loop vectorise (tests/cpp/exp_row_test.cpp checks it against exp
// in double, special values included).
#ifndef ATTNCAL_CPU_EXP_H_
#define ATTNCAL_CPU_EXP_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "cpu/isa.h"
#include "cpu/lanes.h"

namespace attncal {

typedef int32_t Ints8 __attribute__((vector_size(32)));

// The reduction and the polynomial, shared by every form: for xc in [-104, 0], e = e^r and the integer n (as a
// float) with exp(xc) = e * 2^n.
template <typename F>
__attribute__((always_inline)) inline void exp_reduce(const F& xc, F& e, F& n) {
  const F zero = {};
  n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const F r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  F q = zero + 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  e = (q * r * r + r) + 1.0f;
}

// exp(x) for x <= 0 (x - row max), subnormal results included (like expf and ONNX Runtime's
// Softmax); exactly 0 below -104 (under half the smallest subnormal) and for -inf; NaN for NaN
// (x - max is NaN for a NaN score and for a row of -inf or with +inf scores: ONNX Softmax gives
// NaN there).  n = round(x log2 e) by the 1.5 * 2^23 trick, r = x - n ln 2 in two parts, a
// degree-6 polynomial for e^r on [-ln2/2, ln2/2] (Cephes expf), times 2^n as two normal powers of
// two (n >= -150).  The clamp maps NaN to -104, so the integer conversion sees a finite value.
// F is float (I = int32_t) or Lanes8 (I = Ints8): one formula for the scalar and the 8-lane form, its
// branches written as selects (AVX-512's row form below runs exp_reduce on 16 lanes and takes 2^n with
// vscalefps, which rounds a subnormal result once, as the two powers of two do).
template <typename F, typename I>
inline void exp_nonpos(const F& x, F& out) {
  const F zero = {};
  const F lo = zero - 104.0f;
  const F xc = x > lo ? x : lo;
  F e, n;
  exp_reduce(xc, e, n);
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

// exp(x - m) over a row, one body per instruction-set path (cpu/isa.h).  AVX-512 runs 16 lanes a step and takes
// the power of two with vscalefps, one instruction where the other forms take eight (the exp is most of the
// softmax's time, and at small head sizes the softmax a large part of the attention's).  GCC 12 does not vectorise
// the scalar loop for AVX2 or baseline x86-64 ("control flow in loop": it does not if-convert the exp's selects
// without masks), so those run the 8-lane form, one ymm register a step (a 16-lane form, two registers a step, was
// slower on an AVX2-only core).  Both FMA paths fuse the polynomial's multiply-adds the same way, so they give the
// same bits; vscalefps rounds a subnormal result once, as the two powers of two do.  The measurements behind these
// choices: see docs/native-kernels.md.
#if ATTNCAL_ISA_PATHS
__attribute__((target("avx512f,fma"))) static void exp_shifted_row_avx512(const float* x, float* y, int64_t n,
                                                                          float m) {
  typedef float Lanes16 __attribute__((vector_size(64)));
  const Lanes16 zero = {}, lo = zero - 104.0f;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    Lanes16 v, e, k;
    std::memcpy(&v, x + i, sizeof v);
    v -= m;
    exp_reduce(v > lo ? v : lo, e, k);
    // e * 2^k in one vscalefps, rounded once as the two powers of two are (exact where the result is normal)
    const Lanes16 p = _mm512_maskz_scalef_ps(0xFFFF, e, k);  // (the unmasked form trips -Wmaybe-uninitialized)
    const Lanes16 out = v < lo ? zero : (v == v ? p : v);
    std::memcpy(y + i, &out, sizeof out);
  }
  for (; i < n; ++i) y[i] = exp_nonpos(x[i] - m);
}
__attribute__((target("avx2,fma"))) static void exp_shifted_row_avx2(const float* x, float* y, int64_t n, float m) {
  exp_shifted_row_lanes8(x, y, n, m);
}
static void exp_shifted_row_default(const float* x, float* y, int64_t n, float m) {
  exp_shifted_row_lanes8(x, y, n, m);
}
static void exp_shifted_row(const float* x, float* y, int64_t n, float m) {
  ATTNCAL_ISA_SELECT(exp_shifted_row, (x, y, n, m))
}
#else
static void exp_shifted_row(const float* x, float* y, int64_t n, float m) { exp_shifted_row_lanes8(x, y, n, m); }
#endif

}  // namespace attncal

#endif  // ATTNCAL_CPU_EXP_H_
