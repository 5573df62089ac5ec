#include "lockstep/core/errors.hpp"

#include <mpi.h>

#include <string_view>

namespace lockstep::detail {

std::string where(const std::source_location& loc) {
  std::string_view file = loc.file_name();
  if (auto slash = file.find_last_of('/'); slash != std::string_view::npos) file.remove_prefix(slash + 1);
  return concat(file, ":", loc.line());
}

std::string rank_suffix() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) return "";
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return concat(" [rank ", rank, "/", size, "]");
}

void throw_invalid(const std::string& msg, const std::source_location& loc) {
  throw InvalidArgument(concat(where(loc), ": ", msg, rank_suffix()));
}

}  // namespace lockstep::detail
