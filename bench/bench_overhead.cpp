// bench_overhead: a probe for profilers. Calls MPIBackend::allreduce and the raw MPI_Allreduce
// on the same 8-byte buffer, each from its own non-inlined loop, so that a profiler separates
// what Lockstep adds per call from the MPI call itself. bench/profile_overhead.sh runs it under
// valgrind --tool=callgrind and prints the instructions per call, outside the transfer and in all.
//
// Run: mpiexec -n 2 ./bench_overhead [calls]   (exits non-zero if a result is wrong)
#include <lockstep/lockstep.hpp>

#include <cstdio>

#include "lockstep_cli.hpp"

namespace ls = lockstep;

__attribute__((noinline)) void lockstep_loop(ls::MPIBackend& be, ls::TensorView v, int n) {
  for (int i = 0; i < n; ++i) be.allreduce(v, ls::ReduceOp::sum);
}
__attribute__((noinline)) void raw_loop(MPI_Comm c, float* p, int n) {
  for (int i = 0; i < n; ++i) MPI_Allreduce(MPI_IN_PLACE, p, 2, MPI_FLOAT, MPI_SUM, c);
}

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  int calls = 2000;
  lockstep_cli::App app("bench_overhead", "MPIBackend::allreduce and MPI_Allreduce of 8 bytes, each from its own loop (for profilers)");
  app.add_option("calls", calls, "calls of each")->check(lockstep_cli::at_least(0));
  if (const auto rc = lockstep_cli::parse(app, argc, argv)) return *rc;
  auto& be = ls::get_distributed_backend<ls::MPIBackend>();
  float x[2] = {0.0f, 0.0f};  // zeros stay zeros: the loops can run any number of times
  ls::TensorView v{x, 2, ls::DType::f32, ls::Device::cpu()};
  lockstep_loop(be, v, calls);
  raw_loop(be.comm(), x, calls);
  // A real check that both paths reduce: rank r contributes r + 1.
  float y[2] = {static_cast<float>(be.rank() + 1), 1.0f};
  be.allreduce(ls::TensorView{y, 2, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::sum);
  const int n = be.size();
  const bool ok = y[0] == static_cast<float>(n * (n + 1) / 2) && y[1] == static_cast<float>(n);
  if (be.rank() == 0) std::printf("bench_overhead: %d calls each, result %s\n", calls, ok ? "correct" : "WRONG");
  return ok ? 0 : 1;
}
