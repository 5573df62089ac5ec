// GradientReducer's bucket plan: the trainable gradients, from the last one backwards (the order
// backward produces them), grouped into buckets of at most bucket_bytes (host) or
// device_bucket_bytes (device); a dtype or device change starts a new bucket. Across machines, a
// host bucket's large tensors are marked to be reduced where they lie (split_across_hosts).
#include "train/reducer_impl.hpp"

#include <utility>

namespace lockstep {

// Across machines (Backend::local_size() < size(): the same verdict on every rank) the host
// buckets are 16 MiB, and packing a bucket's gradients into its buffer and unpacking them after
// costs copies that nothing overlaps (docs/performance/across-hosts.md, "Across hosts", measures them). So a bucket of two or more host tensors that holds tensors of
// kInPlaceTensorBytes or more reduces each of those where it lies, with calls of its own, and
// packs only the others, together, into one call. The calls must follow from the tensors' sizes
// alone, the same on every rank: MPI matches collectives by count, and a rank that reduced a
// bucket whole because its gradients happen to lie back to back while another reduced it in
// parts would wait for ever. So a bucket whose gradients lie back to back is split the same way
// (its small tensors are packed too). Not split: on one machine (nothing changes there: its
// 1 MiB buckets already make every tensor of 1 MiB or more a bucket of its own), device buckets
// (one copy launch packs them), a bucket of one tensor (already in place), and the sharded
// reducer (its reduce-scatter cuts each bucket into the ranks' pieces of the whole bucket).
void GradientReducer::Impl::split_across_hosts(Bucket& b) const {
  if (!b.device.is_cpu() || b.last - b.first < 2) return;
  std::vector<std::size_t> large, small;
  std::int64_t small_numel = 0;
  for (std::size_t j = b.first; j < b.last; ++j) {
    if (static_cast<std::size_t>(leaves[j].numel) * size_of(leaves[j].dtype) >= detail::kInPlaceTensorBytes) {
      large.push_back(j);
    } else {
      small.push_back(j);
      small_numel += leaves[j].numel;
    }
  }
  if (large.empty()) return;  // packed (or taken in place) whole, as on one machine
  b.large = std::move(large);
  b.small = std::move(small);
  b.small_numel = small_numel;
}

void GradientReducer::Impl::plan() {
  // Unset, the size follows the path (host_bucket_bytes); a size set is kept as given.
  options.bucket_bytes = host_bucket_bytes(options, *backend);
  across_hosts = backend->local_size() < backend->size();
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
    if (across_hosts && !options.shard_optimizer_state) split_across_hosts(b);
    buckets.push_back(std::move(b));
    i = first;
  }
}

}  // namespace lockstep
