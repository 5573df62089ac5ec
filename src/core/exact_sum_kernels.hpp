// Internal: the loops of the exact sum (exact_sum.hpp) over many elements, written to vectorise
// (32- and 64-bit lanes, no branches) and run with AVX2 (the fused sum: AVX-512) where the CPU has it. They are integer
// work (the fused sum holds its integers in doubles, below 2^53: exact), and only the conversion
// to f32 rounds, each element alone, so every instruction set gives the same bits.
#pragma once

#include <cstdint>

namespace lockstep::detail::exact {

constexpr int kBinBits = 12;  // ExactSum::kBinBits
constexpr int kBins = 4;      // ExactSum::kBins; the counters are kept one array per bin

/// The top bin (stored + 1) of a magnitude given as f32 bits without the sign: 0 for zero, 255
/// for NaN and infinity. It grows with the magnitude.
std::uint8_t top_of_magnitude(std::uint32_t a);

/// The largest magnitude among n f32 values given as bits (the sign left out).
std::uint32_t max_magnitude(const std::uint32_t* u, std::int64_t n);

/// out[k]: the finite f32 value u[k] truncated toward zero at 2^(low - 149) and counted in those
/// units (|out[k]| < 2^48 for values below the window's top).
void fold_values(const std::uint32_t* u, std::int64_t n, int low, std::int64_t* out);

/// Adds the values u[k] to element k's counters (counter j in c[j][k]) and top (top[k]) in the
/// common cases: a normal value into an empty element (its window starts at its own top bin) or
/// into an element whose window already holds it; zeros add nothing. Every other element is left
/// as it was (is_careful(u[k], top[k]) says which); returns how many.
std::int64_t add_common(const std::uint32_t* u, std::int64_t n, std::uint8_t* top, std::int32_t* const c[kBins]);

/// The values add_common leaves: NaN and infinity, subnormals, any value into a non-finite
/// element, and values above an element's window.
inline bool is_careful(std::uint32_t u, std::uint8_t top) {
  const std::uint32_t a = u & 0x7fffffffu;
  const std::int32_t biased = static_cast<std::int32_t>(a >> 23);
  const std::int32_t tb = (biased + 22) * 5462 >> 16;  // (biased + 22) / 12 for biased < 256
  const bool common = biased != 0 && biased != 0xff && top != 255 && (top == 0 || tb < top);
  return !(a == 0 || common);
}

/// out[k]: element k's counters (c[j][k], top[k]) inside the window of a block whose top is
/// block_top (stored + 1, finite and not empty), in units of the window's lowest bin.
void fold_counters(const std::uint8_t* top, std::int32_t* const c[kBins], std::int64_t n, std::int32_t block_top,
                   std::int64_t* out);

/// out[k] = f32(double(w[k]) * scale / divisor), each rounding to nearest.
void to_f32(const std::int64_t* w, std::int64_t n, double scale, double divisor, float* out);

constexpr int kMaxFusedSources = 32;  // fold_sum_to_f32's sums stay below 2^53
/// The exact sum of `sources` values per element (at most kMaxFusedSources), each given as the sources' f32
/// bits (u[p][k]: source p's value of element k), fused: every value folded at its block's
/// window (fold_values), the folds summed exactly (in any order), and the sum converted once
/// (to_f32 with the block's scale and divisor): the bits the separate passes give. n elements
/// from the start of a block of kBlock elements; block_top[b] is block b's agreed top (a block
/// of top 0 gives zeros, of top 255 NaN), or, with block_top null, the top of the largest
/// magnitude among the block's values of every source (what agreeing the sources' own tops by
/// their max gives).
constexpr std::int64_t kBlock = 64;  // ExactSum::kBlock
void fold_sum_to_f32(const std::uint32_t* const* u, int sources, std::int64_t n, const std::uint8_t* block_top,
                     double divisor, float* out);

/// The instruction sets fold_sum_to_f32 has a form for (it takes the widest the CPU has); for
/// the test that every form gives the same bits.
enum class FusedIsa { baseline, avx2, avx512 };
bool fused_isa_available(FusedIsa isa);
/// fold_sum_to_f32 in the named form; std::invalid_argument where the CPU lacks it.
void fold_sum_to_f32_on(FusedIsa isa, const std::uint32_t* const* u, int sources, std::int64_t n,
                        const std::uint8_t* block_top, double divisor, float* out);

}  // namespace lockstep::detail::exact
