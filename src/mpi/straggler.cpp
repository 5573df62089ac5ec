// The straggler warning (straggler.hpp): which ranks a collective still waits on, from the
// timings of one status query per slow collective.
#include "mpi/straggler.hpp"

#include <algorithm>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>

#include "comm/rank_list.hpp"
#include "lockstep/core/errors.hpp"
#include "reliability/settings_state.hpp"

namespace lockstep::detail {

namespace {

struct StragglerSettings {
  double warn;      // seconds (> 0), a fraction of the deadline (< 0), or 0: off
  double interval;  // seconds between two warnings of a process
};

// Parsed with the other LOCKSTEP_* settings (src/reliability/settings.cpp) and agreed across
// ranks when a backend is made, so a malformed value stops every rank alike.
StragglerSettings straggler_settings() {
  const Settings& s = settings();
  return {s.straggler_warn, s.straggler_interval};
}

std::string straggler_secs(double s) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(s < 0.1 ? 3 : 1) << s << " s";
  return os.str();
}

}  // namespace

double straggler_clock_now() noexcept {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

StragglerWatch::StragglerWatch(int rank, std::vector<std::string> hosts) : rank_(rank), hosts_(std::move(hosts)) {
}

double StragglerWatch::after(double timeout) const {
  const double w = straggler_settings().warn;
  if (w == 0 || timeout <= 0 || straggler_clock_now() - last_look_.load(std::memory_order_relaxed) < kLookGap) return 0;
  const double s = w < 0 ? -w * timeout : w;
  return s < timeout ? s : 0;
}

void StragglerWatch::look(const std::string& what, double waited, double timeout,
                          const std::function<void(std::vector<PeerAnswer>&, double)>& query) noexcept {
  try {
    last_look_.store(straggler_clock_now(), std::memory_order_relaxed);
    const int size = static_cast<int>(hosts_.size());
    std::vector<PeerAnswer> a(static_cast<std::size_t>(size));
    // Answers are waited for until shortly before the deadline (a later one would stay queued
    // and be taken for the answer to the next query), at most 3 s.
    query(a, std::max(0.05, std::min(3.0, 0.9 * (timeout - waited))));
    // A delay is slow above a tenth of the wait so far (at least 50 ms): well above what a
    // loaded host's scheduling adds, well below what holds a collective up.
    const double slow = std::max(0.05, waited / 10);
    std::vector<int> late, behind, out_late;  // reach this rank late; not yet in it; this rank's reach them late
    double late_max = 0, fast_max = 0, out_max = 0;
    int remote_peers = 0, remote_answered = 0;
    for (int r = 0; r < size; ++r) {
      if (r == rank_) continue;
      const PeerAnswer& p = a[static_cast<std::size_t>(r)];
      const bool remote = hosts_[static_cast<std::size_t>(r)] != hosts_[static_cast<std::size_t>(rank_)];
      remote_peers += remote;
      if (!p.answered) {
        late.push_back(r);
        late_max = std::max(late_max, p.received - p.sent);
        continue;
      }
      remote_answered += remote;
      if (p.behind) behind.push_back(r);
      const double back = p.received - p.stamped, out = p.stamped - p.sent;
      if (back > slow) {
        late.push_back(r);
        late_max = std::max(late_max, back);
      } else {
        fast_max = std::max(fast_max, back);
        if (remote && out > slow) {
          out_late.push_back(r);
          out_max = std::max(out_max, out);
        }
      }
    }
    auto names = [&](const std::vector<int>& ranks) { return ranks_with_hosts(ranks, hosts_); };
    std::string key, text;
    if (!late.empty()) {
      key = "late " + names(late);
      text = concat(names(late), " answered a status query only after ", straggler_secs(late_max),
                    " (the others within ", straggler_secs(fast_max), "), or not yet: their host or its link is slow");
    } else if (!behind.empty()) {
      key = "behind " + names(behind);
      text = concat(names(behind), " had not yet entered it and ", behind.size() == 1 ? "was" : "were",
                    " inside no collective: behind (slower compute, or held up elsewhere)");
    } else if (!out_late.empty() && static_cast<int>(out_late.size()) == remote_answered && remote_peers > 0) {
      // Every rank on another host receives this rank's messages late, and answers at once:
      // this host's own sending is slow.
      key = "self " + std::to_string(rank_);
      text = concat("this rank's messages reached ", names(out_late), " only after up to ", straggler_secs(out_max),
                    ": this rank's host (", hosts_[static_cast<std::size_t>(rank_)], ") or its link is slow");
    } else {
      return;  // every rank answers at once and has entered: the data is just large
    }
    const double now = straggler_clock_now();
    if (named_.count(key) != 0 || now - last_warning_ < straggler_settings().interval) return;
    named_.insert(key);
    last_warning_ = now;
    std::cerr << "lockstep: straggler warning: " << what << " has waited " << straggler_secs(waited) << " of its "
              << straggler_secs(timeout) << " deadline on rank " << rank_ << "/" << size << "; " << text
              << ". Training goes on (LOCKSTEP_STRAGGLER_WARN sets when this is looked at; off: never)." << std::endl;
  } catch (...) {
  }
}

}  // namespace lockstep::detail
