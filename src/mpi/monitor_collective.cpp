// CommMonitor (monitor_impl.hpp): the slow paths of entering and leaving a collective (the fast path is inline in monitor_impl.hpp).
#include "mpi/monitor_impl.hpp"

namespace lockstep {
namespace detail {

bool CommMonitor::enter(Coll coll, TensorView* data, std::int64_t count, int op, int root) {
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

void CommMonitor::leave(bool ok) {
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

bool CommMonitor::should_check(const CallSite& site) {
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

void CommMonitor::record_entered(const Fingerprint& fp, const CallSite& site, bool checking, bool waiting) {
  in_collective_ = true;
  fast_current_ = -1;
  checking_ = checking;
  waiting_request_ = waiting;
  current_ = fp;
  current_site_ = site;
  since_ = entered_ = Clock::now();
}

void CommMonitor::run(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op, const char* what,
                      std::shared_ptr<void> owner) {
  MPI_Request req;
  check_mpi(MPI_Iallreduce(send, recv, count, dt, op, check_, &req), what);
  check_mpi(wait_keeping(&req, std::move(owner), [this](MPI_Request* q) { return wait(q); }), what);
}

}  // namespace detail
}  // namespace lockstep
