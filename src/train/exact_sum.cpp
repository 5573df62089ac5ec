// The exact, order-independent sum of deterministic mode (exact_sum.hpp); the loops over many
// elements are in exact_sum_kernels.cpp.
#include "train/exact_sum.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "lockstep/core/errors.hpp"
#include "core/exact_sum_kernels.hpp"

namespace lockstep::detail {

namespace {
constexpr int kW = ExactSum::kBinBits;
constexpr int kK = ExactSum::kBins;
static_assert(kW == exact::kBinBits && kK == exact::kBins);
constexpr std::int64_t kMask = (std::int64_t{1} << kW) - 1;
// f32 magnitudes in units of the smallest subnormal (2^-149) have at most 24 + 253 = 277 bits:
// bins 0 .. 23, stored + 1 in a byte.
constexpr int kSubnormalExponent = 149;

const std::uint32_t* bits_of(const float* x) { return reinterpret_cast<const std::uint32_t*>(x); }

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
}  // namespace

void ExactSum::reset(std::int64_t numel) {
  numel_ = numel;
  // The tops and counters (17 bytes per element) are made when a value first goes into the bins:
  // the common step (one micro-batch per rank, folded where it lies) never needs them.
  std::vector<std::uint8_t>().swap(top_);
  std::vector<std::int32_t>().swap(bins_);
  binned_ = false;
  count_ = 0;
  first_held_ = false;
}

void ExactSum::ensure_bins() {
  if (top_.size() == static_cast<std::size_t>(numel_)) return;
  top_.assign(static_cast<std::size_t>(numel_), kEmpty);
  bins_.assign(static_cast<std::size_t>(numel_) * kK, 0);
}

bool ExactSum::covers_all(const std::vector<Part>& parts) const {
  std::int64_t covered = 0;
  for (const Part& part : parts) {
    if (part.at < 0 || part.n < 0 || part.at + part.n > numel()) throw Error("ExactSum: a part out of range");
    covered += part.n;
  }
  return covered == numel();  // the parts are disjoint
}

void ExactSum::add(const std::vector<Part>& parts) {
  if (count_ == 0 && covers_all(parts)) {
    first_.resize(static_cast<std::size_t>(numel()));
    for (const Part& part : parts)
      if (part.n > 0) std::memcpy(first_.data() + part.at, part.x, static_cast<std::size_t>(part.n) * sizeof(float));
    first_held_ = true;
  } else {
    spill_first();
    for (const Part& part : parts) add_to_bins(part.x, part.at, part.n);
  }
  ++count_;
}

void ExactSum::spill_first() {
  if (!first_held_) return;
  first_held_ = false;
  add_to_bins(first_.data(), 0, numel());
}

void ExactSum::add_to_bins(const float* xs, std::int64_t at, std::int64_t n) {
  if (n <= 0) return;
  if (at < 0 || at + n > numel()) throw Error("ExactSum::add: elements out of range");
  ensure_bins();
  binned_ = true;
  const std::uint32_t* us = bits_of(xs);
  const std::size_t stride = static_cast<std::size_t>(numel());
  std::int32_t* const c[kK] = {bins_.data(), bins_.data() + stride, bins_.data() + 2 * stride, bins_.data() + 3 * stride};
  constexpr std::int64_t kChunk = 1024;
  for (std::int64_t first = 0; first < n; first += kChunk) {
    const std::int64_t len = std::min(kChunk, n - first);
    const std::size_t i0 = static_cast<std::size_t>(at + first);
    // The common cases at once; the values that move an element's window up, NaN and infinity,
    // subnormals and non-finite elements one by one below.
    std::int32_t* const ci[kK] = {c[0] + i0, c[1] + i0, c[2] + i0, c[3] + i0};
    if (exact::add_common(us + first, len, top_.data() + i0, ci) == 0) continue;
    for (std::int64_t k = first; k < first + len; ++k) {
      const std::size_t i = static_cast<std::size_t>(at + k);  // the element xs[k] adds to
      const std::uint32_t u = us[k];
      if (!exact::is_careful(u, top_[i])) continue;
      const std::uint32_t biased = (u >> 23) & 0xff;
      const std::uint32_t frac = u & 0x7fffff;
      if (biased == 0xff) {  // NaN or infinity
        top_[i] = kNonFinite;
        continue;
      }
      if (top_[i] == kNonFinite) continue;
      // |x| = m * 2^(p - 149), m < 2^24, p >= 0.
      const std::int64_t m = biased == 0 ? frac : (frac | 0x800000u);
      const int p = biased == 0 ? 0 : static_cast<int>(biased) - 1;
      const int high_bit = p + static_cast<int>(std::bit_width(static_cast<std::uint64_t>(m))) - 1;
      const int tb = high_bit / kW;  // this value's top bin
      int top = top_[i] - 1;         // -1: empty
      if (tb > top) {
        // The window moves up: counter k (bin top - k) becomes counter k + shift; the lowest
        // ones fall out, exactly the pieces a sum that had seen this value first would have
        // dropped.
        const int shift = top < 0 ? kK : tb - top;
        for (int j = kK - 1; j >= 0; --j) c[j][i] = j - shift >= 0 ? c[j - shift][i] : 0;
        top = tb;
        top_[i] = static_cast<std::uint8_t>(tb + 1);
      }
      const bool negative = (u >> 31) != 0;
      const int low_bin = std::max(top - kK + 1, p / kW);
      for (int b = std::min(tb, top); b >= low_bin; --b) {
        const int bit = b * kW;
        const std::int64_t piece = (bit >= p ? m >> (bit - p) : m << (p - bit)) & kMask;
        c[top - b][i] += static_cast<std::int32_t>(negative ? -piece : piece);
      }
    }
  }
}


void ExactSum::tops_of_parts(const std::vector<Part>& parts) {
  for (const Part& part : parts) {
    const std::uint32_t* u = bits_of(part.x);
    for_each_block_piece(part.at, part.n, [&](std::int64_t block, std::int64_t first, std::int64_t len) {
      std::uint8_t& bt = block_top_[static_cast<std::size_t>(block)];
      bt = std::max(bt, exact::top_of_magnitude(exact::max_magnitude(u + first, len)));
    });
  }
}

void ExactSum::fold_parts(const std::vector<Part>& parts, std::int64_t lo, std::int64_t hi) {
  for (const Part& part : parts) {
    const std::int64_t from = std::max(lo, part.at), to = std::min(hi, part.at + part.n);
    if (from >= to) continue;
    const std::uint32_t* u = bits_of(part.x) + (from - part.at);
    std::int64_t* w = wide_.data() + 1 + from;
    for_each_block_piece(from, to - from, [&](std::int64_t block, std::int64_t first, std::int64_t len) {
      const std::uint8_t bt = block_top_[static_cast<std::size_t>(block)];
      if (bt == kNonFinite || bt == kEmpty) {
        std::fill(w + first, w + first + len, std::int64_t{0});
        return;
      }
      const int window_low = (bt - 1) - kK + 1;  // lowest bin of the block's window
      exact::fold_values(u + first, len, window_low * kW, w + first);
    });
  }
}

void ExactSum::fold_bins(std::int64_t lo, std::int64_t hi) {
  const std::size_t stride = static_cast<std::size_t>(numel());
  for (std::int64_t at = lo; at < hi; at += kBlock) {  // lo is a block's first element
    const std::uint8_t bt = block_top_[static_cast<std::size_t>(at / kBlock)];
    const std::int64_t len = std::min(kBlock, hi - at);
    std::int64_t* w = wide_.data() + 1 + at;
    if (bt == kNonFinite || bt == kEmpty) {
      std::fill(w, w + len, std::int64_t{0});
      continue;
    }
    const std::size_t i0 = static_cast<std::size_t>(at);
    std::int32_t* const c[kK] = {bins_.data() + i0, bins_.data() + stride + i0, bins_.data() + 2 * stride + i0,
                                 bins_.data() + 3 * stride + i0};
    exact::fold_counters(top_.data() + i0, c, len, bt, w);
  }
}

std::int64_t ExactSum::reduce(Backend& backend, const std::vector<Part>& last, const std::vector<Out>& outs,
                             bool mean) {
  {
    std::int64_t covered = 0;
    for (const Out& o : outs) {
      if (o.at < 0 || o.n < 0 || o.at + o.n > numel()) throw Error("ExactSum::reduce: an out of range");
      covered += o.n;
    }
    if (covered != numel()) throw Error("ExactSum::reduce: the outs do not cover every element");
  }
  // A rank's only value of the step is folded where it lies (given now, or the copied first
  // value); otherwise every value goes into the counters.
  if (!last.empty() && !covers_all(last)) throw Error("ExactSum::reduce: the parts do not cover every element");
  std::vector<Part> only;
  if (count_ == 0 && !last.empty())
    only = last;
  else if (count_ == 1 && first_held_ && last.empty())
    only = {Part{first_.data(), 0, numel()}};
  else if (!last.empty())
    add(last);
  if (only.empty()) spill_first();
  const bool direct = !only.empty();
  const std::int64_t n = numel();
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  const std::int64_t mine = direct ? 1 : count_;
  // (0) Two bytes, agreed (MAX) before anything else: whether any rank added more values than
  // the window's int64 can hold, so that every rank refuses the step alike before anything is
  // folded; and whether any rank has other than one value given in place. Where none has, every
  // rank has exactly one (the same verdict everywhere), and the backend may fuse the rest into
  // its own reduction (do_exact_sum, which agrees on the call itself before it chooses its
  // path). It holds every rank's values there, so it takes each block's top from all of them:
  // the max that the agreement in (1) gives (the top grows with the magnitude).
  std::uint8_t flags[2] = {static_cast<std::uint8_t>(mine > kMaxSummands ? 1 : 0),
                           static_cast<std::uint8_t>(direct ? 0 : 1)};
  backend.allreduce(TensorView{flags, 2, DType::u8, Device::cpu()}, ReduceOp::max);
  if (flags[0] != 0) {
    discard();
    throw InvalidArgument(concat("deterministic mode: a rank added more than ", kMaxSummands,
                                 " micro-batches in one step (this rank: ", mine, ")", rank_suffix()));
  }
  if (flags[1] == 0) {
    const std::int64_t total = backend.size();  // one value on every rank
    const ExactSumCall call{only.data(), static_cast<std::int64_t>(only.size()), n, nullptr,
                            mean && total > 0 ? static_cast<double>(total) : 1.0, outs.data(),
                            static_cast<std::int64_t>(outs.size())};
    if (backend.do_exact_sum(call)) {
      discard();
      return total;
    }
  }
  // (1) The top of every block, agreed (MAX: exact, any order); a non-finite element makes its
  // block's top kNonFinite everywhere.
  block_top_.assign(static_cast<std::size_t>(blocks), kEmpty);
  if (direct) {
    tops_of_parts(only);
  } else {
    ensure_bins();  // a rank with no value of the step reads empty tops and zero counters
    for (std::int64_t block = 0; block < blocks; ++block) {
      const auto first = top_.begin() + block * kBlock;
      block_top_[static_cast<std::size_t>(block)] = *std::max_element(first, first + std::min(kBlock, n - block * kBlock));
    }
  }
  if (blocks > 0) backend.allreduce(TensorView{block_top_.data(), blocks, DType::u8, Device::cpu()}, ReduceOp::max);
  // (2) Each element's part inside its block's window as one int64 in units of the window's
  // lowest bin, and this rank's count before the first: exact SUMs, in chunks of chunk_elements_
  // (the reducer's bucket size: one huge call is slower than several on most transports), each
  // folded just before its call and (3) converted back just after it.
  wide_.resize(static_cast<std::size_t>(n) + 1);
  wide_[0] = mine;
  const std::int64_t chunk = std::max<std::int64_t>(kBlock, chunk_elements_ / kBlock * kBlock);
  std::int64_t total = 0;
  double divisor = 1.0;
  ExactSumWriter out(outs.data(), static_cast<std::int64_t>(outs.size()));
  for (std::int64_t lo = 0; lo == 0 || lo < n; lo += chunk) {
    const std::int64_t hi = std::min(n, lo + chunk);
    if (direct)
      fold_parts(only, lo, hi);
    else
      fold_bins(lo, hi);
    const std::int64_t first = lo == 0 ? 0 : 1 + lo;  // the first call carries the count
    backend.allreduce(TensorView{wide_.data() + first, 1 + hi - first, DType::i64, Device::cpu()}, ReduceOp::sum);
    if (lo == 0) {
      // The same total on every rank: a total above the bound (each rank below it) is refused on
      // every rank alike, before the sums (which may have wrapped) are used.
      total = wide_[0];
      if (total > kMaxSummands) {
        discard();
        throw InvalidArgument(concat("deterministic mode: ", total,
                                     " micro-batches in one step over all ranks; at most ", kMaxSummands,
                                     rank_suffix()));
      }
      divisor = mean && total > 0 ? static_cast<double>(total) : 1.0;
    }
    // (3) Back to f32: the int64 to double (exact up to 2^53, otherwise rounded the same way
    // everywhere), scaled by a power of two, divided by the count, rounded to f32. The power of
    // two is one per block (2^-185 .. 2^128: normal doubles, so the product is exact).
    for (std::int64_t at = lo; at < hi; at += kBlock) {
      const std::uint8_t bt = block_top_[static_cast<std::size_t>(at / kBlock)];
      const std::int64_t end = std::min(hi, at + kBlock);
      if (bt == kNonFinite || bt == kEmpty) {
        out.each(at, end - at, [&](float* dst, std::int64_t, std::int64_t len) {
          std::fill(dst, dst + len, bt == kEmpty ? 0.0f : std::numeric_limits<float>::quiet_NaN());
        });
        continue;
      }
      const int window_low = (bt - 1) - kK + 1;
      const double scale = std::ldexp(1.0, window_low * kW - kSubnormalExponent);
      out.each(at, end - at, [&](float* dst, std::int64_t off, std::int64_t len) {
        exact::to_f32(wide_.data() + 1 + at + off, len, scale, divisor, dst);
      });
    }
  }
  discard();
  return total;
}

void ExactSum::discard() noexcept {
  // The counters of an empty element are never read, and its first value clears them (add).
  count_ = 0;
  first_held_ = false;
  if (binned_) std::fill(top_.begin(), top_.end(), kEmpty);
  binned_ = false;
}

}  // namespace lockstep::detail
