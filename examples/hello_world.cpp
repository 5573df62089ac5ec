// hello_world: each rank prints its world info and the result of an allreduce.
// Run: mpiexec -n 4 --oversubscribe ./build/examples/hello_world   (--oversubscribe: more ranks
// than cores; as root, export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 first)
#include <lockstep/lockstep.hpp>

#include <cstdio>

namespace ls = lockstep;

int main() {
  ls::initialize<ls::MPIBackend>();
  auto& backend = ls::get_distributed_backend<ls::MPIBackend>();
  const ls::WorldInfo w = ls::world_info();

  // Every rank contributes rank + 1; the sum is n (n + 1) / 2 on every rank.
  ls::Tensor x = ls::Tensor::full({4}, w.rank + 1.0);
  ls::allreduce(backend, x, ls::ReduceOp::sum);
  std::printf("rank %d of %d (local %d of %d): allreduce sum = %g (expected %d)\n", w.rank, w.size,
              w.local_rank, w.local_size, static_cast<double>(x.data<float>()[0]),
              w.size * (w.size + 1) / 2);
  return 0;
}
