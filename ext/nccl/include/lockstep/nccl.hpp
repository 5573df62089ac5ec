// NCCLBackend: the Backend over NCCL for cuda tensors, bootstrapped over MPI. Link the target
// lockstep::nccl and include this header.
//
//   lockstep::initialize<lockstep::NCCLBackend>();   // MPI too, if needed
//   auto& nccl = lockstep::get_distributed_backend<lockstep::NCCLBackend>();
//   lockstep::allreduce(nccl, grads_on_gpu.view(), lockstep::ReduceOp::avg);
//
// Each rank drives one GPU: local_rank % device_count unless Options::device or the environment
// variable LOCKSTEP_CUDA_DEVICE says otherwise. Host (cpu) tensors are handed to an internal
// MPIBackend over the same ranks, so training code may mix both.
#pragma once

#include "lockstep/config.hpp"

#if !LOCKSTEP_HAS_NCCL
#error "<lockstep/nccl.hpp> needs NCCL support: configure Lockstep with -DLOCKSTEP_WITH_CUDA=ON -DLOCKSTEP_WITH_NCCL=ON and link lockstep::nccl"
#endif

#include <mpi.h>

#include <memory>
#include <source_location>
#include <span>

#include "lockstep/comm/backend.hpp"
#include "lockstep/cuda.hpp"
#include "lockstep/mpi/mpi_backend.hpp"

namespace lockstep {

namespace detail {
struct NCCLBackendImpl;  // NCCLBackend's state, defined in the library's source, not a user type
}  // namespace detail

/// Backend over an NCCL communicator for cuda tensors (cpu tensors go to an internal
/// MPIBackend). Blocking collectives return once the result is in the buffer; nonblocking ones
/// return a Request tied to a CUDA event. Every NCCL failure throws NcclError (with NCCL's own
/// message from ncclGetLastError) after aborting the communicator (ncclCommAbort); an aborted
/// backend refuses further collectives.
class NCCLBackend final : public Backend {
 public:
  struct Options {
    /// CUDA device of this rank; -1: LOCKSTEP_CUDA_DEVICE if set, else local_rank % device_count.
    int device = -1;
  };

  /// Collective over the ranks of `comm` (duplicated; the caller keeps ownership of `comm`):
  /// rank 0 creates the NCCL unique id, MPI broadcasts it, every rank joins the communicator.
  explicit NCCLBackend(MPI_Comm comm = MPI_COMM_WORLD) : NCCLBackend(comm, Options{}) {}
  NCCLBackend(MPI_Comm comm, Options options);
  ~NCCLBackend() override;
  NCCLBackend(NCCLBackend&&) noexcept;
  NCCLBackend& operator=(NCCLBackend&&) noexcept;
  NCCLBackend(const NCCLBackend&) = delete;
  NCCLBackend& operator=(const NCCLBackend&) = delete;

  std::string name() const override { return "nccl"; }
  int rank() const override;
  int size() const override;
  int local_rank() const override;
  int local_size() const override;

  /// The CUDA device this rank's communicator uses.
  int device() const noexcept;
  /// The stream NCCL's kernels run on (owned by the backend). Collectives first make it wait for
  /// the work queued so far on cuda::current_stream(device()).
  cudaStream_t stream() const noexcept;
  /// The MPIBackend that serves host tensors (same ranks).
  MPIBackend& host_backend() noexcept;
  /// True once a failure aborted the communicator.
  bool aborted() const noexcept;
  /// Aborts the communicator (ncclCommAbort): pending and later operations fail. Never throws.
  void abort() noexcept;

 protected:
  void do_broadcast(TensorView buf, int root) override;
  void do_allreduce(TensorView buf, ReduceOp op) override;
  void do_allreduce(TensorView send, TensorView recv, ReduceOp op) override;
  void do_reduce(TensorView buf, ReduceOp op, int root) override;
  void do_reduce(TensorView send, TensorView recv, ReduceOp op, int root) override;
  void do_allgather(TensorView send, TensorView recv) override;
  void do_reduce_scatter(TensorView send, TensorView recv, ReduceOp op) override;
  void do_barrier() override;
  Request do_iallreduce(TensorView buf, ReduceOp op) override;
  Request do_ibroadcast(TensorView buf, int root) override;
  /// The buffers in one NCCL group (ncclGroupStart/End), one event for the whole group.
  Request do_iallreduce_many(std::span<const TensorView> bufs, ReduceOp op) override;

 public:

  /// In-place allreduce of several buffers (gradient buckets) in one NCCL group call, so NCCL
  /// fuses their launches; all on this backend's device (or all on the host). Its nonblocking
  /// form is Backend::iallreduce_many (one Request for the whole group), which
  /// DistributedOptimizer uses for its device buckets.
  void allreduce_many(std::span<const TensorView> bufs, ReduceOp op);

  // Hooks used by initialize<NCCLBackend>() and friends (see world.hpp).
  /// Initialises MPI (as initialize<MPIBackend>() does) and the CUDA runtime registration, then
  /// creates the global backend over MPI_COMM_WORLD. Idempotent. Collective.
  static void initialize_global();
  static bool initialized_global() noexcept;
  /// The global backend; throws lockstep::Error if initialize<NCCLBackend>() was not called.
  static NCCLBackend& global();
  /// Destroys the global backend (MPI stays, see finalize<MPIBackend>()).
  static void finalize_global();

 private:
  std::shared_ptr<detail::NCCLBackendImpl> impl_;  // shared with pending requests, which may outlive a move
};

}  // namespace lockstep
