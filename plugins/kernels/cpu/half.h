// IEEE binary16 <-> binary32 on the host, by bit manipulation (round to nearest even, NaN, infinities
// and subnormals preserved), branch-free so that the row loops that call them vectorise.  float16
// tensors are handled as their raw uint16 bits and computed in float32 (cpu/row_calibration.h:
// widen_row, narrow_row).
#ifndef ATTNCAL_CPU_HALF_H_
#define ATTNCAL_CPU_HALF_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace attncal {

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

}  // namespace attncal

#endif  // ATTNCAL_CPU_HALF_H_
