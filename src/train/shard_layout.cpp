// The flat index space of a reducer's trainable tensors and each rank's shard of it
// (DistributedOptions::shard_optimizer_state): piece r of every bucket is rank r's, as in FSDP and
// llm.c's zero.cuh; the pieces of the tensors that make a shard, and copies of a flat range.
#include "train/reducer_impl.hpp"

#include <algorithm>
#include <cstring>

#include "lockstep/core/errors.hpp"
#include "lockstep/train/distributed_optimizer.hpp"

namespace lockstep {

// Sharded: rank r's piece [lo, hi) of a bucket of n elements (bucket-relative). The bucket is
// cut into nranks contiguous pieces of n / nranks elements; the last rank's piece also takes
// the n % nranks left over (the tail), so a bucket smaller than nranks elements is the last
// rank's alone.
std::pair<std::int64_t, std::int64_t> GradientReducer::Impl::piece(std::int64_t n, int r) const {
  const std::int64_t q = n / nranks;
  return {r * q, r == nranks - 1 ? n : (r + 1) * q};
}

// Rank r's ranges of the flat space, in flat order (the last bucket holds the first leaves).
std::vector<FlatRange> GradientReducer::Impl::ranges_of(int r) const {
  std::vector<FlatRange> out;
  if (!sharded) {
    if (total > 0) out.push_back({0, total});
    return out;
  }
  for (std::size_t k = buckets.size(); k-- > 0;) {
    const Bucket& b = buckets[k];
    const auto [lo, hi] = piece(b.numel, r);
    if (hi > lo) out.push_back({leaf_off[b.first] + lo, leaf_off[b.first] + hi});
  }
  return out;
}

// The flat layout and this rank's shard (after plan()).
void GradientReducer::Impl::layout() {
  leaf_off.assign(leaves.size(), 0);
  total = 0;
  for (std::size_t j = 0; j < leaves.size(); ++j) {
    leaf_off[j] = total;
    total += leaves[j].numel;
  }
  nranks = backend->size();
  my_rank = backend->rank();
  wire = options.wire_dtype;
  sharded = options.shard_optimizer_state;
  my_ranges = ranges_of(my_rank);
  my_numel = 0;
  for (const auto& r : my_ranges) my_numel += r.end - r.begin;
}

std::vector<FlatRange> GradientReducer::shard_ranges(int rank) const {
  LOCKSTEP_CHECK_ARG(rank >= 0 && rank < impl_->nranks, "GradientReducer::shard_ranges: rank ", rank,
                     " is out of range [0, ", impl_->nranks, ")");
  return impl_->ranges_of(rank);
}
const std::vector<FlatRange>& GradientReducer::shard_ranges() const noexcept { return impl_->my_ranges; }
std::int64_t GradientReducer::shard_numel() const noexcept { return impl_->my_numel; }
std::int64_t GradientReducer::total_numel() const noexcept { return impl_->total; }
const std::vector<std::int64_t>& GradientReducer::leaf_offsets() const noexcept { return impl_->leaf_off; }

namespace detail {

std::vector<ShardPiece> shard_pieces(const GradientReducer& red) {
  // Each range of this rank's shard lies in one bucket, and each leaf in one bucket: every leaf
  // has at most one piece. Both lists are in flat order.
  std::vector<ShardPiece> out;
  const auto& off = red.leaf_offsets();
  const std::size_t L = off.size();
  auto end_of = [&](std::size_t j) { return j + 1 < L ? off[j + 1] : red.total_numel(); };
  std::size_t j = 0;
  for (const FlatRange& r : red.shard_ranges()) {
    while (j < L && end_of(j) <= r.begin) ++j;
    for (std::size_t k = j; k < L && off[k] < r.end; ++k) {
      const std::int64_t lo = std::max(r.begin, off[k]), hi = std::min(r.end, end_of(k));
      if (hi > lo) out.push_back({k, lo - off[k], hi - off[k]});
    }
  }
  return out;
}

void copy_flat_range(const std::vector<Tensor*>& ts, const std::vector<std::int64_t>& offsets,
                     std::int64_t begin, std::int64_t n, std::byte* buf, bool to_buf) {
  if (n <= 0 || ts.empty()) return;
  const std::size_t es = size_of(ts[0]->dtype());
  // The first tensor that holds `begin`.
  std::size_t j = static_cast<std::size_t>(std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin());
  j = j == 0 ? 0 : j - 1;
  std::int64_t done = 0;
  for (; j < ts.size() && done < n; ++j) {
    const std::int64_t at = begin + done - offsets[j];
    const std::int64_t len = std::min(ts[j]->numel() - at, n - done);
    if (len <= 0) continue;
    std::byte* t = static_cast<std::byte*>(ts[j]->raw_data()) + static_cast<std::size_t>(at) * es;
    std::byte* bb = buf + static_cast<std::size_t>(done) * es;
    if (to_buf) std::memcpy(bb, t, static_cast<std::size_t>(len) * es);
    else std::memcpy(t, bb, static_cast<std::size_t>(len) * es);
    done += len;
  }
}

}  // namespace detail

}  // namespace lockstep
