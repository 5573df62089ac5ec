// Internal: the MPI side of reliability (lockstep/reliability/settings.hpp), used by MPIBackend
// (src/mpi/mpi_backend*.cpp). One CommMonitor per MPIBackend communicator numbers its
// collectives, compares fingerprints, enforces deadlines and answers other ranks' status queries
// from a watchdog thread.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/reliability/settings.hpp"
#include "mpi/blame_report.hpp"
#include "mpi/wait_hook.hpp"

// Whether this build injects the faults of LOCKSTEP_FAULT (CMake option of the same name; the
// layers that need it get it as a compile definition): required, so that no file of the layer
// can silently see it as 0 while another sees 1.
#ifndef LOCKSTEP_FAULT_INJECTION
#error "LOCKSTEP_FAULT_INJECTION (0 or 1) must be defined: cmake/LockstepLayers.cmake sets it"
#endif

namespace lockstep::detail {

/// The collectives a monitor tells apart (blocking and nonblocking forms never match in MPI).
enum class Coll : std::int8_t { broadcast, allreduce, reduce, allgather, reduce_scatter, barrier,
                                iallreduce, ibroadcast };

class CommMonitor;
struct DeferredCheck;
/// Shared, so that a pending request can tell whether its communicator's monitor still exists.
using CommMonitorPtr = std::shared_ptr<CommMonitor>;

/// Creates the monitor of `comm` (a collective over comm: duplicates it twice, for the fingerprint
/// exchange and for the status queries, and starts the watchdog thread).
CommMonitorPtr make_comm_monitor(MPI_Comm comm);

/// Number of nonblocking requests issued on the monitored communicator and not yet completed
/// and destroyed.
int pending_requests(const CommMonitor& m) noexcept;
/// False after a stall or while requests are pending: MPI may still touch the communicator
/// (freeing it then makes MPI_Finalize crash in Open MPI's progress engine), so it is leaked.
bool safe_to_free(const CommMonitor& m) noexcept;
/// Throws InvalidArgument if requests are pending on m (what: the operation refusing, e.g.
/// "finalize<MPIBackend>").
void check_no_pending_requests(const CommMonitor* m, const char* what);

/// What must agree across ranks for one collective, and where it was called.
struct OpRecord {
  std::int64_t v[7] = {-1, -1, -1, -1, -1, -1, 1};  // operation, dtype, count, root, reduce op, seq, valid
  CallSite site;
};

/// Held by a nonblocking request: waits for it with the deadline (and blame) of a blocking
/// collective, and counts it as pending on its communicator until destroyed. Move-only.
class RequestWatch {
 public:
  RequestWatch();
  RequestWatch(std::weak_ptr<CommMonitor> monitor, const OpRecord& op);
  RequestWatch(RequestWatch&& other) noexcept;
  RequestWatch& operator=(RequestWatch&&) = delete;
  RequestWatch(const RequestWatch&) = delete;
  RequestWatch& operator=(const RequestWatch&) = delete;
  ~RequestWatch();
  /// MPI_Waitall, polled against the deadline when there is one; returns an MPI error code or
  /// throws TimeoutError.
  int wait_all(std::vector<MPI_Request>& reqs);
  /// What the request is ("iallreduce #3 (f32 x 500, op sum) at train.cpp:40").
  std::string describe() const;
  /// The request failed with an MPI error on this rank: report_mpi_error on its communicator.
  void report(const std::string& what, int code) noexcept;

 private:
  std::weak_ptr<CommMonitor> monitor_;
  OpRecord op_;
  bool counted_ = false;
  std::unique_ptr<DeferredCheck> check_;  // the fingerprint check issued with the operation
};

/// A watch for the nonblocking collective being issued in the current CollectiveScope on this
/// thread (an unmonitored watch if there is none).
RequestWatch watch_request(const CommMonitorPtr& monitor);

/// One collective on a monitored communicator, from entry to completion: assigns the sequence
/// number, applies an injected fault (in a build with LOCKSTEP_FAULT_INJECTION), compares
/// fingerprints if the check level says so, and lets the guarded_* calls below wait with a
/// deadline. Throws MismatchError / TimeoutError. With the check level off, no timeout and no
/// fault to inject it takes a fast path: the sequence number and the stall check only, no lock
/// and no clock read.
class CollectiveScope {
 public:
  /// `data` is the view the collective sends (it may be changed by an injected fault); `count`
  /// the element count that must agree across ranks; op and root are -1 where they do not apply.
  CollectiveScope(CommMonitor* monitor, Coll coll, TensorView* data, std::int64_t count, int op,
                  int root);
  ~CollectiveScope();
  CollectiveScope(const CollectiveScope&) = delete;
  CollectiveScope& operator=(const CollectiveScope&) = delete;

#if LOCKSTEP_FAULT_INJECTION
  /// True when an injected `skip` fault says this rank must not take part (test only).
  bool skipped() const noexcept { return skipped_; }
#else
  /// Never, in a build without fault injection: the callers' `if (skipped())` compiles away.
  static constexpr bool skipped() noexcept { return false; }
#endif

 private:
  CommMonitor* monitor_;
  CommMonitor* outer_;  // the monitor of an enclosing collective on this thread, if any
  void enter_slow(Coll coll, TensorView* data, std::int64_t count, int op, int root);
  void leave_slow() noexcept;

#if LOCKSTEP_FAULT_INJECTION
  bool skipped_ = false;
#endif
  bool fast_ = false;      // entered through the fast path (nothing to check, no deadline)
  bool scoped_ = false;    // set the thread's current monitor (all but blocking fast-path collectives)
  bool deadline_ = false;  // counted among the collectives under a deadline
  int uncaught_ = 0;       // std::uncaught_exceptions() at entry (slow path only)
};

// The blocking MPI collectives MPIBackend uses. Inside a CollectiveScope with a deadline they run
// as their nonblocking form, polled until done or the deadline; otherwise they are the plain
// blocking call. They return an MPI error code (check with LOCKSTEP_MPI_CHECK) or throw
// TimeoutError.
int guarded_allreduce(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op, MPI_Comm comm);
int guarded_bcast(void* buf, int count, MPI_Datatype dt, int root, MPI_Comm comm);
int guarded_reduce(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op, int root,
                   MPI_Comm comm);
int guarded_allgather(const void* send, int scount, MPI_Datatype sdt, void* recv, int rcount,
                      MPI_Datatype rdt, MPI_Comm comm);
int guarded_reduce_scatter_block(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op,
                                 MPI_Comm comm);
int guarded_barrier(MPI_Comm comm);
/// A point inside a long wait of the collective running on this thread (the shared-memory path
/// calls it while it waits for its peers): throws TimeoutError / MismatchError if another rank
/// reported a stall or a refused collective, or if this collective's deadline passed (with the
/// blame report). A null monitor: nothing to check.
void wait_point(CommMonitor* monitor);
/// The monitor as the hook of the shared-memory path's waits: its at_wait() is wait_point().
WaitHook* as_wait_hook(CommMonitor* monitor) noexcept;
/// The point where this rank's part of a collective is on its way and its wait has not begun:
/// where a test's LOCKSTEP_FAULT kind=freeze_exchange stops the process (a no-op in builds
/// without fault injection).
void exchange_point(CommMonitor* monitor);

/// An MPI error (`what`, the MpiError's text; `code`) in a collective or a request's wait on m's
/// communicator on this rank: tells every other rank (they throw MpiError naming this rank and
/// the error, at once where they poll, at their next collective otherwise) and marks the
/// communicator unusable here. Nothing after the first error of the communicator (then the
/// error may be another rank's, rethrown).
void report_mpi_error(CommMonitor* m, const std::string& what, int code) noexcept;

/// False after a stall or a refused collective on this communicator (every collective throws).
bool monitor_usable(const CommMonitor& m) noexcept;

/// Called on a rank whose arguments to a collective were refused by the front end. At a checked
/// call (LOCKSTEP_CHECK) it takes part in the fingerprint exchange with its arguments marked
/// refused, so that every rank throws the same MismatchError naming this rank's error, and no
/// data moves. Otherwise it tells every other rank (which then throw, or, blocked inside a
/// collective that cannot be interrupted, end the job) and marks the communicator unusable; the
/// caller then throws its own error.
void abandon_collective(CommMonitor* m, const char* op, std::int64_t count, int dtype, int reduce_op, int root,
                        const char* message);

/// Every LOCKSTEP_* setting of this process, checked against every other rank of comm (a
/// collective): throws the same InvalidArgument on every rank when one is malformed anywhere or
/// the ranks differ.
void agree_on_settings(MPI_Comm comm);
/// LOCKSTEP_SHM, LOCKSTEP_SHM_SLICE_BYTES, LOCKSTEP_SHM_MIN_BYTES, LOCKSTEP_CUDA_AWARE_MPI as
/// parsed (nullopt: unset).
std::optional<bool> settings_shm();
std::optional<std::uint64_t> settings_shm_slice_bytes();
std::optional<std::uint64_t> settings_shm_min_bytes();
std::optional<bool> settings_cuda_aware_mpi();

/// True once any communicator of this process saw a stall: MPI_Finalize would then wait for the
/// stalled rank, so finalize skips it.
bool any_stall() noexcept;
/// Tells the other ranks of m's communicator that this rank is leaving (finalize): those still
/// waiting in a collective on it throw, or end the job, instead of waiting forever.
void announce_leaving(CommMonitor& m) noexcept;

}  // namespace lockstep::detail
