// MPIBackend: every collective of the Backend interface over one duplicated MPI communicator.
// This file is one backend's life: its construction (the agreed LOCKSTEP_* settings, the ranks
// of this machine, the shared-memory and hierarchical paths), its accessors and moves, and the
// end of its state. The other jobs are in the files mpi_backend_impl.hpp lists.
#include "lockstep/mpi/mpi_backend.hpp"

#include <cstdint>
#include <exception>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "core/env.hpp"
#include "mpi/mpi_backend_impl.hpp"

namespace lockstep {

detail::MPIBackendImpl::~MPIBackendImpl() {
  // Reliability hook: after a stall or with requests still pending, MPI may still progress
  // operations on comm (MPI_Finalize does), so it is leaked rather than freed under them.
  const bool keep_comm = monitor && !detail::safe_to_free(*monitor);
  if (keep_comm)
    std::cerr << "lockstep: MPIBackend destroyed after a stall or with " << detail::pending_requests(*monitor)
              << " nonblocking request(s) pending; its communicator is left allocated\n";
  monitor.reset();  // stops its watchdog thread before the communicators go
  int fin = 0;
  MPI_Finalized(&fin);
  if (comm != MPI_COMM_NULL && !fin && !keep_comm) MPI_Comm_free(&comm);
}

namespace {

// A setting of the hierarchical path, read here (not among the reliability settings): parsed on
// each rank, then agreed over comm, so that a malformed value, a value this build refuses, or
// values that differ between ranks are the same InvalidArgument on every rank. `parse` returns
// the value or nullopt when unset, and may throw InvalidArgument.
template <class Parse>
std::int64_t agreed_setting(MPI_Comm comm, const char* name, std::int64_t fallback, Parse&& parse) {
  std::int64_t v = fallback;
  std::string error;
  try {
    if (auto x = parse()) v = static_cast<std::int64_t>(*x);
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::int64_t buf[3] = {v, -v, error.empty() ? 0 : 1};
  LOCKSTEP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf, 3, MPI_INT64_T, MPI_MAX, comm));
  if (buf[2] != 0)
    throw InvalidArgument(error.empty() ? detail::concat(name, ": refused on another rank (malformed, or not "
                                                               "available in this build)")
                                        : error);
  if (buf[0] != -buf[1])
    throw InvalidArgument(detail::concat(name, ": the ranks differ (from ", -buf[1], " to ", buf[0],
                                         "); set it alike on every rank"));
  return v;
}

}  // namespace

MPIBackend::MPIBackend(MPI_Comm comm) : impl_(std::make_unique<detail::MPIBackendImpl>()) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin)
    throw Error("MPIBackend: MPI is not initialised; call lockstep::initialize<lockstep::MPIBackend>() first");
  LOCKSTEP_CHECK_ARG(comm != MPI_COMM_NULL, "MPIBackend: communicator is MPI_COMM_NULL");
  LOCKSTEP_MPI_CHECK(MPI_Comm_dup(comm, &impl_->comm));
  LOCKSTEP_MPI_CHECK(MPI_Comm_set_errhandler(impl_->comm, MPI_ERRORS_RETURN));
  LOCKSTEP_MPI_CHECK(MPI_Comm_rank(impl_->comm, &impl_->rank));
  LOCKSTEP_MPI_CHECK(MPI_Comm_size(impl_->comm, &impl_->size));
  // Every LOCKSTEP_* setting, parsed on each rank and then agreed: a value that is malformed or
  // differs on any rank is the same InvalidArgument on every rank (no rank is left waiting).
  detail::agree_on_settings(impl_->comm);
  // The hierarchical path (docs/architecture/hierarchical.md): LOCKSTEP_HIERARCHICAL=0 turns it off.
  const bool hier_on = agreed_setting(impl_->comm, "LOCKSTEP_HIERARCHICAL", 1, [] {
    auto b = detail::env::get_bool("LOCKSTEP_HIERARCHICAL");
    return b ? std::optional<int>(*b ? 1 : 0) : std::nullopt;
  }) != 0;
  // Test settings, honoured only in builds with fault injection (refused on every rank
  // elsewhere): LOCKSTEP_TEST_HOST_SIZE=k treats ranks [0,k), [k,2k), ... as separate machines,
  // so that the hierarchical path runs on one; LOCKSTEP_TEST_HIER_CHUNK_BYTES and
  // LOCKSTEP_TEST_HIER_MIN_BYTES set its chunk and threshold.
  auto test_only = [](const char* name, std::uint64_t lo, std::uint64_t hi) {
    return [name, lo, hi]() -> std::optional<std::uint64_t> {
      auto v = detail::env::get(name);
      if (!v) return std::nullopt;
      if (!LOCKSTEP_FAULT_INJECTION)
        throw InvalidArgument(detail::concat(name, "=\"", *v, "\": a test setting, honoured only in builds with "
                                             "LOCKSTEP_FAULT_INJECTION=ON; unset it"));
      return detail::env::parse_bytes(name, *v, lo, hi);
    };
  };
  const std::int64_t test_host_size =
      agreed_setting(impl_->comm, "LOCKSTEP_TEST_HOST_SIZE", 0, test_only("LOCKSTEP_TEST_HOST_SIZE", 1, 1 << 20));
  const std::int64_t hier_chunk = agreed_setting(impl_->comm, "LOCKSTEP_TEST_HIER_CHUNK_BYTES", 0,
                                                 test_only("LOCKSTEP_TEST_HIER_CHUNK_BYTES", 1, std::uint64_t{1} << 30));
  const std::int64_t hier_min = agreed_setting(impl_->comm, "LOCKSTEP_TEST_HIER_MIN_BYTES", -1,
                                               test_only("LOCKSTEP_TEST_HIER_MIN_BYTES", 0, std::uint64_t{1} << 40));
  MPI_Comm node = MPI_COMM_NULL;
  if (test_host_size > 0)
    LOCKSTEP_MPI_CHECK(MPI_Comm_split(impl_->comm, static_cast<int>(impl_->rank / test_host_size), impl_->rank, &node));
  else
    LOCKSTEP_MPI_CHECK(
        MPI_Comm_split_type(impl_->comm, MPI_COMM_TYPE_SHARED, impl_->rank, MPI_INFO_NULL, &node));
  LOCKSTEP_MPI_CHECK(MPI_Comm_rank(node, &impl_->local_rank));
  LOCKSTEP_MPI_CHECK(MPI_Comm_size(node, &impl_->local_size));
  impl_->cuda_aware = detail::settings_cuda_aware_mpi().value_or(mpib::detect_cuda_aware());
  impl_->monitor = detail::make_comm_monitor(impl_->comm);  // reliability hook
  impl_->shm = detail::ShmCollectives::create(impl_->comm, impl_->local_size);
  if (impl_->shm) {
    // Every wait of the shared-memory path is bounded: it polls the reliability hook (stall
    // notices from other ranks, this collective's deadline).
    impl_->shm->set_wait_hook(detail::as_wait_hook(impl_->monitor.get()));
    LOCKSTEP_MPI_CHECK(MPI_Comm_free(&node));
  } else {
    // Not all on one machine (the same verdict on every rank): the hierarchical collectives where
    // the placement allows it. It takes over `node`, and frees it when it says no.
    impl_->hier = detail::HierarchicalCollectives::create(impl_->comm, node, hier_on, impl_->monitor.get(),
                                                          static_cast<std::size_t>(hier_chunk), hier_min);
  }
  if (impl_->shm) impl_->path = impl_->shm.get();
  else if (impl_->hier) impl_->path = impl_->hier.get();
}

MPIBackend::~MPIBackend() = default;
// A moved-from backend holds no Impl: usable() is false and every collective throws.
MPIBackend::MPIBackend(MPIBackend&& other) noexcept : impl_(std::move(other.impl_)) {}
MPIBackend& MPIBackend::operator=(MPIBackend&& other) noexcept {
  if (this != &other) impl_ = std::move(other.impl_);
  return *this;
}

MPI_Comm MPIBackend::comm() const noexcept { return impl_ ? impl_->comm : MPI_COMM_NULL; }
int MPIBackend::rank() const { return impl_ ? impl_->rank : 0; }
int MPIBackend::size() const { return impl_ ? impl_->size : 0; }
int MPIBackend::local_rank() const { return impl_ ? impl_->local_rank : 0; }
int MPIBackend::local_size() const { return impl_ ? impl_->local_size : 0; }
bool MPIBackend::concurrent_collectives() const {
  int init = 0, fin = 0, provided = MPI_THREAD_SINGLE;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!impl_ || !init || fin) return false;
  MPI_Query_thread(&provided);
  return provided == MPI_THREAD_MULTIPLE;
}
bool MPIBackend::cuda_aware() const noexcept { return impl_ && impl_->cuda_aware; }
void MPIBackend::set_cuda_aware(bool on) noexcept {
  if (impl_) impl_->cuda_aware = on;
}
bool MPIBackend::shared_memory() const noexcept { return impl_ && impl_->shm != nullptr; }
std::uint64_t MPIBackend::in_place_allreduces() const noexcept {
  return impl_ && impl_->shm ? impl_->shm->in_place_calls() : 0;
}
bool MPIBackend::hierarchical() const noexcept { return impl_ && impl_->hier != nullptr; }
bool MPIBackend::usable() const noexcept { return impl_ && detail::monitor_usable(*impl_->monitor); }

void MPIBackend::check_usable() const {
  if (!impl_)
    throw InvalidArgument(detail::concat(detail::describe_call_site(),
                                         ": this MPIBackend was moved from; use the backend it was moved into"));
}

void MPIBackend::abandon(const CallInfo& call, const std::exception& error) {
  if (impl_) detail::abandon_collective(impl_->monitor.get(), call.op, call.count, call.dtype, call.reduce_op,
                                        call.root, error.what());
}

}  // namespace lockstep
