// CommMonitor (monitor_impl.hpp): the watchdog thread: answering queries, receiving notices, ending blocked waits.
#include "mpi/monitor_impl.hpp"

namespace lockstep {
namespace detail {

void CommMonitor::check_blocked() {
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

void CommMonitor::on_left_notice(const std::string& text) {
  char* end = nullptr;
  const long long after = std::strtoll(text.c_str(), &end, 10);
  const std::string msg = (end != nullptr && *end == ' ') ? std::string(end + 1) : text;
  if (left_after_ < 0 || after < left_after_) {
    left_after_ = after;
    left_message_ = msg;
  }
  apply_left_notice();
}

void CommMonitor::apply_left_notice() {
  if (left_after_ < 0) return;
  const std::int64_t in_common = std::min<std::int64_t>(started_.load(), left_after_);
  if (completed_.load() < in_common) return;  // still in a collective the peer completed
  // A rank that left is not a stall of this one: this rank still finalises normally.
  mark_unusable(left_message_, false, false, 0, /*peer_left=*/true);
  left_after_ = -1;
}

void CommMonitor::watchdog_loop() {
  while (!stop_.load()) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) return;
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kTagQuery, ctrl_, &flag, &status) == MPI_SUCCESS && flag) {
      int token = 0;
      MPI_Recv(&token, 1, MPI_INT, status.MPI_SOURCE, kTagQuery, ctrl_, MPI_STATUS_IGNORE);
      // Each reply its own memory: a send left behind (a peer that stopped reading) keeps it
      // for the life of the process instead of reading a reply rewritten or freed under it.
      auto reply = std::make_shared<StatusMsg>(my_status());
      MPI_Request req;
      if (MPI_Isend(reply.get(), sizeof(StatusMsg), MPI_BYTE, status.MPI_SOURCE, kTagReply, ctrl_, &req) ==
          MPI_SUCCESS) {
        // Small enough to go eagerly; wait a little before leaving it behind.
        const auto give_up = Clock::now() + std::chrono::seconds(1);
        int done = 0;
        while (!done && Clock::now() < give_up) {
          MPI_Test(&req, &done, MPI_STATUS_IGNORE);
          if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        if (!done) {
          MPI_Request_free(&req);
          keep_for_process(std::move(reply));
        }
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

}  // namespace detail
}  // namespace lockstep
