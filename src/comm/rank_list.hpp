// Internal (never installed): ranks named in an error or a warning, the one way every layer
// writes them: "rank 2" / "ranks 2, 3" (rank_list), with their hosts (ranks_with_hosts), and one
// value per rank, "rank 0: 4, rank 1: 5" (rank_values). In comm, the lowest layer that names
// ranks (the consensus helpers); mpi, train and remote include it from here.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "lockstep/core/errors.hpp"

namespace lockstep::detail {

/// "rank 2" for one rank, "ranks 2, 3" for several.
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += concat(i ? ", " : "", ranks[i]);
  return s;
}

/// "rank 2 (host b)" / "ranks 2, 3 (host b)" / "ranks 1 (host a), 4 (host b)": ranks with their
/// hosts (hosts[r] is rank r's), each host said once after the run of ranks on it.
inline std::string ranks_with_hosts(const std::vector<int>& ranks, const std::vector<std::string>& hosts) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const std::string& h = hosts[static_cast<std::size_t>(ranks[i])];
    s += concat(i ? ", " : "", ranks[i]);
    if (i + 1 == ranks.size() || hosts[static_cast<std::size_t>(ranks[i + 1])] != h) s += concat(" (host ", h, ")");
  }
  return s;
}

/// "rank 0: 4, rank 1: 5": each rank's value (values[r] is rank r's), the first `most` ranks at
/// most, then ", ..." when there are more.
template <class T>
std::string rank_values(const std::vector<T>& values, std::size_t most = static_cast<std::size_t>(-1)) {
  std::string s;
  for (std::size_t r = 0; r < values.size() && r < most; ++r) s += concat(r ? ", " : "", "rank ", r, ": ", values[r]);
  if (values.size() > most) s += ", ...";
  return s;
}

}  // namespace lockstep::detail
