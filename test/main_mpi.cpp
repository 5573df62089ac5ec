// The one MPI-aware Catch2 main of the test suite: initialise MPI, run the Catch2 session on
// every rank, combine the results across ranks, finalise. Only rank 0 prints its report; a
// failing rank other than 0 prints its own report to stderr, prefixed with its rank.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <mpi.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "lockstep/lockstep.hpp"

int main(int argc, char** argv) {
  lockstep::initialize<lockstep::MPIBackend>();
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  Catch::Session session;
  std::vector<char*> args(argv, argv + argc);
  std::string out_file;
  std::string out_flag = "--out";
  if (rank != 0) {
    out_file = "/tmp/lockstep-test-" + std::to_string(::getpid()) + ".txt";
    args.push_back(out_flag.data());
    args.push_back(out_file.data());
  }
  int rc = session.applyCommandLine(static_cast<int>(args.size()), args.data());
  int failed = rc != 0 ? 1 : session.run();
  if (rank != 0) {
    if (failed != 0) {
      std::ifstream in(out_file);
      std::stringstream ss;
      ss << in.rdbuf();
      std::cerr << "---- report of rank " << rank << "/" << size << " (failed) ----\n" << ss.str();
    }
    std::remove(out_file.c_str());
  }
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed != 0 && failed == 0)
    std::cerr << "some rank other than 0 failed (see its report above)\n";
  lockstep::finalize<lockstep::MPIBackend>();
  return any_failed != 0 ? 1 : 0;
}
