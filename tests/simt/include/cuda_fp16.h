// Stand-in for CUDA's cuda_fp16.h (tests/simt): __half and __half2 as their IEEE binary16 bits, with the
// conversions the kernels use, rounded to nearest even (subnormals, overflow to infinity and NaN included).
// No implicit conversion and no arithmetic on __half: a use the kernels do not make fails the build.
#ifndef SIMT_CUDA_FP16_H_
#define SIMT_CUDA_FP16_H_

#include <cstdint>
#include <cstring>

#include "simt/ptx.h"
#include "simt/runtime.h"

namespace simt {
inline uint32_t float_bits(float f) { return std::bit_cast<uint32_t>(f); }
inline float bits_float(uint32_t u) { return std::bit_cast<float>(u); }
// float -> binary16, round to nearest even.
inline uint16_t f32_to_f16_rn(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t exp = (u >> 23) & 0xffu;
  uint32_t man = u & 0x7fffffu;
  if (exp == 0xffu) return static_cast<uint16_t>(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0u));  // inf, NaN
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (rounding cannot bring it back)
  if (e <= 0) {  // subnormal half (or zero): shift the full significand, round to nearest even
    if (e < -10) return static_cast<uint16_t>(sign);
    man |= 0x800000u;
    const int shift = 14 - e;  // 24-bit significand -> 10-bit subnormal field at exponent -14
    const uint32_t half = 1u << (shift - 1);
    const uint32_t rest = man & ((1u << shift) - 1);
    uint32_t r = man >> shift;
    if (rest > half || (rest == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);  // a carry into the exponent field gives the smallest normal
  }
  uint32_t r = (static_cast<uint32_t>(e) << 10) | (man >> 13);
  const uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;  // a carry may reach infinity: correct
  return static_cast<uint16_t>(sign | r);
}
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}
}  // namespace simt

struct __half {
  uint16_t __x;
};
struct __attribute__((aligned(4))) __half2 {
  __half x, y;  // x: the low 16 bits of the 32-bit register
};

inline __half __float2half_rn(float f) { return __half{simt::f32_to_f16_rn(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline float __half2float(__half h) { return simt::f16_to_f32(h.__x); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half_rn(a), __float2half_rn(b)}; }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }

#endif  // SIMT_CUDA_FP16_H_
