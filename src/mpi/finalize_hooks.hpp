// Internal: what must end before the global MPIBackend goes (and MPI with it, when Lockstep
// started it). The remote layer registers its sessions' end here: a session left open at
// finalize had its progress thread calling MPI after MPI_Finalize, and ended the process in
// std::terminate (a joinable thread in a static table) and MPI_Abort.
#pragma once

#include <functional>

namespace lockstep {
class Backend;
namespace detail {

/// Runs `hook(going, mpi_ends)` in finalize<MPIBackend>(), before the global backend `going`
/// (nullptr when there is none) is destroyed; `mpi_ends`: MPI is finalised after it. Once per
/// `key` (a later registration with the same key replaces it). The hook must not throw and must
/// not call finalize or initialize.
void at_finalize(const void* key, std::function<void(const Backend* going, bool mpi_ends)> hook);

}  // namespace detail
}  // namespace lockstep
