// Remote calls: a timeout's default and the backoff between polls.
#include "remote/polling.hpp"

namespace lockstep::detail::remote {

double resolve_timeout(double t) { return t < 0 ? lockstep::timeout() : t; }

void backoff(Clock::time_point since_active) {
  const auto idle = Clock::now() - since_active;
  if (idle < std::chrono::milliseconds(2)) std::this_thread::yield();
  else if (idle < std::chrono::milliseconds(200)) std::this_thread::sleep_for(std::chrono::microseconds(50));
  else std::this_thread::sleep_for(std::chrono::microseconds(500));
}

}  // namespace lockstep::detail::remote
