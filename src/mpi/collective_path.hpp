// Internal to the mpi layer: what a path of MPIBackend's blocking collectives is, beside flat MPI.
// ShmCollectives (all ranks on one machine) and HierarchicalCollectives (machines with the same
// number of ranks) are the two; a backend has at most one (MPIBackendImpl::path), and a new path
// is a third implementation (docs/architecture.md, "A collective's path"). Its one caller is
// run_collective (collective_sequence.cpp), step 4 of every blocking collective.
//
// The contract of every call: the ranks first agree on it (agreement.hpp), whatever it is; then
// the path either runs it and returns true, or returns false having moved nothing, the same
// answer on every rank, and the caller runs it another way (flat_mpi.cpp; Backend's three passes
// for the 16-bit forms). Calls that differ are a MismatchError on every rank before any buffer
// is written. Every wait polls the path's WaitHook. Buffers are host
// memory when `host` is true (device memory is never moved here: false after agreeing).
#pragma once

#include <cstdint>

#include "lockstep/comm/backend.hpp"
#include "lockstep/core/tensor.hpp"

namespace lockstep::detail {

class CollectivePath {
 public:
  /// recv = op over the ranks of send (send may equal recv); avg divides by the rank count.
  virtual bool allreduce(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op, bool host) = 0;
  /// root's recv = op over the ranks of send (recv unused elsewhere, may be null there).
  virtual bool reduce(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op, int root,
                      bool host) = 0;
  /// buf on every rank = buf on root.
  virtual bool broadcast(void* buf, std::int64_t numel, DType dtype, int root, bool host) = 0;
  /// recv (numel) = op over the ranks of block rank() of send (size() x numel); recv may be that block.
  virtual bool reduce_scatter(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op,
                              bool host) = 0;
  /// recv (size() x numel) = every rank's send in rank order; send may be block rank() of recv.
  virtual bool allgather(const void* send, void* recv, std::int64_t numel, DType dtype, bool host) = 0;
  /// The 16-bit wire forms of f32 host data (Backend::allreduce_wire16, reduce_scatter_wire16).
  virtual bool allreduce_wire16(float* buf, std::int64_t numel, DType wire, ReduceOp op) = 0;
  virtual bool reduce_scatter_wire16(const float* send, float* recv, std::int64_t numel, DType wire,
                                     ReduceOp op) = 0;
  /// Agrees on a barrier with every rank. The agreement is itself the barrier: no rank returns
  /// before every rank has published its call, so there is nothing left for MPI to do.
  virtual void barrier() = 0;

 protected:
  CollectivePath() = default;
  CollectivePath(const CollectivePath&) = default;
  CollectivePath& operator=(const CollectivePath&) = default;
  ~CollectivePath() = default;  // owned as its concrete class (MPIBackendImpl::shm, ::hier)
};

}  // namespace lockstep::detail
