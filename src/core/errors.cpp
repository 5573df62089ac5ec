#include "lockstep/core/errors.hpp"

#include <string_view>

namespace lockstep::detail {

std::string where(const std::source_location& loc) {
  std::string_view file = loc.file_name();
  if (auto slash = file.find_last_of('/'); slash != std::string_view::npos) file.remove_prefix(slash + 1);
  return concat(file, ":", loc.line());
}

// rank_suffix() asks MPI_COMM_WORLD for the rank, so it is defined in the mpi layer
// (src/mpi/world.cpp): nothing in the core includes <mpi.h>.

void throw_invalid(const std::string& msg, const std::source_location& loc) {
  throw InvalidArgument(concat(where(loc), ": ", msg, rank_suffix()));
}

}  // namespace lockstep::detail
