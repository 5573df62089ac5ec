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
// split are torch_digits's (digits_data.hpp): 1,500 training images, 297 held out.
//
// Run (from the repository root, after building into build/):
//   mpiexec -n 2 --oversubscribe build/examples/torch/torch_digits_bn --epochs 5
#include <torch/torch.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>
#include <lockstep/torch/sync_batchnorm.hpp>

#include "digits_data.hpp"
#include "lockstep_cli.hpp"

#include <cstdint>
#include <cstdio>
#include <string>

namespace ls = lockstep;
namespace lt = lockstep::torch;

namespace {

using namespace digits;  // the data set (digits_data.hpp)

struct Options {
  std::int64_t epochs = 5;
  std::int64_t batch = 60;
  double lr = 3e-3;
  std::uint64_t seed = 42;
  int threads = 1;
  std::string data = kDefaultData;
};

void add_flags(CLI::App& app, Options& o, int ranks) {
  namespace cli = lockstep_cli;
  app.add_option("--epochs", o.epochs, "epochs to train")->type_name("E")->check(cli::at_least(0));
  app.add_option("--batch", o.batch, "global batch size, split across ranks; a multiple of N")->type_name("B")
      ->check(cli::at_least(2));
  app.add_option("--lr", o.lr, "Adam learning rate")->type_name("LR")->check(cli::positive());
  app.add_option("--seed", o.seed, "seed of the initial weights and the per-epoch shuffles")->type_name("SEED")
      ->check(cli::at_least(0));
  app.add_option("--threads", o.threads, "LibTorch intra-op threads per rank")->type_name("T")->check(cli::at_least(1));
  app.add_option("--data", o.data, "digits.csv.gz (default: python3-sklearn's copy)")->type_name("PATH");
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

/// Mean cross-entropy over the whole test set, in eval mode (the running statistics: no
/// collective in the model); each rank scores its share, the sums are reduced.
std::pair<double, double> evaluate(ls::Backend& backend, torch::nn::Sequential& net, const Digits& test) {
  torch::NoGradGuard no_grad;
  const std::int64_t n = test.y.size(0), lo = n * backend.rank() / backend.size(),
                     hi = n * (backend.rank() + 1) / backend.size();
  auto sums = torch::zeros({2}, torch::kDouble);  // loss sum, correct count
  if (hi > lo) {
    const auto logits = net->forward(planes(test.x.narrow(0, lo, hi - lo)));
    const auto y = test.y.narrow(0, lo, hi - lo);
    sums[0] = torch::nn::functional::cross_entropy(
                  logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                  .item<double>();
    sums[1] = logits.argmax(1).eq(y).sum().item<double>();
  }
  backend.allreduce(lt::view(sums), ls::ReduceOp::sum);
  return {sums[0].item<double>() / static_cast<double>(n), sums[1].item<double>() / static_cast<double>(n)};
}

int run(const Options& o, ls::Backend& backend) {
  const int rank = backend.rank(), ranks = backend.size();
  const bool root = rank == 0;
  torch::set_num_threads(o.threads);

  Digits all;
  const std::string read_error = read_digits(o.data, all);
  std::int32_t ok = read_error.empty() ? 1 : 0;
  backend.allreduce(ls::TensorView{&ok, 1, ls::DType::i32, ls::Device::cpu()}, ls::ReduceOp::min);
  if (!read_error.empty()) throw ls::InvalidArgument(read_error);
  if (ok == 0) throw ls::InvalidArgument("another rank could not read the digits data set (see its message)");
  const std::int64_t rows = all.y.size(0), train_rows = rows - kTestRows;
  const auto split = permutation(rows, kSplitSeed);
  const auto train_idx = index_tensor(split.data(), train_rows);
  const auto test_idx = index_tensor(split.data() + train_rows, kTestRows);
  const Digits train{all.x.index_select(0, train_idx), all.y.index_select(0, train_idx)};
  const Digits test{all.x.index_select(0, test_idx), all.y.index_select(0, test_idx)};

  torch::manual_seed(o.seed + static_cast<std::uint64_t>(rank));
  auto net = make_net();
  const std::size_t converted = lt::convert_sync_batchnorm(backend, *net);  // the two BatchNorm2d
  lt::synchronize(backend, *net, 0);  // rank 0's weights (and running statistics) everywhere
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(o.lr));
  lt::DistributedOptimizer opt(backend, adam, ls::DistributedOptions{}, lt::TorchOptions{.names_from = net.get()});

  const std::int64_t share = o.batch / ranks, batches = train_rows / o.batch;
  if (root)
    std::printf("training a CNN with %zu SyncBatchNorm2d on %lld digits as 8x8 planes (%lld held out): %d ranks, "
                "global batch %lld (%lld per rank), Adam lr %g, %lld epochs\n",
                converted, static_cast<long long>(train_rows), static_cast<long long>(kTestRows), ranks,
                static_cast<long long>(o.batch), static_cast<long long>(share), o.lr,
                static_cast<long long>(o.epochs));
  std::pair<double, double> score{0, 0};
  for (std::int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    net->train();
    const auto order = permutation(train_rows, o.seed * 1000003u + static_cast<std::uint64_t>(epoch));
    for (std::int64_t b = 0; b < batches; ++b) {
      const auto idx = index_tensor(order.data() + b * o.batch + rank * share, share);
      opt.zero_grad();
      // Forward: one allreduce per SyncBatchNorm; backward: one more per SyncBatchNorm, and the
      // gradient buckets.
      torch::nn::functional::cross_entropy(net->forward(planes(train.x.index_select(0, idx))),
                                           train.y.index_select(0, idx))
          .backward();
      opt.step();
    }
    net->eval();
    score = evaluate(backend, net, test);
    if (root)
      std::printf("epoch %3lld  test loss %.6f  test accuracy %.4f\n", static_cast<long long>(epoch + 1),
                  score.first, score.second);
  }
  if (o.epochs == 0) {
    net->eval();
    score = evaluate(backend, net, test);
  }
  if (root) {
    std::printf("final test loss %.17g\n", score.first);
    std::printf("final test accuracy %.4f\n", score.second);
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
