// The exact, order-independent sum of deterministic mode (exact_sum.hpp).
#include "train/exact_sum.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "lockstep/core/errors.hpp"

namespace lockstep::detail {

namespace {
constexpr int kW = ExactSum::kBinBits;
constexpr int kK = ExactSum::kBins;
constexpr std::int64_t kMask = (std::int64_t{1} << kW) - 1;
// f32 magnitudes in units of the smallest subnormal (2^-149) have at most 24 + 253 = 277 bits:
// bins 0 .. 23, stored + 1 in a byte.
constexpr int kSubnormalExponent = 149;
}  // namespace

void ExactSum::reset(std::int64_t numel) {
  top_.assign(static_cast<std::size_t>(numel), kEmpty);
  bins_.assign(static_cast<std::size_t>(numel) * kK, 0);
  count_ = 0;
}

void ExactSum::add(const float* xs, std::int64_t at, std::int64_t n) {
  if (n <= 0) return;
  if (at < 0 || at + n > numel()) throw Error("ExactSum::add: elements out of range");
  for (std::size_t k = 0; k < static_cast<std::size_t>(n); ++k) {
    const std::size_t i = static_cast<std::size_t>(at) + k;  // the element xs[k] adds to
    std::uint32_t u;
    std::memcpy(&u, &xs[k], sizeof u);
    const std::uint32_t biased = (u >> 23) & 0xff;
    const std::uint32_t frac = u & 0x7fffff;
    if (biased == 0xff) {  // NaN or infinity
      top_[i] = kNonFinite;
      continue;
    }
    if (biased == 0 && frac == 0) continue;  // +0 and -0 add nothing
    if (top_[i] == kNonFinite) continue;
    // |x| = m * 2^(p - 149), m < 2^24, p >= 0.
    const std::int64_t m = biased == 0 ? frac : (frac | 0x800000u);
    const int p = biased == 0 ? 0 : static_cast<int>(biased) - 1;
    const int high_bit = p + static_cast<int>(std::bit_width(static_cast<std::uint64_t>(m))) - 1;
    const int tb = high_bit / kW;  // this value's top bin
    std::int32_t* c = &bins_[i * kK];
    int top = top_[i] - 1;  // -1: empty
    if (tb > top) {
      // The window moves up: counter k (bin top - k) becomes counter k + shift; the lowest ones
      // fall out, exactly the pieces a sum that had seen this value first would have dropped.
      const int shift = top < 0 ? kK : tb - top;
      for (int k = kK - 1; k >= 0; --k) c[k] = k - shift >= 0 ? c[k - shift] : 0;
      top = tb;
      top_[i] = static_cast<std::uint8_t>(tb + 1);
    }
    const bool negative = (u >> 31) != 0;
    const int low_bin = std::max(top - kK + 1, p / kW);
    for (int b = std::min(tb, top); b >= low_bin; --b) {
      const int at = b * kW;
      const std::int64_t piece = (at >= p ? m >> (at - p) : m << (p - at)) & kMask;
      c[top - b] += static_cast<std::int32_t>(negative ? -piece : piece);
    }
  }
}

namespace {

// The top bin (stored + 1) of a magnitude given as f32 bits without the sign: kEmpty for zero,
// kNonFinite for NaN and infinity. The top bin grows with the magnitude, so the top of a block
// is that of its largest magnitude.
std::uint8_t top_of_magnitude(std::uint32_t a) {
  if (a == 0) return 0;
  if (a >= 0x7f800000u) return 255;
  const std::uint32_t biased = a >> 23;
  // The highest set bit of |x| in units of 2^-149: biased + 22 for a normal number.
  const int high_bit = biased != 0 ? static_cast<int>(biased) + 22 : static_cast<int>(std::bit_width(a)) - 1;
  return static_cast<std::uint8_t>(high_bit / kW + 1);
}

// The largest magnitude among n f32 values (as bits without the sign). Written to vectorise.
[[gnu::always_inline]] inline std::uint32_t max_magnitude_body(const std::uint32_t* u, std::int64_t n) {
  std::uint32_t mx = 0;
  for (std::int64_t k = 0; k < n; ++k) mx = std::max(mx, u[k] & 0x7fffffffu);
  return mx;
}

// Each of n finite f32 values truncated toward zero at 2^(low - 149) and counted in those units
// (|result| < 2^48 for values below the window's top). Written to vectorise.
[[gnu::always_inline]] inline void fold_values_body(const std::uint32_t* u, std::int64_t n, int low,
                                                     std::int64_t* out) {
  for (std::int64_t k = 0; k < n; ++k) {
    const std::uint32_t biased = (u[k] >> 23) & 0xffu;
    const std::uint64_t m = (u[k] & 0x7fffffu) | (biased != 0 ? 0x800000u : 0u);
    const int p = biased != 0 ? static_cast<int>(biased) - 1 : 0;  // |x| = m * 2^(p - 149)
    const int d = p - low;
    const std::uint64_t v = d >= 0 ? m << std::min(d, 63) : m >> std::min(-d, 63);
    out[k] = (u[k] >> 31) != 0 ? -static_cast<std::int64_t>(v) : static_cast<std::int64_t>(v);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define LOCKSTEP_EXACT_AVX2 1
[[gnu::target("avx2")]] std::uint32_t max_magnitude_avx2(const std::uint32_t* u, std::int64_t n) {
  return max_magnitude_body(u, n);
}
[[gnu::target("avx2")]] void fold_values_avx2(const std::uint32_t* u, std::int64_t n, int low, std::int64_t* out) {
  fold_values_body(u, n, low, out);
}
const bool kHasAvx2 = __builtin_cpu_supports("avx2");
#endif

// Integer work: the same result on every instruction set, so the choice is free.
std::uint32_t max_magnitude(const std::uint32_t* u, std::int64_t n) {
#ifdef LOCKSTEP_EXACT_AVX2
  if (kHasAvx2) return max_magnitude_avx2(u, n);
#endif
  return max_magnitude_body(u, n);
}
void fold_values(const std::uint32_t* u, std::int64_t n, int low, std::int64_t* out) {
#ifdef LOCKSTEP_EXACT_AVX2
  if (kHasAvx2) return fold_values_avx2(u, n, low, out);
#endif
  fold_values_body(u, n, low, out);
}

// Calls f(block, first, count) for the pieces of elements [at, at + n) cut at block edges,
// first relative to at.
template <typename F>
void for_each_block_piece(std::int64_t at, std::int64_t n, F&& f) {
  for (std::int64_t k = 0; k < n;) {
    const std::int64_t i = at + k;
    const std::int64_t block = i / ExactSum::kBlock;
    const std::int64_t len = std::min(n - k, (block + 1) * ExactSum::kBlock - i);
    f(block, k, len);
    k += len;
  }
}

const std::uint32_t* bits_of(const float* x) { return reinterpret_cast<const std::uint32_t*>(x); }

}  // namespace

void ExactSum::tops_of_parts(const std::vector<Part>& parts) {
  std::int64_t covered = 0;
  for (const Part& part : parts) {
    if (part.at < 0 || part.n < 0 || part.at + part.n > numel())
      throw Error("ExactSum::reduce: a part out of range");
    covered += part.n;
    const std::uint32_t* u = bits_of(part.x);
    for_each_block_piece(part.at, part.n, [&](std::int64_t block, std::int64_t first, std::int64_t len) {
      std::uint8_t& bt = block_top_[static_cast<std::size_t>(block)];
      bt = std::max(bt, top_of_magnitude(max_magnitude(u + first, len)));
    });
  }
  if (covered != numel()) throw Error("ExactSum::reduce: the parts do not cover every element");
}

void ExactSum::fold_parts(const std::vector<Part>& parts) {
  for (const Part& part : parts) {
    const std::uint32_t* u = bits_of(part.x);
    std::int64_t* w = wide_.data() + part.at;
    for_each_block_piece(part.at, part.n, [&](std::int64_t block, std::int64_t first, std::int64_t len) {
      const std::uint8_t bt = block_top_[static_cast<std::size_t>(block)];
      if (bt == kNonFinite || bt == kEmpty) {
        std::fill(w + first, w + first + len, std::int64_t{0});
        return;
      }
      const int window_low = (bt - 1) - kK + 1;  // lowest bin of the block's window
      fold_values(u + first, len, window_low * kW, w + first);
    });
  }
}

void ExactSum::fold_bins() {
  const std::int64_t n = numel();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint8_t bt = block_top_[static_cast<std::size_t>(i / kBlock)];
    const std::uint8_t t = top_[static_cast<std::size_t>(i)];
    std::int64_t v = 0;
    if (bt != kNonFinite && t != kEmpty && t != kNonFinite) {
      const int window_low = (bt - 1) - kK + 1;  // lowest bin of the block's window
      const int top = t - 1;
      const std::int32_t* c = &bins_[static_cast<std::size_t>(i) * kK];
      for (int k = 0; k < kK; ++k) {
        const int b = top - k;
        if (b < window_low) break;  // below the block's window: dropped on every rank alike
        v += static_cast<std::int64_t>(c[k]) * (std::int64_t{1} << ((b - window_low) * kW));
      }
    }
    wide_[static_cast<std::size_t>(i)] = v;
  }
}

std::int64_t ExactSum::reduce(Backend& backend, const std::vector<Part>& last, float* out, bool mean) {
  // A value more on a rank that already holds some: into the counters like the others.
  const bool direct = !last.empty() && count_ == 0;
  if (!last.empty() && !direct) {
    for (const Part& part : last) add(part.x, part.at, part.n);
    count_one();
  }
  const std::int64_t n = numel();
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  const std::int64_t mine = direct ? 1 : count_;
  // (1) The top of every block, agreed (MAX: exact, any order); a non-finite element makes its
  // block's top kNonFinite everywhere.
  // One byte more says whether any rank added more values than the window's int64 can hold, so
  // that every rank refuses the step alike before anything is folded.
  block_top_.assign(static_cast<std::size_t>(blocks) + 1, kEmpty);
  if (direct) {
    tops_of_parts(last);
  } else {
    for (std::int64_t i = 0; i < n; ++i) {
      std::uint8_t& bt = block_top_[static_cast<std::size_t>(i / kBlock)];
      bt = std::max(bt, top_[static_cast<std::size_t>(i)]);
    }
  }
  block_top_[static_cast<std::size_t>(blocks)] = mine > kMaxSummands ? 1 : 0;
  backend.allreduce(TensorView{block_top_.data(), blocks + 1, DType::u8, Device::cpu()}, ReduceOp::max);
  if (block_top_[static_cast<std::size_t>(blocks)] != 0) {
    discard();
    throw InvalidArgument(concat("deterministic mode: a rank added more than ", kMaxSummands,
                                 " micro-batches in one step (this rank: ", mine, ")", rank_suffix()));
  }
  // (2) Each element's part inside its block's window as one int64 in units of the window's
  // lowest bin, and this rank's count as the last element: one exact SUM.
  wide_.resize(static_cast<std::size_t>(n) + 1);
  if (direct)
    fold_parts(last);
  else
    fold_bins();
  wide_[static_cast<std::size_t>(n)] = mine;
  backend.allreduce(TensorView{wide_.data(), n + 1, DType::i64, Device::cpu()}, ReduceOp::sum);
  // The same total on every rank: a total above the bound (each rank below it) is refused on
  // every rank alike, before the sums (which may have wrapped) are used.
  const std::int64_t total = wide_[static_cast<std::size_t>(n)];
  if (total > kMaxSummands) {
    discard();
    throw InvalidArgument(concat("deterministic mode: ", total, " micro-batches in one step over all ranks; at most ",
                                 kMaxSummands, rank_suffix()));
  }
  // (3) Back to f32: the int64 to double (exact up to 2^53, otherwise rounded the same way
  // everywhere), scaled by a power of two, divided by the count, rounded to f32.
  // The power of two is one per block (2^-185 .. 2^128: normal doubles, so the product is exact).
  const double divisor = mean && total > 0 ? static_cast<double>(total) : 1.0;
  for (std::int64_t block = 0; block < blocks; ++block) {
    const std::uint8_t bt = block_top_[static_cast<std::size_t>(block)];
    const std::int64_t lo = block * kBlock, hi = std::min(n, lo + kBlock);
    if (bt == kNonFinite || bt == kEmpty) {
      std::fill(out + lo, out + hi, bt == kEmpty ? 0.0f : std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    const int window_low = (bt - 1) - kK + 1;
    const double scale = std::ldexp(1.0, window_low * kW - kSubnormalExponent);
    const std::int64_t* w = wide_.data();
    if (divisor == 1.0)
      for (std::int64_t i = lo; i < hi; ++i) out[i] = static_cast<float>(static_cast<double>(w[i]) * scale);
    else
      for (std::int64_t i = lo; i < hi; ++i) out[i] = static_cast<float>(static_cast<double>(w[i]) * scale / divisor);
  }
  discard();
  return total;
}

void ExactSum::discard() noexcept {
  // The counters of an empty element are never read, and its first value clears them (add).
  count_ = 0;
  std::fill(top_.begin(), top_.end(), kEmpty);
}

}  // namespace lockstep::detail
