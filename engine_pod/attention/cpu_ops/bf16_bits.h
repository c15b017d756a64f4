// bf16 <-> float on the bits, shared by the CPU kernels: loops of these
// vectorise, where c10::BFloat16's branchy conversion does not.
#pragma once

#include <cstdint>
#include <cstring>

namespace tessera_cpu {

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// x rounded to the nearest even bf16, in the upper 16 bits (NaN stays a quiet NaN).
inline uint32_t bf16_rounded_bits(float x) {
  const uint32_t u = float_bits(x);
  return x != x ? (u | 0x00400000u) : u + 0x7FFFu + ((u >> 16) & 1u);
}

inline uint16_t to_bf16_bits(float x) { return static_cast<uint16_t>(bf16_rounded_bits(x) >> 16); }

}  // namespace tessera_cpu
