// Internal to the mpi layer: what happens to a blocking collective call of MPIBackend, in one
// place. Each do_* function of mpi_backend_collectives.cpp describes its call (a CollectiveCall:
// which collective, its buffers, op and root) and hands it to run_collective
// (collective_sequence.cpp), which takes every call through the same steps, in this order:
//   1. the monitor's scope (monitor.hpp): the call number, an injected fault, the fingerprints
//      when LOCKSTEP_CHECK says so, the deadline armed for every wait below;
//   2. at one rank, nothing to move where nothing needs moving;
//   3. staging (Staged): device memory on the host where MPI cannot read it or the call works
//      on the host (avg's division, the 16-bit operators, the hierarchical path);
//   4. the backend's path, if it has one (MPIBackendImpl::path, collective_path.hpp): it agrees
//      on the call with every rank (agreement.hpp), then moves it or declines, the same answer
//      on every rank; ranks whose calls differ get the same MismatchError;
//   5. flat MPI (flat_mpi.cpp) for a declined call or a backend without a path;
//   6. the copy out of staged memory; an MpiError is told to every rank before it leaves
//      (report_mpi_error), a MismatchError or TimeoutError leaves as it is.
// A new path is a CollectivePath that MPIBackend's constructor installs as MPIBackendImpl::path;
// nothing here changes for it.
#pragma once

#include "lockstep/comm/backend.hpp"
#include "lockstep/core/tensor.hpp"
#include "mpi/agreement.hpp"

namespace lockstep::detail {

struct MPIBackendImpl;

namespace mpib {

/// One blocking collective as its do_* function describes it. `send` is the buffer read (for
/// broadcast and the in-place allreduce and reduce, the one buffer: `one_buffer`); `recv` the
/// buffer written (reduce: only the root's is used). Allgather and reduce_scatter in place pass
/// two views, one a block of the other.
struct CollectiveCall {
  CallKind kind = CallKind::barrier;
  TensorView send{};
  TensorView recv{};
  bool one_buffer = false;
  ReduceOp op = ReduceOp::sum;
  int root = -1;
  DType wire = DType::bf16;  // the 16-bit forms' wire dtype (allreduce_wire16, reduce_scatter_wire16)
};

/// Runs `call` through the steps above. True when the call is done; false only for a 16-bit
/// wire form that no path took (no path, or the path declined the agreed call on every rank):
/// the caller then runs Backend's three passes, whose allreduce or reduce_scatter is a call of
/// its own. The call is taken by reference and adjusted in place (its op at one rank, recv for
/// one buffer): a copy of it on the stack, read back in other widths than it was written, stalls
/// the store forwarding of every small call (30 ns of a 50 ns call at one rank).
bool run_collective(MPIBackendImpl& impl, CollectiveCall&& call);

// ---- flat_mpi.cpp: the flat MPI form of each collective --------------------------------------
// Host views (or device views for a CUDA-aware MPI where the call needs no host work); a call
// whose send and recv are the same buffer (or, for allgather and reduce_scatter, this rank's
// block of the other) runs in place. avg divides on the host after the sum. Every MPI call is a
// guarded_* one (under the collective's deadline), split above MPI's int count limit.

void flat_allreduce(MPIBackendImpl& impl, TensorView send, TensorView recv, ReduceOp op);
/// recv: the root's; null data elsewhere.
void flat_reduce(MPIBackendImpl& impl, TensorView send, TensorView recv, ReduceOp op, int root);
void flat_broadcast(MPIBackendImpl& impl, TensorView buf, int root);
void flat_allgather(MPIBackendImpl& impl, TensorView send, TensorView recv);
void flat_reduce_scatter(MPIBackendImpl& impl, TensorView send, TensorView recv, ReduceOp op);
void flat_barrier(MPIBackendImpl& impl);

}  // namespace mpib
}  // namespace lockstep::detail
