// The one MPI-aware Catch2 main of the test suite: initialise MPI, run the Catch2 session on
// every rank, combine the results across ranks, finalise. Only rank 0 prints its report; a
// failing rank other than 0 prints its own report to stderr, prefixed with its rank.
//
// The GPU tests (test/tests_40_gpu.cmake) build it with LOCKSTEP_TEST_GPU=1, which adds one
// rule: a machine without a usable GPU reports the test skipped to CTest (exit code 77) rather
// than passing it. With LOCKSTEP_TEST_GPU_DEVICE_PER_RANK=1 a test also needs one device per
// node-local rank (NCCL refuses two ranks on one GPU); with LOCKSTEP_TEST_GPU_WITH_NCCL=1 the
// NCCL backend is finalised too.
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

#ifndef LOCKSTEP_TEST_GPU
#define LOCKSTEP_TEST_GPU 0
#endif
#ifndef LOCKSTEP_TEST_GPU_DEVICE_PER_RANK
#define LOCKSTEP_TEST_GPU_DEVICE_PER_RANK 0
#endif
#ifndef LOCKSTEP_TEST_GPU_WITH_NCCL
#define LOCKSTEP_TEST_GPU_WITH_NCCL 0
#endif
#if LOCKSTEP_TEST_GPU
#include "lockstep/cuda.hpp"
#endif
#if LOCKSTEP_TEST_GPU_WITH_NCCL
#include "lockstep/nccl.hpp"
#endif

namespace {
// NCCL before MPI: the NCCL backend holds an MPIBackend (and its watchdog thread) over MPI, so
// it must be gone before MPI_Finalize, not destroyed later by its at-exit handler.
void finalize_all() {
#if LOCKSTEP_TEST_GPU_WITH_NCCL
  lockstep::finalize<lockstep::NCCLBackend>();
#endif
  lockstep::finalize<lockstep::MPIBackend>();
}

#if LOCKSTEP_TEST_GPU
// Whether every rank has the GPUs the test needs; every rank decides together, so that no rank
// runs collectives the others skip.
bool gpus_usable(lockstep::MPIBackend& world) {
  lockstep::cuda::init();
  const int devices = lockstep::cuda::device_count();
  const int needed = LOCKSTEP_TEST_GPU_DEVICE_PER_RANK ? world.local_size() : 1;
  int ok = devices >= needed ? 1 : 0, all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_ok && world.rank() == 0)
    std::cout << "skipped: this test needs " << needed << " CUDA device(s) per node, " << devices << " visible\n";
  return all_ok != 0;
}
#endif
}  // namespace

int main(int argc, char** argv) {
  lockstep::initialize<lockstep::MPIBackend>();
  auto& world = lockstep::get_distributed_backend<lockstep::MPIBackend>();
  const int rank = world.rank(), size = world.size();
#if LOCKSTEP_TEST_GPU
  if (!gpus_usable(world)) {
    finalize_all();
    return 77;
  }
#endif

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
  finalize_all();
  return any_failed != 0 ? 1 : 0;
}
