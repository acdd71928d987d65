// Storage types of the CPU kernels and their conversions to and from float.
// The kernels compute in float32 throughout; these are only the load/store ends.
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxflash::cpu {

struct f16 {
  uint16_t bits;
};
struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }

inline float to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float to_float(f16 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t mant = x.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {  // inf / nan
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {  // normal
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {  // zero
    u = sign;
  } else {  // subnormal: renormalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    u = sign | ((112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class T>
T from_float(float x);

template <>
inline float from_float<float>(float x) {
  return x;
}

// Round to nearest even, as XLA converts.
template <>
inline bf16 from_float<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

template <>
inline f16 from_float<f16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return f16{static_cast<uint16_t>(sign | 0x7e00u)};  // nan
  if (abs >= 0x477ff000u) return f16{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    float a;
    std::memcpy(&a, &abs, 4);
    // 2^-24 is the subnormal step; rint rounds half to even.
    const float scaled = a * 16777216.0f;
    const uint32_t m = static_cast<uint32_t>(__builtin_rintf(scaled));
    return f16{static_cast<uint16_t>(sign | m)};
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  uint32_t v = abs - 0x38000000u;
  v += 0xfffu + ((v >> 13) & 1u);
  return f16{static_cast<uint16_t>(sign | (v >> 13))};
}

}  // namespace jaxflash::cpu
