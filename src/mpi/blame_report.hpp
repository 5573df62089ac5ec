// The blame report a launcher reads (LOCKSTEP_RUN_ADDR, LOCKSTEP_REPORT_DIR): written by the communicator monitor
// when it detects a stall, and by a remote session whose close gave up on silent ranks. Apart
// from monitor.hpp so that the remote layer can include it (monitor.hpp needs the mpi layer's
// LOCKSTEP_FAULT_INJECTION definition). Defined in monitor.cpp.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

namespace lockstep::detail {

/// LOCKSTEP_RUN_ADDR (set by lockstep-run for every rank, with LOCKSTEP_RUN_TOKEN): the report
/// is sent to lockstep-run's TCP socket there, from whatever host the rank is on (at most 2 s;
/// a failure is said on stderr, once per process, with the report's content).
/// LOCKSTEP_REPORT_DIR (lockstep-run --report-dir, or the user's): the rank that detects a stall writes
/// DIR/blame.WORLDRANK there, a few lines a launcher reads to find the lost hosts:
///   rank W / host H / silent R... / behind R... / message TEXT
/// (`silent` and `behind` are ranks of comm, written as ranks of MPI_COMM_WORLD). Written to a
/// temporary name and renamed: a reader sees all of it or nothing. The directory is made if it
/// does not exist on this host. A failure to write it changes nothing else, but is said on
/// stderr (once per process) with the report's content. Nothing is written or sent when neither
/// variable is set. Used by the
/// monitor (a stall) and by remote sessions (a close that gave up on silent ranks).
void write_blame_report(MPI_Comm comm, const std::vector<int>& silent, const std::vector<int>& behind,
                        const std::string& msg) noexcept;

}  // namespace lockstep::detail
