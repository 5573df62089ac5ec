// What the scenario programs that run_trust.sh drives (trust_program.cpp,
// adversarial_program.cpp) share: each rank prints one line "rank R: <outcome>" per step,
// flushed, so that the script sees it even if the job is killed.
#pragma once

#include <cstdio>
#include <exception>
#include <string>

#include "lockstep/lockstep.hpp"
#include "test_support.hpp"

namespace lstest::scenario {

inline int g_rank = -1;

/// Prints "rank R: s" and flushes.
inline void say(const std::string& s) {
  std::printf("rank %d: %s\n", g_rank, s.c_str());
  std::fflush(stdout);
}

/// Prints an exception as this rank's line: "rank R: <kind>: <what>".
inline void report(const std::exception& e) { say(std::string(error_kind(e)) + ": " + e.what()); }

/// Initialises Lockstep (which starts MPI and finalises it at exit) and returns the global
/// backend. When initialisation fails, reports the error and returns nullptr: main then returns
/// 0 (reported; a non-zero code would make mpiexec end the ranks still printing).
inline ls::MPIBackend* start() {
  try {
    ls::initialize<ls::MPIBackend>();
  } catch (const std::exception& e) {
    g_rank = ls::detail::world_rank();
    report(e);
    return nullptr;
  }
  g_rank = ls::detail::world_rank();
  return &ls::get_distributed_backend<ls::MPIBackend>();
}

/// Runs f: "no exception", or "<kind>: <first line of what>".
template <class F>
std::string outcome(F&& f) {
  try {
    f();
    return "no exception";
  } catch (const std::exception& e) {
    std::string w = e.what();
    return std::string(error_kind(e)) + ": " + w.substr(0, w.find('\n'));
  }
}

}  // namespace lstest::scenario
