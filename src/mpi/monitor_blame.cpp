// CommMonitor (monitor_impl.hpp): status queries to the other ranks and the blame of a stall.
#include "mpi/monitor_impl.hpp"

namespace lockstep {
namespace detail {

StatusMsg CommMonitor::my_status() {
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

std::string CommMonitor::describe_unrecorded(std::int64_t packed) {
  return concat(name_of(static_cast<Coll>(packed % 16)), " #", packed / 16,
                " (no details recorded: no check level and no deadline were set when it started)");
}

void CommMonitor::look_for_stragglers(double t, double warn) {
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

void CommMonitor::query_all(std::vector<StatusMsg>& st, std::vector<bool>& answered, double give_up_s,
               std::vector<double>* arrived) {
  // What the query's requests read and write. A rank that answers after give_up_s (a frozen
  // host that comes back) may still deliver into a reply, and a send to a dead rank may never
  // complete: when any request is left behind, this is kept for the life of the process.
  struct Exchange {
    int token = 0;
    std::vector<StatusMsg> replies;
  };
  auto ex = std::make_shared<Exchange>();
  ex->token = rank_;
  ex->replies.resize(static_cast<std::size_t>(size_));
  std::vector<MPI_Request> recvs(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
  std::vector<MPI_Request> sends(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Irecv(&ex->replies[r], sizeof(StatusMsg), MPI_BYTE, r, kTagReply, ctrl_, &recvs[r]);
    MPI_Isend(&ex->token, 1, MPI_INT, r, kTagQuery, ctrl_, &sends[r]);
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
        st[r] = ex->replies[r];
        if (arrived != nullptr) (*arrived)[static_cast<std::size_t>(r)] = straggler_clock_now();
        --pending;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  bool left_behind = false;
  for (int r = 0; r < size_; ++r) {
    if (recvs[r] != MPI_REQUEST_NULL) {
      MPI_Cancel(&recvs[r]);
      MPI_Request_free(&recvs[r]);
      left_behind = true;
    }
    // A query to a dead rank may never complete; it is left behind rather than waited for.
    if (sends[r] != MPI_REQUEST_NULL) {
      int done = 0;
      MPI_Test(&sends[r], &done, MPI_STATUS_IGNORE);
      if (!done) {
        MPI_Request_free(&sends[r]);
        left_behind = true;
      }
    }
  }
  if (left_behind) keep_for_process(std::move(ex));
}

void CommMonitor::notify_all(const std::string& msg, int tag, bool leaving) {
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

std::string CommMonitor::status_lines() {
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

std::string CommMonitor::ranks_on_hosts(const std::vector<int>& ranks) const {
  return ranks_with_hosts(ranks, hosts_);
}

std::vector<std::string> CommMonitor::lost_hosts(const std::vector<int>& silent) const {
  std::vector<std::string> out;
  std::map<std::string, int> total, quiet;
  for (const auto& h : hosts_) ++total[h];
  if (total.size() < 2) return out;
  for (int r : silent) ++quiet[hosts_[static_cast<std::size_t>(r)]];
  for (const auto& [h, n] : quiet)
    if (n == total[h] && h != hosts_[static_cast<std::size_t>(rank_)]) out.push_back(h);
  return out;
}

}  // namespace detail
}  // namespace lockstep
