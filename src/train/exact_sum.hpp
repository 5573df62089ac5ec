// Internal (never installed): the exact, order-independent sum of deterministic mode
// (DistributedOptions::deterministic; docs/training.md, "Deterministic training").
//
// Each value is cut at fixed bit positions into pieces of kBinBits bits (bins: bin b holds the
// bits [b * kBinBits, (b + 1) * kBinBits) of the value's magnitude in units of the smallest
// subnormal), and a sum keeps one integer counter per bin for the kBins bins at and below the
// highest bin any of its values reached (the top). A value's pieces below that window are
// dropped, never rounded into a higher bin, and the counters are never normalised, so dropping a
// whole bin when the top rises drops exactly the pieces that a sum which had seen the high value
// first would have dropped: what a sum holds depends only on the multiset of its values, not on
// their order or grouping. Integer counters add exactly.
//
// Across ranks (reduce): (0) two flags agreed (too many values; not one value given in place on
// every rank), (1) the top of every block of kBlock elements, agreed with one MAX
// allreduce of one byte per block; (2) each rank's counters inside its block's window folded
// into one int64 in units of the window's lowest bin (exact: the window is kBins * kBinBits =
// 48 bits and at most kMaxSummands values were added), SUM allreduces of int64 in chunks, the
// first with the count of micro-batches as one element more; (3) the total scaled back and
// divided by the count,
// rounded to f32 (the one place where rounding happens, the same on every rank). A rank whose
// only value of the step is given to reduce() itself (parts: the common step of one micro-batch
// per rank) never cuts it into bins: its block tops come from the values' magnitudes, and each
// value is cut once at its block's window (truncated toward zero there), which is what its bins
// would have held inside that window: the same contribution, bit for bit. When every rank has
// exactly one value so (agreed with the block tops), a backend may fold the values inside its
// own reduction instead (Backend::do_exact_sum; MPIBackend's shared-memory path: each rank's f32
// values through the slots, folded, summed in int64 and converted in registers, no int64 in
// memory): the same bits, since an int64 sum is exact in any order. The result:
// the same bits at any number of ranks, any split of the values over the ranks, and any
// algorithm of the collectives. Its error: the dropped pieces, each below 2^-36 of the largest
// magnitude in its block, far below the f32 rounding of an ordinary sum.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/exact_sum_call.hpp"
#include "lockstep/comm/backend.hpp"
#include "lockstep/core/tensor.hpp"

namespace lockstep::detail {

class ExactSum {
 public:
  static constexpr int kBinBits = 12;
  static constexpr int kBins = 4;
  static constexpr std::int64_t kBlock = 64;
  // The values one element may sum over all ranks (micro-batches of one step): the window's
  // int64 then cannot overflow (each value's part in the window is below 2^48 units).
  static constexpr std::int64_t kMaxSummands = std::int64_t{1} << 14;

  ExactSum() = default;
  explicit ExactSum(std::int64_t numel) { reset(numel); }

  /// numel elements, each an empty sum.
  void reset(std::int64_t numel);
  std::int64_t numel() const noexcept { return numel_; }
  /// Values added to each element since reset (the micro-batches of this rank).
  std::int64_t count() const noexcept { return count_; }

  /// Part of one value, in host memory: x[k] is the value of element at + k, for k < n.
  using Part = ExactSumPart;
  /// Adds one value, given as parts over disjoint ranges of elements (an element no part holds
  /// adds nothing), and counts it. A NaN or infinity marks its element non-finite: reduce() then
  /// gives NaN for the whole block of that element. A first value that covers every element is
  /// only copied (cut into bins when a second one comes, or folded directly by reduce()).
  void add(const std::vector<Part>& parts);
  void add(const float* x) { add({Part{x, 0, numel()}}); }

  /// Collective (every rank, the same numel()): out[i] = (sum over every rank of element i) /
  /// (the total count when mean, else 1), the same bits on every rank. Returns the total count.
  /// More than kMaxSummands values on a rank, or in total, is an InvalidArgument on every rank
  /// (the sums are then discarded).
  std::int64_t reduce(Backend& backend, float* out, bool mean) { return reduce(backend, {}, out, mean); }
  /// reduce() with one more value on this rank, given as parts that together cover every element
  /// once (none: no value more). Each element of the parts is read before it is written, so a
  /// part may lie in the result at its own elements (in place).
  std::int64_t reduce(Backend& backend, const std::vector<Part>& last, float* out, bool mean) {
    return reduce(backend, last, std::vector<Out>{Out{out, 0, numel()}}, mean);
  }
  /// The result written to outs: disjoint ranges that together cover every element once.
  using Out = ExactSumOut;
  std::int64_t reduce(Backend& backend, const std::vector<Part>& last, const std::vector<Out>& out, bool mean);
  /// Every element an empty sum again (what reduce() leaves too).
  void discard() noexcept;
  /// reduce() sums in calls of about this many bytes (8 per element; default 16 MiB); the same
  /// on every rank.
  void set_chunk_bytes(std::size_t bytes) noexcept {
    chunk_elements_ = std::max<std::int64_t>(kBlock, static_cast<std::int64_t>(bytes / sizeof(std::int64_t)));
  }

 private:
  // Per element: the top bin reached (kEmpty: no value yet, kNonFinite: a NaN or infinity), and
  // kBins counters, counter k for bin top - k.
  static constexpr std::uint8_t kEmpty = 0;         // tops are stored + 1
  static constexpr std::uint8_t kNonFinite = 255;
  std::int64_t numel_ = 0;
  std::vector<std::uint8_t> top_;  // top_ and bins_: empty until a value goes into the bins
  bool binned_ = false;  // a value went into the counters since the tops were last cleared
  std::vector<std::int32_t> bins_;  // kBins per element
  std::int64_t count_ = 0;
  // The first value of a step, when it covered every element: copied, not yet in the bins.
  std::vector<float> first_;
  bool first_held_ = false;
  std::vector<std::uint8_t> block_top_;  // reduce's scratch
  std::vector<std::int64_t> wide_;
  bool covers_all(const std::vector<Part>& parts) const;
  void add_to_bins(const float* x, std::int64_t at, std::int64_t n);
  void spill_first();                                  // first_ into the bins
  void ensure_bins();                                  // top_ and bins_ made (empty sums)
  void tops_of_parts(const std::vector<Part>& parts);  // block_top_ from values given in place
  // wide_[1 + i] for the elements i in [lo, hi) (lo a block's first), in the agreed windows:
  void fold_parts(const std::vector<Part>& parts, std::int64_t lo, std::int64_t hi);  // from values
  void fold_bins(std::int64_t lo, std::int64_t hi);                                   // from counters
  std::int64_t chunk_elements_ = std::int64_t{1} << 21;
};

}  // namespace lockstep::detail
