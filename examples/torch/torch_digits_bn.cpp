// torch_digits_bn: a small LibTorch CNN with BatchNorm2d trained data-parallel on scikit-learn's
// handwritten digits as 8x8 planes, its BatchNorms made lt::SyncBatchNorm2d by
// lt::convert_sync_batchnorm.
//
// The model, a torch::nn::Sequential as a user writes it for one process:
//   Conv2d(1 => 16, 3x3, pad 1), BatchNorm2d(16), ReLU, MaxPool2d(2)   8x8 => 4x4
//   Conv2d(16 => 32, 3x3, pad 1), BatchNorm2d(32), ReLU, MaxPool2d(2)  4x4 => 2x2
//   Flatten, Linear(128 => 10)
// The convolutions have no bias: BatchNorm subtracts it again, so its true gradient is 0 and
// Adam would turn the rounding noise in it into steps of lr size (a random walk of the running
// means that makes runs differ by more than rounding).
// convert_sync_batchnorm swaps the two BatchNorm2d for SyncBatchNorm2d (same weights, same
// running statistics), so each batch is normalised with the statistics of the global batch,
// every rank's rows: -n 1, 2 and 4 train the same model (the same test loss, up to float
// rounding), which a plain BatchNorm2d, normalising each rank's share on its own, would not.
// Gradients are averaged by lt::DistributedOptimizer over torch::optim::Adam. The data and the
// split are torch_digits's (digits_data.hpp): 1,500 training images, 297 held out; so is the
// data-parallel loop (digits_training.hpp), with the images seen as 8x8 planes.
//
// Run (from the repository root, after building into build/):
//   mpiexec -n 2 --oversubscribe build/examples/torch/torch_digits_bn --epochs 5
#include <torch/torch.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>
#include <lockstep/torch/sync_batchnorm.hpp>

#include "digits_data.hpp"
#include "digits_training.hpp"
#include "lockstep_cli.hpp"

#include <cstdint>
#include <cstdio>
#include <string>

namespace ls = lockstep;
namespace lt = lockstep::torch;

namespace {

using namespace digits;  // the data set and the shared loop (digits_data.hpp, digits_training.hpp)

struct Options : CommonOptions {
  Options() {
    epochs = 5;
    lr = 3e-3;
  }
};

void add_flags(CLI::App& app, Options& o, int ranks) {
  namespace cli = lockstep_cli;
  add_common_flags(app, o, "epochs to train", "global batch size, split across ranks; a multiple of N", 2);
  app.callback([&o, ranks] {
    if (o.batch % ranks != 0)
      throw cli::refused("--batch", std::to_string(o.batch) + " is not a multiple of the " + std::to_string(ranks) +
                                        " ranks (the global batch is split evenly)");
  });
}

torch::nn::Sequential make_net() {
  namespace nn = torch::nn;
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 16, 3).padding(1).bias(false)), nn::BatchNorm2d(16), nn::ReLU(),
                        nn::MaxPool2d(2), nn::Conv2d(nn::Conv2dOptions(16, 32, 3).padding(1).bias(false)), nn::BatchNorm2d(32),
                        nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(), nn::Linear(32 * 2 * 2, kClasses));
}

torch::Tensor planes(const torch::Tensor& rows) { return rows.view({-1, 1, 8, 8}); }

int run(const Options& o, ls::Backend& backend) {
  const int rank = backend.rank(), ranks = backend.size();
  const bool root = rank == 0;
  const Split data = start(backend, o);
  const Digits &train = data.train, &test = data.test;
  const std::int64_t train_rows = train.y.size(0);
  auto net = make_net();
  const std::size_t converted = lt::convert_sync_batchnorm(backend, *net);  // the two BatchNorm2d
  lt::synchronize(backend, *net, 0);  // rank 0's weights (and running statistics) everywhere
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(o.lr));
  lt::DistributedOptimizer opt(backend, adam, ls::DistributedOptions{}, lt::TorchOptions{.names_from = net.get()});

  const std::int64_t share = o.batch / ranks;
  if (root)
    std::printf("training a CNN with %zu SyncBatchNorm2d on %lld digits as 8x8 planes (%lld held out): %d ranks, "
                "global batch %lld (%lld per rank), Adam lr %g, %lld epochs\n",
                converted, static_cast<long long>(train_rows), static_cast<long long>(kTestRows), ranks,
                static_cast<long long>(o.batch), static_cast<long long>(share), o.lr,
                static_cast<long long>(o.epochs));
  // Forward: one allreduce per SyncBatchNorm; backward: one more per SyncBatchNorm, and the
  // gradient buckets. Evaluation (eval mode) uses the running statistics: no collective in the model.
  const Forward forward = [&net](const torch::Tensor& rows) { return net->forward(planes(rows)); };
  Score score;
  for (std::int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    net->train();
    train_epoch(opt, forward, train, epoch_order(train_rows, o.seed, epoch), o.batch, rank, ranks);
    net->eval();
    score = evaluate(backend, forward, test);
    if (root)
      std::printf("epoch %3lld  test loss %.6f  test accuracy %.4f\n", static_cast<long long>(epoch + 1), score.loss,
                  score.accuracy());
  }
  if (o.epochs == 0) {
    net->eval();
    score = evaluate(backend, forward, test);
  }
  if (root) {
    std::printf("final test loss %.17g\n", score.loss);
    std::printf("final test accuracy %.4f\n", score.accuracy());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  ls::Backend& backend = ls::get_distributed_backend<ls::MPIBackend>();
  Options o;
  lockstep_cli::App app("torch_digits_bn",
                        "A CNN with SyncBatchNorm2d trained on scikit-learn's handwritten digits with lockstep::torch.\n"
                        "Run as: mpiexec -n N torch_digits_bn [flags]");
  add_flags(app, o, backend.size());
  return lockstep_cli::run_main(app, argc, argv, [&] { return run(o, backend); });
}
