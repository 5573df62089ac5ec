// Writes a LibTorch model's checkpoint with lockstep::torch (module and Adam state after two
// steps) and, beside it, an input batch and the model's output on it; read_checkpoint.py then
// loads the checkpoint in Python (torch 1.13, a small safetensors reader) into the same
// architecture and checks it computes the same output. Usage: torch_export DIR
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>

#include "lockstep/lockstep.hpp"
#include "lockstep/torch.hpp"

namespace ls = lockstep;
namespace lt = lockstep::torch;

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::relu(bn->forward(fc1->forward(x)))); }
};
TORCH_MODULE(Net);

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: torch_export DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  ls::initialize<ls::MPIBackend>();
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  torch::manual_seed(1);
  Net net;
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  lt::DistributedOptimizer opt(b, adam, {}, {.names_from = net.get()});
  for (int s = 0; s < 2; ++s) {  // training mode: BatchNorm's running statistics move
    opt.zero_grad();
    torch::mse_loss(net->forward(torch::randn({16, 6})), torch::randn({16, 3})).backward();
    opt.step();
  }
  lt::save_checkpoint(b, dir / "model.safetensors", *net, adam);
  net->eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor x = torch::randn({5, 6});
  const torch::Tensor y = net->forward(x).contiguous();
  ls::Checkpoint io;
  io.add("x", lt::borrow(x).reshape_view({5, 6}));
  io.add("y", lt::borrow(y).reshape_view({5, 3}));
  ls::save_checkpoint(dir / "io.safetensors", io);
  std::printf("wrote %s and %s\n", (dir / "model.safetensors").c_str(), (dir / "io.safetensors").c_str());
  return 0;
}
