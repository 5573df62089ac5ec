// Internal (never installed): memory kept for the life of the process. What a backend may still
// read or write after a wait was given up on (a notice's text, the buffers of a collective or of
// a request that may never complete, a communicator being created) must never be freed; it is
// kept here, reachable from one registry, so that leak checkers do not report it. Used by
// Request (comm: the owners a failed request was given), the communicator monitor and the
// hierarchical path (mpi) and the remote calls (remote); MPI's own form is in
// mpi/keep_for_process.hpp.
#pragma once

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace lockstep::detail {

/// Keeps `p` (and what it owns) reachable for the life of the process. A std::unique_ptr
/// converts: keep_for_process(std::move(text)).
inline void keep_for_process(std::shared_ptr<void> p) {
  static std::mutex mu;
  static auto* kept = new std::vector<std::shared_ptr<void>>();  // never freed, on purpose
  std::lock_guard lock(mu);
  kept->push_back(std::move(p));
}

}  // namespace lockstep::detail
