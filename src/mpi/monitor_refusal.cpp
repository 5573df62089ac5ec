// CommMonitor (monitor_impl.hpp): refused collectives, MPI errors and leaving: marking a communicator unusable and telling the other ranks.
#include "mpi/monitor_impl.hpp"

namespace lockstep {
namespace detail {

void CommMonitor::mark_unusable(const std::string& msg, bool refused, bool stall, int mpi_code, bool peer_left) {
  {
    std::lock_guard lock(mutex_);
    // The first reason is kept, with one exception: a peer's leaving is a consequence when
    // this rank then finds that the ranks disagreed on a collective they both entered (the
    // peer threw at that mismatch and left before this rank had compared): the mismatch is
    // the reason every rank must report.
    if (!stalled_ || (reason_is_peer_left_ && refused)) {
      stall_message_ = msg;
      refused_ = refused;
      mpi_code_ = mpi_code;
      reason_is_peer_left_ = peer_left;
    }
  }
  stalled_.store(true, std::memory_order_release);
  if (stall) {
    g_any_stall.store(true);
    stalled_for_real_.store(true);
  }
}

void CommMonitor::announce_leaving() {
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

void CommMonitor::on_local_mpi_error(const std::string& what, int code) {
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

void CommMonitor::on_failure_notice(const std::string& text) {
  const auto nl = text.find('\n');
  int code = nl == std::string::npos ? 0 : static_cast<int>(std::strtol(text.c_str(), nullptr, 10));
  if (code == 0) code = MPI_ERR_OTHER;
  mark_unusable((nl == std::string::npos ? text : text.substr(nl + 1)) + rank_suffix(), false, true, code);
}

void CommMonitor::abandon(Coll coll, std::int64_t count, int dtype, int reduce_op, int root, const char* message) {
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
  const auto give_up = Clock::now() + after_seconds(limit);
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

void CommMonitor::on_accepted_reply(const std::string& text) {
  const std::int64_t seq = std::strtoll(text.c_str(), nullptr, 10);
  std::lock_guard lock(mutex_);
  accepted_by_peer_.insert(seq);
}

void CommMonitor::reply_accepted(int to, std::int64_t seq) {
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

void CommMonitor::on_refusal_notice(const std::string& text, int source) {
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

bool CommMonitor::refused_here(std::int64_t seq) const {  // under mutex_
  auto it = refused_by_me_.upper_bound(seq);
  if (it == refused_by_me_.begin()) return false;
  --it;
  return seq >= it->first && seq <= it->second;
}

void CommMonitor::update_pending_min() {  // under mutex_
  pending_min_seq_.store(pending_refusals_.empty() ? INT64_MAX : pending_refusals_.begin()->first,
                         std::memory_order_relaxed);
}

[[gnu::noinline]] void CommMonitor::check_pending_refusal(std::int64_t seq) {
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

}  // namespace detail
}  // namespace lockstep
