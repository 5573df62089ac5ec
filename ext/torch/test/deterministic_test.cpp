// lockstep::torch in deterministic mode (DistributedOptions::deterministic) under mpiexec at 1-4
// ranks: N ranks, each with its block of the micro-batches (uneven, some none), train the model
// that one process (a backend over MPI_COMM_SELF) trains on all of them, bit for bit, in any
// order of the micro-batches; accumulation_steps and skip_non_finite; LibTorch's settings while a
// deterministic optimizer lives; every refusal on every rank; lt::model_hash.
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/io/model_hash.hpp"
#include "lockstep/lockstep.hpp"
#include "lockstep/torch.hpp"
#include "torch_test_support.hpp"
#include "lockstep/torch/sync_batchnorm.hpp"

namespace ls = lockstep;
namespace lt = lockstep::torch;

// This file's helpers and test cases (test_torch compiles the LibTorch tests as one unit).
namespace deterministic_tests {

using namespace lttest;

namespace {

struct MlpImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(13, 37));
    fc2 = register_module("fc2", torch::nn::Linear(37, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
};
TORCH_MODULE(Mlp);

// The same initial weights in every call and on every rank (a fixed seed, no communication).
Mlp fresh_model() {
  torch::manual_seed(7);
  return Mlp();
}

// Micro-batch m of step s: 6 rows whose values spread over several magnitudes, so that an f32
// sum in another order would round differently.
std::pair<torch::Tensor, torch::Tensor> micro_batch(int s, int m) {
  torch::manual_seed(100000 + 1000 * s + m);
  auto x = torch::randn({6, 13}) * std::pow(10.0f, static_cast<float>(m % 4) - 1.0f);
  auto y = torch::randn({6, 5});
  return {x, y};
}

// This rank's block of M micro-batches (ls::micro_batches_of's deal).
std::vector<int> mine_of(int M, int rank, int size) {
  std::vector<int> v;
  for (std::int64_t m : ls::split_micro_batches(M, rank, size)) v.push_back(static_cast<int>(m));
  return v;
}

// Trains `steps` Adam steps in deterministic mode over backend b; in step s this rank computes
// the micro-batches `order` (its own block, or all of them in one process). With `last_by_step`
// the last micro-batch is left to step() (zero_grad, backward, step) instead of accumulate().
// With max_grad_norm, *norm receives the last step's global norm.
Mlp train(ls::Backend& b, const std::vector<int>& order, int steps, bool last_by_step = false,
          std::optional<double> max_grad_norm = std::nullopt, double* norm = nullptr) {
  Mlp net = fresh_model();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  lt::DistributedOptimizer opt(b, adam, {.deterministic = true},
                               lt::TorchOptions{.names_from = net.get(), .max_grad_norm = max_grad_norm});
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    for (std::size_t k = 0; k < order.size(); ++k) {
      auto [x, y] = micro_batch(s, order[k]);
      torch::mse_loss(net->forward(x), y).backward();
      if (!(last_by_step && k + 1 == order.size())) opt.accumulate();
    }
    opt.step();
  }
  if (norm != nullptr) *norm = opt.last_grad_norm();
  return net;
}

bool same_bits(const torch::nn::Module& a, const torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  if (pa.size() != pb.size()) return false;
  for (std::size_t i = 0; i < pa.size(); ++i)
    if (!torch::equal(pa[i], pb[i])) return false;
  return true;
}

}  // namespace

TEST_CASE("deterministic: N ranks on uneven blocks of micro-batches equal one process bit for bit, in any order",
          "[torch][mpi][deterministic]") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank(), n = b.size();
  ls::MPIBackend self(MPI_COMM_SELF);
  for (int M : {1, 3, 7}) {
    const std::vector<int> mine = mine_of(M, rank, n);
    std::vector<int> all, reversed;
    for (int m = 0; m < M; ++m) all.push_back(m);
    reversed.assign(all.rbegin(), all.rend());
    Mlp got = train(b, mine, 3);
    Mlp one = train(self, all, 3);
    Mlp back = train(self, reversed, 3);
    INFO("M " << M << ", rank " << rank << " holds " << mine.size());
    CHECK(same_bits(*one, *back));  // the order of the micro-batches does not matter
    CHECK(all_ranks(same_bits(*got, *one)));
    CHECK(lt::model_hash(*got) == lt::model_hash(*one));
    // step() takes a gradient backward left as the rank's last micro-batch.
    Mlp by_step = train(b, mine, 3, /*last_by_step=*/true);
    CHECK(all_ranks(same_bits(*by_step, *one)));
  }
}

TEST_CASE("deterministic: accumulation_steps = 2 is one step over both calls' micro-batches; skip_non_finite skips "
          "the step on every rank",
          "[torch][mpi][deterministic]") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank(), n = b.size();
  ls::MPIBackend self(MPI_COMM_SELF);
  const int M = 5;
  const std::vector<int> mine = mine_of(M, rank, n);
  std::vector<int> all;
  for (int m = 0; m < M; ++m) all.push_back(m);
  Mlp one = train(self, all, 1);
  {
    // The first half of this rank's micro-batches before the first step() call, the rest before
    // the second: one optimizer step over all of them.
    Mlp net = fresh_model();
    torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
    lt::DistributedOptimizer opt(b, adam, {.accumulation_steps = 2, .deterministic = true});
    const std::size_t half = mine.size() / 2;
    bool stepped[2] = {};
    for (int call = 0; call < 2; ++call) {
      opt.zero_grad();
      for (std::size_t k = call == 0 ? 0 : half; k < (call == 0 ? half : mine.size()); ++k) {
        auto [x, y] = micro_batch(0, mine[k]);
        torch::mse_loss(net->forward(x), y).backward();
        opt.accumulate();
      }
      stepped[call] = opt.step();
    }
    CHECK(!stepped[0]);
    CHECK(stepped[1]);
    CHECK(all_ranks(same_bits(*net, *one)));
  }
  {
    // A NaN in the last rank's first micro-batch: every rank skips, the parameters stay.
    Mlp net = fresh_model(), start = fresh_model();
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    lt::DistributedOptimizer opt(b, sgd, {.skip_non_finite = true, .deterministic = true});
    opt.zero_grad();
    for (std::size_t k = 0; k < mine.size(); ++k) {
      auto [x, y] = micro_batch(0, mine[k]);
      if (rank == n - 1 && k == 0) x[0][0] = std::nanf("");
      torch::mse_loss(net->forward(x), y).backward();
      opt.accumulate();
    }
    CHECK(!opt.step());
    CHECK(opt.skipped_steps() == 1);
    CHECK(all_ranks(same_bits(*net, *start)));
  }
}

TEST_CASE("deterministic: LibTorch's threads and deterministic algorithms while the optimizer lives, restored after",
          "[torch][mpi][deterministic]") {
  ls::MPIBackend& b = backend();
  at::set_num_threads(2);
  at::globalContext().setDeterministicAlgorithms(false, false);
  {
    Mlp net = fresh_model();
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    lt::DistributedOptimizer opt(b, sgd, {.deterministic = true}, {.deterministic_threads = 1});
    CHECK(opt.deterministic());
    CHECK(at::get_num_threads() == 1);
    CHECK(at::globalContext().deterministicAlgorithms());
    CHECK(!at::globalContext().deterministicAlgorithmsWarnOnly());
  }
  CHECK(at::get_num_threads() == 2);
  CHECK(!at::globalContext().deterministicAlgorithms());
  at::set_num_threads(1);
  CHECK(all_ranks(true));
}

TEST_CASE("deterministic: what cannot work is refused at setup on every rank, naming it", "[torch][mpi][deterministic]") {
  ls::MPIBackend& b = backend();
  auto refused = [&](ls::DistributedOptions o, torch::nn::Module& net, std::vector<torch::Tensor> params,
                     const std::string& part) {
    torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.1));
    o.deterministic = true;
    const std::string e = error_of<ls::InvalidArgument>(
        [&] { lt::DistributedOptimizer opt(b, sgd, o, lt::TorchOptions{.names_from = &net}); });
    INFO(e);
    CHECK(all_ranks(mentions(e, part)));
  };
  Mlp net = fresh_model();
  refused({.shard_optimizer_state = true}, *net, net->parameters(), "does not take shard_optimizer_state");
  refused({.wire_dtype = ls::DType::bf16}, *net, net->parameters(), "does not take wire_dtype bf16");
  {
    torch::nn::Linear f64(torch::nn::LinearOptions(3, 2));
    f64->to(torch::kDouble);
    refused({}, *f64, f64->parameters(), "sums Float (f32) gradients exactly; parameter 'weight'");
  }
  {
    torch::nn::Sequential seq(torch::nn::Linear(4, 4), lt::SyncBatchNorm1d(b, torch::nn::BatchNorm1dOptions(4)));
    refused({}, *seq, seq->parameters(), "does not take lockstep::torch::SyncBatchNorm ('1')");
    // Without names_from the optimizer cannot see it: the training forward refuses while a
    // deterministic optimizer lives (before any collective, on every rank).
    torch::optim::SGD sgd(seq->parameters(), torch::optim::SGDOptions(0.1));
    lt::DistributedOptimizer opt(b, sgd, {.deterministic = true});
    const std::string e = error_of<ls::InvalidArgument>([&] { (void)seq->forward(torch::randn({3, 4})); });
    INFO(e);
    CHECK(all_ranks(mentions(e, "not in deterministic mode")));
  }
  {
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    lt::DistributedOptimizer opt(b, sgd);
    const std::string e = error_of<ls::InvalidArgument>([&] { opt.accumulate(); });
    CHECK(all_ranks(mentions(e, "accumulate: only in deterministic mode")));
  }
}

TEST_CASE("deterministic: a parameter without gradient in one rank's micro-batch is an error on every rank, or zero",
          "[torch][mpi][deterministic]") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank();
  for (auto policy : {lt::UnusedParameters::error, lt::UnusedParameters::zero}) {
    Mlp net = fresh_model();
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    lt::DistributedOptimizer opt(b, sgd, {.deterministic = true},
                                 {.unused_parameters = policy, .names_from = net.get()});
    opt.zero_grad();
    auto [x, y] = micro_batch(0, rank);
    // Rank 0's micro-batch skips fc2 (its output is fc1's, summed): fc2 gets no gradient there.
    auto out = rank == 0 ? net->fc1->forward(x).sum() : torch::mse_loss(net->forward(x), y);
    out.backward();
    opt.accumulate();
    const std::string e = error_of<ls::InvalidArgument>([&] { opt.step(); });
    INFO(e);
    if (policy == lt::UnusedParameters::error)
      CHECK(all_ranks(mentions(e, "parameter 'fc2.weight' got no gradient in this step (in one of its micro-batches)")));
    else
      CHECK(all_ranks(e.empty()));
  }
}

TEST_CASE("model_hash: ls::model_hash of the parameters by name; one changed bit changes it", "[torch][deterministic]") {
  Mlp net = fresh_model();
  std::map<std::string, ls::Tensor> x;
  for (const auto& p : net->named_parameters()) x.emplace(p.key(), lt::borrow(p.value()));
  const std::string h = lt::model_hash(*net);
  CHECK(h == ls::model_hash(x));
  CHECK(h.size() == 15);
  CHECK(h.rfind("crc32c:", 0) == 0);
  {
    torch::NoGradGuard no_grad;
    float* w = net->fc2->bias.data_ptr<float>();
    w[0] = std::nextafter(w[0], 1e9f);
  }
  CHECK(lt::model_hash(*net) != h);
}

TEST_CASE("deterministic: clipping by the global norm (max_grad_norm) gives the same bits at any rank count",
          "[torch][mpi][deterministic]") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank(), n = b.size();
  ls::MPIBackend self(MPI_COMM_SELF);
  const int M = 5;
  std::vector<int> all;
  for (int m = 0; m < M; ++m) all.push_back(m);
  double norm_n = 0, norm_1 = 0, norm_free = 0;
  Mlp got = train(b, mine_of(M, rank, n), 2, false, 0.05, &norm_n);
  Mlp one = train(self, all, 2, false, 0.05, &norm_1);
  Mlp free = train(self, all, 2, false, 1e9, &norm_free);  // a bound never reached: no clipping
  INFO("norms " << norm_n << " " << norm_1 << " " << norm_free);
  CHECK(all_ranks(same_bits(*got, *one) && norm_n == norm_1));
  CHECK(norm_1 > 0.05);          // it clipped
  CHECK(!same_bits(*one, *free));  // and clipping changed the model
  // The gradients the optimizer stepped with were clipped to the bound.
  double sq = 0;
  for (const auto& p : got->parameters()) sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
  CHECK(std::sqrt(sq) <= 0.05 * (1 + 1e-5));
  // Bad bound: refused on every rank.
  Mlp net = fresh_model();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  const std::string e = error_of<ls::InvalidArgument>(
      [&] { lt::DistributedOptimizer opt(b, sgd, {.deterministic = true}, {.max_grad_norm = -1.0}); });
  CHECK(all_ranks(mentions(e, "max_grad_norm must be positive")));
}

TEST_CASE("deterministic: with Join, a rank without a batch adds no micro-batch (the mean over those with rows)",
          "[torch][mpi][deterministic]") {
  // Rank r has batches for steps 0 .. r: at step s the ranks r >= s each compute micro-batch
  // (s, r), the others run backward on 0 rows and step() (join.hpp's loop). One process that
  // accumulates exactly those micro-batches per step must get the same bits.
  ls::MPIBackend& b = backend();
  const int rank = b.rank(), n = b.size();
  auto loss_of = [](Mlp& net, const std::pair<torch::Tensor, torch::Tensor>& xy) {
    return torch::mse_loss(net->forward(xy.first), xy.second);
  };
  Mlp got = fresh_model();
  {
    torch::optim::Adam adam(got->parameters(), torch::optim::AdamOptions(1e-2));
    lt::DistributedOptimizer opt(b, adam, {.deterministic = true}, lt::TorchOptions{.names_from = got.get()});
    lt::Join join(b);
    for (int s = 0; join.next(s <= rank); ++s) {
      opt.zero_grad();
      const auto xy = s <= rank ? micro_batch(s, rank) : std::pair{torch::zeros({0, 13}), torch::zeros({0, 5})};
      loss_of(got, xy).backward();
      opt.step();
    }
    CHECK(join.steps() == n);
  }
  ls::MPIBackend self(MPI_COMM_SELF);
  Mlp one = fresh_model();
  {
    torch::optim::Adam adam(one->parameters(), torch::optim::AdamOptions(1e-2));
    lt::DistributedOptimizer opt(self, adam, {.deterministic = true}, lt::TorchOptions{.names_from = one.get()});
    for (int s = 0; s < n; ++s) {
      opt.zero_grad();
      for (int r = s; r < n; ++r) {
        loss_of(one, micro_batch(s, r)).backward();
        opt.accumulate();
      }
      opt.step();
    }
  }
  CHECK(all_ranks(same_bits(*got, *one)));
}

}  // namespace deterministic_tests
