// The helpers the hierarchical path's tests share (hierarchical_test.cpp,
// hierarchical_reducer_test.cpp: one program).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "lockstep/lockstep.hpp"

namespace hier_test {

inline lockstep::MPIBackend& backend() { return lockstep::get_distributed_backend<lockstep::MPIBackend>(); }

inline int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' ? fallback : std::atoi(v);
}
inline bool env_off(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && (std::string(v) == "0" || std::string(v) == "off");
}

/// True on every rank when `ok` is true on every rank.
inline bool all_ranks(bool ok) {
  int v = ok ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return v == 1;
}

/// True on every rank when the bytes hash alike on every rank.
inline bool same_on_every_rank(const void* p, std::size_t bytes) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  std::uint64_t lo = h, hi = h;
  MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

}  // namespace hier_test
