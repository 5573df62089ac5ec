// Internal (never installed): deadlines in seconds on the steady clock, the one conversion the
// communicator monitor (mpi) and the remote calls (remote) both use.
#pragma once

#include <algorithm>
#include <chrono>

namespace lockstep::detail {

using Clock = std::chrono::steady_clock;

/// `s` seconds as a clock duration. Capped at 10^9 s (about 32 years): a timeout the parser
/// accepts, such as LOCKSTEP_TIMEOUT=1e300, overflowed the clock's 64-bit nanosecond count (the
/// conversion gave a negative duration), so every collective timed out at once.
inline Clock::duration after_seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::min(s, 1e9)));
}

/// Now plus `seconds`; no deadline (time_point::max()) for seconds <= 0.
inline Clock::time_point deadline_after(double seconds) {
  if (seconds <= 0) return Clock::time_point::max();
  return Clock::now() + after_seconds(seconds);
}

}  // namespace lockstep::detail
