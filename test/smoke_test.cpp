#include <catch2/catch.hpp>

#include "lockstep/lockstep.hpp"

namespace ls = lockstep;

TEST_CASE("allreduce sums across ranks") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  ls::Tensor x = ls::Tensor::full({5}, b.rank() + 1.0);
  ls::allreduce(b, x, ls::ReduceOp::sum);
  CHECK(x.data<float>()[4] == Approx(b.size() * (b.size() + 1) / 2.0));
}
