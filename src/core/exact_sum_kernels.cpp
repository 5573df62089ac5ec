// The vectorised loops of the exact sum (exact_sum_kernels.hpp). Each body is written once and
// compiled for the build's baseline and for AVX2 (the fused sum's block loop also for AVX-512),
// the form chosen once, at load time, from what the CPU has.
#include "core/exact_sum_kernels.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include <limits>
#include <stdexcept>

namespace lockstep::detail::exact {

namespace {

constexpr int kW = kBinBits;

[[gnu::always_inline]] inline std::uint32_t max_magnitude_body(const std::uint32_t* u, std::int64_t n) {
  std::uint32_t mx = 0;
  for (std::int64_t k = 0; k < n; ++k) mx = std::max(mx, u[k] & 0x7fffffffu);
  return mx;
}

// One finite value's bits u truncated toward zero at 2^(low - 149), counted in those units.
[[gnu::always_inline]] inline std::int64_t fold_one(std::uint32_t u, int low) {
  const std::uint32_t biased = (u >> 23) & 0xffu;
  const std::uint64_t m = (u & 0x7fffffu) | (biased != 0 ? 0x800000u : 0u);
  const int p = biased != 0 ? static_cast<int>(biased) - 1 : 0;  // |x| = m * 2^(p - 149)
  const int d = p - low;
  const std::uint64_t v = d >= 0 ? m << std::min(d, 63) : m >> std::min(-d, 63);
  return (u >> 31) != 0 ? -static_cast<std::int64_t>(v) : static_cast<std::int64_t>(v);
}

[[gnu::always_inline]] inline void fold_values_body(const std::uint32_t* __restrict u, std::int64_t n, int low,
                                                     std::int64_t* __restrict out) {
  for (std::int64_t k = 0; k < n; ++k) out[k] = fold_one(u[k], low);
}


[[gnu::always_inline]] inline std::int64_t add_common_body(const std::uint32_t* __restrict u, std::int64_t n,
                                                           std::uint8_t* __restrict top, std::int32_t* __restrict c0,
                                                           std::int32_t* __restrict c1, std::int32_t* __restrict c2,
                                                           std::int32_t* __restrict c3) {
  std::int32_t careful = 0;
  for (std::int64_t k = 0; k < n; ++k) {
    const std::uint32_t a = u[k] & 0x7fffffffu;
    const std::int32_t biased = static_cast<std::int32_t>(a >> 23);
    const std::int32_t t = top[k];
    const std::int32_t tb = (biased + 22) * 5462 >> 16;  // the value's top bin: (biased + 22) / 12
    const std::int32_t empty = t == 0;
    const std::int32_t apply = (biased != 0) & (biased != 0xff) & (t != 255) & (empty | (tb < t));
    careful += (a != 0) & (apply == 0);  // the same test as is_careful
    const std::int32_t w = empty ? tb : t - 1;           // the window's top bin
    const std::int32_t d = (biased - 1) - (w - 3) * kW;  // |x| = m * 2^d units of the window's lowest bin
    const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const std::int32_t sign = -static_cast<std::int32_t>(u[k] >> 31);  // 0 or -1
    const std::int32_t keep = -apply;                                   // all ones where applied
    const std::int32_t clear = -(apply & empty);                        // all ones where set afresh
    auto piece = [&](std::int32_t at) {  // bits [at, at + 12) of m * 2^d, signed; 0 where not applied
      const std::int32_t e = d - at;
      const std::uint32_t left = m << std::clamp(e, 0, 31), right = m >> std::clamp(-e, 0, 31);
      const std::uint32_t bits = (e >= 0 ? left : right) & 0xfffu;
      return ((static_cast<std::int32_t>(bits) ^ sign) - sign) & keep;
    };
    // Counter j holds bin w - j: bits [12 (3 - j), 12 (4 - j)) of the value in window units.
    c0[k] = (c0[k] & ~clear) + piece(3 * kW);
    c1[k] = (c1[k] & ~clear) + piece(2 * kW);
    c2[k] = (c2[k] & ~clear) + piece(kW);
    c3[k] = (c3[k] & ~clear) + piece(0);
    top[k] = static_cast<std::uint8_t>(t + ((tb + 1) & clear));
  }
  return careful;
}

[[gnu::always_inline]] inline void fold_counters_body(const std::uint8_t* __restrict top,
                                                      const std::int32_t* __restrict c0,
                                                      const std::int32_t* __restrict c1,
                                                      const std::int32_t* __restrict c2,
                                                      const std::int32_t* __restrict c3, std::int64_t n,
                                                      std::int32_t block_top, std::int64_t* __restrict out) {
  for (std::int64_t k = 0; k < n; ++k) {
    const std::int32_t t = top[k];
    // Counter j (bin t - 1 - j) lies (3 - j - s) bins above the window's lowest, s = block_top - t;
    // below the window (negative): dropped, alike on every rank.
    const std::int32_t s = block_top - t;
    auto term = [&](std::int32_t c, std::int32_t j) -> std::int64_t {
      const std::int32_t e = 3 - j - s;
      const std::int64_t v = static_cast<std::int64_t>(c) << (std::clamp(e, 0, 3) * kW);
      return e >= 0 ? v : 0;
    };
    const std::int64_t v = term(c0[k], 0) + term(c1[k], 1) + term(c2[k], 2) + term(c3[k], 3);
    out[k] = t != 0 ? v : 0;  // an empty element's counters are stale
  }
}

// double(w) as hi * 2^32 + lo: both parts exact, one rounding in the sum, the same as the
// conversion of the whole int64 (which has no vector instruction before AVX-512).
[[gnu::always_inline]] inline double to_double(std::int64_t w) {
  constexpr double k2p32 = 4294967296.0, k2p52 = 4503599627370496.0;
  const std::int32_t hi = static_cast<std::int32_t>(w >> 32);
  const std::uint64_t lo_bits = 0x4330000000000000ull | (static_cast<std::uint64_t>(w) & 0xffffffffull);
  const double lo = std::bit_cast<double>(lo_bits) - k2p52;
  return static_cast<double>(hi) * k2p32 + lo;
}

// Whether dividing by `divisor` is multiplying by its reciprocal, bit for bit: a power of two
// (1, 2, 4, ...), whose reciprocal is exact; both then scale the product exactly (the products
// here lie far inside the normal doubles), and the one rounding is to f32.
bool exact_reciprocal(double divisor) {
  int e = 0;
  return divisor > 0.0 && std::frexp(divisor, &e) == 0.5;
}

[[gnu::always_inline]] inline void to_f32_body(const std::int64_t* __restrict w, std::int64_t n, double scale,
                                               double divisor, float* __restrict out) {
  if (exact_reciprocal(divisor)) {
    // scale / divisor is a power of two too (2^-188 and up): one multiplication, no division.
    const double factor = scale / divisor;
    for (std::int64_t k = 0; k < n; ++k) out[k] = static_cast<float>(to_double(w[k]) * factor);
    return;
  }
  for (std::int64_t k = 0; k < n; ++k) out[k] = static_cast<float>(to_double(w[k]) * scale / divisor);
}

// 2^e as a double, for e in the normal range (-1022 .. 1023): its bits, no library call.
[[gnu::always_inline]] inline double pow2(int e) {
  return std::bit_cast<double>(static_cast<std::uint64_t>(1023 + e) << 52);
}

// The fused sum in doubles rather than int64 words, the same integers: a value folded at the
// window is trunc(x * 2^(149 - low)) (x widened to f64 and scaled by a power of two: exact; the
// truncation toward zero is fold_one's), an integer below 2^48 in magnitude, so the sum of up to
// kMaxFusedSources of them stays below 2^53, every partial sum exact and the order irrelevant,
// and the total is the int64 sum's value, which to_f32 turns into the same f32. The sum starts
// at +0, so folds of -0 give +0 as the int64 0 does.
static_assert(kMaxFusedSources * (std::int64_t{1} << 48) <= (std::int64_t{1} << 53));

// One block's folds summed and converted, element by element: a value's fold is trunc(x * up),
// the sum (from +0: a sum of folds of -0 is +0, as in int64) is exact in any order, and the
// result f32(sum * (scale / divisor)) for a power-of-two divisor, else f32(sum * scale /
// divisor), as to_f32 converts the int64 sum. The vector forms below compute the same
// operations lane by lane, so every instruction set gives the same bits.
[[gnu::always_inline]] inline void fold_block_scalar(const float* const* x, int sources, std::int64_t len,
                                                      double up, double scale, double divisor, bool reciprocal,
                                                      float* __restrict out) {
  for (std::int64_t k = 0; k < len; ++k) {
    double sum = 0.0;
    for (int p = 0; p < sources; ++p) sum += std::trunc(static_cast<double>(x[p][k]) * up);
    out[k] = reciprocal ? static_cast<float>(sum * (scale / divisor)) : static_cast<float>(sum * scale / divisor);
  }
}

// The window of a block whose top is bt (stored + 1, finite, not empty): the fold's factor up
// and the conversion's scale, both powers of two.
struct Window {
  double up, scale;
};
[[gnu::always_inline]] inline Window window_of(std::uint8_t bt) {
  const int low = ((bt - 1) - kBins + 1) * kW;
  return {pow2(149 - low), pow2(low - 149)};  // 2^-130 .. 2^149 and its inverse
}

void fold_sum_to_f32_scalar(const std::uint32_t* const* u, int sources, std::int64_t n,
                            const std::uint8_t* block_top, double divisor, float* __restrict out) {
  const bool reciprocal = exact_reciprocal(divisor);
  const float* x[kMaxFusedSources];
  for (std::int64_t at = 0; at < n; at += kBlock) {
    const std::int64_t len = std::min(kBlock, n - at);
    std::uint8_t bt = 0;
    if (block_top != nullptr) {
      bt = block_top[at / kBlock];
    } else {  // the block's top from every source's values (in cache for the fold below)
      std::uint32_t mx = 0;
      for (int p = 0; p < sources; ++p) mx = std::max(mx, max_magnitude_body(u[p] + at, len));
      bt = top_of_magnitude(mx);
    }
    if (bt == 0 || bt == 255) {
      std::fill(out + at, out + at + len, bt == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    const Window w = window_of(bt);
    for (int p = 0; p < sources; ++p) x[p] = reinterpret_cast<const float*>(u[p] + at);
    fold_block_scalar(x, sources, len, w.up, w.scale, divisor, reciprocal, out + at);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// The vector forms: whole blocks only, the sources' count a template argument where it is small
// (S > 0; 0: the count at run time) so that the loops over the sources unroll, each element's
// sum held in a register. GCC does not vectorise trunc unless told that no floating-point
// exception can be observed, so they are written with intrinsics.
using FullBlocks = void (*)(const std::uint32_t* const* u, int sources, std::int64_t blocks,
                            const std::uint8_t* block_top, double divisor, bool reciprocal, float* out);

template <int S>
[[gnu::target("avx2")]] void full_blocks_avx2(const std::uint32_t* const* u, int sources, std::int64_t blocks,
                                              const std::uint8_t* block_top, double divisor, bool reciprocal,
                                              float* out) {
  const int ns = S > 0 ? S : sources;
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const __m256d vdivisor = _mm256_set1_pd(divisor);
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t at = b * kBlock;
    std::uint8_t bt = 0;
    if (block_top != nullptr) {
      bt = block_top[b];
    } else {
      __m256i mx = _mm256_setzero_si256();
      for (int p = 0; p < ns; ++p)
        for (int j = 0; j < kBlock; j += 8)
          mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u[p] + at + j)),
                                                     magnitude));
      __m128i m = _mm_max_epu32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
      m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
      m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
      bt = top_of_magnitude(static_cast<std::uint32_t>(_mm_cvtsi128_si32(m)));
    }
    if (bt == 0 || bt == 255) {
      std::fill(out + at, out + at + kBlock, bt == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    const Window w = window_of(bt);
    const __m256d vup = _mm256_set1_pd(w.up);
    const __m256d vfactor = _mm256_set1_pd(reciprocal ? w.scale / divisor : w.scale);
    for (int j = 0; j < kBlock; j += 4) {
      __m256d sum = _mm256_setzero_pd();
      for (int p = 0; p < ns; ++p) {
        const __m128 v = _mm_loadu_ps(reinterpret_cast<const float*>(u[p] + at + j));
        const __m256d y = _mm256_mul_pd(_mm256_cvtps_pd(v), vup);
        sum = _mm256_add_pd(sum, _mm256_round_pd(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC));
      }
      __m256d r = _mm256_mul_pd(sum, vfactor);
      if (!reciprocal) r = _mm256_div_pd(r, vdivisor);
      _mm_storeu_ps(out + at + j, _mm256_cvtpd_ps(r));
    }
  }
}

// GCC 12 warns that the unmasked AVX-512 conversions read an "uninitialised" pass-through
// operand (_mm512_undefined_*), which no lane uses.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int S>
[[gnu::target("avx512f")]] void full_blocks_avx512(const std::uint32_t* const* u, int sources, std::int64_t blocks,
                                                   const std::uint8_t* block_top, double divisor, bool reciprocal,
                                                   float* out) {
  const int ns = S > 0 ? S : sources;
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  const __m512d vdivisor = _mm512_set1_pd(divisor);
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t at = b * kBlock;
    std::uint8_t bt = 0;
    if (block_top != nullptr) {
      bt = block_top[b];
    } else {
      __m512i mx = _mm512_setzero_si512();
      for (int p = 0; p < ns; ++p)
        for (int j = 0; j < kBlock; j += 16)
          mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_loadu_si512(u[p] + at + j), magnitude));
      bt = top_of_magnitude(_mm512_reduce_max_epu32(mx));
    }
    if (bt == 0 || bt == 255) {
      std::fill(out + at, out + at + kBlock, bt == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    const Window w = window_of(bt);
    const __m512d vup = _mm512_set1_pd(w.up);
    const __m512d vfactor = _mm512_set1_pd(reciprocal ? w.scale / divisor : w.scale);
    for (int j = 0; j < kBlock; j += 8) {
      __m512d sum = _mm512_setzero_pd();
      for (int p = 0; p < ns; ++p) {
        const __m256 v = _mm256_loadu_ps(reinterpret_cast<const float*>(u[p] + at + j));
        const __m512d y = _mm512_mul_pd(_mm512_cvtps_pd(v), vup);
        sum = _mm512_add_pd(sum, _mm512_roundscale_pd(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC));
      }
      __m512d r = _mm512_mul_pd(sum, vfactor);
      if (!reciprocal) r = _mm512_div_pd(r, vdivisor);
      _mm256_storeu_ps(out + at + j, _mm512_cvtpd_ps(r));
    }
  }
}
#pragma GCC diagnostic pop

constexpr FullBlocks kFullAvx2[] = {&full_blocks_avx2<0>, &full_blocks_avx2<1>, &full_blocks_avx2<2>,
                                    &full_blocks_avx2<3>, &full_blocks_avx2<4>, &full_blocks_avx2<5>,
                                    &full_blocks_avx2<6>, &full_blocks_avx2<7>, &full_blocks_avx2<8>};
constexpr FullBlocks kFullAvx512[] = {&full_blocks_avx512<0>, &full_blocks_avx512<1>, &full_blocks_avx512<2>,
                                      &full_blocks_avx512<3>, &full_blocks_avx512<4>, &full_blocks_avx512<5>,
                                      &full_blocks_avx512<6>, &full_blocks_avx512<7>, &full_blocks_avx512<8>};

// The whole blocks in a vector form, the last, shorter block (if any) in the scalar one.
void fold_sum_to_f32_vector(const FullBlocks* forms, const std::uint32_t* const* u, int sources, std::int64_t n,
                            const std::uint8_t* block_top, double divisor, float* out) {
  const std::int64_t full = n / kBlock;
  const FullBlocks form = sources >= 1 && sources <= 8 ? forms[sources] : forms[0];
  form(u, sources, full, block_top, divisor, exact_reciprocal(divisor), out);
  const std::int64_t done = full * kBlock;
  if (done == n) return;
  const std::uint32_t* tail[kMaxFusedSources];
  for (int p = 0; p < sources; ++p) tail[p] = u[p] + done;
  fold_sum_to_f32_scalar(tail, sources, n - done, block_top != nullptr ? block_top + full : nullptr, divisor,
                         out + done);
}
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define LOCKSTEP_EXACT_AVX2 1
[[gnu::target("avx2")]] std::uint32_t max_magnitude_avx2(const std::uint32_t* u, std::int64_t n) {
  return max_magnitude_body(u, n);
}
[[gnu::target("avx2")]] void fold_values_avx2(const std::uint32_t* u, std::int64_t n, int low, std::int64_t* out) {
  fold_values_body(u, n, low, out);
}
[[gnu::target("avx2")]] std::int64_t add_common_avx2(const std::uint32_t* u, std::int64_t n, std::uint8_t* top,
                                                     std::int32_t* const c[kBins]) {
  return add_common_body(u, n, top, c[0], c[1], c[2], c[3]);
}
[[gnu::target("avx2")]] void fold_counters_avx2(const std::uint8_t* top, std::int32_t* const c[kBins], std::int64_t n,
                                                std::int32_t block_top, std::int64_t* out) {
  fold_counters_body(top, c[0], c[1], c[2], c[3], n, block_top, out);
}
[[gnu::target("avx2")]] void to_f32_avx2(const std::int64_t* w, std::int64_t n, double scale, double divisor,
                                         float* out) {
  to_f32_body(w, n, scale, divisor, out);
}
const bool kAvx2 = __builtin_cpu_supports("avx2");
const bool kAvx512 = __builtin_cpu_supports("avx512f");
#endif

}  // namespace

std::uint8_t top_of_magnitude(std::uint32_t a) {
  if (a == 0) return 0;
  if (a >= 0x7f800000u) return 255;
  const std::uint32_t biased = a >> 23;
  // The highest set bit of |x| in units of 2^-149: biased + 22 for a normal number.
  const int high_bit = biased != 0 ? static_cast<int>(biased) + 22 : static_cast<int>(std::bit_width(a)) - 1;
  return static_cast<std::uint8_t>(high_bit / kW + 1);
}

#ifdef LOCKSTEP_EXACT_AVX2
#define LOCKSTEP_EXACT_PICK(name, ...) \
  if (kAvx2) return name##_avx2(__VA_ARGS__)
#else
#define LOCKSTEP_EXACT_PICK(name, ...)
#endif

std::uint32_t max_magnitude(const std::uint32_t* u, std::int64_t n) {
  LOCKSTEP_EXACT_PICK(max_magnitude, u, n);
  return max_magnitude_body(u, n);
}

void fold_values(const std::uint32_t* u, std::int64_t n, int low, std::int64_t* out) {
  LOCKSTEP_EXACT_PICK(fold_values, u, n, low, out);
  fold_values_body(u, n, low, out);
}

std::int64_t add_common(const std::uint32_t* u, std::int64_t n, std::uint8_t* top, std::int32_t* const c[kBins]) {
  LOCKSTEP_EXACT_PICK(add_common, u, n, top, c);
  return add_common_body(u, n, top, c[0], c[1], c[2], c[3]);
}

void fold_counters(const std::uint8_t* top, std::int32_t* const c[kBins], std::int64_t n, std::int32_t block_top,
                   std::int64_t* out) {
  LOCKSTEP_EXACT_PICK(fold_counters, top, c, n, block_top, out);
  fold_counters_body(top, c[0], c[1], c[2], c[3], n, block_top, out);
}

void to_f32(const std::int64_t* w, std::int64_t n, double scale, double divisor, float* out) {
  LOCKSTEP_EXACT_PICK(to_f32, w, n, scale, divisor, out);
  to_f32_body(w, n, scale, divisor, out);
}

bool fused_isa_available(FusedIsa isa) {
  switch (isa) {
    case FusedIsa::baseline: return true;
#ifdef LOCKSTEP_EXACT_AVX2
    case FusedIsa::avx2: return kAvx2;
    case FusedIsa::avx512: return kAvx512;
#endif
    default: return false;
  }
}

void fold_sum_to_f32_on(FusedIsa isa, const std::uint32_t* const* u, int sources, std::int64_t n,
                        const std::uint8_t* block_top, double divisor, float* out) {
  if (!fused_isa_available(isa)) throw std::invalid_argument("fold_sum_to_f32_on: this CPU lacks the instruction set");
  if (sources < 1 || sources > kMaxFusedSources) throw std::invalid_argument("fold_sum_to_f32_on: 1 to 32 sources");
#ifdef LOCKSTEP_EXACT_AVX2
  if (isa == FusedIsa::avx512) return fold_sum_to_f32_vector(kFullAvx512, u, sources, n, block_top, divisor, out);
  if (isa == FusedIsa::avx2) return fold_sum_to_f32_vector(kFullAvx2, u, sources, n, block_top, divisor, out);
#endif
  fold_sum_to_f32_scalar(u, sources, n, block_top, divisor, out);
}

void fold_sum_to_f32(const std::uint32_t* const* u, int sources, std::int64_t n, const std::uint8_t* block_top,
                     double divisor, float* out) {
#ifdef LOCKSTEP_EXACT_AVX2
  if (kAvx512) return fold_sum_to_f32_vector(kFullAvx512, u, sources, n, block_top, divisor, out);
  if (kAvx2) return fold_sum_to_f32_vector(kFullAvx2, u, sources, n, block_top, divisor, out);
#endif
  fold_sum_to_f32_scalar(u, sources, n, block_top, divisor, out);
}

}  // namespace lockstep::detail::exact
