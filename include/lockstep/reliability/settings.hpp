// Reliability: collective fingerprints, stall timeouts with blame, and fault injection for tests.
//
// Every MPIBackend numbers its collectives (a per-communicator sequence number). At check level
// `always` (or for the first N calls of each call site at level `first`) the ranks compare, before
// any data moves, what they are about to do: operation, dtype, element count, root, reduce op and
// sequence number. A disagreement throws MismatchError on every rank, naming what each rank called
// and where (the call site recorded by the free functions of world.hpp).
//
// With a timeout set, every blocking collective has a deadline. When it expires the rank asks
// every other rank (over a separate communicator, answered by a background watchdog thread) what
// it is doing, names the ranks that are behind, tells every rank, and throws TimeoutError (or
// aborts the job if chosen). A rank that was not inside a collective throws at its next one.
//
// Settings are process-wide and must be the same on every rank: every MPIBackend checks that they
// are when it is created (a malformed or differing value is the same InvalidArgument on every
// rank). Environment variables (read once, on first use, by one strict parser):
// LOCKSTEP_CHECK=off|first|first:N|always, LOCKSTEP_TIMEOUT=seconds (0: none; unset: the
// default 600 s, enforced by the watchdog, which ends the job), LOCKSTEP_TIMEOUT_ACTION=throw|abort,
// LOCKSTEP_SHM=0|1, LOCKSTEP_SHM_SLICE_BYTES, LOCKSTEP_SHM_MIN_BYTES, LOCKSTEP_CUDA_AWARE_MPI=0|1,
// and LOCKSTEP_FAULT (fault injection, see docs/reliability.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <source_location>
#include <string>

namespace lockstep {

/// How often the ranks compare collective fingerprints.
enum class CheckLevel : std::uint8_t {
  off,    ///< never
  first,  ///< the first N calls of each call site (N = check_first_calls())
  always  ///< every collective
};

/// What a rank does when one of its collectives passes its deadline.
enum class TimeoutAction : std::uint8_t {
  throw_error,  ///< every rank throws TimeoutError (ranks outside a collective at their next one)
  abort         ///< the blame message is printed and the job ends with MPI_Abort
};

/// Sets the fingerprint check level; `first_calls` is N for CheckLevel::first. Same on every rank.
void set_check_level(CheckLevel level, int first_calls = 3);
/// The current check level (from LOCKSTEP_CHECK until set_check_level is called; default off).
CheckLevel check_level();
/// N of CheckLevel::first: how many calls of each call site are checked.
int check_first_calls();

/// Sets the deadline of every blocking collective, in seconds; 0 disables it. Same on every rank.
void set_timeout(double seconds);
/// The current deadline in seconds (from LOCKSTEP_TIMEOUT until set_timeout is called; 0 = none).
/// Without either it is the default, 600 s, which the watchdog enforces by ending the job with
/// the blame report; a chosen deadline makes collectives poll and throw TimeoutError.
double timeout();
/// True while the deadline is the default one (LOCKSTEP_TIMEOUT unset, set_timeout not called).
bool timeout_is_default();
/// Chooses what happens when a deadline passes.
void set_timeout_action(TimeoutAction action);
/// The current timeout action (from LOCKSTEP_TIMEOUT_ACTION; default throw_error).
TimeoutAction timeout_action();

/// "off", "first", "always".
const char* name(CheckLevel level) noexcept;

namespace detail {

/// Where the collective the calling thread is about to start was called: `loc` is the call of
/// the Backend collective itself (recorded by the front end in backend.hpp, so a collective
/// issued inside the library names the library's line), `outer` the user's call of the library
/// function that issued it (synchronize, update, a checkpoint), when there is one. `op` names
/// the collective ("allreduce", ...). Read by the backend when it records the collective.
struct CallSite {
  std::source_location loc;
  std::source_location outer;
  const char* op = nullptr;
  bool known = false;
  bool has_outer = false;
};
inline thread_local CallSite t_call_site;

/// Records a call site for the duration of one call, restoring the previous one after. Nested
/// scopes keep the outermost site as `outer` and the innermost as `loc`.
class CallSiteScope {
 public:
  explicit CallSiteScope(const std::source_location& loc, const char* op = nullptr) noexcept
      : saved_(t_call_site) {
    CallSite s;
    s.loc = loc;
    s.known = true;
    s.op = op != nullptr ? op : saved_.op;
    if (saved_.has_outer) {
      s.outer = saved_.outer;
      s.has_outer = true;
    } else if (saved_.known) {
      s.outer = saved_.loc;
      s.has_outer = true;
    }
    t_call_site = s;
  }
  ~CallSiteScope() { t_call_site = saved_; }
  CallSiteScope(const CallSiteScope&) = delete;
  CallSiteScope& operator=(const CallSiteScope&) = delete;

 private:
  CallSite saved_;
};

/// "allreduce called at train.cpp:40 (inside the call at main.cpp:12)" for the current call
/// site of this thread; "a collective" when none is recorded.
std::string describe_call_site();

/// 64-bit hash of `bytes` bytes (not cryptographic; equal inputs give equal hashes on every rank).
std::uint64_t hash_bytes(const void* data, std::size_t bytes) noexcept;

}  // namespace detail
}  // namespace lockstep
