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

std::int64_t ExactSum::reduce(Backend& backend, float* out, bool mean) {
  const std::int64_t n = numel();
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  // (1) The top of every block, agreed (MAX: exact, any order); a non-finite element makes its
  // block's top kNonFinite everywhere.
  // One byte more says whether any rank added more values than the window's int64 can hold, so
  // that every rank refuses the step alike before anything is folded.
  block_top_.assign(static_cast<std::size_t>(blocks) + 1, kEmpty);
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint8_t& bt = block_top_[static_cast<std::size_t>(i / kBlock)];
    bt = std::max(bt, top_[static_cast<std::size_t>(i)]);
  }
  block_top_[static_cast<std::size_t>(blocks)] = count_ > kMaxSummands ? 1 : 0;
  backend.allreduce(TensorView{block_top_.data(), blocks + 1, DType::u8, Device::cpu()}, ReduceOp::max);
  if (block_top_[static_cast<std::size_t>(blocks)] != 0) {
    const std::int64_t mine = count_;
    discard();
    throw InvalidArgument(concat("deterministic mode: a rank added more than ", kMaxSummands,
                                 " micro-batches in one step (this rank: ", mine, ")", rank_suffix()));
  }
  // (2) Each element's counters inside its block's window as one int64 in units of the
  // window's lowest bin, and this rank's count as the last element: one exact SUM.
  wide_.assign(static_cast<std::size_t>(n) + 1, 0);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint8_t bt = block_top_[static_cast<std::size_t>(i / kBlock)];
    const std::uint8_t t = top_[static_cast<std::size_t>(i)];
    if (bt == kNonFinite || t == kEmpty || t == kNonFinite) continue;
    const int window_low = (bt - 1) - kK + 1;  // lowest bin of the block's window
    const int top = t - 1;
    const std::int32_t* c = &bins_[static_cast<std::size_t>(i) * kK];
    std::int64_t v = 0;
    for (int k = 0; k < kK; ++k) {
      const int b = top - k;
      if (b < window_low) break;  // below the block's window: dropped on every rank alike
      v += static_cast<std::int64_t>(c[k]) * (std::int64_t{1} << ((b - window_low) * kW));
    }
    wide_[static_cast<std::size_t>(i)] = v;
  }
  wide_[static_cast<std::size_t>(n)] = count_;
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
    for (std::int64_t i = lo; i < hi; ++i)
      out[i] = static_cast<float>(static_cast<double>(wide_[static_cast<std::size_t>(i)]) * scale / divisor);
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
