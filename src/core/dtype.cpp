#include "lockstep/core/dtype.hpp"

#include <bit>

namespace lockstep {

const char* name(DType t) noexcept {
  switch (t) {
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "?";
}

std::string to_string(Device d) {
  return d.is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

float to_float(bfloat16 b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b.bits) << 16);
}

bfloat16 to_bfloat16(float f) noexcept {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16{static_cast<std::uint16_t>((u >> 16) | 0x40)};  // quiet NaN
  std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bfloat16{static_cast<std::uint16_t>((u + rounding) >> 16)};
}

float to_float(half h) noexcept {
  std::uint32_t sign = static_cast<std::uint32_t>(h.bits & 0x8000u) << 16;
  std::uint32_t exp = (h.bits >> 10) & 0x1fu;
  std::uint32_t mant = h.bits & 0x3ffu;
  std::uint32_t out;
  if (exp == 0) {
    if (mant == 0) {
      out = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      out = sign | (static_cast<std::uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    out = sign | 0x7f800000u | (mant << 13);
  } else {
    out = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(out);
}

half to_half(float f) noexcept {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return half{static_cast<std::uint16_t>(sign | 0x7e00u)};  // NaN
  if (abs >= 0x477ff000u) return half{static_cast<std::uint16_t>(sign | 0x7c00u)};  // overflow -> inf
  if (abs < 0x38800000u) {  // result is subnormal or zero
    if (abs < 0x33000000u) return half{sign};
    std::uint32_t exp = abs >> 23;
    std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    // value = mant * 2^(exp-150) and the half subnormal unit is 2^-24, so shift by 126-exp.
    std::uint32_t shift = 126 - exp;
    std::uint32_t q = mant >> shift;
    std::uint32_t rem = mant & ((1u << shift) - 1u);
    std::uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return half{static_cast<std::uint16_t>(sign | q)};
  }
  std::uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);  // round to nearest even
  std::uint32_t exp = (rounded >> 23) - 127 + 15;
  std::uint32_t mant = (rounded >> 13) & 0x3ffu;
  if (exp >= 0x1f) return half{static_cast<std::uint16_t>(sign | 0x7c00u)};
  return half{static_cast<std::uint16_t>(sign | (exp << 10) | mant)};
}

}  // namespace lockstep
