// Remote calls: deadlines, the backoff between polls, and memory kept for the process.
#include "remote/polling.hpp"

#include <mutex>

namespace lockstep::detail::remote {

double resolve_timeout(double t) { return t < 0 ? lockstep::timeout() : t; }

void backoff(Clock::time_point since_active) {
  const auto idle = Clock::now() - since_active;
  if (idle < std::chrono::milliseconds(2)) std::this_thread::yield();
  else if (idle < std::chrono::milliseconds(200)) std::this_thread::sleep_for(std::chrono::microseconds(50));
  else std::this_thread::sleep_for(std::chrono::microseconds(500));
}

/// Memory that a collective given up on may still use (MPI may write into it when the late
/// ranks arrive): kept, reachable, for the life of the process.
std::mutex g_kept_mu;
std::vector<std::shared_ptr<void>>* g_kept = nullptr;
void keep_for_ever(std::shared_ptr<void> p) {
  std::lock_guard lk(g_kept_mu);
  if (g_kept == nullptr) g_kept = new std::vector<std::shared_ptr<void>>();
  g_kept->push_back(std::move(p));
}

}  // namespace lockstep::detail::remote
