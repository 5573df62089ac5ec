// torch_digits: a LibTorch MLP trained data-parallel with lockstep::torch on scikit-learn's
// handwritten digits (1,797 8x8 images, 10 classes); the data set is read by digits_data.hpp.
//
// The model is Linear(64 => 128), ReLU, Linear(128 => 10), trained with cross-entropy and
// torch::optim::Adam wrapped in lt::DistributedOptimizer. The data is the gzipped CSV that
// Debian's python3-sklearn ships (64 pixel values 0-16, then the label, per row), read with zlib.
// A fixed shuffle holds out 297 images as the test set; the other 1,500 are the training set.
// Every epoch all ranks draw the same permutation of the training set (from --seed and the epoch)
// and each takes its 1/N of every global batch, so -n 1, 2 and 4 train the same model: the
// gradients are averaged across ranks during backward. Each rank scores its share of the test
// set; the correct counts are summed across ranks, so the accuracy printed by rank 0 is over the
// whole test set.
//
// With --deterministic every global batch is cut into micro-batches of --micro-batch rows (10 by
// default), dealt to the ranks by global index (ls::micro_batches_of: a contiguous block each,
// some ranks one more, maybe none); each micro-batch's gradient is computed alone and handed to
// opt.accumulate(), and opt.step() sums every micro-batch of every rank exactly
// (DistributedOptions::deterministic), so -n 1, 2, 3 and 4 train the same model bit for bit.
// Every run ends with the line `model hash crc32c:XXXXXXXX` (lt::model_hash of the parameters).
//
// The epoch count lives in the model, as an int64 buffer "epochs_done": lt::save_checkpoint
// writes it with the parameters and Adam's state in one atomic file, so a checkpoint can never
// hold the weights of one epoch and the epoch number of another.
//
// Run (from the repository root, after building into build/):
//   mpiexec -n 2 --oversubscribe build/examples/torch/torch_digits --epochs 20
//   # stop and resume: 5 epochs, then continue to 20 from the checkpoint
//   mpiexec -n 2 --oversubscribe build/examples/torch/torch_digits --epochs 5 --checkpoint ck.safetensors
//   mpiexec -n 2 --oversubscribe build/examples/torch/torch_digits --epochs 20 --checkpoint ck.safetensors --resume
//   # deterministic: the same last line (model hash) at -n 1, 2, 3 and 4
//   mpiexec -n 3 --oversubscribe build/examples/torch/torch_digits --epochs 2 --deterministic
// `torch_digits --help` lists every flag; docs/torch.md describes the output and the checkpoint.
#include <torch/torch.h>
#include <zlib.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>

#include "digits_data.hpp"
#include "digits_training.hpp"
#include "lockstep_cli.hpp"

#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace ls = lockstep;
namespace lt = lockstep::torch;

namespace {

using namespace digits;  // the data set and the shared loop (digits_data.hpp, digits_training.hpp)

struct Options : CommonOptions {
  std::string checkpoint;
  bool resume = false;
  bool deterministic = false;
  std::int64_t micro_batch = 10;  // with --deterministic: 60 / 10 = 6 micro-batches per global batch
};

/// The flags, one line each; lockstep_cli::parse then checks them the same way on every rank.
void add_flags(CLI::App& app, Options& o, int ranks) {
  namespace cli = lockstep_cli;
  add_common_flags(app, o, "epochs to train in total",
                   "global batch size, split across ranks; a multiple of N (with --deterministic: of --micro-batch)", 1);
  app.add_option("--checkpoint", o.checkpoint, "write a checkpoint there after every epoch")->type_name("PATH");
  app.add_flag("--resume", o.resume, "continue from --checkpoint PATH after its last epoch");
  app.add_flag("--deterministic", o.deterministic,
               "the same model bit for bit at any rank count (micro-batches by global index, exact sums)");
  auto* micro = app.add_option("--micro-batch", o.micro_batch,
                               "with --deterministic: rows per micro-batch (--batch a multiple of it)")
                    ->type_name("M")
                    ->check(cli::at_least(1));
  // Checks across flags, after all of them are read.
  app.callback([&o, ranks, micro] {
    if (!o.deterministic && micro->count() > 0) throw cli::refused("--micro-batch", "needs --deterministic");
    // Deterministic: ranks take whole micro-batches, any number each, so only the micro-batch
    // size must divide the global batch.
    if (o.deterministic && o.batch % o.micro_batch != 0)
      throw cli::refused("--batch", std::to_string(o.batch) + " is not a multiple of --micro-batch " +
                                        std::to_string(o.micro_batch) + " (a global batch is made of whole micro-batches)");
    if (!o.deterministic && o.batch % ranks != 0)
      throw cli::refused("--batch", std::to_string(o.batch) + " is not a multiple of the " + std::to_string(ranks) +
                                        " ranks (the global batch is split evenly)");
    if (o.resume && o.checkpoint.empty()) throw cli::refused("--resume", "needs --checkpoint PATH");
  });
}

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor epochs_done;  // training bookkeeping, saved and loaded with the weights
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kPixels, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, kClasses));
    epochs_done = register_buffer("epochs_done", torch::zeros({1}, torch::kLong));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::relu(fc1->forward(x))); }
};
TORCH_MODULE(Net);

int run(const Options& o, ls::Backend& backend) {
  const int rank = backend.rank();
  const int ranks = backend.size();
  const bool root = rank == 0;

  // Every rank reads the file (they agree on success before the first collective that needs it)
  // and starts from its own random weights; synchronize makes them rank 0's.
  const Split data = start(backend, o);
  const Digits &train = data.train, &test = data.test;
  const std::int64_t train_rows = train.y.size(0);
  Net net;
  const Forward forward = [&net](const torch::Tensor& x) { return net->forward(x); };
  lt::synchronize(backend, *net, 0);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(o.lr));
  lt::synchronize(backend, adam, 0);

  if (o.resume) {
    // Before the DistributedOptimizer exists: load_checkpoint fills the parameters, the
    // "epochs_done" buffer and Adam's state (step count, moments) with the file's values.
    lt::load_checkpoint(backend, o.checkpoint, *net, adam);
    if (root)
      std::printf("resumed from %s after epoch %lld\n", o.checkpoint.c_str(),
                  static_cast<long long>(net->epochs_done.item<std::int64_t>()));
  }
  // Deterministic: the optimizer also sets LibTorch's intra-op threads to --threads (the same in
  // every run compared) and its deterministic algorithms.
  lt::DistributedOptimizer opt(backend, adam, ls::DistributedOptions{.deterministic = o.deterministic},
                               lt::TorchOptions{.names_from = net.get(), .deterministic_threads = o.threads});

  const std::int64_t share = o.batch / ranks;
  const std::int64_t batches = train_rows / o.batch;  // the last partial batch is dropped
  if (root && o.deterministic)
    std::printf("training Linear(64=>128), ReLU, Linear(128=>10) on %lld digits (%lld held out): %d ranks, "
                "global batch %lld (%lld micro-batches of %lld, deterministic), Adam lr %g, %lld epochs\n",
                static_cast<long long>(train_rows), static_cast<long long>(kTestRows), ranks,
                static_cast<long long>(o.batch), static_cast<long long>(o.batch / o.micro_batch),
                static_cast<long long>(o.micro_batch), o.lr, static_cast<long long>(o.epochs));
  else if (root)
    std::printf("training Linear(64=>128), ReLU, Linear(128=>10) on %lld digits (%lld held out): %d ranks, "
                "global batch %lld (%lld per rank), Adam lr %g, %lld epochs\n",
                static_cast<long long>(train_rows), static_cast<long long>(kTestRows), ranks,
                static_cast<long long>(o.batch), static_cast<long long>(share), o.lr,
                static_cast<long long>(o.epochs));
  // Deterministic: this rank's block of each global batch's micro-batches (the same deal for every
  // batch); which rows micro-batch m holds depends on the seed, the epoch and m only.
  const ls::MicroBatches mine =
      o.deterministic ? ls::micro_batches_of(o.batch, o.micro_batch, rank, ranks) : ls::MicroBatches{};

  const auto t_start = std::chrono::steady_clock::now();
  std::int64_t epoch = net->epochs_done.item<std::int64_t>();
  const std::int64_t first_epoch = epoch;
  double train_loss = 0;
  Score score;
  while (epoch < o.epochs) {
    net->train();
    const auto order = epoch_order(train_rows, o.seed, epoch);
    double loss_sum = 0;  // this rank's summed cross-entropy
    for (std::int64_t b = 0; b < batches && o.deterministic; ++b) {
      // Each micro-batch's gradient alone (the mean over its rows: accumulate() zeroes the
      // gradients after taking them), then the collective step: the exact sum over every rank's
      // micro-batches divided by their count, the mean over the global batch, then Adam.
      opt.zero_grad();
      for (std::int64_t m : mine) {
        const auto idx = index_tensor(order.data() + b * o.batch + m * o.micro_batch, o.micro_batch);
        const auto x = train.x.index_select(0, idx), y = train.y.index_select(0, idx);
        auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
        loss.backward();
        opt.accumulate();
        loss_sum += loss.item<double>() * static_cast<double>(o.micro_batch);
      }
      opt.step();  // also on a rank without micro-batches
    }
    if (!o.deterministic) loss_sum = train_epoch(opt, forward, train, order, o.batch, rank, ranks);
    auto sums = torch::tensor({loss_sum}, torch::kDouble);
    backend.allreduce(lt::view(sums), ls::ReduceOp::sum);
    train_loss = sums[0].item<double>() / static_cast<double>(batches * o.batch);
    net->eval();
    score = evaluate(backend, forward, test);
    ++epoch;
    net->epochs_done.fill_(epoch);
    if (root)
      std::printf("epoch %3lld  train loss %.6f  test loss %.6f  test accuracy %.4f (%lld/%lld)\n",
                  static_cast<long long>(epoch), train_loss, score.loss,
                  score.accuracy(), static_cast<long long>(score.correct), static_cast<long long>(score.total));
    if (!o.checkpoint.empty()) lt::save_checkpoint(backend, o.checkpoint, *net, adam);
  }
  if (epoch == first_epoch) {
    // Nothing trained in this run (--resume at or past --epochs): score the model as it is.
    net->eval();
    score = evaluate(backend, forward, test);
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  if (root) {
    std::printf("done: %lld epochs (%lld this run) on %d ranks in %.2f s, %lld optimizer steps this run\n",
                static_cast<long long>(epoch), static_cast<long long>(epoch - first_epoch), ranks, total,
                static_cast<long long>(opt.applied_steps()));
    if (epoch > first_epoch) std::printf("final train loss %.17g\n", train_loss);
    std::printf("final test loss %.17g\n", score.loss);
    std::printf("final test accuracy %.4f (%lld/%lld)\n",
                score.accuracy(), static_cast<long long>(score.correct), static_cast<long long>(score.total));
    if (!o.checkpoint.empty()) std::printf("checkpoint: %s\n", o.checkpoint.c_str());
    // The last line: the parameters' bytes in name order, to compare runs bit for bit.
    std::printf("model hash %s\n", lt::model_hash(*net).c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  ls::Backend& backend = ls::get_distributed_backend<ls::MPIBackend>();
  const int ranks = backend.size();
  Options o;
  lockstep_cli::App app("torch_digits", "An MLP trained on scikit-learn's handwritten digits with lockstep::torch.\n"
                                        "Run as: mpiexec -n N torch_digits [flags]");
  add_flags(app, o, ranks);
  return lockstep_cli::run_main(app, argc, argv, [&] { return run(o, backend); });
}
