// The monitor of a communicator (monitor.hpp): collective fingerprints, stall timeouts with
// blame, over MPI. The settings it reads are the reliability layer's
// (src/reliability/settings.cpp). In a build with LOCKSTEP_FAULT_INJECTION (the tests' builds) it
// also injects the faults of LOCKSTEP_FAULT (src/reliability/fault.cpp); without it, the code
// between `#if LOCKSTEP_FAULT_INJECTION` and `#endif` below does not exist, and the fast path has
// no fault check at all.
// The design in short:
// - each monitored communicator gets two duplicates: `check_` for the fingerprint exchange (so a
//   fingerprint can never be matched against a data collective) and `ctrl_` for status queries;
// - a watchdog thread per communicator answers status queries and receives stall notices; it
//   polls with MPI_Iprobe every few milliseconds rather than blocking in MPI_Recv, because a
//   blocked receive spins a core in Open MPI;
// - with a deadline, blocking collectives run as their nonblocking form polled with MPI_Test, so
//   that a stalled rank can give up and throw instead of waiting forever.
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

#include "lockstep/core/errors.hpp"
#include "lockstep/reliability/settings.hpp"
#include "mpi/monitor.hpp"
#include "mpi/straggler.hpp"
#include "reliability/settings_state.hpp"
#if LOCKSTEP_FAULT_INJECTION
#include "reliability/fault.hpp"
#endif

namespace lockstep {
namespace detail {

// ---------------------------------------------------------------------------------------------
// Fingerprints and descriptions
// ---------------------------------------------------------------------------------------------
namespace {

const char* name_of(Coll c) {
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
constexpr int kFields = 7;
const char* const kFieldNames[kFields] = {"operation", "dtype", "element count", "root", "reduce op",
                                          "sequence number", "validity of the arguments"};

struct Fingerprint {
  // coll, dtype, count, root, op, seq, arguments accepted (1) or refused (0) by the front end
  std::int64_t v[kFields] = {-1, -1, -1, -1, -1, -1, 1};
};

Fingerprint fingerprint_of(Coll coll, const TensorView* data, std::int64_t count, int root, int op,
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

std::string site_string(const CallSite& s) {
  if (!s.known) return "an unrecorded call site";
  if (s.has_outer) return concat(where(s.loc), " (inside the call at ", where(s.outer), ")");
  return where(s.loc);
}

std::string describe(const Fingerprint& f, const CallSite& site) {
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

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << (ranks.size() == 1 ? "rank " : "ranks ");
  for (std::size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  return os.str();
}

std::string seconds_string(double s) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << s << " s";
  return os.str();
}

using Clock = std::chrono::steady_clock;

// A deadline's distance as a clock duration. Capped at 10^9 s (about 32 years): a timeout the
// parser accepts, such as LOCKSTEP_TIMEOUT=1e300, overflowed the clock's 64-bit nanosecond count
// (the conversion gave a negative duration), so every collective timed out at once.
Clock::duration after_seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::min(s, 1e9)));
}

constexpr int kTagQuery = 7101, kTagReply = 7102, kTagStall = 7103, kTagRefused = 7104, kTagLeft = 7105, kTagAccepted = 7106,
              kTagFailed = 7107;
constexpr int kTextBytes = 480;

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

void copy_text(char (&dst)[kTextBytes], const std::string& s) {
  std::size_t n = std::min(s.size(), static_cast<std::size_t>(kTextBytes - 1));
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Settings agreed across ranks
// ---------------------------------------------------------------------------------------------

std::optional<bool> settings_shm() { return settings().shm; }
std::optional<std::uint64_t> settings_shm_slice_bytes() { return settings().shm_slice; }
std::optional<std::uint64_t> settings_shm_min_bytes() { return settings().shm_min; }
std::optional<bool> settings_cuda_aware_mpi() { return settings().cuda_aware; }

void agree_on_settings(MPI_Comm comm) {
  Settings& s = loaded_settings();
  // What this rank has: its error, or its settings; both as text, with a hash to compare.
  struct Entry {
    std::int32_t ok;
    std::int32_t pad;
    std::uint64_t hash;
    char text[kTextBytes];
  };
  Entry mine{};
  mine.ok = s.env_error.empty() ? 1 : 0;
  const std::string& text = mine.ok ? s.canonical : s.env_error;
  mine.hash = hash_bytes(text.data(), text.size());
  copy_text(mine.text, text);
  int size = 1, rank = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  std::vector<Entry> all(static_cast<std::size_t>(size));
  if (int rc = MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, comm);
      rc != MPI_SUCCESS)
    throw MpiError(concat("lockstep: MPI_Allgather of the settings failed", rank_suffix()), rc);
  std::vector<int> bad;
  for (int r = 0; r < size; ++r)
    if (!all[r].ok) bad.push_back(r);
  if (!bad.empty()) {
    std::ostringstream os;
    os << "lockstep: a LOCKSTEP_* setting is malformed on " << rank_list(bad) << ", so every rank stops here:";
    for (int r : bad) os << "\n  rank " << r << ": " << all[r].text;
    throw InvalidArgument(os.str() + rank_suffix());
  }
  bool same = true;
  for (int r = 1; r < size; ++r) same = same && all[r].hash == all[0].hash;
  if (!same) {
    std::ostringstream os;
    os << "lockstep: the ranks disagree on their LOCKSTEP_* settings (they must be the same on every rank; set "
          "them for the whole job, e.g. mpiexec -x VAR):";
    for (int r = 0; r < size; ++r) os << "\n  rank " << r << ": " << all[r].text;
    throw InvalidArgument(os.str() + rank_suffix());
  }
}


// ---------------------------------------------------------------------------------------------
// CommMonitor
// ---------------------------------------------------------------------------------------------

namespace {
// Set once any communicator of this process saw a stall or a refused collective (any_stall()).
std::atomic<bool> g_any_stall{false};
// The texts of notices whose sends were never waited for (a rank leaving, or a monitor going
// while a peer had not received yet): MPI may still read them, so they are kept for the life of
// the process, reachable from this global (so that leak checkers do not report them).
std::mutex g_kept_texts_mutex;
std::vector<std::unique_ptr<std::string>>* g_kept_texts = nullptr;
void keep_for_process(std::unique_ptr<std::string> text) {
  std::lock_guard lock(g_kept_texts_mutex);
  if (!g_kept_texts) g_kept_texts = new std::vector<std::unique_ptr<std::string>>();
  g_kept_texts->push_back(std::move(text));
}
// CollectiveScopes under a deadline, process-wide. While it is 0 no collective anywhere needs
// its polled form, which lets guarded_* skip the thread-local lookup (in code compiled as PIC a
// thread_local access is a call); while it is not, collectives take the slow path.
std::atomic<int> g_deadline_scopes{0};
}  // namespace

/// The fingerprint check of a nonblocking collective: issued with it, completed in its wait, so
/// that checks do not serialise the buckets in flight.
struct DeferredCheck {
  Fingerprint fp;
  CallSite site;
  std::int64_t buf[2 * kFields] = {};
  MPI_Request req = MPI_REQUEST_NULL;
};

namespace {

/// LOCKSTEP_REPORT_DIR (set by lockstep-run): the rank that detects a stall writes
/// DIR/blame.WORLDRANK there, a few lines a launcher reads to find the lost hosts:
///   rank W / host H / silent R... / behind R... / message TEXT
/// (ranks of MPI_COMM_WORLD). Written to a temporary name and renamed: a reader sees all of it
/// or nothing. Best effort: a failure to write it changes nothing else.
void write_blame_report(MPI_Comm comm, const std::vector<int>& silent, const std::vector<int>& behind,
                        const std::string& msg) noexcept {
  try {
    const char* dir = std::getenv("LOCKSTEP_REPORT_DIR");
    if (dir == nullptr || *dir == '\0') return;
    MPI_Group group, world;
    MPI_Comm_group(comm, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    auto to_world = [&](const std::vector<int>& ranks) {
      std::vector<int> out(ranks.size(), MPI_UNDEFINED);
      if (!ranks.empty())
        MPI_Group_translate_ranks(group, static_cast<int>(ranks.size()), ranks.data(), world, out.data());
      std::string line;
      for (int r : out) {
        line.push_back(' ');
        line.append(r == MPI_UNDEFINED ? std::string("?") : std::to_string(r));
      }
      return line;
    };
    const std::string silent_line = to_world(silent), behind_line = to_world(behind);
    MPI_Group_free(&group);
    MPI_Group_free(&world);
    int me = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "unknown");
    std::string first = msg.substr(0, msg.find('\n'));
    const std::string text = concat("rank ", me, "\nhost ", host, "\nsilent", silent_line, "\nbehind", behind_line,
                                    "\nmessage ", first, "\n");
    const std::string path = concat(dir, "/blame.", me);
    const std::string tmp = concat(path, ".tmp.", ::getpid());
    FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr) return;
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) std::remove(tmp.c_str());
  } catch (...) {
  }
}

}  // namespace

class CommMonitor {
 public:
  explicit CommMonitor(MPI_Comm comm) {
    MPI_Comm_rank(comm, &rank_);
    MPI_Comm_size(comm, &size_);
    check_mpi(MPI_Comm_dup(comm, &check_), "MPI_Comm_dup(fingerprint communicator)");
    check_mpi(MPI_Comm_dup(comm, &ctrl_), "MPI_Comm_dup(status communicator)");
    MPI_Comm_set_errhandler(check_, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(ctrl_, MPI_ERRORS_RETURN);
    // An identity for this communicator's notices: a notice that no watchdog received before its
    // communicator was freed can be matched on a later communicator that MPI gives the same
    // context; the identity lets that watchdog drop it.
    if (rank_ == 0) {
      std::random_device rd;
      comm_id_ = (static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^
                 static_cast<std::uint64_t>(Clock::now().time_since_epoch().count());
    }
    check_mpi(MPI_Bcast(&comm_id_, 1, MPI_UINT64_T, 0, ctrl_), "MPI_Bcast(monitor identity)");
    // Every rank's host name, once: a stall report names the host of each rank it blames, and
    // a host none of whose ranks answers as lost (across hosts, the thing to replace).
    {
      constexpr int kSlot = 64;
      char mine[kSlot] = {};
      char name_buf[MPI_MAX_PROCESSOR_NAME] = {};
      int len = 0;
      if (MPI_Get_processor_name(name_buf, &len) != MPI_SUCCESS || len <= 0) std::strcpy(name_buf, "unknown");
      std::strncpy(mine, name_buf, kSlot - 1);
      std::vector<char> all(static_cast<std::size_t>(kSlot) * static_cast<std::size_t>(size_));
      check_mpi(MPI_Allgather(mine, kSlot, MPI_CHAR, all.data(), kSlot, MPI_CHAR, ctrl_),
                "MPI_Allgather(host names)");
      hosts_.resize(static_cast<std::size_t>(size_));
      for (int r = 0; r < size_; ++r)
        hosts_[static_cast<std::size_t>(r)] = std::string(all.data() + static_cast<std::size_t>(r) * kSlot,
                                                          strnlen(all.data() + static_cast<std::size_t>(r) * kSlot, kSlot));
    }
    (void)settings();  // a bad environment variable fails at creation, on every rank alike
    straggler_ = std::make_unique<StragglerWatch>(rank_, hosts_);
#if LOCKSTEP_FAULT_INJECTION
    const FaultSpec& f = fault_spec();
    fault_pending_ = f.kind != FaultKind::none && f.rank == rank_;
#endif
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    // Without MPI_THREAD_MULTIPLE there is no watchdog; a timed-out rank then names the ranks
    // that did not answer instead of what they were doing.
    if (provided == MPI_THREAD_MULTIPLE) watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~CommMonitor() {
    stop_ = true;
    if (watchdog_.joinable()) watchdog_.join();
    int fin = 0;
    MPI_Finalized(&fin);
    // After a stall, requests abandoned on these communicators may still be progressed by MPI
    // (in MPI_Finalize too); they are leaked rather than freed under those requests.
    // Notices still in flight are not waited for (their peer may be gone): their requests are
    // freed and their text is kept for the life of the process (keep_for_process), as MPI may
    // still read it.
    for (auto& n : notices_) {
      if (fin) {
        keep_for_process(std::move(n.text));
        continue;
      }
      int done = 0;
      MPI_Testall(static_cast<int>(n.reqs.size()), n.reqs.data(), &done, MPI_STATUSES_IGNORE);
      if (done) continue;
      for (auto& req : n.reqs)
        if (req != MPI_REQUEST_NULL) MPI_Request_free(&req);
      keep_for_process(std::move(n.text));
    }
    if (!fin && !stalled_) {
      MPI_Comm_free(&check_);
      MPI_Comm_free(&ctrl_);
    }
  }

  // --- nonblocking requests ----------------------------------------------------------------------

  void add_pending(int d) noexcept { pending_.fetch_add(d); }
  int pending() const noexcept { return pending_.load(); }
  bool stalled() const noexcept { return stalled_.load(); }

  /// The nonblocking collective this monitor is issuing (for its request). Only the thread
  /// inside that collective's CollectiveScope calls this.
  const OpRecord& current_record() const noexcept { return issuing_; }

  /// Waits for the requests of a nonblocking collective, with the deadline and blame of a
  /// blocking one (the deadline counts from the start of the wait).
  int wait_request(std::vector<MPI_Request>& reqs, const OpRecord& op) {
    throw_if_stalled();
    const double t = polled_timeout();
    if (t <= 0) {
      // No polled deadline: the watchdog times this wait (the default deadline). It is polled
      // all the same (MPI_Waitall spins in Open MPI's progress engine too), so that an error or
      // a stall reported by another rank ends it with an exception here instead of a wait that
      // cannot be interrupted (which the watchdog could only end by ending the job).
      waits_.fetch_add(1, std::memory_order_relaxed);
      in_plain_wait_.store(true, std::memory_order_relaxed);
      struct Done {
        std::atomic<bool>& f;
        ~Done() { f.store(false, std::memory_order_relaxed); }
      } done{in_plain_wait_};
      for (std::uint64_t i = 0;; ++i) {
        int flag = 0;
        const int rc = testall(reqs, &flag);
        if (rc != MPI_SUCCESS || flag) return rc;
        throw_if_stalled();
        if (i > 2000) std::this_thread::yield();
      }
    }
    {
      Fingerprint fp;
      std::copy(std::begin(op.v), std::end(op.v), fp.v);
      std::lock_guard lock(mutex_);
      record_entered(fp, op.site, /*checking=*/false, /*waiting=*/true);
    }
    int rc = poll([&](int* flag) { return testall(reqs, flag); });
    std::lock_guard lock(mutex_);
    in_collective_ = false;
    waiting_request_ = false;
    since_ = Clock::now();
    return rc;
  }

  /// MPI_Testall, with the error of the request that failed rather than MPI_ERR_IN_STATUS.
  static int testall(std::vector<MPI_Request>& reqs, int* flag) {
    // On the stack for the usual request or two (this runs in a polling loop).
    MPI_Status small[4];
    std::vector<MPI_Status> large;
    if (reqs.size() > 4) large.resize(reqs.size());
    MPI_Status* sts = reqs.size() > 4 ? large.data() : small;
    const int rc = MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), flag, sts);
    if (rc == MPI_ERR_IN_STATUS)
      for (std::size_t i = 0; i < reqs.size(); ++i)
        if (sts[i].MPI_ERROR != MPI_SUCCESS && sts[i].MPI_ERROR != MPI_ERR_PENDING) return sts[i].MPI_ERROR;
    return rc;
  }

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
  bool enter(Coll coll, TensorView* data, std::int64_t count, int op, int root) {
    // Only this thread writes started_, so reading it here needs no lock; one lock per
    // collective keeps this path cheap too.
    const std::int64_t seq = started_.load(std::memory_order_relaxed);
#if LOCKSTEP_FAULT_INJECTION
    // Fault injection happens before the rank counts as inside the collective, so that a delayed
    // rank looks like a rank that has not arrived yet (which is what it simulates).
    if (fault_pending_ && seq == fault_spec().after) {
      fault_pending_ = false;
      if (!inject_fault(fault_spec(), rank_, seq, name_of(coll), data, count)) return false;
    }
#endif
    throw_if_stalled();

    if (seq >= pending_min_seq_.load(std::memory_order_relaxed)) check_pending_refusal(seq);
    Fingerprint fp = fingerprint_of(coll, data, count, root, op, seq);
    const CallSite site = t_call_site;
    const bool check = should_check(site);
    deadline_ = polled_timeout() > 0;
    deadline_flag_.store(deadline_, std::memory_order_relaxed);
    if (coll == Coll::iallreduce || coll == Coll::ibroadcast) {
      std::copy(std::begin(fp.v), std::end(fp.v), issuing_.v);
      issuing_.site = site;
    }
    {
      std::lock_guard lock(mutex_);
      started_.store(seq + 1, std::memory_order_relaxed);
      record_entered(fp, site, check, /*waiting=*/false);
      deadline_at_ = entered_ + after_seconds(deadline_ ? polled_timeout() : 0.0);
    }
    if (check) {
      if (coll == Coll::iallreduce || coll == Coll::ibroadcast) start_deferred(fp, site);
      else compare_fingerprints(fp, site);
      std::lock_guard lock(mutex_);
      checking_ = false;
    }
    return true;
  }

  void leave(bool ok) {
    std::lock_guard lock(mutex_);
    in_collective_ = false;
    if (ok) {
      completed_.store(completed_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      last_ = current_;
      last_site_ = current_site_;
      fast_last_ = -1;
    }
    since_ = Clock::now();
  }

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

  void throw_if_stalled() {
    if (stalled_.load(std::memory_order_acquire)) [[unlikely]] throw_stalled();
  }
  [[noreturn, gnu::noinline]] void throw_stalled() {
    std::string msg;
    bool refused;
    int mpi_code;
    {
      std::lock_guard lock(mutex_);
      msg = stall_message_;
      refused = refused_;
      mpi_code = mpi_code_;
    }
    if (mpi_code != 0) throw MpiError(msg, mpi_code);
    if (refused) throw MismatchError(msg);
    throw TimeoutError(msg);
  }

  /// See detail::wait_point().
  void wait_point() {
    wait_points_.fetch_add(1, std::memory_order_relaxed);
    throw_if_stalled();
    if (deadline_ && Clock::now() > deadline_at_) on_deadline(polled_timeout());
  }

  /// Marks this communicator unusable: every later collective throws `msg` (a MismatchError
  /// when `refused`, a TimeoutError otherwise). `stall`: a rank stopped answering (then finalize
  /// must not wait for it: any_stall()).
  void mark_unusable(const std::string& msg, bool refused, bool stall = true, int mpi_code = 0) {
    {
      std::lock_guard lock(mutex_);
      if (!stalled_) {
        stall_message_ = msg;
        refused_ = refused;
        mpi_code_ = mpi_code;
      }
    }
    stalled_.store(true, std::memory_order_release);
    if (stall) {
      g_any_stall.store(true);
      stalled_for_real_.store(true);
    }
  }
  /// Unusable because of a stall or a refused collective (not merely because a peer left, which
  /// leaves nothing in flight on this communicator).
  bool stalled_for_real() const noexcept { return stalled_for_real_.load(); }

  /// Tells every other rank that this one is finalising: a rank still waiting in a collective
  /// on this communicator would wait for it forever.
  void announce_leaving() {
    if (size_ == 1) return;
    std::string failure;
    {
      std::lock_guard lock(mutex_);
      failure = own_failure_notice_;
    }
    // After an MPI error here, the notice of leaving is that error again: the first notice may
    // not have been read yet, and "rank R has left" must not hide the reason.
    if (!failure.empty()) {
      notify_all(failure, kTagFailed, /*leaving=*/true);
      return;
    }
    // Led by the number of collectives this rank took part in: a peer still finishing one of
    // those (its last data in flight on a slow link) can complete it (see on_left_notice).
    notify_all(concat(started_.load(), " lockstep: rank ", rank_,
                      " has left (it finalised Lockstep or returned from main) "
                      "while this rank still uses the communicator; collectives on it can no longer complete"),
               kTagLeft);
  }

  /// See detail::report_mpi_error(): an MPI error in a collective on this rank. The other ranks
  /// may be inside the same collective, waiting for data that will never come (they used to
  /// wait for the default deadline): they are told, as of a stall, and throw MpiError naming
  /// this rank and its error; this communicator is unusable here too (its next collective would
  /// wait for ranks that throw).
  void on_local_mpi_error(const std::string& what, int code) {
    {
      std::lock_guard lock(mutex_);
      if (stalled_.load()) return;  // already unusable (this error may be another rank's, rethrown)
    }
    const std::string text = what.rfind("lockstep: ", 0) == 0 ? what.substr(10) : what;
    const std::string notice =
        concat(code, "\nlockstep: rank ", rank_, "/", size_, " failed in MPI, so this rank stops too: ", text);
    {
      std::lock_guard lock(mutex_);
      own_failure_notice_ = notice;
    }
    if (size_ > 1) notify_all(notice, kTagFailed);
    mark_unusable(concat("lockstep: this communicator is unusable after an MPI error on this rank: ", text), false,
                  true, code);
  }

  /// The watchdog received another rank's MPI error ("<code>\n<message>").
  void on_failure_notice(const std::string& text) {
    const auto nl = text.find('\n');
    int code = nl == std::string::npos ? 0 : static_cast<int>(std::strtol(text.c_str(), nullptr, 10));
    if (code == 0) code = MPI_ERR_OTHER;
    mark_unusable((nl == std::string::npos ? text : text.substr(nl + 1)) + rank_suffix(), false, true, code);
  }

  /// See detail::abandon_collective().
  void abandon(Coll coll, std::int64_t count, int dtype, int reduce_op, int root, const char* message) {
    if (stalled_.load()) return;  // already unusable: the caller's own error is what matters
    const std::int64_t seq = started_.load(std::memory_order_relaxed);
    Fingerprint fp;
    fp.v[0] = static_cast<std::int64_t>(coll);
    fp.v[1] = dtype;
    fp.v[2] = count;
    fp.v[3] = root;
    fp.v[4] = reduce_op;
    fp.v[5] = seq;
    fp.v[6] = 0;
    const CallSite site = t_call_site;
    if (size_ > 1 && should_check(site)) {
      // A checked call: the peers are about to compare fingerprints with this one; this rank's
      // is marked refused, so every rank throws the same MismatchError and no data moves.
      {
        std::lock_guard lock(mutex_);
        started_.store(seq + 1, std::memory_order_relaxed);
        record_entered(fp, site, /*checking=*/true, /*waiting=*/false);
        refusal_ = message;
      }
      try {
        compare_fingerprints(fp, site);
      } catch (const MismatchError& e) {
        {
          std::lock_guard lock(mutex_);
          in_collective_ = checking_ = false;
          refusal_.clear();
        }
        // A nonblocking collective's peers issue their data operation right after the check
        // (they see the mismatch only in wait()), so it is pending on their communicator, which
        // they mark unusable: this rank's is no better (its next collective would meet that
        // operation, or wait for peers that now throw at every collective).
        if (coll == Coll::iallreduce || coll == Coll::ibroadcast)
          mark_unusable(concat("lockstep: this communicator is unusable after a refused nonblocking collective "
                               "(the other ranks had issued theirs): ", e.what()),
                        true, false);
        throw;
      }
      std::lock_guard lock(mutex_);
      in_collective_ = checking_ = false;
      refusal_.clear();
      return;
    }
    if (size_ == 1) return;
    // Unchecked: this rank takes the collective's sequence number without communicating and
    // tells the others which collective it refused. A rank that refused the same one (the same
    // bad arguments everywhere) ignores the notice, and the backend stays usable; a rank that
    // accepted it cannot complete it (and may have sent data that would be read by a later
    // collective), so that rank's communicator becomes unusable (see on_refusal_notice).
    {
      std::lock_guard lock(mutex_);
      started_.store(seq + 1, std::memory_order_relaxed);
      completed_.store(completed_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      // Runs of consecutive refusals are one entry: after thousands of refusals in a row a late
      // notice for an early one must still be recognised (a set of the last 4096 numbers forgot
      // it, and the rank then marked its communicator unusable although nothing had moved).
      if (!refused_by_me_.empty() && refused_by_me_.rbegin()->second + 1 == seq) refused_by_me_.rbegin()->second = seq;
      else refused_by_me_.emplace(seq, seq);
      if (refused_by_me_.size() > 4096) refused_by_me_.erase(refused_by_me_.begin());
      // Ranks whose notice for this collective came before this rank reached it refused it too.
      for (int src : pending_sources_[seq]) confirmations_[seq].insert(src);
      pending_sources_.erase(seq);
      pending_refusals_.erase(seq);
      update_pending_min();
    }
    std::string msg = concat("lockstep: rank ", rank_, " refused its arguments to ", describe(fp, site), ": ",
                             message);
    notify_all(concat(seq, "\n", msg), kTagRefused);
    // Before this rank may communicate again, every other rank must have answered for this
    // collective: refused it too (its own notice; then nothing moved anywhere and the backend
    // stays usable), or accepted it (then it may be inside it, and this rank's next collective
    // would complete it with the wrong data: the communicator becomes unusable here too).
    const double limit = polled_timeout() > 0 ? polled_timeout() : watchdog_timeout() > 0 ? watchdog_timeout() : 1e9;
    const auto give_up = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(std::min(limit, 1e9)));
    std::string why;
    urgent_.fetch_add(1);  // the watchdog polls fast while this rank waits for the answers
    struct Calm {
      std::atomic<int>& u;
      ~Calm() { u.fetch_sub(1); }
    } calm{urgent_};
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (accepted_by_peer_.count(seq) != 0) {
          why = "another rank accepted its arguments to that collective";
        } else if (static_cast<int>(confirmations_[seq].size()) == size_ - 1) {
          confirmations_.erase(seq);
          return;  // refused everywhere
        }
      }
      if (why.empty() && stalled_.load()) return;  // unusable already (a stall or a notice)
      if (why.empty() && Clock::now() > give_up) why = "not every rank answered within the deadline";
      if (!why.empty()) break;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    {
      std::lock_guard lock(mutex_);
      confirmations_.erase(seq);
      accepted_by_peer_.erase(seq);
    }
    mark_unusable(concat("lockstep: this communicator is unusable: this rank refused its arguments to ",
                         describe(fp, site), " and ", why, " (", message, ")"),
                  true, false);
  }

  /// The watchdog received "rank R accepted collective #seq, which this rank refused".
  void on_accepted_reply(const std::string& text) {
    const std::int64_t seq = std::strtoll(text.c_str(), nullptr, 10);
    std::lock_guard lock(mutex_);
    accepted_by_peer_.insert(seq);
  }

  /// Tells rank `to` that this rank accepted collective #seq, which `to` refused.
  void reply_accepted(int to, std::int64_t seq) {
    std::lock_guard lock(notices_mutex_);
    auto text = std::make_unique<std::string>(concat(comm_id_, " ", seq));
    MPI_Request req;
    if (MPI_Isend(text->data(), static_cast<int>(text->size()), MPI_CHAR, to, kTagAccepted, ctrl_, &req) ==
        MPI_SUCCESS) {
      Notice n;
      n.text = std::move(text);
      n.reqs.push_back(req);
      notices_.push_back(std::move(n));
    }
  }

  /// The watchdog received "rank R refused collective #seq".
  void on_refusal_notice(const std::string& text, int source) {
    const auto nl = text.find('\n');
    const std::int64_t seq = nl == std::string::npos ? -1 : std::strtoll(text.c_str(), nullptr, 10);
    const std::string msg = nl == std::string::npos ? text : text.substr(nl + 1);
    {
      std::lock_guard lock(mutex_);
      if (refused_here(seq)) {  // refused here too: nothing moved anywhere
        confirmations_[seq].insert(source);
        return;
      }
      if (seq >= started_.load()) {  // not reached yet: refuse it, or answer, when it comes
        pending_refusals_.emplace(seq, msg);
        pending_sources_[seq].push_back(source);
        update_pending_min();
        return;
      }
    }
    reply_accepted(source, seq);  // this rank is inside it or past it
    mark_unusable(concat("lockstep: this communicator is unusable: ", msg.substr(msg.rfind("lockstep: ", 0) == 0 ? 10 : 0)),
                  true, false);
  }

  bool refused_here(std::int64_t seq) const {  // under mutex_
    auto it = refused_by_me_.upper_bound(seq);
    if (it == refused_by_me_.begin()) return false;
    --it;
    return seq >= it->first && seq <= it->second;
  }

  void update_pending_min() {  // under mutex_
    pending_min_seq_.store(pending_refusals_.empty() ? INT64_MAX : pending_refusals_.begin()->first,
                           std::memory_order_relaxed);
  }

  /// This rank is about to enter collective #seq (or a later one) that another rank refused.
  [[gnu::noinline]] void check_pending_refusal(std::int64_t seq) {
    std::string msg;
    std::vector<int> sources;
    std::int64_t refused_seq = seq;
    {
      std::lock_guard lock(mutex_);
      auto it = pending_refusals_.begin();
      if (it == pending_refusals_.end() || it->first > seq) return;
      msg = it->second;
      sources = pending_sources_[it->first];
      refused_seq = it->first;
    }
    for (int src : sources) reply_accepted(src, refused_seq);  // this rank accepted that one
    mark_unusable(concat("lockstep: this communicator is unusable: ", msg.substr(msg.rfind("lockstep: ", 0) == 0 ? 10 : 0)),
                  true, false);
    throw MismatchError(msg + rank_suffix());
  }

 private:
  bool should_check(const CallSite& site) {
    switch (check_level()) {
      case CheckLevel::off: return false;
      case CheckLevel::always: return true;
      case CheckLevel::first: break;
    }
    // Per call site: the collective's own line and, for one issued inside the library, the
    // user's call of the library function, so first:N counts each of synchronize's, update's and
    // a checkpoint's collectives for each place they are called from.
    auto hash_loc = [](const std::source_location& l) {
      const char* file = l.file_name();
      return hash_bytes(file, std::strlen(file)) ^ (std::uint64_t{l.line()} << 20) ^ l.column();
    };
    std::uint64_t key = 0;
    if (site.known) key = hash_loc(site.loc);
    if (site.has_outer) key = key * 0x9E3779B97F4A7C15ull ^ hash_loc(site.outer);
    std::lock_guard lock(mutex_);
    return site_calls_[key]++ < check_first_calls();
  }

  // --- fingerprints ------------------------------------------------------------------------------

  void compare_fingerprints(const Fingerprint& fp, const CallSite& site) {
    // One small allreduce: the maximum of every field and of its bitwise complement, from which
    // the minimum follows (min x = ~max ~x); the fields agree iff max == min.
    std::int64_t buf[2 * kFields];
    fill_check_buffer(fp, buf);
    run(MPI_IN_PLACE, buf, 2 * kFields, MPI_INT64_T, MPI_MAX, "fingerprint MPI_Allreduce");
    if (!agree(buf)) report_mismatch(fp, site);
  }

  static void fill_check_buffer(const Fingerprint& fp, std::int64_t* buf) {
    for (int i = 0; i < kFields; ++i) {
      buf[i] = fp.v[i];
      buf[kFields + i] = ~fp.v[i];
    }
  }
  static bool agree(const std::int64_t* buf) {
    bool same = true;
    for (int i = 0; i < kFields; ++i) same = same && buf[i] == ~buf[kFields + i];
    return same;
  }

 public:
  std::unique_ptr<DeferredCheck> take_deferred() { return std::move(deferred_); }

  /// Completes a deferred check; throws MismatchError on every rank if the fingerprints differ
  /// (the communicator is then unusable: the data operation was already issued).
  void finish_deferred(DeferredCheck& d) {
    if (d.req == MPI_REQUEST_NULL) return;
    {
      std::lock_guard lock(mutex_);
      record_entered(d.fp, d.site, /*checking=*/true, /*waiting=*/true);
    }
    check_mpi(wait(&d.req), "fingerprint MPI_Iallreduce");
    {
      std::lock_guard lock(mutex_);
      in_collective_ = waiting_request_ = checking_ = false;
    }
    if (agree(d.buf)) return;
    try {
      report_mismatch(d.fp, d.site, false);
    } catch (const MismatchError& e) {
      mark_unusable(std::string("lockstep: this communicator is unusable after a mismatched nonblocking "
                                "collective: ") + e.what(), true, false);
      throw;
    }
  }

 private:
  // Records, under mutex_, that this thread is inside the collective `fp` called at `site` (what
  // the watchdog answers other ranks' status queries with): in its fingerprint check or not, in
  // the wait for a nonblocking request or not.
  void record_entered(const Fingerprint& fp, const CallSite& site, bool checking, bool waiting) {
    in_collective_ = true;
    fast_current_ = -1;
    checking_ = checking;
    waiting_request_ = waiting;
    current_ = fp;
    current_site_ = site;
    since_ = entered_ = Clock::now();
  }

  void start_deferred(const Fingerprint& fp, const CallSite& site) {
    // A check whose operation failed to be issued (it threw after entering) was never taken by
    // a request: complete it before its buffer goes.
    if (deferred_ && deferred_->req != MPI_REQUEST_NULL) MPI_Wait(&deferred_->req, MPI_STATUS_IGNORE);
    auto d = std::make_unique<DeferredCheck>();
    d->fp = fp;
    d->site = site;
    fill_check_buffer(fp, d->buf);
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, d->buf, 2 * kFields, MPI_INT64_T, MPI_MAX, check_, &d->req),
              "fingerprint MPI_Iallreduce");
    deferred_ = std::move(d);
  }

  [[noreturn]] void report_mismatch(const Fingerprint& fp, const CallSite& site, bool nothing_moved = true) {
    // Slow path, only on a mismatch: gather every rank's fingerprint and description.
    MismatchMsg mine;
    mine.fp = fp;
    copy_text(mine.text, fp.v[6] == 0 ? concat(describe(fp, site), "; its arguments were refused: ", refusal_)
                                      : describe(fp, site));
    std::vector<MismatchMsg> all(static_cast<std::size_t>(size_));
    MPI_Request req;
    check_mpi(MPI_Iallgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, check_, &req),
              "MPI_Iallgather(fingerprints)");
    check_mpi(wait(&req), "MPI_Iallgather(fingerprints)");

    // Group the ranks by fingerprint; a strict majority tells which ranks are the odd ones out.
    std::map<std::vector<std::int64_t>, std::vector<int>> groups;
    for (int r = 0; r < size_; ++r)
      groups[std::vector<std::int64_t>(all[r].fp.v, all[r].fp.v + kFields)].push_back(r);
    const std::vector<int>* majority = nullptr;
    for (auto& [key, ranks] : groups)
      if (2 * ranks.size() > static_cast<std::size_t>(size_)) majority = &ranks;
    std::vector<std::string> fields;
    for (int i = 0; i < kFields; ++i) {
      bool same = true;
      for (int r = 1; r < size_; ++r) same = same && all[r].fp.v[i] == all[0].fp.v[i];
      if (!same) fields.emplace_back(kFieldNames[i]);
    }
    std::ostringstream os;
    os << "lockstep: collective mismatch on a " << size_ << "-rank communicator: the ranks disagree on the ";
    for (std::size_t i = 0; i < fields.size(); ++i)
      os << (i == 0 ? "" : i + 1 == fields.size() ? " and " : ", ") << fields[i];
    os << ". What each rank called:";
    std::vector<int> odd;
    for (int r = 0; r < size_; ++r) {
      bool is_odd = majority != nullptr &&
                    std::find(majority->begin(), majority->end(), r) == majority->end();
      if (is_odd) odd.push_back(r);
      os << "\n  rank " << r << ": " << all[r].text << (is_odd ? "   <-- differs from the majority" : "");
    }
    if (!odd.empty()) os << "\nOdd one(s) out: " << rank_list(odd) << ".";
    os << (nothing_moved ? "\nNo data was exchanged." : "\nThe nonblocking operation was already issued; this backend is unusable now.")
       << " [reported by rank " << rank_ << "/" << size_ << "]";
    {
      std::lock_guard lock(mutex_);
      in_collective_ = false;
    }
    throw MismatchError(os.str());
  }

  // Runs a small allreduce on the fingerprint communicator, with the deadline if there is one.
  // Always the nonblocking form, polled: with nonblocking buckets in flight (as
  // DistributedOptimizer has), a blocking MPI_Allreduce here slows the whole gradient sync down
  // (docs/performance.md, "Reliability defaults").
  void run(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op, const char* what) {
    MPI_Request req;
    check_mpi(MPI_Iallreduce(send, recv, count, dt, op, check_, &req), what);
    check_mpi(wait(&req), what);
  }

  // --- stall handling ----------------------------------------------------------------------------

  StatusMsg my_status() {
    StatusMsg m;
    std::lock_guard lock(mutex_);
    m.started = started_.load();
    m.completed = completed_.load();
    m.in_collective = in_collective_.load() ? 1 : 0;
    m.stamp = straggler_clock_now();
    const double secs = std::chrono::duration<double>(Clock::now() - since_).count();
    // Collectives that took the fast path left no record but their operation and number, and
    // no time (the clock is not read there).
    const std::int64_t fast_current = fast_current_.load(), fast_last = fast_last_.load();
    std::ostringstream os;
    if (m.in_collective && fast_current >= 0) {
      os << "inside " << describe_unrecorded(fast_current);
    } else if (m.in_collective) {
      os << (waiting_request_ ? "waiting for the result of " : "inside ")
         << (checking_ ? "the fingerprint check of " : "") << describe(current_, current_site_)
         << " for " << seconds_string(secs);
    } else {
      os << "not inside any collective";
      if (fast_last < 0) os << " for " << seconds_string(secs);
      os << "; ";
      if (m.completed == 0) os << "no collective completed yet";
      else if (fast_last >= 0) os << "last completed " << describe_unrecorded(fast_last);
      else os << "last completed " << describe(last_, last_site_);
    }
    copy_text(m.text, os.str());
    return m;
  }

  static std::int64_t pack(std::int64_t seq, Coll coll) noexcept {
    return seq * 16 + static_cast<std::int64_t>(coll);
  }
  static std::string describe_unrecorded(std::int64_t packed) {
    return concat(name_of(static_cast<Coll>(packed % 16)), " #", packed / 16,
                  " (no details recorded: no check level and no deadline were set when it started)");
  }

  [[noreturn]] void on_deadline(double t) {
    Fingerprint cur;
    CallSite site;
    bool checking;
    {
      std::lock_guard lock(mutex_);
      cur = current_;
      site = current_site_;
      checking = checking_;
    }
    const std::int64_t seq = cur.v[5];
    std::vector<StatusMsg> st(static_cast<std::size_t>(size_));
    std::vector<bool> answered(static_cast<std::size_t>(size_), false);
    st[rank_] = my_status();
    answered[rank_] = true;
    query_all(st, answered);

    std::vector<int> behind, waiting, ahead, silent;
    std::ostringstream lines;
    for (int r = 0; r < size_; ++r) {
      lines << "\n  rank " << r << " (" << hosts_[static_cast<std::size_t>(r)] << "): ";
      if (!answered[r]) {
        silent.push_back(r);
        lines << "did not answer (exited, finalised, killed, or MPI without thread support)";
        continue;
      }
      lines << st[r].text;
      if (st[r].started <= seq) {
        behind.push_back(r);
        lines << "   <-- behind";
      } else if (st[r].in_collective && st[r].started == seq + 1) {
        waiting.push_back(r);
      } else {
        ahead.push_back(r);
      }
    }
    std::ostringstream os;
    os << "lockstep: stall: " << (checking ? "the fingerprint check of " : "")
       << (waiting_request_ ? "the wait for " : "") << describe(cur, site)
       << " did not complete within " << t << " s on rank " << rank_ << "/" << size_ << ".";
    if (!behind.empty()) os << " Behind (not yet in collective #" << seq << "): " << ranks_on_hosts(behind) << ".";
    if (!silent.empty()) os << " No answer from " << ranks_on_hosts(silent) << ".";
    const std::vector<std::string> lost = lost_hosts(silent);
    if (!lost.empty()) {
      os << " No rank of " << (lost.size() == 1 ? "host " : "hosts ");
      for (std::size_t i = 0; i < lost.size(); ++i) os << (i ? ", " : "") << lost[i];
      os << " answered: " << (lost.size() == 1 ? "that host is" : "those hosts are")
         << " lost or cut off from this one.";
    }
    if (behind.empty() && silent.empty())
      os << " Every rank has reached collective #" << seq
         << " (a mismatched collective or a deadline too short for the data size).";
    os << " State of each rank:" << lines.str();
    std::string msg = os.str();
    write_blame_report(ctrl_, silent, behind, msg);

    if (timeout_action() == TimeoutAction::abort) {
      std::cerr << msg << "\nlockstep: aborting the job (LOCKSTEP_TIMEOUT_ACTION=abort)" << std::endl;
      MPI_Abort(MPI_COMM_WORLD, 124);
    }
    notify_all(msg);
    {
      std::lock_guard lock(mutex_);
      in_collective_ = false;
      waiting_request_ = false;
    }
    mark_unusable("lockstep: this communicator is unusable after a stall: " + msg, false);
    throw TimeoutError(msg);
  }

  // The straggler warning's look (straggler.hpp), `warn` s into a collective with deadline t.
  void look_for_stragglers(double t, double warn) {
    std::int64_t seq;
    std::string what;
    {
      std::lock_guard lock(mutex_);
      seq = current_.v[5];
      what = describe(current_, current_site_);
    }
    straggler_->look(what, warn, t, [&](std::vector<PeerAnswer>& a, double give_up) {
      std::vector<StatusMsg> st(static_cast<std::size_t>(size_));
      std::vector<bool> answered(static_cast<std::size_t>(size_), false);
      answered[rank_] = true;
      std::vector<double> got(static_cast<std::size_t>(size_), 0);
      const double sent = straggler_clock_now();
      query_all(st, answered, give_up, &got);
      for (int r = 0; r < size_; ++r) {
        auto& p = a[static_cast<std::size_t>(r)];
        p.sent = sent;
        p.answered = r != rank_ && answered[r];
        p.received = p.answered ? got[r] : straggler_clock_now();
        p.stamped = st[r].stamp;
        // Behind: not yet in this collective and not inside the one before either (finishing
        // it over a slow link is not being behind).
        p.behind = p.answered && st[r].started <= seq && st[r].in_collective == 0;
      }
    });
  }

  // Asks every other rank's watchdog for its status; waits at most a few seconds (give_up) for
  // answers. `arrived`: when each answer arrived (straggler_clock_now()).
  void query_all(std::vector<StatusMsg>& st, std::vector<bool>& answered, double give_up_s = 3,
                 std::vector<double>* arrived = nullptr) {
    std::vector<MPI_Request> recvs(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
    std::vector<MPI_Request> sends(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
    int token = rank_;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      MPI_Irecv(&st[r], sizeof(StatusMsg), MPI_BYTE, r, kTagReply, ctrl_, &recvs[r]);
      MPI_Isend(&token, 1, MPI_INT, r, kTagQuery, ctrl_, &sends[r]);
    }
    const auto give_up = Clock::now() + after_seconds(give_up_s);
    int pending = size_ - 1;
    while (pending > 0 && Clock::now() < give_up) {
      for (int r = 0; r < size_; ++r) {
        if (recvs[r] == MPI_REQUEST_NULL) continue;
        int flag = 0;
        MPI_Test(&recvs[r], &flag, MPI_STATUS_IGNORE);
        if (flag) {
          answered[r] = true;
          if (arrived != nullptr) (*arrived)[static_cast<std::size_t>(r)] = straggler_clock_now();
          --pending;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (int r = 0; r < size_; ++r) {
      if (recvs[r] != MPI_REQUEST_NULL) {
        MPI_Cancel(&recvs[r]);
        MPI_Request_free(&recvs[r]);
      }
      // A query to a dead rank may never complete; it is left behind rather than waited for.
      if (sends[r] != MPI_REQUEST_NULL) MPI_Request_free(&sends[r]);
    }
  }

  // Tells every other rank about the stall, so that ranks waiting elsewhere or outside any
  // collective throw too instead of hanging.
  void notify_all(const std::string& msg, int tag = kTagStall, bool leaving = false) {
    std::string note = concat(comm_id_, " ",
                              tag == kTagStall ? "lockstep: rank " + std::to_string(rank_) +
                                                     " reported a stall, so this rank stops too: " +
                                                     msg.substr(msg.rfind("lockstep: ", 0) == 0 ? 10 : 0)
                                               : msg);
    // The text must outlive the sends, which are not waited for: MPI may read it after the
    // MPI_Isend returned (under a flood of notices Open MPI queues the send and packs it later),
    // so each notice has its own text, kept until its sends completed (one reused string was
    // overwritten, or reallocated, under sends still in flight). The one of a rank leaving is
    // sent just before its monitor goes, so it is kept for the life of the process.
    std::lock_guard lock(notices_mutex_);
    // Oldest first, stopping at the first one still in flight: constant time per notice even
    // under a flood of thousands (the sends complete in about the order they were made).
    while (!notices_.empty()) {
      int done = 0;
      Notice& oldest = notices_.front();
      MPI_Testall(static_cast<int>(oldest.reqs.size()), oldest.reqs.data(), &done, MPI_STATUSES_IGNORE);
      if (!done) break;
      notices_.pop_front();
    }
    auto text = std::make_unique<std::string>(note);
    std::vector<MPI_Request> reqs;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      MPI_Request req;
      if (MPI_Isend(text->data(), static_cast<int>(text->size()), MPI_CHAR, r, tag, ctrl_, &req) ==
          MPI_SUCCESS)
        reqs.push_back(req);
    }
    if (tag == kTagLeft || leaving) {
      for (auto& req : reqs) MPI_Request_free(&req);
      keep_for_process(std::move(text));
      return;
    }
    notices_.push_back(Notice{std::move(reqs), std::move(text)});
  }

  // The statuses of every rank, as report lines, with the ranks that did not answer named.
  std::string status_lines() {
    std::vector<StatusMsg> st(static_cast<std::size_t>(size_));
    std::vector<bool> answered(static_cast<std::size_t>(size_), false);
    st[rank_] = my_status();
    answered[rank_] = true;
    query_all(st, answered);
    std::ostringstream lines;
    for (int r = 0; r < size_; ++r) {
      lines << "\n  rank " << r << ": "
            << (answered[r] ? st[r].text : "did not answer (exited, finalised, killed, stopped, or no thread support)");
    }
    return lines.str();
  }

  // Run by the watchdog thread every few milliseconds: ends the job when the thread running
  // collectives has been blocked inside one collective past the default deadline, or, after
  // another rank reported a stall or a refused collective, inside a wait that cannot be
  // interrupted (a blocking MPI call without a polled deadline).
  void check_blocked() {
    const bool inside = in_collective_.load(std::memory_order_relaxed) || in_plain_wait_.load(std::memory_order_relaxed);
    const std::int64_t st = started_.load(std::memory_order_relaxed), co = completed_.load(std::memory_order_relaxed);
    const std::int64_t wt = waits_.load(std::memory_order_relaxed), wp = wait_points_.load(std::memory_order_relaxed);
    const auto now = Clock::now();
    if (!inside || st != wd_started_ || co != wd_completed_ || wt != wd_waits_ || wp != wd_points_) {
      wd_started_ = st;
      wd_completed_ = co;
      wd_waits_ = wt;
      wd_points_ = wp;
      wd_since_ = now;
      return;
    }
    const double blocked = std::chrono::duration<double>(now - wd_since_).count();
    const double limit = watchdog_timeout();
    if (limit > 0 && blocked > limit && !deadline_flag_.load(std::memory_order_relaxed)) {
      std::string msg = concat("lockstep: stall: rank ", rank_, "/", size_, " has been inside one collective for ",
                               seconds_string(blocked), ", past the default deadline of ", limit,
                               " s (LOCKSTEP_TIMEOUT=seconds chooses another and makes it a TimeoutError; "
                               "LOCKSTEP_TIMEOUT=0 turns it off). State of each rank:",
                               status_lines(), "\nlockstep: ending the job");
      std::cerr << msg << std::endl;
      MPI_Abort(MPI_COMM_WORLD, 124);
    }
    if (stalled_.load() && !deadline_flag_.load(std::memory_order_relaxed) && blocked > 2.0) {
      std::string why;
      {
        std::lock_guard lock(mutex_);
        why = stall_message_;
      }
      std::cerr << "lockstep: rank " << rank_ << "/" << size_
                << " is blocked inside a collective that cannot be interrupted (no polled deadline: "
                   "LOCKSTEP_TIMEOUT not set) after this: "
                << why << "\nlockstep: ending the job" << std::endl;
      MPI_Abort(MPI_COMM_WORLD, 124);
    }
  }

  // A peer left after taking part in `after` collectives ("<after> <message>"). This rank is
  // unusable from its first collective the peer did not take part in; until it has completed
  // those the peer did (a slow link can leave this rank's last one in progress after the peer
  // has finished it and left), the notice waits. Watchdog thread only.
  void on_left_notice(const std::string& text) {
    char* end = nullptr;
    const long long after = std::strtoll(text.c_str(), &end, 10);
    const std::string msg = (end != nullptr && *end == ' ') ? std::string(end + 1) : text;
    if (left_after_ < 0 || after < left_after_) {
      left_after_ = after;
      left_message_ = msg;
    }
    apply_left_notice();
  }
  void apply_left_notice() {
    if (left_after_ < 0) return;
    const std::int64_t in_common = std::min<std::int64_t>(started_.load(), left_after_);
    if (completed_.load() < in_common) return;  // still in a collective the peer completed
    // A rank that left is not a stall of this one: this rank still finalises normally.
    mark_unusable(left_message_, false, false);
    left_after_ = -1;
  }

  void watchdog_loop() {
    while (!stop_.load()) {
      int fin = 0;
      MPI_Finalized(&fin);
      if (fin) return;
      int flag = 0;
      MPI_Status status;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kTagQuery, ctrl_, &flag, &status) == MPI_SUCCESS && flag) {
        int token = 0;
        MPI_Recv(&token, 1, MPI_INT, status.MPI_SOURCE, kTagQuery, ctrl_, MPI_STATUS_IGNORE);
        reply_ = my_status();
        MPI_Request req;
        if (MPI_Isend(&reply_, sizeof reply_, MPI_BYTE, status.MPI_SOURCE, kTagReply, ctrl_, &req) ==
            MPI_SUCCESS) {
          // Small enough to go eagerly; wait a little so that reply_ may be reused.
          const auto give_up = Clock::now() + std::chrono::seconds(1);
          int done = 0;
          while (!done && Clock::now() < give_up) {
            MPI_Test(&req, &done, MPI_STATUS_IGNORE);
            if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          if (!done) MPI_Request_free(&req);
        }
        continue;
      }
      bool got = false;
      // An MPI error first: a rank that failed may leave at once, and its "left" notice, found in
      // the same look, must not hide the reason.
      for (int tag : {kTagFailed, kTagStall, kTagRefused, kTagLeft, kTagAccepted}) {
        if (MPI_Iprobe(MPI_ANY_SOURCE, tag, ctrl_, &flag, &status) == MPI_SUCCESS && flag) {
          int n = 0;
          MPI_Get_count(&status, MPI_CHAR, &n);
          std::string text(static_cast<std::size_t>(std::max(n, 0)), '\0');
          MPI_Recv(text.data(), n, MPI_CHAR, status.MPI_SOURCE, tag, ctrl_, MPI_STATUS_IGNORE);
          text = text.substr(0, text.find('\0'));
          // "<identity> <text>": a notice meant for an earlier communicator is dropped.
          const auto space = text.find(' ');
          if (space == std::string::npos || std::strtoull(text.c_str(), nullptr, 10) != comm_id_) continue;
          text = text.substr(space + 1);
          if (tag == kTagRefused) on_refusal_notice(text, status.MPI_SOURCE);
          else if (tag == kTagAccepted) on_accepted_reply(text);
          else if (tag == kTagFailed) on_failure_notice(text);
          else if (tag == kTagLeft) on_left_notice(text);
          else mark_unusable(text, false, true);
          got = true;
        }
      }
      if (got) continue;
      apply_left_notice();
      check_blocked();
      if (urgent_.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
      else std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  static void check_mpi(int rc, const char* what) {
    if (rc != MPI_SUCCESS) throw MpiError(concat("lockstep reliability: ", what, " failed", rank_suffix()), rc);
  }

  int rank_ = 0, size_ = 1;
  std::vector<std::string> hosts_;  // every rank's host name (MPI_Get_processor_name)
  std::unique_ptr<StragglerWatch> straggler_;

  // "ranks 2, 3 (host b)" / "ranks 1 (host a), 4 (host b)": the ranks with their hosts.
  std::string ranks_on_hosts(const std::vector<int>& ranks) const {
    std::ostringstream os;
    os << (ranks.size() == 1 ? "rank " : "ranks ");
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      const std::string& h = hosts_[static_cast<std::size_t>(ranks[i])];
      os << (i ? ", " : "") << ranks[i];
      if (i + 1 == ranks.size() || hosts_[static_cast<std::size_t>(ranks[i + 1])] != h) os << " (host " << h << ")";
    }
    return os.str();
  }
  // The hosts none of whose ranks answered, where the ranks span more than one host.
  std::vector<std::string> lost_hosts(const std::vector<int>& silent) const {
    std::vector<std::string> out;
    std::map<std::string, int> total, quiet;
    for (const auto& h : hosts_) ++total[h];
    if (total.size() < 2) return out;
    for (int r : silent) ++quiet[hosts_[static_cast<std::size_t>(r)]];
    for (const auto& [h, n] : quiet)
      if (n == total[h] && h != hosts_[static_cast<std::size_t>(rank_)]) out.push_back(h);
    return out;
  }
  std::uint64_t comm_id_ = 0;  // the same on every rank of the communicator (see the constructor)
  MPI_Comm check_ = MPI_COMM_NULL, ctrl_ = MPI_COMM_NULL;
  std::thread watchdog_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> stalled_{false};
  std::atomic<int> pending_{0};
  // Touched only by the thread running the collective (not the watchdog).
#if LOCKSTEP_FAULT_INJECTION
  bool fault_pending_ = false;  // an injected fault is still to hit this rank
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
  StatusMsg reply_;
  std::unique_ptr<DeferredCheck> deferred_;  // the check of the nonblocking collective being issued
};

CommMonitorPtr make_comm_monitor(MPI_Comm comm) { return std::make_shared<CommMonitor>(comm); }

int pending_requests(const CommMonitor& m) noexcept { return m.pending(); }
bool safe_to_free(const CommMonitor& m) noexcept { return !m.stalled_for_real() && m.pending() == 0; }
bool monitor_usable(const CommMonitor& m) noexcept { return !m.stalled(); }
bool any_stall() noexcept { return g_any_stall.load(); }
void announce_leaving(CommMonitor& m) noexcept {
  try {
    m.announce_leaving();
  } catch (...) {
  }
}

void report_mpi_error(CommMonitor* m, const std::string& what, int code) noexcept {
  if (m == nullptr) return;
  try {
    m->on_local_mpi_error(what, code);
  } catch (...) {
  }
}

void wait_point(void* monitor) {
  if (monitor != nullptr) static_cast<CommMonitor*>(monitor)->wait_point();
}

void abandon_collective(CommMonitor* m, const char* op, std::int64_t count, int dtype, int reduce_op, int root,
                        const char* message) {
  if (m == nullptr) return;
  static const std::pair<const char*, Coll> names[] = {
      {"broadcast", Coll::broadcast}, {"allreduce", Coll::allreduce},   {"reduce", Coll::reduce},
      {"allgather", Coll::allgather}, {"reduce_scatter", Coll::reduce_scatter}, {"barrier", Coll::barrier},
      {"iallreduce", Coll::iallreduce}, {"ibroadcast", Coll::ibroadcast}};
  Coll coll = Coll::allreduce;
  for (const auto& [n, c] : names)
    if (std::strcmp(n, op) == 0) coll = c;
  m->abandon(coll, count, dtype, reduce_op, root, message);
}

void check_no_pending_requests(const CommMonitor* m, const char* what) {
  // After a stall nothing can be waited for any more; the communicator is leaked instead.
  if (m == nullptr || m->pending() == 0 || m->stalled()) return;
  const int n = m->pending();
  throw InvalidArgument(concat(what, ": ", n, " nonblocking request", n == 1 ? " is" : "s are",
                               " still pending on this backend; wait() for ", n == 1 ? "it" : "them",
                               " (or let the Request objects go out of scope) first", rank_suffix()));
}

RequestWatch::RequestWatch() = default;
RequestWatch::RequestWatch(std::weak_ptr<CommMonitor> monitor, const OpRecord& op)
    : monitor_(std::move(monitor)), op_(op) {
  if (auto m = monitor_.lock()) {
    m->add_pending(1);
    counted_ = true;
    check_ = m->take_deferred();  // owns the buffer its MPI request writes to
  }
}
RequestWatch::RequestWatch(RequestWatch&& other) noexcept
    : monitor_(std::move(other.monitor_)), op_(other.op_), counted_(std::exchange(other.counted_, false)),
      check_(std::move(other.check_)) {}
RequestWatch::~RequestWatch() {
  if (check_ && check_->req != MPI_REQUEST_NULL) {
    // Completed by test() rather than wait(): finish the check here, where nothing may throw.
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) {
      MPI_Wait(&check_->req, MPI_STATUS_IGNORE);
      bool same = true;
      for (int i = 0; i < kFields; ++i) same = same && check_->buf[i] == ~check_->buf[kFields + i];
      if (!same)
        std::cerr << "lockstep: the ranks disagreed about " << detail::describe(check_->fp, check_->site)
                  << " (found after test(); wait() would have thrown MismatchError)" << rank_suffix() << std::endl;
    }
  }
  if (counted_)
    if (auto m = monitor_.lock()) m->add_pending(-1);
}
std::string RequestWatch::describe() const {
  Fingerprint fp;
  std::copy(std::begin(op_.v), std::end(op_.v), fp.v);
  return fp.v[0] < 0 ? std::string("a nonblocking collective") : detail::describe(fp, op_.site);
}
void RequestWatch::report(const std::string& what, int code) noexcept {
  if (auto m = monitor_.lock()) report_mpi_error(m.get(), what, code);
}
int RequestWatch::wait_all(std::vector<MPI_Request>& reqs) {
  auto m = monitor_.lock();
  if (!m) return MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
  if (check_) {
    m->finish_deferred(*check_);
    check_.reset();
  }
  return m->wait_request(reqs, op_);
}

// ---------------------------------------------------------------------------------------------
// CollectiveScope and the guarded calls
// ---------------------------------------------------------------------------------------------
namespace {
thread_local CommMonitor* t_monitor = nullptr;  // monitor of the collective this thread is in
}

RequestWatch watch_request(const CommMonitorPtr& monitor) {
  if (!monitor || t_monitor != monitor.get()) return {};
  return RequestWatch(monitor, monitor->current_record());
}

// The fast path of a blocking collective touches neither the thread-local t_monitor nor
// std::uncaught_exceptions(), and the rest is out of line, so that the fast path needs no saved
// registers: a few loads, stores and branches.
CollectiveScope::CollectiveScope(CommMonitor* monitor, Coll coll, TensorView* data, std::int64_t count,
                                 int op, int root)
    : monitor_(monitor), outer_(nullptr) {
  if (monitor_ == nullptr) return;
  if (coll != Coll::iallreduce && coll != Coll::ibroadcast && monitor_->fast_ok()) {
    monitor_->enter_fast(coll);
    fast_ = true;
    return;
  }
  enter_slow(coll, data, count, op, root);
}

void CollectiveScope::enter_slow(Coll coll, TensorView* data, std::int64_t count, int op, int root) {
  if (monitor_->fast_ok()) {
    // A nonblocking collective: its request needs the record and t_monitor (watch_request).
    monitor_->enter_fast(coll);
    monitor_->record_issuing(coll, data, count, op, root);
    fast_ = true;
  } else {
    uncaught_ = std::uncaught_exceptions();
#if LOCKSTEP_FAULT_INJECTION
    if (!monitor_->enter(coll, data, count, op, root)) {
      skipped_ = true;  // an injected skip fault: this rank does not take part
      monitor_ = nullptr;
      return;
    }
#else
    (void)monitor_->enter(coll, data, count, op, root);
#endif
    if (monitor_->has_deadline()) {
      deadline_ = true;
      g_deadline_scopes.fetch_add(1);
    }
  }
  outer_ = t_monitor;
  t_monitor = monitor_;
  scoped_ = true;
}

CollectiveScope::~CollectiveScope() {
  if (monitor_ == nullptr) return;
  if (fast_ && !scoped_) monitor_->leave_fast();
  else leave_slow();
}

void CollectiveScope::leave_slow() noexcept {
  t_monitor = outer_;
  if (deadline_) g_deadline_scopes.fetch_sub(1);
  if (fast_) monitor_->leave_fast();
  else monitor_->leave(std::uncaught_exceptions() == uncaught_);
}

namespace {
// Runs a blocking MPI collective, or its nonblocking form polled against the deadline.
template <class Blocking, class Nonblocking>
int guarded(Blocking&& blocking, Nonblocking&& nonblocking) {
  if (g_deadline_scopes.load(std::memory_order_relaxed) == 0) return blocking();
  CommMonitor* m = t_monitor;
  if (m == nullptr || !m->has_deadline()) return blocking();
  MPI_Request req;
  int rc = nonblocking(&req);
  if (rc != MPI_SUCCESS) return rc;
  return m->wait(&req);
}

// The polled form of guarded_allreduce, out of line (and with the same six arguments) so that
// the common case, no deadline, compiles to a check and a tail call.
[[gnu::noinline]] int polled_allreduce(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op,
                                       MPI_Comm comm) {
  CommMonitor* m = t_monitor;
  if (m == nullptr || !m->has_deadline()) return MPI_Allreduce(send, recv, count, dt, op, comm);
  MPI_Request req;
  int rc = MPI_Iallreduce(send, recv, count, dt, op, comm, &req);
  if (rc != MPI_SUCCESS) return rc;
  return m->wait(&req);
}
}  // namespace

int guarded_allreduce(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op, MPI_Comm comm) {
  if (g_deadline_scopes.load(std::memory_order_relaxed) == 0) return MPI_Allreduce(send, recv, count, dt, op, comm);
  return polled_allreduce(send, recv, count, dt, op, comm);
}
int guarded_bcast(void* buf, int count, MPI_Datatype dt, int root, MPI_Comm comm) {
  return guarded([&] { return MPI_Bcast(buf, count, dt, root, comm); },
                 [&](MPI_Request* r) { return MPI_Ibcast(buf, count, dt, root, comm, r); });
}
int guarded_reduce(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op, int root,
                   MPI_Comm comm) {
  return guarded([&] { return MPI_Reduce(send, recv, count, dt, op, root, comm); },
                 [&](MPI_Request* r) { return MPI_Ireduce(send, recv, count, dt, op, root, comm, r); });
}
int guarded_allgather(const void* send, int scount, MPI_Datatype sdt, void* recv, int rcount,
                      MPI_Datatype rdt, MPI_Comm comm) {
  return guarded([&] { return MPI_Allgather(send, scount, sdt, recv, rcount, rdt, comm); },
                 [&](MPI_Request* r) { return MPI_Iallgather(send, scount, sdt, recv, rcount, rdt, comm, r); });
}
int guarded_reduce_scatter_block(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op,
                                 MPI_Comm comm) {
  return guarded([&] { return MPI_Reduce_scatter_block(send, recv, count, dt, op, comm); },
                 [&](MPI_Request* r) { return MPI_Ireduce_scatter_block(send, recv, count, dt, op, comm, r); });
}
int guarded_barrier(MPI_Comm comm) {
  return guarded([&] { return MPI_Barrier(comm); }, [&](MPI_Request* r) { return MPI_Ibarrier(comm, r); });
}

}  // namespace detail
}  // namespace lockstep

