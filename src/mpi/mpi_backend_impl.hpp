// MPIBackend's internals (not installed): its state, and what its source files share. One job
// per file:
//   mpi_backend.cpp              one backend's life: construction (the agreed settings, the
//                                machine's ranks, shared memory, hierarchy), accessors, moves
//   mpi_backend_errors.cpp       how errors leave: check_mpi (MpiError), the report to the other
//                                ranks, abort_job and the std::terminate handler
//   mpi_backend_types.cpp        MPI datatypes and operators (f16/bf16 through user-defined
//                                operators), avg's division on the host
//   mpi_backend_staging.cpp      device memory for MPI: the pinned pool, Staged, producer waits
//   mpi_backend_collectives.cpp  the blocking collectives, each described as a CollectiveCall
//                                for run_collective (collective_sequence.hpp: what happens to a
//                                call; flat_mpi.cpp: its flat MPI form)
//   mpi_backend_exact.cpp        deterministic mode's exact sum, fused on the shared-memory path
//   mpi_backend_requests.cpp     nonblocking iallreduce and ibroadcast, and their requests
//   mpi_backend_global.cpp       the global backend behind initialize / finalize<MPIBackend>
// The shared helpers live in detail::mpib (mpib:: in these files): named, not anonymous, so that
// a unity build of the mpi layer sees each once.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "lockstep/core/device_runtime.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/mpi/mpi_backend.hpp"
#include "mpi/hierarchical.hpp"  // allreduce across machines: shared memory within, MPI between
#include "mpi/monitor.hpp"       // reliability hooks (fingerprints, deadlines, fault injection)
#include "mpi/mpi_types.hpp"     // datatypes and operators of every DType and ReduceOp
#include "mpi/shm/shm_collectives.hpp"  // node-local collectives through shared memory

namespace lockstep {
namespace detail::mpib {

// Pinned host buffers that stage device memory, reused across calls: cudaMallocHost costs far
// more than most collectives it would stage. Power-of-two size classes. Shared by the backend
// and its pending requests (a request may outlive the backend). mpi_backend_staging.cpp.
class PinnedPool {
 public:
  PinnedPool() = default;
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  ~PinnedPool();
  /// A buffer of at least `bytes` bytes; `cls` receives its size class for give().
  void* take(std::size_t bytes, std::size_t& cls);
  /// Returns a buffer from take() for reuse.
  void give(void* p, std::size_t cls) noexcept;

 private:
  std::mutex mutex_;
  std::map<std::size_t, std::vector<void*>> free_;
};

}  // namespace detail::mpib

// MPIBackend's state (its pimpl; declared in mpi_backend.hpp, defined only here).
struct detail::MPIBackendImpl {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  bool cuda_aware = false;

  // Pinned host buffers that stage device memory (blocking and nonblocking operations alike).
  std::shared_ptr<mpib::PinnedPool> pinned_pool = std::make_shared<mpib::PinnedPool>();

  // Reliability hook: sequence numbers, fingerprints, deadlines (src/mpi/monitor.cpp).
  detail::CommMonitorPtr monitor;

  // Large host allreduce and broadcast when every rank is on this machine (null otherwise).
  std::unique_ptr<detail::ShmCollectives> shm;
  // Host allreduce when the ranks span machines with the same number (>= 2) on each (null
  // otherwise, and whenever shm is set).
  std::unique_ptr<detail::HierarchicalCollectives> hier;
  // Whichever of shm and hier exists (null: flat MPI only): the path every blocking collective
  // tries first (collective_path.hpp).
  detail::CollectivePath* path = nullptr;

  // Frees the communicator, unless MPI may still be progressing operations on it
  // (mpi_backend.cpp).
  ~MPIBackendImpl();
};

namespace detail::mpib {

// ---- mpi_backend_types.cpp: datatypes and reduction operators ---------------------------------

// mpi_type, mpi_op, free_half_ops, scale_host: mpi/mpi_types.hpp.

/// At one rank the mean is the sum, which is the data itself: no pass over the buffer, no staging.
inline ReduceOp one_rank_op(ReduceOp op, int size) noexcept {
  return op == ReduceOp::avg && size == 1 ? ReduceOp::sum : op;
}
/// Whether MPI reduces this dtype itself (f16 and bf16 go through user-defined operators that
/// run on the host, so their device buffers are staged even with CUDA-aware MPI).
inline bool is_mpi_native(DType t) { return t != DType::f16 && t != DType::bf16; }

/// Largest element count handed to one MPI call (MPI counts are int).
inline constexpr std::int64_t kMaxChunk = std::int64_t{1} << 30;

// ---- mpi_backend_staging.cpp: device memory for MPI -------------------------------------------
// Device memory is handed to MPI directly when MPI is CUDA-aware, else staged through pinned
// host buffers from one pool. The producing stream is synchronised first either way.

/// What MPI says about itself; LOCKSTEP_CUDA_AWARE_MPI overrides it (read with the settings).
bool detect_cuda_aware();

/// Before a device buffer is read by MPI (`direct`: a CUDA-aware MPI reads the device memory
/// itself) or by a staging copy, the producer's writes must be complete (see the definition).
void wait_for_producer(DeviceRuntime& rt, int index, bool direct);

/// A host-side stand-in for a view during one blocking collective. For host views it is the
/// view itself; for device views it is either the device pointer (CUDA-aware MPI) or a pinned
/// host buffer from the backend's pool, copied in before and out after, and given back to the
/// pool at the end of the call.
class Staged {
 public:
  /// `host_work`: the call does work of its own on the buffer on the host (the avg division,
  /// the f16/bf16 operators, a local copy), so device memory is staged even with CUDA-aware MPI.
  /// Inline, and nothing but two copies of the view for a host view: every blocking collective
  /// makes one, and the host case is the hot path (bench/profile_overhead.sh counts it).
  Staged(MPIBackendImpl& impl, TensorView v, bool copy_in, bool host_work = false) : orig_(v), host_(v) {
    if (!v.device.is_cpu()) stage(impl, copy_in, host_work);
  }
  ~Staged() {
    if (staged_) release();
  }
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  /// The view MPI works on.
  TensorView host() const { return host_; }
  void copy_out() {
    if (staged_) copy_back();
  }

 private:
  void stage(MPIBackendImpl& impl, bool copy_in, bool host_work);  // a device view
  void release() noexcept;
  void copy_back();
  std::shared_ptr<PinnedPool> pool_;  // set only for a device view
  TensorView orig_, host_;
  std::size_t cls_ = 0;
  bool staged_ = false;
};

// ---- mpi_backend_errors.cpp -------------------------------------------------------------------

/// run_collective (collective_sequence.cpp), which every blocking collective of MPIBackend goes
/// through, hands an MpiError to this before it goes on: an MPI error on one rank is told to the
/// others (monitor.hpp, report_mpi_error), which would otherwise wait in the same collective for
/// the default deadline.
void report_mpi_error(MPIBackendImpl* impl, const MpiError& e) noexcept;
/// rank_suffix(), or "" if that throws.
std::string rank_suffix_noexcept() noexcept;
/// The std::terminate handler initialize<MPIBackend>() installs: an exception that escapes main
/// (or any thread) on one rank would leave the others waiting in their next collective; instead
/// the whole job ends (abort_job), with the rank and the message.
[[noreturn]] void terminate_job() noexcept;

}  // namespace detail::mpib

namespace mpib = detail::mpib;

}  // namespace lockstep
