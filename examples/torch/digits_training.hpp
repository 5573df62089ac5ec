// The data-parallel loop the LibTorch digits examples (torch_digits, torch_digits_bn) share: the
// flags both take, the data set read on every rank and split, one epoch of plain data-parallel
// training (each rank its 1/N of every global batch) and the score over the held-out images.
// What differs between them is the model and how it sees an image (a row of 64 pixels, or an
// 8x8 plane): the `Forward` they pass.
#pragma once

#include <torch/torch.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>

#include "digits_data.hpp"
#include "lockstep_cli.hpp"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace digits {

/// The model's forward pass on a batch of rows (64 pixels each): logits for the 10 classes.
using Forward = std::function<torch::Tensor(const torch::Tensor&)>;

/// The flags both examples take; each sets its own defaults.
struct CommonOptions {
  std::int64_t epochs = 20;
  std::int64_t batch = 60;
  double lr = 1e-3;
  std::uint64_t seed = 42;
  int threads = 1;
  std::string data = kDefaultData;
};

/// --epochs, --batch, --lr, --seed, --threads and --data, in that order (what --help lists).
inline void add_common_flags(CLI::App& app, CommonOptions& o, const std::string& epochs_help,
                             const std::string& batch_help, std::int64_t batch_min) {
  namespace cli = lockstep_cli;
  app.add_option("--epochs", o.epochs, epochs_help)->type_name("E")->check(cli::at_least(0));
  app.add_option("--batch", o.batch, batch_help)->type_name("B")->check(cli::at_least(batch_min));
  app.add_option("--lr", o.lr, "Adam learning rate")->type_name("LR")->check(cli::positive());
  app.add_option("--seed", o.seed, "seed of the initial weights and the per-epoch shuffles")->type_name("SEED")
      ->check(cli::at_least(0));
  app.add_option("--threads", o.threads, "LibTorch intra-op threads per rank")->type_name("T")->check(cli::at_least(1));
  app.add_option("--data", o.data, "digits.csv.gz (default: python3-sklearn's copy)")->type_name("PATH");
}

/// The training and the held-out images.
struct Split {
  Digits train, test;
};

/// Reads the data set on every rank and splits it (a fixed shuffle, the last kTestRows rows held
/// out). The ranks agree on success before any collective that needs the data: a file missing
/// on one node is an InvalidArgument on every rank, not a hang.
inline Split read_and_split(lockstep::Backend& backend, const std::string& path) {
  namespace ls = lockstep;
  Digits all;
  const std::string read_error = read_digits(path, all);
  std::int32_t ok = read_error.empty() ? 1 : 0;
  backend.allreduce(ls::TensorView{&ok, 1, ls::DType::i32, ls::Device::cpu()}, ls::ReduceOp::min);
  if (!read_error.empty()) throw ls::InvalidArgument(read_error);
  if (ok == 0) throw ls::InvalidArgument("another rank could not read the digits data set (see its message)");
  const std::int64_t rows = all.y.size(0), train_rows = rows - kTestRows;
  const auto split = permutation(rows, kSplitSeed);
  const auto train_idx = index_tensor(split.data(), train_rows);
  const auto test_idx = index_tensor(split.data() + train_rows, kTestRows);
  return {{all.x.index_select(0, train_idx), all.y.index_select(0, train_idx)},
          {all.x.index_select(0, test_idx), all.y.index_select(0, test_idx)}};
}

/// What both examples do first: LibTorch's intra-op threads, the data set read and split, and
/// this rank's own seed for the initial weights (lt::synchronize then makes them rank 0's).
inline Split start(lockstep::Backend& backend, const CommonOptions& o) {
  torch::set_num_threads(o.threads);
  Split data = read_and_split(backend, o.data);
  torch::manual_seed(o.seed + static_cast<std::uint64_t>(backend.rank()));
  return data;
}

/// The epoch's shuffle of the training rows: the same on every rank, from the seed and the epoch.
inline std::vector<std::int64_t> epoch_order(std::int64_t train_rows, std::uint64_t seed, std::int64_t epoch) {
  return permutation(train_rows, seed * 1000003u + static_cast<std::uint64_t>(epoch));
}

/// One epoch of plain data-parallel training: every whole global batch of `batch` rows in
/// `order` (the last partial one is dropped), this rank taking its contiguous 1/N of each; the
/// gradients of the mean cross-entropy over the rank's share are averaged across ranks by `opt`
/// as backward goes. Returns this rank's summed cross-entropy over its rows.
inline double train_epoch(lockstep::torch::DistributedOptimizer& opt, const Forward& forward, const Digits& train,
                          const std::vector<std::int64_t>& order, std::int64_t batch, int rank, int ranks) {
  const std::int64_t share = batch / ranks, batches = train.y.size(0) / batch;
  double loss_sum = 0;
  for (std::int64_t b = 0; b < batches; ++b) {
    const auto idx = index_tensor(order.data() + b * batch + rank * share, share);
    const auto x = train.x.index_select(0, idx), y = train.y.index_select(0, idx);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(forward(x), y);  // mean over this rank's share
    loss.backward();
    opt.step();
    loss_sum += loss.item<double>() * static_cast<double>(share);
  }
  return loss_sum;
}

/// Loss and accuracy over the whole test set.
struct Score {
  double loss = 0;
  std::int64_t correct = 0, total = 0;
  double accuracy() const { return static_cast<double>(correct) / static_cast<double>(total); }
};

/// Scores the model (in whatever mode the caller set, eval for running statistics) on the test
/// set: each rank its contiguous share, the sums reduced across ranks.
inline Score evaluate(lockstep::Backend& backend, const Forward& forward, const Digits& test) {
  namespace ls = lockstep;
  torch::NoGradGuard no_grad;
  const std::int64_t n = test.y.size(0), rank = backend.rank(), ranks = backend.size();
  const std::int64_t lo = n * rank / ranks, hi = n * (rank + 1) / ranks;
  double loss_sum = 0;
  std::int64_t correct = 0;
  if (hi > lo) {
    const auto x = test.x.narrow(0, lo, hi - lo), y = test.y.narrow(0, lo, hi - lo);
    const auto logits = forward(x);
    loss_sum = torch::nn::functional::cross_entropy(
                   logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                   .item<double>();
    correct = logits.argmax(1).eq(y).sum().item<std::int64_t>();
  }
  auto sums = torch::tensor({loss_sum}, torch::kDouble);
  auto counts = torch::tensor({correct, hi - lo}, torch::kLong);
  backend.allreduce(lockstep::torch::view(sums), ls::ReduceOp::sum);
  backend.allreduce(lockstep::torch::view(counts), ls::ReduceOp::sum);
  Score s;
  s.correct = counts[0].item<std::int64_t>();
  s.total = counts[1].item<std::int64_t>();
  s.loss = sums[0].item<double>() / static_cast<double>(s.total);
  return s;
}

}  // namespace digits
