// Internal to the mpi layer (not installed): the class CommMonitor of monitor.cpp and the helpers
// its files share. The member functions are defined by job in monitor*.cpp: monitor.cpp
// (construction, the free functions of monitor.hpp), monitor_wait.cpp (request waits and
// deadlines), monitor_collective.cpp (the slow paths of entering and leaving a collective),
// monitor_refusal.cpp (refused collectives, MPI errors, leaving), monitor_fingerprint.cpp (the
// fingerprint and mismatch exchange), monitor_blame.cpp (status queries and stall blame),
// monitor_watchdog.cpp (the watchdog thread). The design in short is at the top of monitor.cpp.
#pragma once

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iomanip>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <climits>
#include <optional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "comm/rank_list.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/reliability/settings.hpp"
#include "mpi/deadline.hpp"
#include "mpi/keep_for_process.hpp"
#include "mpi/monitor.hpp"
#include "mpi/straggler.hpp"
#include "mpi/wait_hook.hpp"
#include "reliability/settings_state.hpp"
#if LOCKSTEP_FAULT_INJECTION
#include "reliability/fault.hpp"
#endif

namespace lockstep {
namespace detail {

// ---------------------------------------------------------------------------------------------
// Fingerprints and descriptions
// ---------------------------------------------------------------------------------------------

inline const char* name_of(Coll c) {
  switch (c) {
    case Coll::broadcast: return "broadcast";
    case Coll::allreduce: return "allreduce";
    case Coll::reduce: return "reduce";
    case Coll::allgather: return "allgather";
    case Coll::reduce_scatter: return "reduce_scatter";
    case Coll::barrier: return "barrier";
    case Coll::iallreduce: return "iallreduce";
    case Coll::ibroadcast: return "ibroadcast";
  }
  return "?";
}

// What must agree across ranks, in the order compared.
inline constexpr int kFields = 7;
inline const char* const kFieldNames[kFields] = {"operation", "dtype", "element count", "root", "reduce op",
                                          "sequence number", "validity of the arguments"};

struct Fingerprint {
  // coll, dtype, count, root, op, seq, arguments accepted (1) or refused (0) by the front end
  std::int64_t v[kFields] = {-1, -1, -1, -1, -1, -1, 1};
};

inline Fingerprint fingerprint_of(Coll coll, const TensorView* data, std::int64_t count, int root, int op,
                           std::int64_t seq) noexcept {
  Fingerprint fp;
  fp.v[0] = static_cast<std::int64_t>(coll);
  fp.v[1] = data != nullptr ? static_cast<std::int64_t>(data->dtype) : -1;
  fp.v[2] = count;
  fp.v[3] = root;
  fp.v[4] = op;
  fp.v[5] = seq;
  return fp;
}

inline std::string site_string(const CallSite& s) {
  if (!s.known) return "an unrecorded call site";
  if (s.has_outer) return concat(where(s.loc), " (inside the call at ", where(s.outer), ")");
  return where(s.loc);
}

inline std::string describe(const Fingerprint& f, const CallSite& site) {
  std::ostringstream os;
  auto coll = static_cast<Coll>(f.v[0]);
  os << name_of(coll) << " #" << f.v[5];
  if (coll != Coll::barrier) {
    os << " (" << (f.v[1] >= 0 ? name(static_cast<DType>(f.v[1])) : "?") << " x " << f.v[2];
    if (f.v[4] >= 0) os << ", op " << name(static_cast<ReduceOp>(f.v[4]));
    if (f.v[3] >= 0) os << ", root " << f.v[3];
    os << ")";
  }
  os << " at " << site_string(site);
  return os.str();
}

inline std::string seconds_string(double s) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << s << " s";
  return os.str();
}

inline constexpr int kTagQuery = 7101, kTagReply = 7102, kTagStall = 7103, kTagRefused = 7104, kTagLeft = 7105, kTagAccepted = 7106,
              kTagFailed = 7107;
inline constexpr int kTextBytes = 480;

// A rank's answer to a status query.
struct StatusMsg {
  std::int64_t started = 0;    // collectives entered (the current one is started - 1)
  std::int64_t completed = 0;  // collectives completed
  std::int32_t in_collective = 0;
  std::int32_t pad = 0;
  double stamp = 0;  // when it was answered (system clock, seconds): the straggler warning's timing
  char text[kTextBytes] = {};
};

// One rank's side of a fingerprint mismatch, gathered to every rank.
struct MismatchMsg {
  Fingerprint fp;
  char text[kTextBytes] = {};
};

inline void copy_text(char (&dst)[kTextBytes], const std::string& s) {
  std::size_t n = std::min(s.size(), static_cast<std::size_t>(kTextBytes - 1));
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}


// ---------------------------------------------------------------------------------------------
// CommMonitor
// ---------------------------------------------------------------------------------------------

// Set once any communicator of this process saw a stall or a refused collective (any_stall()).
inline std::atomic<bool> g_any_stall{false};
// The texts of notices whose sends were never waited for (a rank leaving, or a monitor going
// while a peer had not received yet): MPI may still read them, so they are kept for the life of
// the process (keep_for_process, mpi/keep_for_process.hpp).
// CollectiveScopes under a deadline, process-wide. While it is 0 no collective anywhere needs
// its polled form, which lets guarded_* skip the thread-local lookup (in code compiled as PIC a
// thread_local access is a call); while it is not, collectives take the slow path.
inline std::atomic<int> g_deadline_scopes{0};

/// The fingerprint check of a nonblocking collective: issued with it, completed in its wait, so
/// that checks do not serialise the buckets in flight.
struct DeferredCheck {
  Fingerprint fp;
  CallSite site;
  std::int64_t buf[2 * kFields] = {};
  MPI_Request req = MPI_REQUEST_NULL;
};


class CommMonitor final : public WaitHook {
 public:
  explicit CommMonitor(MPI_Comm comm);

  ~CommMonitor();

  // --- nonblocking requests ----------------------------------------------------------------------

  void add_pending(int d) noexcept { pending_.fetch_add(d); }
  int pending() const noexcept { return pending_.load(); }
  bool stalled() const noexcept { return stalled_.load(); }

  /// The nonblocking collective this monitor is issuing (for its request). Only the thread
  /// inside that collective's CollectiveScope calls this.
  const OpRecord& current_record() const noexcept { return issuing_; }

  /// Waits for the requests of a nonblocking collective, with the deadline and blame of a
  /// blocking one (the deadline counts from the start of the wait).
  int wait_request(std::vector<MPI_Request>& reqs, const OpRecord& op);

  /// MPI_Testall, with the error of the request that failed rather than MPI_ERR_IN_STATUS.
  static int testall(std::vector<MPI_Request>& reqs, int* flag);

  // --- called by CollectiveScope, on the thread running the collective --------------------------

  /// Whether a collective entered now may take the fast path: nothing to check, no deadline
  /// (and no collective under a deadline anywhere in the process, so that guarded_* calls can
  /// tell from one global counter that they need not look further), no fault to inject.
  bool fast_ok() const noexcept {
#if LOCKSTEP_FAULT_INJECTION
    if (fault_pending_) return false;
#endif
    return g_settings.quiet.load(std::memory_order_relaxed) && g_deadline_scopes.load(std::memory_order_relaxed) == 0;
  }

  /// The fast path of enter(), when fast_ok(): the collective takes its sequence number (and
  /// the stall check), nothing more. Nothing is recorded under the mutex and the clock is not
  /// read: the watchdog needs the current collective's record only to answer another rank whose
  /// deadline passed, which the settings (the same on every rank) rule out here; what it answers
  /// then is the counters and the operation and sequence number in fast_current_ / fast_last_.
  void enter_fast(Coll coll) {
    throw_if_stalled();
    // Only the thread running collectives on this communicator writes started_ and completed_
    // (one collective at a time, as MPI requires); the watchdog only reads them.
    const std::int64_t seq = started_.load(std::memory_order_relaxed);
    if (seq >= pending_min_seq_.load(std::memory_order_relaxed)) [[unlikely]] check_pending_refusal(seq);
    fast_current_.store(pack(seq, coll), std::memory_order_relaxed);
    started_.store(seq + 1, std::memory_order_relaxed);
    in_collective_.store(true, std::memory_order_relaxed);
    deadline_ = false;
    deadline_flag_.store(false, std::memory_order_relaxed);
  }

  /// The fast path of leave(), for a collective entered by enter_fast(). It counts the
  /// collective as completed even when it is left by an exception: telling the two apart costs
  /// two std::uncaught_exceptions() calls, about as much as the rest of the fast path, and the
  /// count only shows in the status text another rank prints after its deadline passed.
  void leave_fast() noexcept {
    in_collective_.store(false, std::memory_order_relaxed);
    fast_last_.store(fast_current_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    completed_.store(completed_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }

  /// Enters a collective; returns false if an injected skip fault says not to take part (never
  /// in a build without fault injection).
  bool enter(Coll coll, TensorView* data, std::int64_t count, int op, int root);

  void leave(bool ok);

  /// Whether the collective entered last on this monitor has a deadline (the timeout when it
  /// was entered; none on the fast path). Read by the thread inside that collective.
  bool has_deadline() const noexcept { return deadline_; }

  /// Polls `req` until it completes, the deadline passes (throws TimeoutError or aborts; no
  /// deadline when the timeout is 0), or another rank reports a stall (throws TimeoutError).
  int wait(MPI_Request* req) {
    return poll([req](int* flag) { return MPI_Test(req, flag, MPI_STATUS_IGNORE); });
  }

  template <class Test>
  int poll(Test&& test) {
    const double t = polled_timeout();
    double warn = t > 0 ? straggler_->after(t) : 0;  // the straggler warning (straggler.hpp)
    Clock::time_point deadline, warn_at;
    {
      std::lock_guard lock(mutex_);
      deadline = entered_ + after_seconds(t);
      warn_at = entered_ + after_seconds(warn);
    }
    for (std::uint64_t i = 0;; ++i) {
      int flag = 0;
      int rc = test(&flag);
      if (rc != MPI_SUCCESS || flag) return rc;
      throw_if_stalled();
      // Spin briefly (most collectives finish within microseconds), then yield the core, which
      // matters when ranks outnumber cores.
      if (i > 2000) {
        if (t > 0 && (i & 63) == 0 && Clock::now() > deadline) on_deadline(t);
        if (warn > 0 && (i & 63) == 0 && Clock::now() > warn_at) {
          look_for_stragglers(t, warn);
          warn = 0;
        }
        std::this_thread::yield();
      }
    }
  }

  /// Records the nonblocking collective just entered by enter_fast() for its request.
  void record_issuing(Coll coll, const TensorView* data, std::int64_t count, int op, int root) noexcept {
    const std::int64_t seq = started_.load(std::memory_order_relaxed) - 1;
    const Fingerprint fp = fingerprint_of(coll, data, count, root, op, seq);
    std::copy(std::begin(fp.v), std::end(fp.v), issuing_.v);
    issuing_.site = t_call_site;
  }

  void throw_if_stalled();
  [[noreturn, gnu::noinline]] void throw_stalled();

  /// See detail::wait_point().
  void wait_point();
  /// The shared-memory path's waits call it (see detail::as_wait_hook()).
  void at_wait() override { wait_point(); }
#if LOCKSTEP_FAULT_INJECTION
  /// See detail::exchange_point().
  void exchange_point();
#endif

  /// Marks this communicator unusable: every later collective throws `msg` (a MismatchError
  /// when `refused`, a TimeoutError otherwise). `stall`: a rank stopped answering (then finalize
  /// must not wait for it: any_stall()).
  void mark_unusable(const std::string& msg, bool refused, bool stall = true, int mpi_code = 0,
                     bool peer_left = false);
  /// Unusable because of a stall or a refused collective (not merely because a peer left, which
  /// leaves nothing in flight on this communicator).
  bool stalled_for_real() const noexcept { return stalled_for_real_.load(); }

  /// Tells every other rank that this one is finalising: a rank still waiting in a collective
  /// on this communicator would wait for it forever.
  void announce_leaving();

  /// See detail::report_mpi_error(): an MPI error in a collective on this rank. The other ranks
  /// may be inside the same collective, waiting for data that will never come (until their
  /// deadline, if nobody told them): they are told, as of a stall, and throw MpiError naming
  /// this rank and its error; this communicator is unusable here too (its next collective would
  /// wait for ranks that throw).
  void on_local_mpi_error(const std::string& what, int code);

  /// The watchdog received another rank's MPI error ("<code>\n<message>").
  void on_failure_notice(const std::string& text);

  /// See detail::abandon_collective().
  void abandon(Coll coll, std::int64_t count, int dtype, int reduce_op, int root, const char* message);

  /// The watchdog received "rank R accepted collective #seq, which this rank refused".
  void on_accepted_reply(const std::string& text);

  /// Tells rank `to` that this rank accepted collective #seq, which `to` refused.
  void reply_accepted(int to, std::int64_t seq);

  /// The watchdog received "rank R refused collective #seq".
  void on_refusal_notice(const std::string& text, int source);

  bool refused_here(std::int64_t seq) const;  // under mutex_

  void update_pending_min();  // under mutex_

  /// This rank is about to enter collective #seq (or a later one) that another rank refused.
  [[gnu::noinline]] void check_pending_refusal(std::int64_t seq);

 private:
  bool should_check(const CallSite& site);

  // --- fingerprints ------------------------------------------------------------------------------

  void compare_fingerprints(const Fingerprint& fp, const CallSite& site);

  static void fill_check_buffer(const Fingerprint& fp, std::int64_t* buf);
  static bool agree(const std::int64_t* buf);

 public:
  std::unique_ptr<DeferredCheck> take_deferred() { return std::move(deferred_); }

  /// Completes a deferred check; throws MismatchError on every rank if the fingerprints differ
  /// (the communicator is then unusable: the data operation was already issued).
  void finish_deferred(DeferredCheck& d);

 private:
  // Records, under mutex_, that this thread is inside the collective `fp` called at `site` (what
  // the watchdog answers other ranks' status queries with): in its fingerprint check or not, in
  // the wait for a nonblocking request or not.
  void record_entered(const Fingerprint& fp, const CallSite& site, bool checking, bool waiting);

  void start_deferred(const Fingerprint& fp, const CallSite& site);

  [[noreturn]] void report_mismatch(const Fingerprint& fp, const CallSite& site, bool nothing_moved = true);

  // Runs a small allreduce on the fingerprint communicator, with the deadline if there is one.
  // Always the nonblocking form, polled: with nonblocking buckets in flight (as
  // DistributedOptimizer has), a blocking MPI_Allreduce here slows the whole gradient sync down
  // (docs/performance/rounds.md, "Reliability defaults").
  // send and recv lie in `owner`, kept for the process if the wait throws with the request pending.
  void run(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op, const char* what,
           std::shared_ptr<void> owner);

  // --- stall handling ----------------------------------------------------------------------------

  StatusMsg my_status();

  static std::int64_t pack(std::int64_t seq, Coll coll) noexcept {
    return seq * 16 + static_cast<std::int64_t>(coll);
  }
  static std::string describe_unrecorded(std::int64_t packed);

  [[noreturn]] void on_deadline(double t);

  // The straggler warning's look (straggler.hpp), `warn` s into a collective with deadline t.
  void look_for_stragglers(double t, double warn);

  // Asks every other rank's watchdog for its status; waits at most a few seconds (give_up) for
  // answers. `arrived`: when each answer arrived (straggler_clock_now()).
  void query_all(std::vector<StatusMsg>& st, std::vector<bool>& answered, double give_up_s = 3,
                 std::vector<double>* arrived = nullptr);

  // Tells every other rank about the stall, so that ranks waiting elsewhere or outside any
  // collective throw too instead of hanging.
  void notify_all(const std::string& msg, int tag = kTagStall, bool leaving = false);

  // The statuses of every rank, as report lines, with the ranks that did not answer named.
  std::string status_lines();

  // Run by the watchdog thread every few milliseconds: ends the job when the thread running
  // collectives has been blocked inside one collective past the default deadline, or, after
  // another rank reported a stall or a refused collective, inside a wait that cannot be
  // interrupted (a blocking MPI call without a polled deadline).
  void check_blocked();

  // A peer left after taking part in `after` collectives ("<after> <message>"). This rank is
  // unusable from its first collective the peer did not take part in; until it has completed
  // those the peer did (a slow link can leave this rank's last one in progress after the peer
  // has finished it and left), the notice waits. Watchdog thread only.
  void on_left_notice(const std::string& text);
  void apply_left_notice();

  void watchdog_loop();

  static void check_mpi(int rc, const char* what);

  int rank_ = 0, size_ = 1;
  std::vector<std::string> hosts_;  // every rank's host name (MPI_Get_processor_name)
  std::unique_ptr<StragglerWatch> straggler_;

  // "ranks 2, 3 (host b)" / "ranks 1 (host a), 4 (host b)": the ranks with their hosts.
  std::string ranks_on_hosts(const std::vector<int>& ranks) const;
  // The hosts none of whose ranks answered, where the ranks span more than one host.
  std::vector<std::string> lost_hosts(const std::vector<int>& silent) const;
  std::uint64_t comm_id_ = 0;  // the same on every rank of the communicator (see the constructor)
  MPI_Comm check_ = MPI_COMM_NULL, ctrl_ = MPI_COMM_NULL;
  std::thread watchdog_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> stalled_{false};
  std::atomic<int> pending_{0};
  // Touched only by the thread running the collective (not the watchdog).
#if LOCKSTEP_FAULT_INJECTION
  bool fault_pending_ = false;  // an injected fault is still to hit this rank
  bool exchange_fault_ = false;  // a freeze_exchange fault is still to hit this rank
#endif
  bool deadline_ = false;       // see has_deadline()
  OpRecord issuing_;            // see current_record()

  // Written by the thread running the collective, read by the watchdog: atomics, because the
  // fast path writes them without the mutex (the slow paths write them under it).
  std::atomic<std::int64_t> started_{0}, completed_{0};
  std::atomic<bool> in_collective_{false};
  // pack(seq, coll) of the collective entered / last completed on the fast path, or -1 when the
  // record under the mutex (current_ / last_) describes it.
  std::atomic<std::int64_t> fast_current_{-1}, fast_last_{-1};
  // For the watchdog's check_blocked(): plain waits of nonblocking requests (count, and whether
  // one is in progress), wait points passed (the shared-memory path's polls), and whether the
  // current collective has a polled deadline (it then throws by itself).
  std::atomic<std::int64_t> waits_{0}, wait_points_{0};
  std::atomic<bool> in_plain_wait_{false}, deadline_flag_{false};
  // Touched only by the watchdog thread.
  std::int64_t wd_started_ = -1, wd_completed_ = -1, wd_waits_ = -1, wd_points_ = -1;
  std::int64_t left_after_ = -1;  // see on_left_notice(); -1: no notice waiting
  std::string left_message_;
  Clock::time_point wd_since_ = Clock::now();
  // Touched only by the thread running the collective.
  Clock::time_point deadline_at_{};

  std::mutex mutex_;  // guards everything below (read by the watchdog thread)
  bool checking_ = false, waiting_request_ = false;
  Fingerprint current_, last_;
  CallSite current_site_, last_site_;
  Clock::time_point since_ = Clock::now(), entered_ = Clock::now();
  std::unordered_map<std::uint64_t, int> site_calls_;
  std::string stall_message_;
  std::map<std::int64_t, std::int64_t> refused_by_me_;    // collectives this rank refused: runs first -> last
  std::map<std::int64_t, std::string> pending_refusals_;  // refused elsewhere, not reached here
  std::map<std::int64_t, std::vector<int>> pending_sources_;  // who refused those
  std::map<std::int64_t, std::set<int>> confirmations_;   // ranks that refused what this one refused
  std::set<std::int64_t> accepted_by_peer_;                // refused here, accepted by another rank
  std::atomic<int> urgent_{0};  // > 0 while the collective thread waits for answers to a refusal
  std::atomic<std::int64_t> pending_min_seq_{INT64_MAX};  // first key of pending_refusals_
  bool refused_ = false;   // the communicator became unusable through a refused collective
  bool reason_is_peer_left_ = false;  // ... because a peer left (see mark_unusable)
  int mpi_code_ = 0;       // ... through an MPI error (here or on another rank): its code
  std::string own_failure_notice_;  // the notice of an MPI error on this rank (announce_leaving)
  std::string refusal_;    // this rank's refusal message during abandon()'s fingerprint exchange
  // Notices sent and not yet known to be delivered, with their text (see notify_all).
  struct Notice {
    std::vector<MPI_Request> reqs;
    std::unique_ptr<std::string> text;
  };
  std::atomic<bool> stalled_for_real_{false};  // see stalled_for_real()
  std::mutex notices_mutex_;
  std::deque<Notice> notices_;
  std::unique_ptr<DeferredCheck> deferred_;  // the check of the nonblocking collective being issued
};

}  // namespace detail
}  // namespace lockstep
