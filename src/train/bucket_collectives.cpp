// The collectives of GradientReducer's buckets: a bucket's reduction (allreduces in slices, or
// sharded a reduce-scatter and its tail; 16-bit on the wire where asked), launched in bucket
// order, nonblocking or blocking or on the communication thread. One call of each step also
// carries the micro-step count's trailer (micro_steps.cpp).
#include "train/reducer_impl.hpp"

#include <algorithm>

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
// `carried`: this part's call carries the micro-step trailer (carries(), micro_steps.cpp): its
// last slice, or sharded its tail or its reduce-scatter, is reduced in the carrier's buffer.
void GradientReducer::Impl::communicate(const Bucket& /*b*/, TensorView target, std::int64_t step, bool carried) {
  const bool wire16 = wire && target.dtype == DType::f32 && target.device.is_cpu();
  const ReduceOp op = wire && !wire16 ? ReduceOp::sum : options.op;
  auto allreduce = [&](TensorView v) {
    if (wire16) backend->allreduce_wire16(v, *wire, op);
    else backend->allreduce(v, op);
  };
  if (!sharded) {
    const std::int64_t end = carried ? target.numel - last_slice(target.numel, step) : target.numel;
    for (std::int64_t off = 0; off < end; off += step) allreduce(target.slice(off, std::min(step, end - off)));
    if (carried) allreduce(carry(target.slice(end, target.numel - end)));
    return;
  }
  // Each call is whole: MPIBackend's shared-memory path slices it itself (each slice holds a
  // part of every rank's piece, so every rank reduces in every slice).
  const std::int64_t q = target.numel / nranks, t = target.numel - q * nranks;
  if (q > 0) {
    TensorView send = target.slice(0, q * nranks), recv = target.slice(my_rank * q, q);
    if (carried && carrier.rs) {
      send = carry_blocks(send, q);
      recv = send.slice(carrier.at, q + Carrier::kTrailer);
    }
    if (wire16) backend->reduce_scatter_wire16(send, recv, *wire, op);
    else backend->reduce_scatter(send, recv, op);
  }
  if (t > 0) {
    const TensorView tail = target.slice(q * nranks, t);
    allreduce(carried && !carrier.rs ? carry(tail) : tail);
  }
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
    b.requests.push_back(keeping(backend->iallreduce(target, wire ? ReduceOp::sum : op), b));
    return;
  }
  // A host bucket is one view (packed, or in place), or across machines, where a bucket holds
  // tensors of 1 MiB or more among others, several parts (prepare_parts): each is reduced as a
  // bucket of its own would be, in the same order on every rank.
  prepare_parts(bi);
  if (b.parts.empty()) return;
  if (carrier.used && carrier.bucket == bi) carrier.count = accumulated + 1;
  const std::int64_t step = slice_elements(b);
  if (!blocking && use_thread) {
    b.slice = step;
    enqueue(bi);
    return;
  }
  if (blocking || sharded || wire) {
    // Sharded, or a wire dtype: these collectives have no nonblocking form, so without the
    // thread they run here.
    for (std::size_t p = 0; p < b.parts.size(); ++p) communicate(b, b.parts[p], step, carries(bi, p));
    return;
  }
  for (std::size_t p = 0; p < b.parts.size(); ++p) {
    const TensorView& t = b.parts[p];
    const bool carried = carries(bi, p);
    const std::int64_t end = carried ? t.numel - last_slice(t.numel, step) : t.numel;
    for (std::int64_t off = 0; off < end; off += step)
      b.requests.push_back(keeping(backend->iallreduce(t.slice(off, std::min(step, end - off)), op), b));
    if (carried)
      b.requests.push_back(keeping(backend->iallreduce(carry(t.slice(end, t.numel - end)), op), b));
  }
}

Request GradientReducer::Impl::keeping(Request r, const Bucket& b) const {
  r.keep(b.work.owner()).keep(b.wire.owner()).keep(b.pack.owner()).keep(carrier.buf.owner());
  for (std::size_t j = b.first; j < b.last && j < bound.size(); ++j)
    if (bound[j] != nullptr) r.keep(bound[j]->owner());
  return r;
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

}  // namespace lockstep
