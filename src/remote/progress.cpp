// Remote calls: the passes over the incoming messages (one thread at a time), the housekeeping
// between them (heartbeats, requests given up on, tensors owed), the waits that take the passes
// themselves, and the progress thread that takes them when nobody else does.
#include "remote/engine.hpp"

#include <algorithm>
#include <cstring>
#include <iostream>
#include <thread>

#include "remote/polling.hpp"
#include "remote/test_hooks.hpp"

namespace lockstep::detail::remote {

bool Engine::poll_once(bool* ctrl_empty, const std::function<void()>* before_receive) {
  bool did = false;
  for (int tag : {kTagReq, kTagRep, kTagCtrl}) {
    int flag = 0;
    MPI_Message msg;
    MPI_Status st;
    MPI_Improbe(MPI_ANY_SOURCE, tag, comm, &flag, &msg, &st);
    if (flag) {
      if (before_receive != nullptr) (*before_receive)();
      receive(msg, st);
      did = true;
    }
    if (tag == kTagCtrl && ctrl_empty != nullptr) *ctrl_empty = !flag;
  }
  return did;
}

void Engine::housekeeping() {
  // Heartbeats: from the driver to every rank while it drives, from a serving rank to the
  // driver while it serves in a run (so that the driver can tell a lost rank from a busy one when
  // the run ends), and from every rank to the ranks closing the session (they wait for the
  // others while serving). Each destination has its own request: a rank that takes no more
  // messages (a lost host) holds up its own heartbeats only. (With one set for all, a heartbeat
  // stuck to a lost rank held back every later one, and the live ranks took this one for silent.)
  if (!hb_over && Clock::now() >= next_hb) {
    const bool drive = driving.load(), to_driver = hb_driver.load();
    for (int r = 0; r < size; ++r) {
      const auto i = static_cast<std::size_t>(r);
      if (r == rank || left_ranks[i] || !((drive && r != 0) || (to_driver && r == 0) || closing_ranks[i])) continue;
      MPI_Request& q = hb_reqs[i];
      if (q != MPI_REQUEST_NULL) {
        int flag = 0;
        MPI_Test(&q, &flag, MPI_STATUS_IGNORE);
        if (!flag) continue;  // its last one is still not taken
      }
      MPI_Isend(&heartbeat_head(), static_cast<int>(kHead), MPI_BYTE, r, kTagCtrl, comm, &q);
    }
    const double every = timeout > 0 ? std::clamp(timeout / 5, 0.02, 1.0) : 1.0;
    next_hb = Bound::within(every).at();
  }
  std::lock_guard lk(mu);
  for (auto it = orphans.begin(); it != orphans.end();) {
    int flag = 0;
    MPI_Testall(static_cast<int>(it->reqs.size()), it->reqs.data(), &flag, MPI_STATUSES_IGNORE);
    it = flag ? orphans.erase(it) : it + 1;
  }
  if (!owed.empty() && Clock::now() >= next_owed_try) {
    (void)take_owed();
    next_owed_try = Clock::now() + std::chrono::milliseconds(100);
  }
}

bool Engine::pass(const std::function<void()>* before_receive) {
  const auto start = Clock::now();
  bool ctrl_empty = false;
  bool did = poll_once(&ctrl_empty, before_receive);
  ctrl_looks.saw(ctrl_empty, start);
  did = advance_arrivals() || did;
  housekeeping();
  return did;
}

int Engine::try_pass(const std::function<void()>* before_receive) {
  std::unique_lock pl(poll_mu, std::try_to_lock);
  if (!pl.owns_lock() || passes_over) return -1;
  try {
    return pass(before_receive) ? 1 : 0;
  } catch (const std::exception& x) {
    std::cerr << "lockstep remote: receiving: " << x.what() << "\n";
    return 1;
  }
}

bool Engine::wait_polling(std::vector<MPI_Request>& reqs, Clock::time_point deadline,
                  const std::function<void()>* before_receive) {
  Waiting w(*this);
  return wait_requests(reqs, deadline, nullptr, [&] { return try_pass(before_receive) == 1; });
}

void Engine::wait_step(std::unique_lock<std::mutex>& lk, Clock::time_point& active, Clock::time_point until,
               bool may_run) {
  if (may_run && !queue.empty()) {
    Incoming in = std::move(queue.front());
    queue.pop_front();
    lk.unlock();
    {
      Waiting running(*this, -1);  // the rank's code runs: the progress thread takes the passes
      execute(in);
    }
    lk.lock();
    active = Clock::now();
    return;
  }
  lk.unlock();
  const int r = try_pass();
  if (r == 1) active = Clock::now();
  else if (r == 0) backoff(active);
  lk.lock();
  if (r < 0) cv.wait_until(lk, std::min(until, Clock::now() + std::chrono::milliseconds(1)));
}

void Engine::progress_loop() {
  auto active = Clock::now();
  while (!stop_progress.load()) {
    if (waiters.load() > 0) {
      // A waiting thread takes the passes. A long nap: each wake-up of this thread takes a
      // core from the polling one where the rank's threads share cores (at 100 µs naps, the
      // round trip of a 64 KiB call varied 2x between runs).
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      active = Clock::now() - std::chrono::milliseconds(2);  // then no busy yielding
      continue;
    }
    if (try_pass() == 1) active = Clock::now();
    else backoff(active);
  }
  // Whatever arrived meanwhile (late replies of abandoned calls) is received and dropped, and
  // tensors still arriving are finished, all within drain_seconds (a second; none after a
  // failed close: then their receives are left to settle_orphans, which cancels them). Bounded
  // as a whole: messages that keep coming (heartbeats), or tensors that never come from a lost
  // rank, cannot hold it. Not once MPI is finalised (see ~Engine).
  int fin = 0;
  MPI_Finalized(&fin);
  if (fin) return;
  const Bound drain = Bound::within(drain_seconds.load());
  std::lock_guard pl(poll_mu);
  for (int i = 0; i < 3; ++i)
    while (!drain.passed() && poll_once()) {}
  while (!arriving.empty() && !drain.passed())
    if (!advance_arrivals()) std::this_thread::yield();
  orphan_arrivals();
}

void Engine::orphan_arrivals() {
  std::lock_guard lk(mu);
  for (auto& a : arriving)
    if (!a.reqs.empty()) orphans.push_back(Orphan{std::move(a.reqs), Encoder(), std::move(a.in.segs), true});
  arriving.clear();
}

Engine::~Engine() {
  if (!progress.joinable() && !executor.joinable()) return;
  {
    std::lock_guard lk(mu);
    closing = true;
  }
  cv.notify_all();
  stop_progress = true;
  if (executor.joinable() && executor.get_id() != std::this_thread::get_id()) executor.join();
  if (progress.joinable() && progress.get_id() != std::this_thread::get_id()) progress.join();
  if (executor.joinable()) executor.detach();
  if (progress.joinable()) progress.detach();
}

}  // namespace lockstep::detail::remote
