// Internal (never installed): keep_for_process (core/keep_for_process.hpp) for MPI requests.
#pragma once

#include <mpi.h>

#include <memory>
#include <utility>

#include "core/keep_for_process.hpp"

namespace lockstep::detail {

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
