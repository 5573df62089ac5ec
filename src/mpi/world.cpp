#include "lockstep/mpi/world.hpp"

#include <atomic>

#include <mpi.h>

#include <exception>
#include <iostream>

#include "lockstep/mpi/mpi_backend.hpp"

namespace lockstep {

bool is_available() noexcept {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

namespace {
// The rank MPI last gave, so that a rank still knows who it is after MPI was finalised (its
// messages, rank_zero_only after a failed initialize).
std::atomic<int> g_last_world_rank{-1};
}  // namespace

int detail::world_rank() noexcept {
  if (!is_available()) {
    const int last = g_last_world_rank.load();
    return last >= 0 ? last : 0;
  }
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  g_last_world_rank.store(r);
  return r;
}

void detail::check_ranks_of(const Backend& b, const std::vector<int>& ranks, const char* what) {
  const int n = b.size();
  LOCKSTEP_CHECK_ARG(n > 0, what, ": the ", b.name(), " backend given has no ranks (moved from)");
  for (const int r : ranks)
    LOCKSTEP_CHECK_ARG(r >= 0 && r < n, what, ": rank ", r, " is not a rank of the ", b.name(),
                       " backend given (its ranks are 0 to ", n - 1, ")");
}

// Declared in core/errors.hpp: every error message of the library names the rank.
std::string detail::rank_suffix() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) return "";
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return concat(" [rank ", rank, "/", size, "]");
}

WorldInfo world_info() {
  if (!is_available()) return {};
  if (MPIBackend::initialized_global()) {
    const MPIBackend& b = MPIBackend::global();
    return {b.rank(), b.size(), b.local_rank(), b.local_size()};
  }
  WorldInfo w;
  LOCKSTEP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &w.rank));
  LOCKSTEP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &w.size));
  MPI_Comm node = MPI_COMM_NULL;
  LOCKSTEP_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, w.rank, MPI_INFO_NULL, &node));
  LOCKSTEP_MPI_CHECK(MPI_Comm_rank(node, &w.local_rank));
  LOCKSTEP_MPI_CHECK(MPI_Comm_size(node, &w.local_size));
  LOCKSTEP_MPI_CHECK(MPI_Comm_free(&node));
  return w;
}

AutoInit::AutoInit(std::function<void()> worker_init) : uncaught_(std::uncaught_exceptions()) {
  owns_ = !MPIBackend::initialized_global();
  initialize<MPIBackend>();
  if (worker_init) worker_init();
  MPIBackend::global().barrier();
}

AutoInit::~AutoInit() {
  // Left by an exception: the other ranks are not at this barrier (they may be inside any
  // collective), and MPI_Finalize would wait for them. The exception goes on; if nothing catches
  // it, the terminate handler ends the whole job with its message.
  if (std::uncaught_exceptions() > uncaught_) return;
  try {
    if (MPIBackend::initialized_global()) MPIBackend::global().barrier();
    if (owns_) finalize<MPIBackend>();
  } catch (const std::exception& e) {
    std::cerr << "lockstep: AutoInit teardown failed: " << e.what() << "\n";
  }
}

}  // namespace lockstep
