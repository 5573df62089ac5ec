// Internal (never installed): one call of deterministic mode's exact sum across ranks, as a
// backend that fuses it into its own reduction sees it (Backend::do_exact_sum; the exact sum
// itself is src/train/exact_sum.hpp, its loops src/core/exact_sum_kernels.hpp).
//
// The common step: every rank's only value of the step (one micro-batch per rank) is summed
// exactly over the ranks. The fused form itself is already agreed (every rank has exactly one
// value, so the count is size() everywhere); the block tops are agreed or left to the backend. The result must be the bits of the int64 path: each value folded into an
// int64 at its block's window (exact::fold_values), the int64 summed over the ranks, converted
// once (exact::to_f32 with the block's scale, divided by `divisor`).
#pragma once

#include <cstdint>

namespace lockstep::detail {

/// Part of one value, in host memory: x[k] is the value of element at + k, for k < n.
struct ExactSumPart {
  const float* x;
  std::int64_t at;
  std::int64_t n;
};

struct ExactSumCall {
  /// This rank's value: parts over disjoint ranges that together cover [0, numel) once. A part
  /// may lie in out at its own elements (it is read before they are written).
  const ExactSumPart* parts = nullptr;
  std::int64_t nparts = 0;
  std::int64_t numel = 0;  // the same on every rank
  /// The agreed top of every block of exact::kBlock elements (stored + 1; 0: zeros, 255: NaN);
  /// null: the backend takes each block's top from every rank's values of the block, which it
  /// holds (the max over them is what the ranks' MAX agreement of their own tops gives).
  const std::uint8_t* block_top = nullptr;
  double divisor = 1.0;   // the same on every rank: the count of values for a mean, else 1
  float* out = nullptr;   // numel elements, host memory
};

}  // namespace lockstep::detail
