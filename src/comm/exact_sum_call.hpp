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

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace lockstep::detail {

/// Part of one value, in host memory: x[k] is the value of element at + k, for k < n.
struct ExactSumPart {
  const float* x;
  std::int64_t at;
  std::int64_t n;
};

/// Where part of the result goes, in host memory: x[k] receives element at + k, for k < n.
struct ExactSumOut {
  float* x;
  std::int64_t at;
  std::int64_t n;
};

/// Writes results into outs (disjoint ranges covering the elements once, in any order): the
/// pieces of a range of elements, one per out it crosses. Ranges written in increasing order
/// find their out at once (the last one found is tried first); others by binary search.
class ExactSumWriter {
 public:
  ExactSumWriter(const ExactSumOut* outs, std::int64_t nouts) {
    // Empty outs (a tensor of no elements) hold nothing: left out, so that the out found for an
    // element is the one that holds it.
    for (std::int64_t j = 0; j < nouts; ++j)
      if (outs[j].n > 0) outs_.push_back(outs[j]);
    std::sort(outs_.begin(), outs_.end(), [](const ExactSumOut& a, const ExactSumOut& b) { return a.at < b.at; });
  }
  /// f(dst, offset, len) for each piece of elements [at, at + m): dst receives elements
  /// [at + offset, at + offset + len).
  template <typename F>
  void each(std::int64_t at, std::int64_t m, F&& f) {
    std::int64_t done = 0;
    while (done < m) {
      const ExactSumOut& o = find(at + done);
      const std::int64_t len = std::min(m - done, o.at + o.n - (at + done));
      f(o.x + (at + done - o.at), done, len);
      done += len;
    }
  }
  void write(std::int64_t at, const float* src, std::int64_t m) {
    each(at, m, [&](float* dst, std::int64_t off, std::int64_t len) {
      std::memcpy(dst, src + off, static_cast<std::size_t>(len) * sizeof(float));
    });
  }

 private:
  const ExactSumOut& find(std::int64_t i) {
    for (std::size_t j = hint_; j < outs_.size() && j < hint_ + 2; ++j)
      if (outs_[j].at <= i && i < outs_[j].at + outs_[j].n) return outs_[hint_ = j];
    auto it = std::upper_bound(outs_.begin(), outs_.end(), i,
                               [](std::int64_t v, const ExactSumOut& o) { return v < o.at; });
    hint_ = static_cast<std::size_t>(it - outs_.begin()) - 1;  // the covering out (the outs cover every element)
    return outs_[hint_];
  }
  std::vector<ExactSumOut> outs_;
  std::size_t hint_ = 0;
};

struct ExactSumCall {
  /// This rank's value: parts over disjoint ranges that together cover [0, numel) once. A part
  /// may lie in the result at its own elements (each element is read before it is written).
  const ExactSumPart* parts = nullptr;
  std::int64_t nparts = 0;
  std::int64_t numel = 0;  // the same on every rank
  /// The agreed top of every block of exact::kBlock elements (stored + 1; 0: zeros, 255: NaN);
  /// null: the backend takes each block's top from every rank's values of the block, which it
  /// holds (the max over them is what the ranks' MAX agreement of their own tops gives).
  const std::uint8_t* block_top = nullptr;
  double divisor = 1.0;   // the same on every rank: the count of values for a mean, else 1
  /// The result: outs over disjoint ranges that together cover [0, numel) once (ExactSumWriter).
  const ExactSumOut* outs = nullptr;
  std::int64_t nouts = 0;
};

}  // namespace lockstep::detail
