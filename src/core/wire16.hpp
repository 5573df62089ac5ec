// Conversions between f32 and the 16-bit wire dtypes (bf16, f16) over whole buffers, for
// gradient compression (DistributedOptions::wire_dtype) and the shared-memory path's 16-bit sums.
// Round to nearest even, NaN kept a NaN, as lockstep::to_bfloat16 / to_half do element by
// element. bf16 is a shift (the loops vectorise); f16 uses the F16C instructions where the CPU
// has them and the scalar conversion otherwise.
#pragma once

#include <cstdint>
#include <cstring>

#include "lockstep/core/dtype.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define LOCKSTEP_WIRE16_X86 1
#endif

namespace lockstep::detail {

inline std::uint16_t bf16_bits(float f) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint32_t q = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : q);
}
inline float bf16_value(std::uint16_t b) noexcept {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#ifdef LOCKSTEP_WIRE16_X86
__attribute__((target("avx,f16c"))) inline void f32_to_f16_f16c(const float* s, std::uint16_t* d, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) d[i] = to_half(s[i]).bits;
}
// d[i] = float(s[i]) * mul (mul_only: 1 / div is exact) or / div.
__attribute__((target("avx,f16c"))) inline void f16_to_f32_f16c(const std::uint16_t* s, float* d, std::int64_t n,
                                                                 float div, bool mul_only) {
  std::int64_t i = 0;
  if (mul_only) {
    const __m256 k = _mm256_set1_ps(1.0f / div);
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))), k));
  } else {
    const __m256 k = _mm256_set1_ps(div);
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(d + i, _mm256_div_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))), k));
  }
  for (; i < n; ++i) d[i] = to_float(half{s[i]}) / div;
}
// F16C and AVX in the CPU (CPUID leaf 1) and AVX state saved by the OS (XGETBV): read directly,
// since clang's __builtin_cpu_supports does not know "f16c".
inline bool have_f16c() noexcept {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
    const bool osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u, f16c = (c >> 29) & 1u;
    if (!(osxsave && avx && f16c)) return false;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 6u) == 6u;  // XMM and YMM state enabled
  }();
  return yes;
}
#endif

/// dst[i] = src[i] rounded to `wire` (bf16 or f16).
inline void to_wire16(DType wire, const float* __restrict__ src, void* dst, std::int64_t n) {
  auto* __restrict__ d = static_cast<std::uint16_t*>(dst);
  if (wire == DType::bf16) {
    for (std::int64_t i = 0; i < n; ++i) d[i] = bf16_bits(src[i]);
    return;
  }
#ifdef LOCKSTEP_WIRE16_X86
  if (have_f16c()) return f32_to_f16_f16c(src, d, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) d[i] = to_half(src[i]).bits;
}

/// Whether x / d equals x * (1 / d) for every float x: d a power of two whose reciprocal is a
/// normal float (both results are then the correctly rounded x / d).
inline bool exact_reciprocal(float d) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &d, 4);
  const std::uint32_t e = (u >> 23) & 0xffu;
  return (u & 0x807fffffu) == 0 && e >= 1 && e <= 253;
}

/// dst[i] = float(src[i]) / div (a multiplication by 1 / div where that is the same bits:
/// several times cheaper than a division, which at 1 MiB slices costs as much as the pass).
inline void from_wire16(DType wire, const void* src, float* __restrict__ dst, std::int64_t n, float div) {
  const auto* __restrict__ s = static_cast<const std::uint16_t*>(src);
  const bool mul_only = exact_reciprocal(div);
  if (wire == DType::bf16) {
    if (div == 1.0f) {
      for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_value(s[i]);
    } else if (mul_only) {
      const float k = 1.0f / div;
      for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_value(s[i]) * k;
    } else {
      for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_value(s[i]) / div;
    }
    return;
  }
#ifdef LOCKSTEP_WIRE16_X86
  if (have_f16c()) return f16_to_f32_f16c(s, dst, n, div, mul_only);
#endif
  if (mul_only) {
    const float k = 1.0f / div;
    for (std::int64_t i = 0; i < n; ++i) dst[i] = to_float(half{s[i]}) * k;
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) dst[i] = to_float(half{s[i]}) / div;
}

}  // namespace lockstep::detail
