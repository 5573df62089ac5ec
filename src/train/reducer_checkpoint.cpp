// Checkpoints of a sharded optimizer state: each slot field gathered from every rank's shard to
// root (full size, as a replicated state holds it), and a full field scattered back into this
// rank's pieces after a load.
#include "train/reducer_impl.hpp"

#include <algorithm>

#include "lockstep/train/distributed_optimizer.hpp"

namespace lockstep {

namespace detail {

void gather_field_to_root(GradientReducer& red, const std::vector<Tensor*>& mine_pieces,
                          const std::vector<Tensor*>& full, DType dtype, int root) {
  Backend& b = red.backend();
  const int n = b.size();
  // The caller's dtype, the same on every rank: taken from this rank's own pieces, a rank that
  // owns none (fewer elements than ranks) fell back to f32 and broadcast f32 where the others
  // broadcast f64.
  const DType dt = dtype;
  const std::size_t es = size_of(dt);
  // Every rank's shard, as every rank computes it.
  std::vector<std::vector<FlatRange>> ranges(static_cast<std::size_t>(n));
  std::vector<std::int64_t> count(static_cast<std::size_t>(n), 0);
  std::int64_t most = 0;
  for (int r = 0; r < n; ++r) {
    ranges[static_cast<std::size_t>(r)] = red.shard_ranges(r);
    for (const auto& x : ranges[static_cast<std::size_t>(r)]) count[static_cast<std::size_t>(r)] += x.end - x.begin;
    most = std::max(most, count[static_cast<std::size_t>(r)]);
  }
  if (most == 0) return;
  // This rank's shard, packed (its pieces, in flat order, are its ranges cut at tensor ends).
  const std::int64_t mc = count[static_cast<std::size_t>(b.rank())];
  Tensor mine = Tensor::zeros({std::max<std::int64_t>(mc, 1)}, dt), other = Tensor::zeros({most}, dt);
  {
    std::int64_t at = 0;
    for (const Tensor* p : mine_pieces) {  // device pieces: one waited copy each (a checkpoint)
      detail::copy_grad_bytes(static_cast<std::byte*>(mine.raw_data()) + static_cast<std::size_t>(at) * es, Device::cpu(),
                 p->raw_data(), p->device(), p->nbytes());
      at += p->numel();
    }
  }
  const bool is_root = b.rank() == root;
  for (int r = 0; r < n; ++r) {
    const std::int64_t m = count[static_cast<std::size_t>(r)];
    if (m == 0) continue;  // every rank computes the same: no broadcast for an empty shard
    Tensor& buf = r == b.rank() ? mine : other;
    if (r != root) b.broadcast(buf.view().slice(0, m), r);
    if (!is_root) continue;
    std::int64_t at = 0;
    for (const auto& x : ranges[static_cast<std::size_t>(r)]) {
      copy_flat_range(full, red.leaf_offsets(), x.begin, x.end - x.begin,
                      static_cast<std::byte*>(buf.raw_data()) + static_cast<std::size_t>(at) * es, false);
      at += x.end - x.begin;
    }
  }
}

void scatter_field_from_full(const std::vector<ShardPiece>& pieces, const std::vector<Tensor*>& mine_pieces,
                             const std::vector<Tensor*>& full) {
  for (std::size_t k = 0; k < pieces.size() && k < mine_pieces.size(); ++k) {
    const auto& p = pieces[k];
    const Tensor* f = full[p.leaf];
    const std::size_t es = size_of(f->dtype());
    // `full` is on the host (the file's tensors); a device piece is one waited copy.
    detail::copy_grad_bytes(mine_pieces[k]->raw_data(), mine_pieces[k]->device(),
               static_cast<const std::byte*>(f->raw_data()) + static_cast<std::size_t>(p.lo) * es, f->device(),
               static_cast<std::size_t>(p.hi - p.lo) * es);
  }
}

}  // namespace detail

}  // namespace lockstep
