// Remote calls without MPI_THREAD_MULTIPLE (issue 15, item 2). The program starts MPI itself, at
// the level named on the command line, before Lockstep; then it asks for background serving
// (RemoteOptions::background), for a plain session, and for run_driver. Each must be an
// lockstep::Error on every rank, naming MPI_THREAD_MULTIPLE and the level MPI was started with,
// within seconds (no rank left waiting); afterwards the backend still works.
//
// Usage: remote_thread_level <serialized|funneled|mixed>
//   mixed: rank 0 starts MPI with MPI_THREAD_FUNNELED, the others with MPI_THREAD_MULTIPLE: the
//          ranks that have it must fail as well, with the same message.
// Exit status 0 when every rank saw what it should, 1 otherwise.
#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>

#include "lockstep/lockstep.hpp"
#include "remote_test_support.hpp"

namespace ls = lockstep;

namespace {
int add(int a, int b) { return a + b; }
LOCKSTEP_REMOTE(add)

using namespace remote_test::program;

// Runs f, which must throw lockstep::Error (and nothing more specific than that is asked) with
// every one of `parts` in its message, within 10 s.
template <class F>
void expect_error(const char* what, F f, std::initializer_list<std::string> parts) {
  const auto t0 = std::chrono::steady_clock::now();
  std::string msg;
  bool threw = false;
  try {
    f();
  } catch (const ls::Error& e) {
    threw = true;
    msg = e.what();
  } catch (const std::exception& e) {
    msg = std::string("not a lockstep::Error: ") + e.what();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  check(threw, std::string(what) + ": no lockstep::Error (" + msg + ")");
  for (const auto& p : parts) check(contains(msg, p), std::string(what) + ": the message lacks '" + p + "': " + msg);
  check(s < 10.0, std::string(what) + ": took " + std::to_string(s) + " s");
  if (g_rank == 0) std::cout << what << ": " << msg << " (" << s << " s)" << std::endl;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "serialized" && mode != "funneled" && mode != "mixed") {
    std::cerr << "usage: remote_thread_level <serialized|funneled|mixed>\n";
    return 2;
  }
  // Which rank this is, before MPI starts (mixed needs it to choose its level).
  int env_rank = 0;
  if (const char* r = std::getenv("OMPI_COMM_WORLD_RANK")) env_rank = std::atoi(r);
  int want = mode == "serialized" ? MPI_THREAD_SERIALIZED : MPI_THREAD_FUNNELED;
  if (mode == "mixed" && env_rank != 0) want = MPI_THREAD_MULTIPLE;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, want, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (mode == "mixed" && size < 2) {
    std::cout << "SKIP: mixed needs 2 ranks or more\n";
    MPI_Finalize();
    return 77;
  }
  if (provided == MPI_THREAD_MULTIPLE && (mode != "mixed" || g_rank == 0)) {
    std::cout << "SKIP: MPI gave MPI_THREAD_MULTIPLE where less was asked for\n";
    MPI_Finalize();
    return 77;
  }
  const std::string level0 = mode == "serialized" ? "MPI_THREAD_SERIALIZED on rank" : "MPI_THREAD_FUNNELED on rank";
  {
    ls::initialize<ls::MPIBackend>();  // MPI is already running: Lockstep uses it as it is
    auto& b = ls::get_distributed_backend<ls::MPIBackend>();
    expect_error("background serving",
                 [&] { ls::RemoteSession s(b, ls::RemoteOptions{.background = true, .timeout = 30}); },
                 {"background serving", "MPI_THREAD_MULTIPLE on every rank, and MPI was started with", level0});
    expect_error("a remote session", [&] { ls::RemoteSession s(b, ls::RemoteOptions{.timeout = 30}); },
                 {"MPI_THREAD_MULTIPLE on every rank, and MPI was started with", level0});
    expect_error("run_driver", [&] { ls::run_driver(b, [&] { return ls::remote_sync_call(b, 0, add, 1, 2); }); },
                 {"MPI_THREAD_MULTIPLE on every rank, and MPI was started with", level0});
    if (mode == "mixed") {
      // Only rank 0 lacks it; the message names rank 0 alone.
      expect_error("mixed levels", [&] { ls::RemoteSession s(b, ls::RemoteOptions{.timeout = 30}); },
                   {"MPI_THREAD_FUNNELED on rank 0:"});
    }
    // Nothing is left behind: the backend's collectives work.
    auto x = ls::Tensor::full({16}, 1.0);
    ls::allreduce(b, x, ls::ReduceOp::sum);
    check(x.data<float>()[15] == static_cast<float>(size), "the allreduce after the errors");
    ls::finalize<ls::MPIBackend>();  // MPI belongs to this program: Lockstep leaves it running
  }
  int failures = g_failures, any = 0;
  MPI_Allreduce(&failures, &any, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0) std::cout << (any == 0 ? "PASS" : "FAIL") << " (" << mode << ", " << size << " ranks)\n";
  MPI_Finalize();
  return any == 0 ? 0 : 1;
}
