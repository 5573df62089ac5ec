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

#include <cstdint>

#include "lockstep/reliability/call_site.hpp"  // kept here for the users of the old reliability.hpp

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
[[nodiscard]] CheckLevel check_level();
/// N of CheckLevel::first: how many calls of each call site are checked.
[[nodiscard]] int check_first_calls();

/// Sets the deadline of every blocking collective, in seconds; 0 disables it. Same on every rank.
void set_timeout(double seconds);
/// The current deadline in seconds (from LOCKSTEP_TIMEOUT until set_timeout is called; 0 = none).
/// Without either it is the default, 600 s, which the watchdog enforces by ending the job with
/// the blame report; a chosen deadline makes collectives poll and throw TimeoutError.
[[nodiscard]] double timeout();
/// True while the deadline is the default one (LOCKSTEP_TIMEOUT unset, set_timeout not called).
[[nodiscard]] bool timeout_is_default();
/// Chooses what happens when a deadline passes.
void set_timeout_action(TimeoutAction action);
/// The current timeout action (from LOCKSTEP_TIMEOUT_ACTION; default throw_error).
[[nodiscard]] TimeoutAction timeout_action();

/// "off", "first", "always".
[[nodiscard]] const char* name(CheckLevel level) noexcept;

}  // namespace lockstep
