// The collectives of GradientReducer's buckets: a bucket's reduction (allreduces in slices, or
// sharded a reduce-scatter and its tail; 16-bit on the wire where asked), launched in bucket
// order, nonblocking or blocking or on the communication thread; and the check that the ranks
// reduced the same number of micro-steps.
#include "train/reducer_impl.hpp"

#include <algorithm>

#include "comm/rank_list.hpp"
#include "lockstep/core/errors.hpp"

namespace lockstep {

using detail::concat;

// The reduction of one bucket, blocking, in slices of `step` elements: an allreduce of each
// slice. Sharded: one in-place reduce-scatter of the bucket's first nranks * q elements (rank r
// receives the sum of its piece; every rank reduces 1/nranks of the bucket, all at once), and
// an allreduce of the tail (n % nranks elements, fewer than nranks), of which only the last
// rank uses the result: the tail has a collective of its own because the bucket is often the
// user's memory (zero copy), which cannot be padded to a multiple of nranks, and padding a
// copy would cost a copy of the whole bucket where the tail costs one small call (an
// allreduce rather than a reduce onto the last rank, whose front end first broadcasts the
// root's verdict on its buffer: two calls). With a wire dtype the same calls in their 16-bit
// form (Backend::allreduce_wire16, reduce_scatter_wire16) on the f32 target: the backend
// rounds, sums and widens (MPIBackend's shared-memory path in one pass). A device bucket
// with a wire dtype arrives already rounded (its 16-bit copy): summed as it is, and widened
// and divided by finish_device_wire.
void GradientReducer::Impl::communicate(const Bucket& /*b*/, TensorView target, std::int64_t step) {
  const bool wire16 = wire && target.dtype == DType::f32 && target.device.is_cpu();
  const ReduceOp op = wire && !wire16 ? ReduceOp::sum : options.op;
  auto allreduce = [&](TensorView v) {
    if (wire16) backend->allreduce_wire16(v, *wire, op);
    else backend->allreduce(v, op);
  };
  if (!sharded) {
    for (std::int64_t off = 0; off < target.numel; off += step)
      allreduce(target.slice(off, std::min(step, target.numel - off)));
    return;
  }
  // Each call is whole: MPIBackend's shared-memory path slices it itself (each slice holds a
  // part of every rank's piece, so every rank reduces in every slice).
  const std::int64_t q = target.numel / nranks, t = target.numel - q * nranks;
  if (q > 0) {
    if (wire16) backend->reduce_scatter_wire16(target.slice(0, q * nranks), target.slice(my_rank * q, q), *wire, op);
    else backend->reduce_scatter(target.slice(0, q * nranks), target.slice(my_rank * q, q), op);
  }
  if (t > 0) allreduce(target.slice(q * nranks, t));
}

// Starts reducing bucket bi. Nonblocking (one request per slice) when backward reported it,
// so that the reduction overlaps the rest of backward; blocking, slice after slice, when
// update() reduces it itself and the bucket is in host memory: nothing is left to overlap
// then, and MPIBackend's blocking allreduce is the faster one (its shared-memory path on one
// machine; Open MPI's blocking algorithms elsewhere). Every rank takes the same branch for the
// same bucket as long as every rank reports the same gradients (the same model code does).
// Device buckets are never sliced (the slices exist for the host's caches) and always go
// nonblocking; reduce_bound sends its device buckets together (iallreduce_many) instead.
void GradientReducer::Impl::launch(std::size_t bi, bool blocking) {
  Bucket& b = buckets[bi];
  b.requests.clear();
  const ReduceOp op = options.op;
  if (!b.device.is_cpu()) {
    const TensorView target = prepare(bi);
    if (target.numel == 0) return;
    detail::StreamOrderedScope ordered;  // packed, or the step's gradients: on the current stream
    if (sharded) {
      // Reduce-scatter (and the tail), blocking: the Backend has no nonblocking form of it.
      communicate(b, target, target.numel);
      return;
    }
    // With a wire dtype the target is the 16-bit copy: summed, and divided when widened.
    b.requests.push_back(backend->iallreduce(target, wire ? ReduceOp::sum : op));
    return;
  }
  // A host bucket is one view (packed, or in place), or across machines, where a bucket holds
  // tensors of 1 MiB or more among others, several parts (prepare_parts): each is reduced as a
  // bucket of its own would be, in the same order on every rank.
  prepare_parts(bi);
  if (b.parts.empty()) return;
  const std::int64_t step = slice_elements(b);
  if (!blocking && use_thread) {
    b.slice = step;
    enqueue(bi);
    return;
  }
  if (blocking || sharded || wire) {
    // Sharded, or a wire dtype: these collectives have no nonblocking form, so without the
    // thread they run here.
    for (const TensorView& t : b.parts) communicate(b, t, step);
    return;
  }
  for (const TensorView& t : b.parts)
    for (std::int64_t off = 0; off < t.numel; off += step)
      b.requests.push_back(backend->iallreduce(t.slice(off, std::min(step, t.numel - off)), op));
}

// The slice a host bucket's views are reduced in, in elements. A bucket larger than
// bucket_bytes (one large tensor) is reduced in slices of bucket_bytes: each slice's reduction
// then works in cache, which one large reduction does not. Never in slices below
// kMinSliceBytes: the number of collectives would grow with the tensor over a tiny bucket_bytes
// (12 bytes: a 4 MiB tensor in 349,526 allreduces a step, each a round trip between the ranks),
// which looks like a hang over MPI, and smaller slices gain no cache. bucket_bytes == 0 (one
// bucket per tensor) keeps each tensor whole (the largest bucket's count is enough).
std::int64_t GradientReducer::Impl::slice_elements(const Bucket& b) const {
  return *options.bucket_bytes == 0
             ? std::max<std::int64_t>(b.numel, 1)
             : static_cast<std::int64_t>(std::max(*options.bucket_bytes, kMinSliceBytes) / size_of(b.dtype));
}

// Gives MPI a chance to progress the requests in flight (no progress thread in Open MPI).
void GradientReducer::Impl::poke() {
  for (std::size_t i = 0; i < next_launch; ++i) {
    for (auto& r : buckets[i].requests) {
      if (r.pending()) {
        r.test();
        return;
      }
    }
  }
}

void GradientReducer::Impl::launch_ready() {
  while (next_launch < buckets.size() && buckets[next_launch].remaining == 0) {
    verify_bound(buckets[next_launch]);
    launch(next_launch++);
  }
}

// With accumulation, every rank must have summed the same number of micro-steps: each divides
// by its own count, so a rank that reduces a cycle cut short (reduce_bound before
// accumulation_steps micro-steps) would leave the replicas different without a word. One
// allgather of the counts per optimizer step (only with accumulation_steps > 1; its options
// are agreed at setup, so every rank makes it), after the step's buckets: a difference throws
// MismatchError on every rank, naming each rank's count.
void GradientReducer::Impl::agree_on_micro_steps() {
  const int n = backend->size();
  std::int64_t mine = accumulated + 1;
  std::vector<std::int64_t> all(static_cast<std::size_t>(n));
  backend->allgather(TensorView{&mine, 1, DType::i64, Device::cpu()},
                     TensorView{all.data(), n, DType::i64, Device::cpu()});
  if (std::all_of(all.begin(), all.end(), [&](std::int64_t c) { return c == all[0]; })) return;
  const std::string counts = detail::rank_values(all);
  accumulated = 0;
  reset_step();
  throw MismatchError(concat("GradientReducer: the ranks reduced different numbers of micro-steps (", counts,
                             "; accumulation_steps = ", options.accumulation_steps,
                             "); every rank must reduce the same number, or the replicas would differ. "
                             "The accumulated gradients were dropped",
                             detail::rank_suffix()));
}

}  // namespace lockstep
