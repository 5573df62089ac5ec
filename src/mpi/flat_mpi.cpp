// The flat MPI path: each blocking collective as MPI's own call on the backend's communicator
// (collective_sequence.hpp), for a backend without a path and for the calls its path declines.
// MPI counts are int: above that, a call runs in chunks (allgather: one broadcast per rank's
// block; reduce_scatter: one reduce per rank's block).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "mpi/collective_sequence.hpp"
#include "mpi/mpi_backend_impl.hpp"

namespace lockstep::detail::mpib {

namespace {

void chunked_allreduce(MPI_Comm comm, const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
  MPI_Datatype dt = mpi_type(t);
  MPI_Op mop = mpi_op(op, t);
  const std::size_t es = size_of(t);
  for (std::int64_t off = 0; off < n; off += kMaxChunk) {
    const int c = static_cast<int>(std::min(kMaxChunk, n - off));
    void* r = static_cast<char*>(recv) + off * es;
    const void* s = send == MPI_IN_PLACE ? MPI_IN_PLACE : static_cast<const char*>(send) + off * es;
    LOCKSTEP_MPI_CHECK(guarded_allreduce(s, r, c, dt, mop, comm));
  }
}

void chunked_bcast(MPI_Comm comm, void* buf, std::int64_t n, DType t, int root) {
  const std::size_t es = size_of(t);
  for (std::int64_t off = 0; off < n; off += kMaxChunk) {
    const int c = static_cast<int>(std::min(kMaxChunk, n - off));
    LOCKSTEP_MPI_CHECK(guarded_bcast(static_cast<char*>(buf) + off * es, c, mpi_type(t), root, comm));
  }
}

// `send` MPI_IN_PLACE: root passes MPI_IN_PLACE, the others `recv` as their send buffer.
void chunked_reduce(MPI_Comm comm, const void* send, void* recv, std::int64_t n, DType t, ReduceOp op, int root,
                    int rank) {
  MPI_Datatype dt = mpi_type(t);
  MPI_Op mop = mpi_op(op, t);
  const std::size_t es = size_of(t);
  for (std::int64_t off = 0; off < n; off += kMaxChunk) {
    const int c = static_cast<int>(std::min(kMaxChunk, n - off));
    const void* s;
    if (send == MPI_IN_PLACE)
      s = rank == root ? MPI_IN_PLACE : static_cast<const char*>(recv) + off * es;
    else
      s = static_cast<const char*>(send) + off * es;
    void* r = recv == nullptr ? nullptr : static_cast<char*>(recv) + off * es;
    LOCKSTEP_MPI_CHECK(guarded_reduce(s, r, c, dt, mop, root, comm));
  }
}

}  // namespace

void flat_allreduce(MPIBackendImpl& impl, TensorView send, TensorView recv, ReduceOp op) {
  const void* s = send.data == recv.data ? MPI_IN_PLACE : send.data;
  if (send.numel <= kMaxChunk)  // one MPI call (every small message): no chunk loop
    LOCKSTEP_MPI_CHECK(guarded_allreduce(s, recv.data, static_cast<int>(send.numel), mpi_type(send.dtype),
                                         mpi_op(op, send.dtype), impl.comm));
  else
    chunked_allreduce(impl.comm, s, recv.data, send.numel, send.dtype, op);
  if (op == ReduceOp::avg) scale_host(recv, impl.size);
}

void flat_reduce(MPIBackendImpl& impl, TensorView send, TensorView recv, ReduceOp op, int root) {
  const void* s = send.data == recv.data ? MPI_IN_PLACE : send.data;
  chunked_reduce(impl.comm, s, recv.data, send.numel, send.dtype, op, root, impl.rank);
  if (op == ReduceOp::avg && impl.rank == root) scale_host(recv, impl.size);
}

void flat_broadcast(MPIBackendImpl& impl, TensorView buf, int root) {
  chunked_bcast(impl.comm, buf.data, buf.numel, buf.dtype, root);
}

void flat_allgather(MPIBackendImpl& impl, TensorView send, TensorView recv) {
  const std::int64_t n = send.numel;
  const std::size_t es = size_of(send.dtype);
  char* const mine = static_cast<char*>(recv.data) + impl.rank * n * es;  // this rank's block of recv
  const bool in_place = send.nbytes() > 0 && send.data == mine;
  if (n <= kMaxChunk) {
    LOCKSTEP_MPI_CHECK(guarded_allgather(in_place ? MPI_IN_PLACE : send.data, static_cast<int>(n),
                                         mpi_type(send.dtype), recv.data, static_cast<int>(n), mpi_type(send.dtype),
                                         impl.comm));
    return;
  }
  // Above the int count limit: each rank's block is broadcast from its owner, in chunks.
  if (!in_place) std::memcpy(mine, send.data, n * es);
  for (int r = 0; r < impl.size; ++r)
    chunked_bcast(impl.comm, static_cast<char*>(recv.data) + r * n * es, n, send.dtype, r);
}

void flat_reduce_scatter(MPIBackendImpl& impl, TensorView send, TensorView recv, ReduceOp op) {
  const std::int64_t n = recv.numel;
  const std::size_t es = size_of(send.dtype);
  char* const sh = static_cast<char*>(send.data);
  const bool in_place = recv.nbytes() > 0 && recv.data == sh + impl.rank * n * es;
  if (n <= kMaxChunk) {
    if (in_place) {
      // MPI_IN_PLACE takes the input from the receive buffer (all of send) and leaves the result
      // in its first block: moved to this rank's block.
      LOCKSTEP_MPI_CHECK(guarded_reduce_scatter_block(MPI_IN_PLACE, sh, static_cast<int>(n), mpi_type(send.dtype),
                                                      mpi_op(op, send.dtype), impl.comm));
      if (impl.rank != 0) std::memmove(recv.data, sh, static_cast<std::size_t>(n) * es);
    } else {
      LOCKSTEP_MPI_CHECK(guarded_reduce_scatter_block(send.data, recv.data, static_cast<int>(n), mpi_type(send.dtype),
                                                      mpi_op(op, send.dtype), impl.comm));
    }
  } else {
    // Above the int count limit: block r is reduced onto rank r, in chunks.
    for (int r = 0; r < impl.size; ++r) {
      if (r == impl.rank && in_place)
        chunked_reduce(impl.comm, MPI_IN_PLACE, recv.data, n, send.dtype, op, r, impl.rank);
      else
        chunked_reduce(impl.comm, sh + r * n * es, r == impl.rank ? recv.data : nullptr, n, send.dtype, op, r,
                       impl.rank);
    }
  }
  if (op == ReduceOp::avg) scale_host(recv, impl.size);
}

void flat_barrier(MPIBackendImpl& impl) { LOCKSTEP_MPI_CHECK(guarded_barrier(impl.comm)); }

}  // namespace lockstep::detail::mpib
