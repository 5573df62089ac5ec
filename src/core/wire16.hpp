// Conversions between f32 and the 16-bit wire dtypes (bf16, f16) over whole buffers, for
// gradient compression (DistributedOptions::wire_dtype) and the shared-memory path's 16-bit sums.
// Round to nearest even, NaN kept a NaN, as lockstep::to_bfloat16 / to_half do element by
// element. bf16 is a shift (the loops vectorise); f16 uses the F16C instructions where the CPU
// has them and the scalar conversion otherwise.
#pragma once

#include <cstdint>
#include <cstring>

#include "lockstep/core/dtype.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
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

#if defined(__SSE2__)
// bf16_bits on 8 floats: written out in SSE2 because GCC's own vectorisation of the scalar loop
// (a 32-to-16-bit narrowing without SSE4.1's packusdw, an unsigned compare) ran at about 3 ns
// per element, slower than memory (bench_scale, "unfused pass 1").
inline __m128i bf16_round4(__m128i u) noexcept {
  const __m128i one = _mm_set1_epi32(1), bias = _mm_set1_epi32(0x7fff);
  const __m128i q = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, bias), _mm_and_si128(_mm_srli_epi32(u, 16), one)), 16);
  // NaN: (u & 0x7fffffff) > 0x7f800000, a signed compare of non-negative values; quietened.
  const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
  const __m128i qn = _mm_or_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x40));
  const __m128i r = _mm_or_si128(_mm_and_si128(nan, qn), _mm_andnot_si128(nan, q));
  // 16-bit values in 32-bit lanes, sign-extended so that the signed saturating pack keeps them.
  return _mm_srai_epi32(_mm_slli_epi32(r, 16), 16);
}
inline void f32_to_bf16_sse2(const float* s, std::uint16_t* d, std::int64_t n) noexcept {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i a = bf16_round4(_mm_castps_si128(_mm_loadu_ps(s + i)));
    const __m128i b = bf16_round4(_mm_castps_si128(_mm_loadu_ps(s + i + 4)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm_packs_epi32(a, b));
  }
  for (; i < n; ++i) d[i] = bf16_bits(s[i]);
}
// dst[i] = bf16_value(src[i]) * k (k == 1: the plain widening), 8 at a time.
inline void bf16_to_f32_sse2(const std::uint16_t* s, float* d, std::int64_t n, float k) noexcept {
  std::int64_t i = 0;
  const __m128i zero = _mm_setzero_si128();
  const __m128 kk = _mm_set1_ps(k);
  for (; i + 8 <= n; i += 8) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm_storeu_ps(d + i, _mm_mul_ps(_mm_castsi128_ps(_mm_unpacklo_epi16(zero, x)), kk));
    _mm_storeu_ps(d + i + 4, _mm_mul_ps(_mm_castsi128_ps(_mm_unpackhi_epi16(zero, x)), kk));
  }
  for (; i < n; ++i) d[i] = bf16_value(s[i]) * k;
}
#endif

/// dst[i] = src[i] rounded to `wire` (bf16 or f16).
inline void to_wire16(DType wire, const float* __restrict__ src, void* dst, std::int64_t n) {
  auto* __restrict__ d = static_cast<std::uint16_t*>(dst);
  if (wire == DType::bf16) {
#if defined(__SSE2__)
    f32_to_bf16_sse2(src, d, n);
#else
    for (std::int64_t i = 0; i < n; ++i) d[i] = bf16_bits(src[i]);
#endif
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
#if defined(__SSE2__)
    // x * 1 is x, and x * (1 / div) is x / div when mul_only.
    if (div == 1.0f || mul_only) return bf16_to_f32_sse2(s, dst, n, 1.0f / div);
#endif
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
