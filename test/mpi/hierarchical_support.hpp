// The helpers the hierarchical path's tests share (hierarchical_test.cpp,
// hierarchical_reducer_test.cpp: one program).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "lockstep/lockstep.hpp"
#include "test_support.hpp"

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

using lstest::same_on_every_rank;  // test_support.hpp

}  // namespace hier_test
