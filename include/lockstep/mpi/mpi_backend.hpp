// MPIBackend: the Backend over an MPI communicator (Open MPI in CI).
#pragma once

#include <mpi.h>

#include <memory>

#include "lockstep/comm/backend.hpp"

namespace lockstep {

namespace detail {
struct MPIBackendImpl;  // MPIBackend's state, defined in the library's source, not a user type
}  // namespace detail

/// Backend over MPI. The constructor duplicates `comm` (MPI_Comm_dup), sets MPI_ERRORS_RETURN
/// on the duplicate and frees it in the destructor; the caller keeps ownership of `comm`.
/// Requires MPI to be initialised (initialize<MPIBackend>() does that). The constructor is a
/// collective: it reads every LOCKSTEP_* setting and checks that all ranks agree on them (a
/// malformed or differing value is the same InvalidArgument on every rank). A moved-from
/// MPIBackend is empty: rank() and size() return 0 and every collective throws.
class MPIBackend final : public Backend {
 public:
  explicit MPIBackend(MPI_Comm comm = MPI_COMM_WORLD);
  ~MPIBackend() override;
  MPIBackend(MPIBackend&&) noexcept;
  MPIBackend& operator=(MPIBackend&&) noexcept;
  MPIBackend(const MPIBackend&) = delete;
  MPIBackend& operator=(const MPIBackend&) = delete;

  /// The duplicated communicator this backend uses (owned by the backend).
  MPI_Comm comm() const noexcept;
  /// Whether device memory is handed to MPI directly (CUDA-aware MPI) rather than staged through
  /// pinned host memory. Detected with MPIX_Query_cuda_support where the MPI has it; the
  /// environment variable LOCKSTEP_CUDA_AWARE_MPI=0/1 or set_cuda_aware() forces either way.
  bool cuda_aware() const noexcept;
  void set_cuda_aware(bool on) noexcept;
  /// Whether host-memory allreduce and broadcast go through a shared-memory segment instead of
  /// MPI: true when every rank of the communicator runs on this machine (2 to 8 ranks) and
  /// LOCKSTEP_SHM=0 is not set. Then every blocking host allreduce of f32/f64/i32/i64 (from
  /// LOCKSTEP_SHM_MIN_BYTES, default 0) and every blocking host broadcast of at least one slice
  /// takes it, deadlines included; the other blocking host allreduces and broadcasts first agree on the call through
  /// it and then go to MPI. allreduce_wire16 and reduce_scatter_wire16 of f32 host data take
  /// it too, fused (docs/training.md, "Scale"). See docs/architecture/shared-memory.md.
  bool shared_memory() const noexcept;
  /// In-place allreduces so far whose buffers, from allocate_reduce_buffer on every rank, were
  /// reduced where they lie instead of through the shared-memory path's slots (0 without that
  /// path): what tells a program its gradient buffers take the fast way.
  std::uint64_t in_place_allreduces() const noexcept;
  /// Whether blocking host allreduce (f32/f64/i32/i64, bf16/f16 sum and avg, from 64 KiB; and
  /// allreduce_wire16, reduce_scatter, reduce_scatter_wire16, allgather and broadcast) goes
  /// hierarchically: shared memory within each machine, MPI between machines (docs/architecture/hierarchical.md, "Hierarchical allreduce"). True when the ranks span
  /// two or more machines with the same number of ranks, at least two, on each (at most 8), and
  /// neither LOCKSTEP_HIERARCHICAL=0 nor LOCKSTEP_SHM=0 is set. Uneven placements and one rank
  /// per machine use the flat MPI path.
  bool hierarchical() const noexcept;
  /// Exact sums of deterministic mode (DistributedOptions::deterministic) so far that the
  /// shared-memory path computed itself, fused into its reduction (one micro-batch on every
  /// rank; docs/training.md, "The exact sum"); 0 without that path.
  std::uint64_t exact_sums_fused() const noexcept;

  std::string name() const override { return "mpi"; }
  int rank() const override;
  int size() const override;
  int local_rank() const override;
  int local_size() const override;
  /// True when MPI provides MPI_THREAD_MULTIPLE (initialize<MPIBackend> asks for it).
  bool concurrent_collectives() const override;

  // Every collective of Backend's front end (backend.hpp) lands in one of these.
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
  /// On the shared-memory path, fused (ShmCollectives::allreduce_wire16: each rank rounds into
  /// its slot, sums the slots in f32 and writes f32); on the hierarchical path (from 64 KiB),
  /// the machines' sums in f32 through shared memory and only the inter-host part in 16-bit
  /// (HierarchicalCollectives::allreduce_wire16); otherwise Backend's three passes, whose 16-bit
  /// allreduce goes to MPI with Lockstep's f16/bf16 operator.
  void do_allreduce_wire16(TensorView buf, DType wire, ReduceOp op) override;
  void do_reduce_scatter_wire16(TensorView send, TensorView recv, DType wire, ReduceOp op) override;
  /// On the shared-memory path: a segment of this rank's that every rank maps (see
  /// Backend::allocate_reduce_buffer); ordinary memory otherwise, or when a segment cannot be
  /// made or mapped on some rank (every rank then falls back alike).
  std::shared_ptr<void> do_allocate_reduce_buffer(std::size_t bytes) override;
  /// On the shared-memory path, fused (ShmCollectives::exact_sum); false otherwise.
  bool do_exact_sum(const detail::ExactSumCall& call) override;
  void abandon(const CallInfo& call, const std::exception& error) override;
  void check_usable() const override;

 public:
  /// Whether this backend is usable: false for a moved-from one and after a stall or a refused
  /// collective (docs/reliability.md), after which every collective throws.
  bool usable() const noexcept;

  // Hooks used by initialize<MPIBackend>() and friends (see world.hpp).
  /// MPI_Init_thread(MPI_THREAD_MULTIPLE) if MPI is not initialised yet, then creates the
  /// global backend over MPI_COMM_WORLD. Idempotent. If Lockstep initialised MPI, it finalises
  /// it at exit.
  static void initialize_global();
  static bool initialized_global() noexcept;
  /// The global backend; throws lockstep::Error if initialize<MPIBackend>() was not called.
  static MPIBackend& global();
  /// Destroys the global backend and finalises MPI if Lockstep initialised it.
  static void finalize_global();

 private:
  std::unique_ptr<detail::MPIBackendImpl> impl_;
};

namespace detail {
/// Throws MpiError naming the call, file:line and rank if `code` is not MPI_SUCCESS.
void check_mpi(int code, const char* call,
               const std::source_location& loc = std::source_location::current());
}  // namespace detail

}  // namespace lockstep

/// Checks an MPI call: LOCKSTEP_MPI_CHECK(MPI_Barrier(comm));
#define LOCKSTEP_MPI_CHECK(call) ::lockstep::detail::check_mpi((call), #call)
