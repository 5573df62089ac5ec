// MPIBackend's blocking allgather and reduce_scatter (the sharded step's collectives): in place
// or not, over shared memory (one machine), the hierarchical path (several machines) or MPI,
// and above MPI's int count limit as one broadcast or reduce per rank's block.
#include <cstdint>
#include <cstring>

#include "mpi/mpi_backend_impl.hpp"

namespace lockstep {

void MPIBackend::do_allgather(TensorView send, TensorView recv) try {
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::allgather, &send, send.numel, -1,
                                -1);  // reliability hook
  if (guard.skipped()) return;
  const std::int64_t n = send.numel;
  const std::size_t es = size_of(send.dtype);
  // In place (send is this rank's block of recv, which the front end allows): device memory is
  // staged (two host buffers, so nothing aliases there); host memory goes as MPI_IN_PLACE.
  const bool in_place = send.nbytes() > 0 && send.data == static_cast<const char*>(recv.data) + impl_->rank * n * es;
  // The large form copies on the host, and so does the hierarchical path.
  const bool host_work = n > mpib::kMaxChunk || (in_place && !send.device.is_cpu()) || impl_->hier;
  mpib::Staged ss(*impl_, send, true, host_work);
  mpib::Staged rs(*impl_, recv, false, host_work);
  const bool host_in_place = in_place && ss.host().data == static_cast<const char*>(rs.host().data) + impl_->rank * n * es;
  // The path (one machine: shared memory; machines of two or more ranks each: each rank's bytes
  // cross to each machine once), after agreeing on the call.
  if (impl_->path && impl_->path->allgather(ss.host().data, rs.host().data, n, send.dtype,
                                            ss.host().device.is_cpu() && rs.host().device.is_cpu())) {
    rs.copy_out();
    return;
  }
  if (n <= mpib::kMaxChunk) {
    LOCKSTEP_MPI_CHECK(detail::guarded_allgather(host_in_place ? MPI_IN_PLACE : ss.host().data, static_cast<int>(n),
                                                 mpib::mpi_type(send.dtype), rs.host().data, static_cast<int>(n),
                                                 mpib::mpi_type(send.dtype), impl_->comm));
  } else {
    // Above the int count limit: each rank's block is broadcast from its owner, in chunks.
    if (!host_in_place) std::memcpy(static_cast<char*>(rs.host().data) + impl_->rank * n * es, ss.host().data, n * es);
    for (int r = 0; r < impl_->size; ++r)
      mpib::chunked_bcast(impl_->comm, static_cast<char*>(rs.host().data) + r * n * es, n, send.dtype, r);
  }
  rs.copy_out();
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_reduce_scatter(TensorView send, TensorView recv, ReduceOp op) try {
  op = mpib::one_rank_op(op, impl_ ? impl_->size : 0);
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::reduce_scatter, &send, recv.numel,
                                static_cast<int>(op), -1);  // reliability hook
  if (guard.skipped()) return;
  const std::int64_t n = recv.numel;
  const std::size_t es = size_of(send.dtype);
  // In place (recv is this rank's block of send, which the front end allows): as in allgather.
  const bool in_place = recv.nbytes() > 0 && recv.data == static_cast<const char*>(send.data) + impl_->rank * n * es;
  const bool host_work =
      op == ReduceOp::avg || !mpib::is_mpi_native(send.dtype) || (in_place && !send.device.is_cpu()) || impl_->hier;
  mpib::Staged ss(*impl_, send, true, host_work);
  mpib::Staged rs(*impl_, recv, false, host_work);
  char* const sh = static_cast<char*>(ss.host().data);
  const bool host_in_place = in_place && rs.host().data == sh + impl_->rank * n * es;
  // The path (avg included): on one machine each rank reduces only its block; across machines
  // of two or more ranks each, a node-local reduce-scatter, then one among the machines.
  if (impl_->path && impl_->path->reduce_scatter(ss.host().data, rs.host().data, n, send.dtype, op,
                                                 ss.host().device.is_cpu() && rs.host().device.is_cpu())) {
    rs.copy_out();
    return;
  }
  if (n <= mpib::kMaxChunk) {
    if (host_in_place) {
      // MPI_IN_PLACE takes the input from the receive buffer (all of send) and leaves the result
      // in its first block: moved to this rank's block.
      LOCKSTEP_MPI_CHECK(detail::guarded_reduce_scatter_block(MPI_IN_PLACE, sh, static_cast<int>(n),
                                                              mpib::mpi_type(send.dtype), mpib::mpi_op(op, send.dtype),
                                                              impl_->comm));
      if (impl_->rank != 0) std::memmove(rs.host().data, sh, static_cast<std::size_t>(n) * es);
    } else {
      LOCKSTEP_MPI_CHECK(detail::guarded_reduce_scatter_block(ss.host().data, rs.host().data, static_cast<int>(n),
                                                              mpib::mpi_type(send.dtype), mpib::mpi_op(op, send.dtype),
                                                              impl_->comm));
    }
  } else {
    // Above the int count limit: block r is reduced onto rank r, in chunks.
    for (int r = 0; r < impl_->size; ++r) {
      if (r == impl_->rank && host_in_place)
        mpib::chunked_reduce(impl_->comm, MPI_IN_PLACE, rs.host().data, n, send.dtype, op, r, impl_->rank);
      else
        mpib::chunked_reduce(impl_->comm, sh + r * n * es, r == impl_->rank ? rs.host().data : nullptr, n,
                             send.dtype, op, r, impl_->rank);
    }
  }
  if (op == ReduceOp::avg) mpib::scale_host(rs.host(), impl_->size);
  rs.copy_out();
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

}  // namespace lockstep
