// GradientReducer's communication thread (DistributedOptions::comm_thread): reduces the host
// buckets that ready reports launch, in launch order, with the backend's blocking collectives,
// while backward goes on. Every other collective on the backend first waits for its queue (the
// drain registered at setup), so every rank keeps one order.
#include "train/reducer_impl.hpp"

#include <algorithm>
#include <exception>

#include "comm/drain.hpp"

namespace lockstep {

GradientReducer::Impl::~Impl() {
  if (!use_thread) return;
  detail::unregister_drain(this);
  {
    std::unique_lock lk(wm);
    wcv.wait(lk, [&] { return wpending == 0; });  // the buckets' memory must outlive the work
    wstop = true;
  }
  wcv.notify_all();
  if (worker.joinable()) worker.join();
}

void GradientReducer::Impl::wait_idle() {
  std::unique_lock lk(wm);
  wcv.wait(lk, [&] { return wpending == 0; });
}

void GradientReducer::Impl::worker_loop() {
  detail::t_on_comm_thread = true;
  std::unique_lock lk(wm);
  for (;;) {
    wcv.wait(lk, [&] { return wstop || !wqueue.empty(); });
    if (wqueue.empty()) return;
    auto [bi, site] = wqueue.front();
    wqueue.pop_front();
    const bool failed = static_cast<bool>(werror);
    lk.unlock();
    std::exception_ptr err;
    if (!failed) {
      try {
        detail::t_call_site = site;  // the collectives name the call that launched them
        Bucket& b = buckets[bi];
        for (std::size_t p = 0; p < b.parts.size(); ++p) communicate(b, b.parts[p], b.slice, carries(bi, p));
      } catch (...) {
        err = std::current_exception();
      }
    }
    lk.lock();
    if (err && !werror) werror = err;
    buckets[bi].done = true;
    --wpending;
    wcv.notify_all();
  }
}

void GradientReducer::Impl::enqueue(std::size_t bi) {
  std::lock_guard lk(wm);
  if (!worker.joinable()) worker = std::thread([this] { worker_loop(); });
  buckets[bi].threaded = true;
  buckets[bi].done = false;
  ++wpending;
  wqueue.emplace_back(bi, detail::t_call_site);
  wcv.notify_all();
}

// Whether host buckets go to the communication thread; registers the drain that makes every
// other collective on the backend wait for the thread's queue.
void GradientReducer::Impl::start_thread_if_used() {
  has_host_bucket = std::any_of(buckets.begin(), buckets.end(), [](const Bucket& b) { return b.device.is_cpu(); });
  // Deterministic mode reduces nothing during backward (exact_reduce does it all at once).
  use_thread = options.comm_thread && !options.deterministic && backend->concurrent_collectives() &&
               std::any_of(buckets.begin(), buckets.end(), [](const Bucket& b) { return b.device.is_cpu(); });
  if (use_thread) detail::register_drain(backend, this, [this] { wait_idle(); });
}

}  // namespace lockstep
