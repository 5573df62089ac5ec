// CommMonitor (monitor_impl.hpp): request waits, polled deadlines and the stall checks of a waiting thread.
#include "mpi/monitor_impl.hpp"

namespace lockstep {
namespace detail {

int CommMonitor::wait_request(std::vector<MPI_Request>& reqs, const OpRecord& op) {
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

int CommMonitor::testall(std::vector<MPI_Request>& reqs, int* flag) {
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

void CommMonitor::throw_if_stalled() {
  if (stalled_.load(std::memory_order_acquire)) [[unlikely]] throw_stalled();
}

[[noreturn, gnu::noinline]] void CommMonitor::throw_stalled() {
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

void CommMonitor::wait_point() {
  wait_points_.fetch_add(1, std::memory_order_relaxed);
  throw_if_stalled();
  if (deadline_ && Clock::now() > deadline_at_) on_deadline(polled_timeout());
}

[[noreturn]] void CommMonitor::on_deadline(double t) {
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

}  // namespace detail
}  // namespace lockstep
