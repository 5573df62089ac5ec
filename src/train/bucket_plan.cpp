// GradientReducer's bucket plan: the trainable gradients, from the last one backwards (the order
// backward produces them), grouped into buckets of at most bucket_bytes (host) or
// device_bucket_bytes (device); a dtype or device change starts a new bucket.
#include "train/reducer_impl.hpp"

#include <utility>

namespace lockstep {

void GradientReducer::Impl::plan() {
  // Unset, the size follows the path (host_bucket_bytes); a size set is kept as given.
  options.bucket_bytes = host_bucket_bytes(options, *backend);
  bucket_of.assign(leaves.size(), 0);
  // Walk backwards: the last leaves (produced first by backward) go into bucket 0.
  std::size_t i = leaves.size();
  while (i > 0) {
    const std::size_t last = i;
    std::size_t first = i - 1;
    // Host and device buckets have their own size (a bucket never mixes devices).
    const std::size_t cap = leaves[first].device.is_cpu() ? *options.bucket_bytes : options.device_bucket_bytes;
    std::size_t bytes = static_cast<std::size_t>(leaves[first].numel) * size_of(leaves[first].dtype);
    while (first > 0) {
      const auto& prev = leaves[first - 1];
      const std::size_t pb = static_cast<std::size_t>(prev.numel) * size_of(prev.dtype);
      // bytes + pb > cap, without the sum (it could wrap with a bucket_bytes near SIZE_MAX).
      if (prev.dtype != leaves[first].dtype || prev.device != leaves[first].device ||
          bytes > cap || pb > cap - bytes)
        break;
      bytes += pb;
      --first;
    }
    Bucket b;
    b.first = first;
    b.last = last;
    b.dtype = leaves[first].dtype;
    b.device = leaves[first].device;
    for (std::size_t j = first; j < last; ++j) {
      b.offsets.push_back(b.numel);
      b.numel += leaves[j].numel;
      bucket_of[j] = buckets.size();
    }
    buckets.push_back(std::move(b));
    i = first;
  }
}

}  // namespace lockstep
