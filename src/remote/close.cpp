// Remote calls: closing a session, gracefully (every call still owed is answered first; the
// ranks sum the calls posted and answered in rounds of one allreduce) or by leaving it, and
// what is left of its requests afterwards.
#include <array>
#include <iostream>
#include <mutex>
#include <optional>

#include "mpi/blame_report.hpp"
#include "remote/engine.hpp"
#include "remote/polling.hpp"
#include "remote/session.hpp"

namespace lockstep::detail::remote {

namespace {

/// After the progress thread ended: the receives given up on are cancelled (no later message
/// can be received on this communicator any more), then everything given up on is waited for
/// until `until` at most; what is still pending then keeps its memory for ever.
void settle_orphans(Engine& e, Bound until) {
  std::lock_guard lk(e.mu);
  for (auto& o : e.orphans)
    if (o.receives)
      for (auto& r : o.reqs)
        if (r != MPI_REQUEST_NULL) MPI_Cancel(&r);
  while (true) {
    for (auto it = e.orphans.begin(); it != e.orphans.end();) {
      int flag = 0;
      MPI_Testall(static_cast<int>(it->reqs.size()), it->reqs.data(), &flag, MPI_STATUSES_IGNORE);
      it = flag ? e.orphans.erase(it) : it + 1;
    }
    if (e.orphans.empty() || until.passed()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Requests still pending now are never completed, so their memory is never freed (MPI may
  // still write or read it).
  for (auto& o : e.orphans) keep_for_process(std::make_shared<Engine::Orphan>(std::move(o)));
  e.orphans.clear();
  e.owed.clear();  // the communicator ends: nothing can take them any more
}

/// Why the close cannot complete any more, or "": a rank (other than this one; ranks that left
/// count too: their round-0 part may never come) known silent (Engine::silent: every rank is
/// watched from the start of the close, the serving ranks by the driver from the start of its
/// run, or named silent by a rank that left; as for the driver's silence, the looks of the
/// passes decide, not the clock alone). Called with e.mu held.
std::string close_blocked(const Engine& e) {
  const std::vector<int> lost = e.silent_ranks();
  if (lost.empty()) return std::string();
  return concat(e.silent_text(lost), " while this rank waited for every rank to close it (",
                lost.size() == 1 ? "it is" : "they are", " stopped, hung, cut off, or never ",
                lost.size() == 1 ? "closes" : "close", " it)");
}

/// Tells every other rank, without waiting long, that this rank is closing (k_closing) or left
/// (k_left; with the ranks this one found silent, so that the others' closes stop waiting for
/// them). A rank known silent is not waited for. Errors are printed, not thrown: a rank that
/// cannot be told times out by itself.
void tell_others(Engine& e, Kind kind) {
  if (e.size < 2) return;
  std::vector<int> dests;
  for (int r = 0; r < e.size; ++r)
    if (r != e.rank) dests.push_back(r);
  Encoder m;
  if (kind == k_left) {
    std::vector<int> lost;
    {
      std::lock_guard lk(e.mu);
      lost = e.silent_ranks();
    }
    m.u32(static_cast<std::uint32_t>(lost.size()));
    for (int r : lost) m.u32(static_cast<std::uint32_t>(r));
  }
  const double wait = e.timeout > 0 ? std::min(e.timeout, 1.0) : 1.0;
  try {
    e.send(dests, kTagCtrl, kind, e.next_id.fetch_add(1), 0, std::string(), m, Bound::within(wait).at(), wait,
           "closing the remote session", 0, nullptr, /*spare_silent=*/true);
  } catch (const std::exception& x) {
    std::cerr << "lockstep remote: " << x.what() << "\n";
  }
}

/// Buffers of a collective that may never complete (a rank gave up waiting for it): kept for
/// the life of the process, since MPI may still write into them.
void leak_wave(std::array<std::uint64_t, 6>* w) { keep_for_process(std::unique_ptr<std::array<std::uint64_t, 6>>(w)); }

/// How a session is closed, on every rank in rounds of one allreduce of [left, requests posted,
/// requests answered] over the session's communicator (a rank that leaves takes part in the
/// first only).
///
/// Graceful (leave = false): this rank serves calls (runs them, or lets the background thread
/// run them) while it waits, until every rank is closing and every request posted on the
/// session has been answered; so no call still owed is dropped, whichever rank closes first.
/// The rounds end when the requests posted in one equal those answered in the round before:
/// every request posted by then had been answered before, and none can follow (Mattern's
/// four-counter method). Meanwhile every rank sends heartbeats to the closing ones (k_closing),
/// so that a rank that hears nothing from another for the session's timeout gives up. When a
/// rank left (its 1 in the first round's sum), the rounds end after the first.
///
/// Leaving (leave = true, after this rank took the driver for silent): the first round only,
/// waited for at most `wait` seconds without serving.
///
/// Returns "" when the rounds completed (the communicator may be freed), else why not.
std::string close_rounds(Engine& e, bool leave, double wait) {
  e.driving = false;
  {
    std::lock_guard lk(e.mu);
    e.close_begun = true;
    // Every rank is watched from now on (every rank sends heartbeats to a closing one), and
    // those the driver watched through its run from the start of it.
    const auto now = Clock::now();
    for (auto& w : e.watch_since) w = std::min(w, now);
  }
  tell_others(e, leave ? k_left : k_closing);
  auto* wave = new std::array<std::uint64_t, 6>{};  // [left, posted, answered] in, their sums out
  std::uint64_t prev_sent = ~std::uint64_t{0}, prev_done = ~std::uint64_t{0};
  const Bound deadline = Bound::within(wait);  // (leaving only)
  std::optional<Engine::Waiting> w;
  if (!leave) w.emplace(e);  // this thread takes the passes
  std::unique_lock lk(e.mu);
  auto active = Clock::now();
  for (int round = 0;; ++round) {
    (*wave)[0] = leave ? 1 : 0;
    (*wave)[1] = e.reqs_sent.load();
    (*wave)[2] = e.reqs_done.load();
    MPI_Request r = MPI_REQUEST_NULL;
    const int rc = MPI_Iallreduce(wave->data(), wave->data() + 3, 3, MPI_UINT64_T, MPI_SUM, e.comm, &r);
    if (rc != MPI_SUCCESS) {
      delete wave;
      return concat("MPI error ", rc, " in its allreduce");
    }
    while (true) {
      int flag = 0;
      if (const int trc = MPI_Test(&r, &flag, MPI_STATUS_IGNORE); trc != MPI_SUCCESS) {
        // (Ranks whose collectives on the session do not match: one closing while another is
        // in another collective of the session.)
        leak_wave(wave);
        return concat("its allreduce failed (MPI error ", trc,
                      "): the ranks were not all closing the session (another collective of it on some rank)");
      }
      if (flag) break;
      std::string why = close_blocked(e);
      if (!why.empty()) {
      } else if (leave) {
        if (deadline.passed()) why = concat("not every rank closed it within ", wait, " s");
      } else if (round > 0 && e.a_rank_left.load()) {
        why = "a rank left it without waiting for the calls still owed (it took another rank for silent)";
      }
      if (!why.empty()) {
        leak_wave(wave);
        return why;
      }
      if (leave) {
        lk.unlock();
        backoff(active);
        lk.lock();
      } else {
        e.wait_step(lk, active, Clock::now() + std::chrono::milliseconds(50), e.can_help());
      }
    }
    if (leave || (*wave)[3] > 0) break;  // a rank left: no more rounds
    const std::uint64_t sent = (*wave)[4], done = (*wave)[5];
    if (sent == prev_done) {
      // Done on every rank. The heartbeats stop, and a last barrier makes sure that no rank
      // frees the communicator while another may still send one to it.
      delete wave;
      lk.unlock();
      {
        std::lock_guard pl(e.poll_mu);
        e.hb_over = true;
      }
      MPI_Request b = MPI_REQUEST_NULL;
      LOCKSTEP_MPI_CHECK(MPI_Ibarrier(e.comm, &b));
      std::vector<MPI_Request> reqs{b};
      if (!wait_requests(reqs, deadline_or_none(e.timeout), nullptr, [&] { return e.try_pass() == 1; }))
        return concat("not every rank reached its last barrier within ", e.timeout, " s");
      return std::string();
    }
    const bool moved = sent != prev_sent || done != prev_done;
    prev_sent = sent;
    prev_done = done;
    if (!moved && round > 0) {
      // A call still runs somewhere: serve a little before the next round instead of spinning.
      const auto until = Clock::now() + std::chrono::milliseconds(2);
      while (Clock::now() < until) e.wait_step(lk, active, until, e.can_help());
    }
  }
  delete wave;
  return std::string();
}

}  // namespace

/// Collective: ends the session of e (close_rounds). With wait < 0 (the normal close) it is
/// graceful: this rank serves the calls still owed until every rank has closed. With wait >= 0
/// (a rank that took the driver for silent) it leaves, waiting at most `wait` seconds for the
/// others. Throws TimeoutError when the ranks did not all close in time (then the communicator
/// is left allocated), or prints it if quiet.
void close_engine(const std::shared_ptr<Engine>& e, bool quiet, double wait) {
  // Once: a session that finalize ended (end_sessions_at_finalize) is still held by its
  // RemoteSession or run_driver, which close it again when they go.
  if (e->ended.exchange(true)) return;
  const bool leave = wait >= 0;
  std::string failed;
  try {
    failed = close_rounds(*e, leave, wait);
  } catch (const std::exception& x) {
    failed = x.what();
  }
  const bool ok = failed.empty();
  // The ranks this close gave up on as silent (found so here, or by a rank that told this one).
  std::vector<int> lost;
  {
    std::lock_guard lk(e->mu);
    lost = e->silent_ranks();
  }
  if (!ok && !leave) tell_others(*e, k_left);  // (a leaving rank told them at the start)
  forget_engine(e);
  {
    std::lock_guard lk(e->mu);
    e->closing = true;
  }
  e->cv.notify_all();
  if (e->executor.joinable()) e->executor.join();
  e->driving = false;
  {
    std::lock_guard pl(e->poll_mu);
    e->hb_over = true;
  }
  e->drain_seconds = ok ? 1.0 : 0.0;
  e->stop_progress = true;
  if (e->progress.joinable()) e->progress.join();
  {
    std::lock_guard pl(e->poll_mu);  // a thread still waiting takes no more passes
    e->passes_over = true;
    e->orphan_arrivals();  // what such a thread's last pass began to receive
  }
  // After a failed close the communicator stays allocated, and what is still pending keeps its
  // memory anyway: no wait (it was a second more, after the deadline that made the close fail).
  settle_orphans(*e, Bound::within(ok ? 1.0 : 0.0));
  {
    std::lock_guard lk(e->mu);
    for (auto& [id, c] : e->pending) {
      c->failure = Call::f_error;
      c->failed = concat("the remote session ended before rank ", c->rank, " answered the call of '", c->fn, "'");
      c->done = true;
    }
    e->pending.clear();
    e->queue.clear();
  }
  e->cache->close();
  e->cv.notify_all();
  if (ok) {
    wait_requests(e->hb_reqs, Bound::within(1.0).at());  // (what is still pending is left to MPI)
    MPI_Comm_free(&e->comm);
    return;
  }
  const std::string what = concat("closing the remote session: ", failed, rank_suffix());
  // A stall, as the monitor's: the launcher (lockstep-run) reads which ranks are lost.
  if (!lost.empty()) write_blame_report(e->comm, lost, {}, what);
  if (quiet) std::cerr << "lockstep remote: " << what << "\n";
  else throw TimeoutError(what);
}

}  // namespace lockstep::detail::remote
