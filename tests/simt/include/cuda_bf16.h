// Stand-in for CUDA's cuda_bf16.h (tests/simt): __nv_bfloat16 and __nv_bfloat162 as their bits, with the
// conversions the kernels use, rounded to nearest even.  No implicit conversion, no arithmetic.
#ifndef SIMT_CUDA_BF16_H_
#define SIMT_CUDA_BF16_H_

#include <cstdint>

#include "cuda_fp16.h"

namespace simt {
inline uint16_t f32_to_bf16_rn(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // ties to even; overflow rounds to inf
}
inline float bf16_to_f32(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }
}  // namespace simt

struct __nv_bfloat16 {
  uint16_t __x;
};
struct __attribute__((aligned(4))) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{simt::f32_to_bf16_rn(f)}; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return simt::bf16_to_f32(b.__x); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }

#endif  // SIMT_CUDA_BF16_H_
