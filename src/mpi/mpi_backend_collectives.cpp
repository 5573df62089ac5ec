// MPIBackend's blocking collectives: broadcast, allreduce, reduce and barrier, each over shared
// memory (one machine), the hierarchical path (several machines) or MPI, and the chunk loops
// that split a call above MPI's int count limit.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "mpi/mpi_backend_impl.hpp"

namespace lockstep {

namespace detail::mpib {

void chunked_allreduce(MPI_Comm comm, const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
  MPI_Datatype dt = mpi_type(t);
  MPI_Op mop = mpi_op(op, t);
  const std::size_t es = size_of(t);
  for (std::int64_t off = 0; off < n; off += kMaxChunk) {
    int c = static_cast<int>(std::min(kMaxChunk, n - off));
    void* r = static_cast<char*>(recv) + off * es;
    const void* s = send == MPI_IN_PLACE ? MPI_IN_PLACE : static_cast<const char*>(send) + off * es;
    LOCKSTEP_MPI_CHECK(detail::guarded_allreduce(s, r, c, dt, mop, comm));
  }
}

void chunked_bcast(MPI_Comm comm, void* buf, std::int64_t n, DType t, int root) {
  const std::size_t es = size_of(t);
  for (std::int64_t off = 0; off < n; off += kMaxChunk) {
    int c = static_cast<int>(std::min(kMaxChunk, n - off));
    LOCKSTEP_MPI_CHECK(detail::guarded_bcast(static_cast<char*>(buf) + off * es, c, mpi_type(t), root, comm));
  }
}

void chunked_reduce(MPI_Comm comm, const void* send, void* recv, std::int64_t n, DType t, ReduceOp op,
                    int root, int rank) {
  MPI_Datatype dt = mpi_type(t);
  MPI_Op mop = mpi_op(op, t);
  const std::size_t es = size_of(t);
  for (std::int64_t off = 0; off < n; off += kMaxChunk) {
    int c = static_cast<int>(std::min(kMaxChunk, n - off));
    const void* s;
    if (send == MPI_IN_PLACE) {
      // In place: root passes MPI_IN_PLACE, the others their buffer as send.
      s = rank == root ? MPI_IN_PLACE : static_cast<const char*>(recv) + off * es;
    } else {
      s = static_cast<const char*>(send) + off * es;
    }
    void* r = recv == nullptr ? nullptr : static_cast<char*>(recv) + off * es;
    LOCKSTEP_MPI_CHECK(detail::guarded_reduce(s, r, c, dt, mop, root, comm));
  }
}

}  // namespace detail::mpib

void MPIBackend::do_broadcast(TensorView buf, int root) try {
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::broadcast, &buf, buf.numel, -1, root);  // reliability hook
  if (guard.skipped()) return;
  if (impl_->size == 1) return;  // one rank: the data is already everywhere
  mpib::Staged s(*impl_, buf, impl_->rank == root);
  // On a path every rank first agrees on the call (CollectivePath::broadcast returns false, on
  // every rank alike, when the call goes to MPI instead).
  const bool host = s.host().device.is_cpu();
  if (!(impl_->path && impl_->path->broadcast(s.host().data, buf.numel, buf.dtype, root, host)))
    mpib::chunked_bcast(impl_->comm, s.host().data, buf.numel, buf.dtype, root);
  if (impl_->rank != root) s.copy_out();  // root's device buffer already holds the data
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_allreduce(TensorView buf, ReduceOp op) try {
  op = mpib::one_rank_op(op, impl_ ? impl_->size : 0);
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::allreduce, &buf, buf.numel,
                                static_cast<int>(op), -1);  // reliability hook
  if (guard.skipped()) return;
  if (impl_->size == 1 && buf.device.is_cpu()) return;  // one rank: the result is the data itself
  // The hierarchical path works on the host: device memory is staged for it, CUDA-aware or not.
  mpib::Staged s(*impl_, buf, true, op == ReduceOp::avg || !mpib::is_mpi_native(buf.dtype) || impl_->hier);
  const bool host = s.host().device.is_cpu();
  if (impl_->path && impl_->path->allreduce(s.host().data, s.host().data, buf.numel, buf.dtype, op, host)) {
    // avg included
  } else {
    if (buf.numel <= mpib::kMaxChunk)  // one MPI call (every small message): no chunk loop
      LOCKSTEP_MPI_CHECK(detail::guarded_allreduce(MPI_IN_PLACE, s.host().data, static_cast<int>(buf.numel),
                                                   mpib::mpi_type(buf.dtype), mpib::mpi_op(op, buf.dtype),
                                                   impl_->comm));
    else
      mpib::chunked_allreduce(impl_->comm, MPI_IN_PLACE, s.host().data, buf.numel, buf.dtype, op);
    if (op == ReduceOp::avg) mpib::scale_host(s.host(), impl_->size);
  }
  s.copy_out();
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_allreduce(TensorView send, TensorView recv, ReduceOp op) try {
  op = mpib::one_rank_op(op, impl_ ? impl_->size : 0);
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::allreduce, &send, send.numel,
                                static_cast<int>(op), -1);  // reliability hook
  if (guard.skipped()) return;
  if (impl_->size == 1 && send.device.is_cpu() && recv.device.is_cpu()) {  // one rank: a copy
    if (send.data != recv.data) std::memcpy(recv.data, send.data, send.nbytes());
    return;
  }
  const bool host_work = op == ReduceOp::avg || !mpib::is_mpi_native(send.dtype) || impl_->hier;
  mpib::Staged ss(*impl_, send, true, host_work);
  mpib::Staged rs(*impl_, recv, false, host_work);
  const bool host = rs.host().device.is_cpu();
  if (impl_->shm && impl_->shm->allreduce(ss.host().data, rs.host().data, send.numel, send.dtype, op, host)) {
    // avg included
  } else if (impl_->hier &&
             impl_->hier->allreduce(ss.host().data, rs.host().data, send.numel, send.dtype, op,
                                    host && ss.host().device.is_cpu())) {
    // avg included
  } else {
    if (send.numel <= mpib::kMaxChunk)  // one MPI call (every small message): no chunk loop
      LOCKSTEP_MPI_CHECK(detail::guarded_allreduce(ss.host().data, rs.host().data, static_cast<int>(send.numel),
                                                   mpib::mpi_type(send.dtype), mpib::mpi_op(op, send.dtype),
                                                   impl_->comm));
    else
      mpib::chunked_allreduce(impl_->comm, ss.host().data, rs.host().data, send.numel, send.dtype, op);
    if (op == ReduceOp::avg) mpib::scale_host(rs.host(), impl_->size);
  }
  rs.copy_out();
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_reduce(TensorView buf, ReduceOp op, int root) try {
  op = mpib::one_rank_op(op, impl_ ? impl_->size : 0);
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::reduce, &buf, buf.numel,
                                static_cast<int>(op), root);  // reliability hook
  if (guard.skipped()) return;
  mpib::Staged s(*impl_, buf, true, op == ReduceOp::avg || !mpib::is_mpi_native(buf.dtype));
  const bool host = s.host().device.is_cpu();
  if (impl_->path && impl_->path->reduce(s.host().data, s.host().data, buf.numel, buf.dtype, op, root, host)) {
    if (impl_->rank == root) s.copy_out();  // avg included
    return;
  }
  mpib::chunked_reduce(impl_->comm, MPI_IN_PLACE, s.host().data, buf.numel, buf.dtype, op, root, impl_->rank);
  if (impl_->rank == root) {
    if (op == ReduceOp::avg) mpib::scale_host(s.host(), impl_->size);
    s.copy_out();
  }
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_reduce(TensorView send, TensorView recv, ReduceOp op, int root) try {
  op = mpib::one_rank_op(op, impl_ ? impl_->size : 0);
  const bool is_root = impl_->rank == root;
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::reduce, &send, send.numel,
                                static_cast<int>(op), root);  // reliability hook
  if (guard.skipped()) return;
  const bool host_work = op == ReduceOp::avg || !mpib::is_mpi_native(send.dtype);
  mpib::Staged ss(*impl_, send, true, host_work);
  const bool host = ss.host().device.is_cpu() && (is_root ? recv.device.is_cpu() : true);
  if (!is_root) {
    if (impl_->path && impl_->path->reduce(ss.host().data, nullptr, send.numel, send.dtype, op, root, host)) return;
    mpib::chunked_reduce(impl_->comm, ss.host().data, nullptr, send.numel, send.dtype, op, root, impl_->rank);
    return;
  }
  mpib::Staged rs(*impl_, recv, false, host_work);
  if (impl_->path && impl_->path->reduce(ss.host().data, rs.host().data, send.numel, send.dtype, op, root, host)) {
    rs.copy_out();  // avg included
    return;
  }
  mpib::chunked_reduce(impl_->comm, ss.host().data, rs.host().data, send.numel, send.dtype, op, root, impl_->rank);
  if (op == ReduceOp::avg) mpib::scale_host(rs.host(), impl_->size);
  rs.copy_out();
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_barrier() try {
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::barrier, nullptr, 0, -1, -1);  // reliability hook
  if (guard.skipped()) return;
  // On a path the agreement is itself the barrier (every rank's call reaches every rank).
  if (impl_->path) return impl_->path->barrier();
  LOCKSTEP_MPI_CHECK(detail::guarded_barrier(impl_->comm));
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

}  // namespace lockstep
