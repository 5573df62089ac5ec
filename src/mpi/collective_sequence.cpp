// What happens to a blocking collective call of MPIBackend: the steps of collective_sequence.hpp,
// in the order they run.
#include "mpi/collective_sequence.hpp"

#include <cstring>
#include <optional>

#include "mpi/mpi_backend_impl.hpp"

namespace lockstep::detail::mpib {

namespace {

// The monitor's name of a collective (its fingerprints and counters).
Coll monitored_as(CallKind kind) {
  switch (kind) {
    case CallKind::broadcast: return Coll::broadcast;
    case CallKind::reduce: return Coll::reduce;
    case CallKind::allgather: return Coll::allgather;
    case CallKind::reduce_scatter:
    case CallKind::reduce_scatter_wire16: return Coll::reduce_scatter;
    case CallKind::barrier: return Coll::barrier;
    default: return Coll::allreduce;
  }
}

bool kind_reduces(CallKind kind) {
  return kind == CallKind::allreduce || kind == CallKind::reduce || kind == CallKind::reduce_scatter;
}

// Whether allgather's send is this rank's block of recv, or reduce_scatter's recv this rank's block
// of send (the front end allows both).
bool block_in_place(const CollectiveCall& c, int rank) {
  if (c.kind == CallKind::allgather)
    return c.send.nbytes() > 0 && c.send.data == static_cast<const char*>(c.recv.data) + rank * c.send.nbytes();
  if (c.kind == CallKind::reduce_scatter)
    return c.recv.nbytes() > 0 && c.recv.data == static_cast<const char*>(c.send.data) + rank * c.recv.nbytes();
  return false;
}

// Step 3's rule: the call works on its buffers on the host, so device memory is staged even for a
// CUDA-aware MPI. avg divides there, MPI reduces f16 and bf16 with operators that run there; the
// hierarchical path moves host memory only (broadcast and reduce aside: it declines device
// memory for the one and never takes the other); an in-place allgather or reduce_scatter of
// device memory would alias two staged views; above the int count limit allgather copies there.
bool works_on_host(const MPIBackendImpl& impl, const CollectiveCall& c) {
  const bool host_op = kind_reduces(c.kind) && (c.op == ReduceOp::avg || !is_mpi_native(c.send.dtype));
  switch (c.kind) {
    case CallKind::allreduce: return host_op || impl.hier != nullptr;
    case CallKind::reduce: return host_op;
    case CallKind::allgather:
      return c.send.numel > kMaxChunk || (block_in_place(c, impl.rank) && !c.send.device.is_cpu()) ||
             impl.hier != nullptr;
    case CallKind::reduce_scatter:
      return host_op || (block_in_place(c, impl.rank) && !c.send.device.is_cpu()) || impl.hier != nullptr;
    default: return false;
  }
}

// Step 2: at one rank, the calls whose result is their input, where no copy is needed.
bool done_at_one_rank(const CollectiveCall& c) {
  if (c.kind == CallKind::broadcast) return true;  // the data is already everywhere
  if (c.kind != CallKind::allreduce) return false;
  if (!c.send.device.is_cpu() || !c.recv.device.is_cpu()) return false;
  if (c.send.data != c.recv.data) std::memcpy(c.recv.data, c.send.data, c.send.nbytes());
  return true;
}

// Step 4: the path's form of the call, on the staged views.
bool on_path(CollectivePath& path, const CollectiveCall& c, TensorView send, TensorView recv, bool host) {
  switch (c.kind) {
    case CallKind::allreduce: return path.allreduce(send.data, recv.data, send.numel, send.dtype, c.op, host);
    case CallKind::reduce: return path.reduce(send.data, recv.data, send.numel, send.dtype, c.op, c.root, host);
    case CallKind::broadcast: return path.broadcast(send.data, send.numel, send.dtype, c.root, host);
    case CallKind::allgather: return path.allgather(send.data, recv.data, send.numel, send.dtype, host);
    case CallKind::reduce_scatter:
      return path.reduce_scatter(send.data, recv.data, recv.numel, send.dtype, c.op, host);
    default: return false;
  }
}

// Step 5.
void run_flat(MPIBackendImpl& impl, const CollectiveCall& c, TensorView send, TensorView recv) {
  switch (c.kind) {
    case CallKind::allreduce: return flat_allreduce(impl, send, recv, c.op);
    case CallKind::reduce: return flat_reduce(impl, send, recv, c.op, c.root);
    case CallKind::broadcast: return flat_broadcast(impl, send, c.root);
    case CallKind::allgather: return flat_allgather(impl, send, recv);
    case CallKind::reduce_scatter: return flat_reduce_scatter(impl, send, recv, c.op);
    default: return;
  }
}

// The 16-bit wire forms: f32 host data, fingerprinted as what goes between the ranks, a 16-bit
// allreduce or reduce_scatter with sum (the record of the three passes' call over MPI); the
// path's CallRecord tells the two apart. The path agrees on the call first, whatever its size,
// and then moves it or declines; the scope ends before the caller's three passes run.
bool run_wire16(MPIBackendImpl& impl, CollectiveCall& c) {
  if (!impl.path) return false;
  const bool scatter = c.kind == CallKind::reduce_scatter_wire16;
  TensorView onwire{c.send.data, c.send.numel, c.wire, Device::cpu()};
  CollectiveScope guard(impl.monitor.get(), monitored_as(c.kind), &onwire, scatter ? c.recv.numel : onwire.numel,
                        static_cast<int>(ReduceOp::sum), -1);  // 1
  if (guard.skipped()) return true;
  // An injected fault may have changed the count or the dtype: the record carries them, so the
  // ranks see the disagreement. A dtype that is not a wire dtype any more goes as `wire`.
  const DType wire = onwire.dtype == DType::bf16 || onwire.dtype == DType::f16 ? onwire.dtype : c.wire;
  if (scatter)
    return impl.path->reduce_scatter_wire16(static_cast<const float*>(c.send.data), static_cast<float*>(c.recv.data),
                                            c.recv.numel, wire, c.op);
  return impl.path->allreduce_wire16(static_cast<float*>(c.send.data), onwire.numel, wire, c.op);
}

}  // namespace

bool run_collective(MPIBackendImpl& impl, CollectiveCall&& c) try {
  if (c.kind == CallKind::allreduce_wire16 || c.kind == CallKind::reduce_scatter_wire16) return run_wire16(impl, c);
  c.op = one_rank_op(c.op, impl.size);
  // 1. The monitor: an injected fault may change `send` (its count, its dtype).
  CollectiveScope guard(impl.monitor.get(), monitored_as(c.kind), c.kind == CallKind::barrier ? nullptr : &c.send,
                        c.kind == CallKind::reduce_scatter ? c.recv.numel : c.send.numel,
                        kind_reduces(c.kind) ? static_cast<int>(c.op) : -1, c.root);
  if (guard.skipped()) return true;
  if (c.one_buffer) c.recv = c.send;
  if (c.kind == CallKind::barrier) {
    // On a path the agreement is itself the barrier (every rank's call reaches every rank).
    if (impl.path) impl.path->barrier();
    else flat_barrier(impl);
    return true;
  }
  // 2.
  if (impl.size == 1 && done_at_one_rank(c)) return true;
  // 3. Staging. Only the root's buffer is read by a broadcast, only the root's is written by a
  // reduce (the others pass none).
  const bool is_root = impl.rank == c.root;
  const bool host_work = works_on_host(impl, c);
  Staged send(impl, c.send, c.kind != CallKind::broadcast || is_root, host_work);
  std::optional<Staged> recv;
  if (!c.one_buffer && (c.kind != CallKind::reduce || is_root)) recv.emplace(impl, c.recv, false, host_work);
  const TensorView send_view = send.host();
  const TensorView recv_view = c.one_buffer ? send_view : recv ? recv->host() : TensorView{};
  // The path moves host memory only; the same answer on every rank (agreed) for a well-formed call.
  const bool host = send_view.device.is_cpu() && (recv_view.data == nullptr || recv_view.device.is_cpu());
  // 4, then 5 for a call the path declined (after agreeing on it) or a backend without one.
  if (!(impl.path && on_path(*impl.path, c, send_view, recv_view, host))) run_flat(impl, c, send_view, recv_view);
  // 6. What this rank's call wrote: a broadcast's buffer on every rank but the root, a reduce's
  // on the root only, every other call's recv.
  const bool written = c.kind == CallKind::broadcast ? !is_root : c.kind != CallKind::reduce || is_root;
  if (written) (c.one_buffer ? send : *recv).copy_out();
  return true;
} catch (const MpiError& e) {
  report_mpi_error(&impl, e);  // the other ranks are told
  throw;
}

}  // namespace lockstep::detail::mpib
