// The global MPIBackend behind initialize<MPIBackend>(), get_distributed_backend<MPIBackend>()
// and finalize<MPIBackend>() (detail::GlobalBackend, src/comm/global_backend.hpp): starting MPI
// when nobody did (with Lockstep's Open MPI defaults), the terminate handler, the finalize hooks
// (detail::at_finalize), and finalising MPI without waiting for ever on a rank that stalled or
// left.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/global_backend.hpp"
#include "core/env.hpp"
#include "mpi/deadline.hpp"
#include "lockstep/mpi/world.hpp"
#include "mpi/finalize_hooks.hpp"
#include "mpi/mpi_backend_impl.hpp"

namespace lockstep {

namespace {
constinit detail::GlobalBackend<MPIBackend> g_global{"MPIBackend", "MPI"};

// At exit after a failed initialize (see there): the ranks meet in a barrier, polled for at
// most 10 s so that a rank that failed alone cannot make the others wait, then MPI_Finalize.
bool g_failed_init_atexit = false;
constexpr double kFailedInitBarrierSeconds = 10;
void finalize_after_failed_init() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin || MPIBackend::initialized_global()) return;  // finalised, or initialised again
  MPI_Request req = MPI_REQUEST_NULL;
  int done = 0;
  if (MPI_Ibarrier(MPI_COMM_WORLD, &req) == MPI_SUCCESS) {
    const auto deadline = detail::Bound::within(kFailedInitBarrierSeconds).at();
    while (MPI_Test(&req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done && detail::Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (done) MPI_Finalize();
}

std::terminate_handler g_previous_terminate = nullptr;
bool g_we_initialised_mpi = false;
}  // namespace

void MPIBackend::initialize_global() {
  // Under the global backend's lock, and only while there is none: MPI's own start included.
  g_global.initialize([]() -> std::unique_ptr<MPIBackend> {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (fin) throw Error("initialize<MPIBackend>: MPI was already finalised; it cannot be initialised again");
    // A peer process that dies (every process of its host killed) resets its TCP connections, and
    // Open MPI's next write to one raised SIGPIPE here: this rank, on a host that is fine, died of
    // the signal before mpiexec saw the lost host, and mpiexec named this rank as the failure.
    // Ignored, the write fails with EPIPE and the lost peer is reported as such (an MPI error, or
    // mpiexec's lost daemon). Only where SIGPIPE has its default action: a handler or disposition
    // the program set is left alone (docs/reliability.md).
    {
      struct sigaction old_pipe {};
      if (::sigaction(SIGPIPE, nullptr, &old_pipe) == 0 && !(old_pipe.sa_flags & SA_SIGINFO) &&
          old_pipe.sa_handler == SIG_DFL) {
        struct sigaction ign {};
        ign.sa_handler = SIG_IGN;
        sigemptyset(&ign.sa_mask);
        ::sigaction(SIGPIPE, &ign, nullptr);
      }
    }
    if (!init) {
      // DistributedOptimizer reduces its buckets with MPI_Iallreduce, and Open MPI's default
      // nonblocking allreduce algorithm is much slower than its ring one (docs/performance.md):
      // the ring is chosen, as a default only (a value the user set wins, other MPIs ignore the
      // variable, a program that starts MPI itself keeps its own settings). Documented in
      // docs/training.md; LOCKSTEP_OMPI_DEFAULTS=0 leaves Open MPI's environment alone. A malformed
      // value is read as the default here and refused on every rank by the settings check.
      bool ompi_defaults = true;
      try {
        ompi_defaults = detail::env::get_bool("LOCKSTEP_OMPI_DEFAULTS").value_or(true);
      } catch (const std::exception&) {
      }
      if (ompi_defaults) ::setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", /*overwrite=*/0);
      // Between machines Open MPI's TCP transport opens one connection per pair of processes, and
      // a rendezvous acknowledgement then queues behind the bulk data going the other way in that
      // connection: traffic both ways at once (every allreduce's) got about half the link's rate
      // per direction, on a shaped link as unshaped. Two connections per pair fill it
      // (docs/performance/across-hosts.md, "Across hosts"). No effect within a machine (shared memory).
      if (ompi_defaults) ::setenv("OMPI_MCA_btl_tcp_links", "2", /*overwrite=*/0);
      int provided = 0;
      int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) throw MpiError("initialize<MPIBackend>: MPI_Init_thread failed", rc);
      g_we_initialised_mpi = true;
    }
    // Errors of requests that MPI cannot attribute to a communicator (Open MPI raises those of
    // nonblocking collectives on MPI_COMM_WORLD) must come back as codes, so that they become an
    // MpiError instead of ending the job. Only when Lockstep started MPI: a program that owns MPI
    // keeps its own handlers (docs/reliability.md).
    if (g_we_initialised_mpi) {
      MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
    }
    if (g_previous_terminate == nullptr) g_previous_terminate = std::set_terminate(mpib::terminate_job);
    try {
      return std::make_unique<MPIBackend>(MPI_COMM_WORLD);
    } catch (...) {
      // The backend's creation failed (on every rank alike: its checks, the settings among them,
      // are agreed across ranks). MPI, which Lockstep started, stays usable for the program, and
      // is finalised when the process exits, so that each rank can report the error and exit
      // normally: a rank that exited without MPI_Finalize would make mpiexec end the others
      // before they printed it.
      if (g_we_initialised_mpi && !g_failed_init_atexit) {
        (void)detail::world_rank();  // remembered for messages after MPI_Finalize
        std::atexit(finalize_after_failed_init);
        g_failed_init_atexit = true;
      }
      throw;
    }
  });  // finalize<MPIBackend>() at exit (GlobalBackend), once a backend was created
}

bool MPIBackend::initialized_global() noexcept { return g_global.initialized(); }

MPIBackend& MPIBackend::global() { return g_global.get(); }

// How long a rank that leaves without MPI_Finalize after a stall waits first (see there).
constexpr int kStallExitGraceMs = 500;

namespace {
std::mutex g_hooks_mutex;
std::vector<std::pair<const void*, std::function<void(const Backend*, bool)>>>* g_finalize_hooks = nullptr;
}  // namespace

void detail::at_finalize(const void* key, std::function<void(const Backend*, bool)> hook) {
  std::lock_guard lock(g_hooks_mutex);
  if (g_finalize_hooks == nullptr) g_finalize_hooks = new std::vector<std::pair<const void*, std::function<void(const Backend*, bool)>>>();
  for (auto& [k, h] : *g_finalize_hooks)
    if (k == key) {
      h = std::move(hook);
      return;
    }
  g_finalize_hooks->emplace_back(key, std::move(hook));
}

void MPIBackend::finalize_global() {
  // What lives on the backend, or on MPI, ends first (remote sessions: their progress threads
  // call MPI), outside the lock (a hook may ask whether the backend is initialised).
  {
    const Backend* going = g_global.current();
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    std::vector<std::function<void(const Backend*, bool)>> hooks;
    {
      std::lock_guard lock(g_hooks_mutex);
      if (g_finalize_hooks != nullptr)
        for (auto& [k, h] : *g_finalize_hooks) hooks.push_back(h);
    }
    if (init && !fin)
      for (auto& h : hooks) {
        try {
          h(going, g_we_initialised_mpi);
        } catch (...) {
        }
      }
  }
  // The rest under the global backend's lock (GlobalBackend::finalize).
  g_global.finalize([](std::unique_ptr<MPIBackend>& backend) {
    // Reliability hook: finalising under pending requests would crash inside MPI_Finalize.
    if (backend) detail::check_no_pending_requests(backend->impl_->monitor.get(), "finalize<MPIBackend>");
    // Only when MPI ends with it: a program that owns MPI may create another backend, and a
    // notice nobody received would then be read on a communicator it was not meant for.
    if (g_we_initialised_mpi && backend && backend->impl_ && backend->impl_->monitor)
      detail::announce_leaving(*backend->impl_->monitor);
    const bool had_backend = static_cast<bool>(backend);
    backend.reset();
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (init && !fin) {
      mpib::free_half_ops();
      if (g_we_initialised_mpi) {
        if (detail::any_stall()) {
          // MPI_Finalize synchronises with every rank, so it would wait for the stalled one
          // (forever, if it never comes back). The process ends without it; mpiexec then ends
          // the rest of the job.
          std::cerr << "lockstep: not calling MPI_Finalize after a stall or a refused collective (it would wait "
                       "for the other ranks); this process exits without it, which ends the job"
                    << mpib::rank_suffix_noexcept() << std::endl;
          // The other ranks that waited for the same collective reach their own deadline at
          // about the same time, or have just been told of this one's: a bounded pause lets them
          // print their error before this exit makes mpiexec end them (on a loaded machine a
          // rank a few milliseconds behind was ended before its report).
          std::this_thread::sleep_for(std::chrono::milliseconds(kStallExitGraceMs));
          return;
        }
        // MPI_Finalize synchronises with every rank and, in Open MPI, cannot be interrupted: a
        // rank inside it is not ended even by another rank's MPI_Abort. So the ranks first meet
        // in a barrier that this rank polls (a rank still inside a collective has been told that
        // this one left, and throws or ends the job), for at most the deadline.
        // Teardown never throws: the deadline is read without the settings' error, which was
        // reported when initialize was refused (thrown again here, after the barrier below was
        // issued, it would leave MPI never finalised, and mpiexec would report the job as
        // exiting improperly). After a refused initialize the wait is bounded as at exit
        // (finalize_after_failed_init): every rank was refused alike, but one that was refused
        // alone must not keep the others here.
        double limit = 1e18;
        try {
          if (timeout() > 0) limit = timeout();
        } catch (const std::exception&) {
          limit = kFailedInitBarrierSeconds;
        }
        if (!had_backend && g_failed_init_atexit) limit = std::min(limit, kFailedInitBarrierSeconds);
        MPI_Request req = MPI_REQUEST_NULL;
        if (MPI_Ibarrier(MPI_COMM_WORLD, &req) == MPI_SUCCESS) {
          const auto deadline = detail::deadline_or_none(limit);
          int done = 0;
          while (!done) {
            if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
            if (done) break;
            if (detail::Clock::now() > deadline) {
              std::cerr << "lockstep: the other ranks did not finalise within " << limit
                        << " s; this process exits without MPI_Finalize, which ends the job"
                        << mpib::rank_suffix_noexcept() << std::endl;
              return;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
        }
        MPI_Finalize();
      }
    }
  });
}

}  // namespace lockstep
