// The program the package test builds against find_package(lockstep COMPONENTS torch): a
// LibTorch model, synchronized and trained one step through lockstep::torch, as an MPI
// singleton. Exits non-zero on a wrong result.
#include <torch/torch.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>

#include <cstdio>

namespace ls = lockstep;
namespace lt = lockstep::torch;

int main() {
  ls::initialize<ls::MPIBackend>();
  auto& backend = ls::get_distributed_backend<ls::MPIBackend>();
  torch::nn::Linear net(3, 1);
  lt::synchronize(backend, *net, 0);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  lt::DistributedOptimizer opt(backend, sgd);
  opt.zero_grad();
  net->forward(torch::ones({2, 3})).sum().backward();
  const bool stepped = opt.step();
  const bool ok = stepped && opt.applied_steps() == 1 && lt::view(net->weight).numel == 3;
  std::printf("torch package test: %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
