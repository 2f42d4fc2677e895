// The 8-lane float vector of the host kernels and the reductions written on it (sums, masked sums, the
// non-finite probe).
#ifndef ATTNCAL_CPU_LANES_H_
#define ATTNCAL_CPU_LANES_H_

#include <cstdint>
#include <cstring>

namespace attncal {

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

// The largest |x[k]| over n floats, as its bits: for non-negative floats the order of the bits is the order of
// the values, and infinity's and NaN's bits lie above every finite value's, so one unsigned maximum answers
// both "all finite?" (below kInfBits) and "how large?".  Integer lanes, which GCC vectorises; a float maximum
// with NaN's rules stays scalar.
constexpr uint32_t kInfBits = 0x7f800000u;
inline uint32_t abs_max_bits(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, sizeof b);
    b &= 0x7fffffffu;
    m = b > m ? b : m;
  }
  return m;
}

// The row routines (cpu/row_calibration.h, cpu/exp.h) are dispatched per instruction-set path themselves
// (cpu/isa.h), not only their innermost loops: the 8-lane sums above are inlined into their caller and compiled for
// its target, and for baseline x86-64 GCC lowers a 32-byte vector to two SSE halves kept on the stack, which costs
// several times the AVX2 form (see docs/native-kernels.md).

}  // namespace attncal

#endif  // ATTNCAL_CPU_LANES_H_
