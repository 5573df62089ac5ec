// Internal (never installed): memory kept for the life of the process. What MPI may still read
// or write after a wait was given up on (a notice's text, the buffers of a collective or of a
// request that may never complete, a communicator being created) must never be freed; it is
// kept here, reachable from one registry, so that leak checkers do not report it. Used by the
// communicator monitor (mpi) and the remote calls (remote).
#pragma once

#include <mpi.h>

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

/// Waits for `req` with wait(req), which may throw or return an error while the request is
/// still pending (a deadline, a stall found elsewhere); then `owner`, what the request reads or
/// writes, is kept for the life of the process, so that a late delivery never lands in memory
/// that was freed and reused. Returns wait's result.
template <class Wait>
int wait_keeping(MPI_Request* req, std::shared_ptr<void> owner, Wait&& wait) {
  int rc;
  try {
    rc = wait(req);
  } catch (...) {
    if (*req != MPI_REQUEST_NULL) keep_for_process(std::move(owner));
    throw;
  }
  if (rc != MPI_SUCCESS && *req != MPI_REQUEST_NULL) keep_for_process(std::move(owner));
  return rc;
}

}  // namespace lockstep::detail
