// Internal: the straggler warning of a monitored communicator (docs/reliability.md, "A slow
// host"). When a collective under a deadline has waited LOCKSTEP_STRAGGLER_WARN seconds (default:
// a quarter of LOCKSTEP_TIMEOUT; 0 or "off": never), the monitor (monitor.cpp) asks every other
// rank's watchdog for its status, as a stall report does, and hands the timings here: for each
// rank, when the query left, when that rank's watchdog stamped its answer (its system clock), and
// when the answer came back. A rank whose answers reach this one late (answer delay well above
// the others') is named, with its host: its host, or its link, is slow. A rank whose own queries
// reach the others late names its own host. Printed to stderr once per set of ranks, at most one
// warning per LOCKSTEP_STRAGGLER_INTERVAL seconds (default 30); nothing is thrown, training goes
// on. The one-way delays need clocks synchronised (NTP) to well under the delays named.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <set>
#include <string>
#include <vector>

namespace lockstep::detail {

/// One rank's answer to a timed status query (system-clock seconds since the epoch).
struct PeerAnswer {
  bool answered = false;
  double sent = 0;      // when this rank sent the query
  double stamped = 0;   // when the peer's watchdog answered (the peer's clock)
  double received = 0;  // when the answer arrived here
  bool behind = false;  // the peer had not yet entered this collective, and was in none
};

/// Seconds since the epoch on the system clock (what PeerAnswer holds).
double straggler_clock_now() noexcept;

class StragglerWatch {
 public:
  StragglerWatch(int rank, std::vector<std::string> hosts);
  /// Seconds after a collective's entry at which to look, for deadline `timeout` (> 0); <= 0:
  /// never (off, not shorter than the deadline, or the last look was under kLookGap s ago: in a
  /// job that stays slow, not every collective pays for a query). The settings are read with
  /// the other LOCKSTEP_* ones (src/reliability/settings.cpp), agreed across ranks.
  double after(double timeout) const;
  static constexpr double kLookGap = 5.0;
  /// The collective `what` has waited `waited` s of its `timeout`: `query(answers, give_up_s)`
  /// asks every rank (answers[rank] for each, this rank's own left unanswered) and waits at most
  /// give_up_s for the answers. Prints the warning, if any. Never throws.
  void look(const std::string& what, double waited, double timeout,
            const std::function<void(std::vector<PeerAnswer>&, double)>& query) noexcept;

 private:
  int rank_;
  std::vector<std::string> hosts_;
  std::set<std::string> named_;  // rank sets already warned about
  double last_warning_ = -1e18;
  std::atomic<double> last_look_{-1e18};
};

}  // namespace lockstep::detail
