// Remote calls, internal: deadlines, polled waits for MPI requests (with something to do between
// polls) and the session's allgather within a deadline. (Deadlines: mpi/deadline.hpp; memory
// kept for the life of the process: core/keep_for_process.hpp.)
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "lockstep/core/errors.hpp"
#include "lockstep/mpi/mpi_backend.hpp"
#include "lockstep/reliability/settings.hpp"
#include "mpi/deadline.hpp"
#include "core/keep_for_process.hpp"
#include "remote/wire.hpp"

namespace lockstep::detail::remote {

/// A timeout setting in seconds: < 0 is lockstep::timeout() (LOCKSTEP_TIMEOUT).
double resolve_timeout(double t);
/// A pause between two polls, longer the longer nothing happened since `since_active`.
void backoff(Clock::time_point since_active);

/// Polls the requests until they complete or the deadline passes (returns false then). With
/// `statuses`, fills one status per request. Between two polls it calls `meanwhile()`, which
/// returns true when it did something (then the backoff starts again).
template <class Meanwhile>
bool wait_requests(std::vector<MPI_Request>& reqs, Clock::time_point deadline, std::vector<MPI_Status>* statuses,
                   Meanwhile&& meanwhile) {
  auto active = Clock::now();
  if (statuses != nullptr) statuses->resize(reqs.size());
  while (true) {
    int flag = 0;
    LOCKSTEP_MPI_CHECK(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag,
                                   statuses != nullptr ? statuses->data() : MPI_STATUSES_IGNORE));
    if (flag) return true;
    if (Clock::now() >= deadline) return false;
    if (meanwhile()) active = Clock::now();
    else backoff(active);
  }
}

inline bool wait_requests(std::vector<MPI_Request>& reqs, Clock::time_point deadline,
                          std::vector<MPI_Status>* statuses = nullptr) {
  return wait_requests(reqs, deadline, statuses, [] { return false; });
}

/// Iallgather of n bytes per rank over comm, within the deadline; `meanwhile` as in
/// wait_requests. The buffers are the heap's, and kept for ever when the deadline passes.
template <class Meanwhile>
std::vector<std::byte> agree(MPI_Comm comm, int size, const void* mine, int n, double timeout, const char* what,
                             Meanwhile&& meanwhile) {
  const auto un = static_cast<std::size_t>(n);
  auto buf = std::make_shared<std::vector<std::byte>>(un * (static_cast<std::size_t>(size) + 1));
  std::memcpy(buf->data(), mine, un);
  MPI_Request r;
  LOCKSTEP_MPI_CHECK(MPI_Iallgather(buf->data(), n, MPI_BYTE, buf->data() + un, n, MPI_BYTE, comm, &r));
  std::vector<MPI_Request> reqs{r};
  if (!wait_requests(reqs, deadline_or_none(timeout), nullptr, meanwhile)) {
    keep_for_process(buf);
    throw TimeoutError(concat(what, ": not every rank joined within ", timeout, " s", rank_suffix()));
  }
  return std::vector<std::byte>(buf->begin() + static_cast<std::ptrdiff_t>(un), buf->end());
}
inline std::vector<std::byte> agree(MPI_Comm comm, int size, const void* mine, int n, double timeout,
                                    const char* what) {
  return agree(comm, size, mine, n, timeout, what, [] { return false; });
}

}  // namespace lockstep::detail::remote
