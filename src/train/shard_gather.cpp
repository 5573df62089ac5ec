// The sharded update's last part: every rank's shard of the parameters, updated on its owner,
// all-gathered into every rank's, bucket by bucket.
#include "train/reducer_impl.hpp"

#include <algorithm>
#include <cstring>
#include <optional>

namespace lockstep {

// Sharded update, last part: piece r of every bucket of `params` (the tensors the reducer was
// set up for, updated on their owner) is all-gathered into every rank's params. A bucket whose
// parameters lie back to back (any one-tensor bucket) is gathered in place; otherwise this
// rank's piece is packed into a buffer of the bucket's size, gathered there, and unpacked.
// Device tensors (all on one device: check_options): the packing and unpacking are one
// copy_many launch each, queued on the current stream, and the collectives run in a
// StreamOrderedScope, since the rule's kernels wrote the parameters on that stream.
void GradientReducer::Impl::gather(const std::vector<Tensor*>& params) {
  if (!sharded || nranks == 1 || params.empty()) return;
  const bool on_device = !buckets.empty() && !buckets[0].device.is_cpu();
  std::optional<detail::StreamOrderedScope> ordered;
  if (on_device) ordered.emplace();
  copies.clear();  // (copy_device's scratch too)
  // Host: memcpy at once; device: collected into `copies` and sent with flush().
  auto move_bytes = [&](void* dst, const void* src, std::size_t n) {
    if (n == 0) return;
    if (on_device) copies.push_back({dst, src, n});
    else std::memcpy(dst, src, n);
  };
  auto flush = [&] {
    if (on_device && !copies.empty())
      device_runtime("DistributedOptimizer").copy_many(copies, buckets[0].device.index);
    copies.clear();
  };
  // Which buckets' parameters lie back to back; the buffer is made once, for the largest of
  // the others (at most bucket_bytes: a bucket of several tensors is no larger).
  std::vector<char> apart(buckets.size(), 0);
  std::int64_t need = 0;
  for (std::size_t k = 0; k < buckets.size(); ++k) {
    const Bucket& b = buckets[k];
    for (std::size_t j = b.first + 1; j < b.last && !apart[k]; ++j)
      apart[k] = static_cast<const std::byte*>(params[j]->raw_data()) !=
                 static_cast<const std::byte*>(params[j - 1]->raw_data()) + params[j - 1]->nbytes();
    if (apart[k]) need = std::max(need, b.numel);
  }
  if (need > gather_buf.numel()) gather_buf = Tensor::zeros({need}, buckets[0].dtype, buckets[0].device);
  for (std::size_t k = 0; k < buckets.size(); ++k) {
    const Bucket& b = buckets[k];
    if (b.numel == 0) continue;
    const std::size_t es = size_of(b.dtype);
    const bool together = !apart[k];
    const auto [lo, hi] = piece(b.numel, my_rank);
    TensorView whole;
    if (together) {
      whole = TensorView{params[b.first]->raw_data(), b.numel, b.dtype, b.device};
    } else {
      whole = gather_buf.view().slice(0, b.numel);
      for (std::size_t j = b.first; j < b.last; ++j) {
        const std::int64_t o = b.offsets[j - b.first];
        const std::int64_t a = std::max(lo, o), e = std::min(hi, o + leaves[j].numel);
        if (e > a)
          move_bytes(static_cast<std::byte*>(whole.data) + static_cast<std::size_t>(a) * es,
                     static_cast<const std::byte*>(params[j]->raw_data()) + static_cast<std::size_t>(a - o) * es,
                     static_cast<std::size_t>(e - a) * es);
      }
      flush();
    }
    const std::int64_t q = b.numel / nranks, t = b.numel - q * nranks;
    if (q > 0) backend->allgather(whole.slice(my_rank * q, q), whole.slice(0, q * nranks));
    if (t > 0) backend->broadcast(whole.slice(q * nranks, t), nranks - 1);
    if (together) continue;
    for (std::size_t j = b.first; j < b.last; ++j)
      move_bytes(params[j]->raw_data(),
                 static_cast<const std::byte*>(whole.data) + static_cast<std::size_t>(b.offsets[j - b.first]) * es,
                 params[j]->nbytes());
    flush();
  }
}

void GradientReducer::gather_shards(const std::vector<Tensor*>& params) { impl_->gather(params); }

}  // namespace lockstep
