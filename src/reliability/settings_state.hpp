// Internal: the process-wide settings of lockstep/reliability/settings.hpp, as the monitor of
// the mpi layer (src/mpi/monitor.cpp) reads them on every collective.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "lockstep/reliability/settings.hpp"

namespace lockstep::detail {

// The default deadline (seconds) when LOCKSTEP_TIMEOUT is not set: PyTorch's collectives give up
// after 10 minutes by default too. Long enough for a rank that loads data or writes a checkpoint
// while the others wait; short enough that a dead job does not hold its machines for a night.
// It is enforced by the watchdog thread, which reads no clock on the collective's path (so it
// costs nothing per call) and ends the job with the blame report when it passes.
constexpr double kDefaultTimeout = 600.0;

struct Settings {
  std::atomic<CheckLevel> level{CheckLevel::off};
  std::atomic<int> first_calls{3};
  // The deadline of every blocking wait, in seconds (0: none).
  std::atomic<double> timeout_s{kDefaultTimeout};
  // True when timeout_s was chosen (LOCKSTEP_TIMEOUT or set_timeout): collectives then poll
  // against it and throw TimeoutError (or abort, per action). False for the default, which the
  // watchdog enforces by ending the job.
  std::atomic<bool> timeout_chosen{false};
  std::atomic<TimeoutAction> action{TimeoutAction::throw_error};
  // True while the check level is off and no deadline is polled: collectives then take the
  // hook's fast path (see CommMonitor::enter_fast). Derived from level and timeout by
  // update_quiet(), under quiet_mutex so that two setters on two threads cannot leave it stale.
  std::atomic<bool> quiet{true};
  std::mutex quiet_mutex;

  // Read once from the environment; agreed across ranks by agree_on_settings().
  std::optional<bool> shm;                // LOCKSTEP_SHM
  std::optional<std::uint64_t> shm_slice; // LOCKSTEP_SHM_SLICE_BYTES
  std::optional<std::uint64_t> shm_min;   // LOCKSTEP_SHM_MIN_BYTES
  std::optional<bool> cuda_aware;         // LOCKSTEP_CUDA_AWARE_MPI
  std::optional<bool> ompi_defaults;      // LOCKSTEP_OMPI_DEFAULTS
  // LOCKSTEP_STRAGGLER_WARN (src/mpi/straggler.hpp): seconds (> 0), a fraction of the deadline
  // (< 0: "25%" is -0.25), or 0 (off); LOCKSTEP_STRAGGLER_INTERVAL: seconds between warnings.
  double straggler_warn = -0.25;
  double straggler_interval = 30.0;
  std::string env_error;                  // the first malformed variable, if any
  std::string canonical;                  // what must agree, as text
};

// A namespace-scope object (constant-initialised), so that the per-collective fast path reads
// `quiet` without a function-local static guard or std::call_once; settings() fills it from the
// environment on first use, and every MPIBackend agrees on it when it is created.
extern Settings g_settings __attribute__((visibility("hidden")));

// g_settings, filled from the environment on the first call (a malformed variable is kept in
// env_error, not thrown: agree_on_settings makes every rank throw it together).
Settings& loaded_settings();
// loaded_settings(), throwing the malformed variable on the rank that has it.
Settings& settings();

// The deadline collectives poll against (and throw at): the chosen timeout, 0 for the default
// one (the watchdog enforces that) or none.
inline double polled_timeout() {
  Settings& s = g_settings;
  return s.timeout_chosen.load(std::memory_order_relaxed) ? s.timeout_s.load(std::memory_order_relaxed) : 0.0;
}
// The deadline the watchdog enforces by ending the job: the default one when no other was
// chosen (0: none).
inline double watchdog_timeout() {
  Settings& s = g_settings;
  return s.timeout_chosen.load(std::memory_order_relaxed) ? 0.0 : s.timeout_s.load(std::memory_order_relaxed);
}
}  // namespace lockstep::detail
