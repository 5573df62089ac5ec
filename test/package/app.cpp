// The program both package tests build: one include, initialise, an allreduce, world info.
// Run as an MPI singleton (no mpiexec), so it is a world of one; exits non-zero on a wrong result.
#include <lockstep/lockstep.hpp>

#include <cstdio>
#include <cstring>

namespace ls = lockstep;

int main() {
  ls::initialize<ls::MPIBackend>();
  auto& backend = ls::get_distributed_backend<ls::MPIBackend>();
  ls::Tensor x = ls::Tensor::full({3}, 2.0, ls::DType::f64);
  ls::allreduce(backend, x, ls::ReduceOp::sum);
  const ls::WorldInfo w = ls::world_info();
  const bool ok = x.data<double>()[2] == 2.0 * w.size && ls::size(backend) == w.size &&
                  std::strlen(LOCKSTEP_VERSION_STRING) > 0;
  std::printf("lockstep %s package test: rank %d of %d, allreduce %s\n", LOCKSTEP_VERSION_STRING, w.rank,
              w.size, ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
