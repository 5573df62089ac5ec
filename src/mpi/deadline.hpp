// Internal (never installed): deadlines in seconds on the steady clock, the one conversion the
// communicator monitor (mpi) and the remote calls (remote) both use.
//
// Two kinds, kept apart by name and type:
//   deadline_or_none(t)  the user's timeout (LOCKSTEP_TIMEOUT, RemoteOptions/CallOptions::timeout),
//                        where 0 (or less) means "no deadline": time_point::max().
//   Bound::within(s)     a bound the library sets on a wait of its own (a notice to the other
//                        ranks, settling the requests given up on, the end of a close, a drain):
//                        always finite; 0 or less means no wait at all (one look). It cannot
//                        express "for ever", so such a wait cannot become unbounded by being
//                        handed a 0. (A failed remote close once settled its requests "for 0 s"
//                        through the user's form, that is for ever: the driver of a remote call
//                        whose worker's host was lost never returned from run_driver.)
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

/// The user's timeout as a deadline: now plus `seconds`; no deadline (time_point::max()) for
/// seconds <= 0, which is how the user turns deadlines off. Never for a wait the library bounds
/// itself: that is a Bound.
inline Clock::time_point deadline_or_none(double seconds) {
  if (seconds <= 0) return Clock::time_point::max();
  return Clock::now() + after_seconds(seconds);
}

/// A bound on a wait the library sets itself: `seconds` from its making, and always finite
/// (seconds <= 0, or NaN: now, so the wait looks once and ends; at most 10^9 s). There is no
/// way to make one that never passes.
class Bound {
 public:
  static Bound within(double seconds) {
    const double s = seconds > 0 ? seconds : 0.0;  // (NaN too)
    return Bound(Clock::now() + after_seconds(s));
  }
  Clock::time_point at() const { return at_; }
  bool passed() const { return Clock::now() >= at_; }

 private:
  explicit Bound(Clock::time_point at) : at_(at) {}
  Clock::time_point at_;
};

}  // namespace lockstep::detail
