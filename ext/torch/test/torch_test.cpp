// lockstep::torch under mpiexec at 1-4 ranks, with real LibTorch models and optimizers: the
// bridge, synchronize of modules (buffers too) and optimizers (lazy state), DistributedOptimizer
// (N ranks equal one process on the whole batch, replicas bitwise equal, accumulation and a
// cycle cut short, unused parameters, non-finite gradients, torch's own zero_grad, a user's own
// optimizer, ranks that froze different layers of one shape, sparse gradients, a gradient failure
// on one rank) and checkpoints (resume bitwise). Every error is checked on every rank.
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "lockstep/torch.hpp"
#include "torch_test_support.hpp"
#include "../src/test_hooks.hpp"  // lt::testing::fail_next_gradient (not installed)

namespace ls = lockstep;
namespace lt = lockstep::torch;

// This file's helpers and test cases (test_torch compiles the LibTorch tests as one unit).
namespace torch_tests {

using namespace lttest;

namespace {

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  NetImpl(int in = 6, int hidden = 8, int out = 3) {
    fc1 = register_module("fc1", torch::nn::Linear(in, hidden));
    bn = register_module("bn", torch::nn::BatchNorm1d(hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, out));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::relu(bn->forward(fc1->forward(x)))); }
};
TORCH_MODULE(Net);

}  // namespace

TEST_CASE("view: a zero-copy view of every shared dtype; clear errors otherwise", "[torch]") {
  torch::set_num_threads(1);
  const std::vector<std::pair<torch::ScalarType, ls::DType>> types{
      {torch::kHalf, ls::DType::f16}, {torch::kBFloat16, ls::DType::bf16}, {torch::kFloat, ls::DType::f32},
      {torch::kDouble, ls::DType::f64}, {torch::kInt, ls::DType::i32},     {torch::kLong, ls::DType::i64},
      {torch::kByte, ls::DType::u8}};
  for (auto [st, dt] : types) {
    auto t = torch::zeros({2, 3}, torch::TensorOptions().dtype(st));
    const ls::TensorView v = lt::view(t);
    CHECK(v.data == t.data_ptr());
    CHECK(v.numel == 6);
    CHECK(v.dtype == dt);
    CHECK(v.device.is_cpu());
  }
  auto b = lt::borrow(torch::ones({4, 5}));
  CHECK(b.shape() == ls::Shape{4, 5});
  CHECK(mentions(error_of<ls::InvalidArgument>([] { lt::view(torch::ones({4, 4}).t()); }), "not contiguous"));
  CHECK(mentions(error_of<ls::InvalidArgument>([] { lt::view(torch::ones({2}).to_sparse()); }), "Sparse"));
  CHECK(mentions(error_of<ls::InvalidArgument>([] { lt::view(torch::ones({2}, torch::kComplexFloat)); }),
                 "has no Lockstep dtype"));
  CHECK(mentions(error_of<ls::InvalidArgument>([] { lt::view(torch::Tensor()); }), "undefined"));
}

TEST_CASE("synchronize(module): parameters and buffers from root; a different module is a MismatchError on every rank",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(b.rank());  // every rank starts different
  Net net;
  net->bn->running_mean.fill_(static_cast<double>(b.rank()));
  lt::synchronize(b, *net, 0);
  CHECK(replicas_equal(*net));
  CHECK(all_ranks(net->bn->running_mean[0].item<float>() == 0.0f));
  // Root 1 where there is one.
  if (b.size() > 1) {
    torch::manual_seed(100 + b.rank());
    Net other;
    lt::synchronize(b, *other, 1);
    CHECK(replicas_equal(*other));
  }
  if (b.size() > 1) {
    // One rank's module has another hidden width: every rank throws, naming the tensor; the
    // modules are left as they were.
    Net odd(6, b.rank() == 1 ? 9 : 8, 3);
    const auto before = odd->fc1->weight.clone();
    const std::string e = error_of<ls::MismatchError>([&] { lt::synchronize(b, *odd, 0); });
    CHECK(all_ranks(mentions(e, "fc1.weight") || mentions(e, "bn.")));
    CHECK(torch::equal(before, odd->fc1->weight));
  }
}

TEST_CASE("synchronize(optimizer): Adam's lazily created state comes from root", "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(7);
  Net net;
  lt::synchronize(b, *net, 0);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  if (b.rank() == 0) {  // only root has stepped: only root has state
    auto [x, y] = global_batch(0, 8);
    torch::mse_loss(net->forward(x), y).backward();
    adam.step();
    adam.param_groups()[0].options().set_lr(0.5);
  }
  lt::synchronize(b, *net, 0);
  lt::synchronize(b, adam, 0);
  CHECK(all_ranks(adam.state().size() == net->parameters().size()));
  CHECK(all_ranks(adam.param_groups()[0].options().get_lr() == 0.5));
  std::map<std::string, ls::Tensor> moments;
  int i = 0;
  for (auto& p : net->parameters()) {
    auto& s = static_cast<torch::optim::AdamParamState&>(*adam.state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
    CHECK(s.step() == 1);
    moments.emplace("m" + std::to_string(i), lt::borrow(s.exp_avg()));
    moments.emplace("v" + std::to_string(i++), lt::borrow(s.exp_avg_sq()));
  }
  CHECK_NOTHROW(ls::check_replicas(b, moments));
  // Root without state: the others' state is dropped.
  torch::optim::Adam fresh(net->parameters(), torch::optim::AdamOptions(1e-2));
  if (b.rank() != 0) {
    auto [x, y] = global_batch(1, 8);
    fresh.zero_grad();
    torch::mse_loss(net->forward(x), y).backward();
    fresh.step();
  }
  lt::synchronize(b, fresh, 0);
  CHECK(all_ranks(fresh.state().empty()));
  // Different optimizers: MismatchError on every rank.
  if (b.size() > 1) {
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    const std::string e = error_of<ls::MismatchError>([&] {
      if (b.rank() == 1) lt::synchronize(b, sgd, 0);
      else lt::synchronize(b, adam, 0);
    });
    CHECK(all_ranks(mentions(e, "optimizer")));
  }
}

namespace {
enum class Which { adam, sgd, mine };
std::unique_ptr<torch::optim::Optimizer> make_optimizer(Which w, Net& net) {
  if (w == Which::adam) return std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-2));
  if (w == Which::sgd)
    return std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  return std::make_unique<MyDescent>(net->parameters(), 0.05);
}
}  // namespace

TEST_CASE("DistributedOptimizer: N ranks equal one process on the whole batch; replicas stay bitwise equal",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const int rows = 12;  // divisible by 1, 2, 3, 4
  for (Which w : {Which::adam, Which::sgd, Which::mine}) {
    for (std::size_t bucket : {std::size_t{0}, std::size_t{256}, ls::kDefaultBucketBytes}) {
      torch::manual_seed(3);
      Net dist, ref;
      {
        torch::NoGradGuard g;
        for (std::size_t i = 0; i < dist->parameters().size(); ++i) ref->parameters()[i].copy_(dist->parameters()[i]);
      }
      // BatchNorm sees only this rank's rows; the reference uses the same per-rank statistics
      // by running in eval mode on both sides (no batch statistics), so the losses match.
      dist->eval();
      ref->eval();
      auto inner = make_optimizer(w, dist);
      auto ref_opt = make_optimizer(w, ref);
      ls::DistributedOptions o;
      o.bucket_bytes = bucket;
      lt::DistributedOptimizer opt(b, *inner, o, {.names_from = dist.get()});
      for (int s = 0; s < 4; ++s) {
        auto [x, y] = global_batch(s, rows);
        opt.zero_grad();
        torch::mse_loss(dist->forward(rows_of(x, b.rank(), b.size())), rows_of(y, b.rank(), b.size())).backward();
        CHECK(opt.step());
        ref_opt->zero_grad();
        torch::mse_loss(ref->forward(x), y).backward();
        ref_opt->step();
      }
      INFO("optimizer " << static_cast<int>(w) << " bucket_bytes " << bucket);
      CHECK(all_ranks(max_abs_diff(*dist, *ref) < 1e-5f));
      CHECK(replicas_equal(*dist));
      CHECK(opt.applied_steps() == 4);
      if (w == Which::mine) CHECK(static_cast<MyDescent&>(*inner).steps == 4);
      if (bucket == 0) CHECK(opt.reducer().bucket_count() == dist->parameters().size());
      CHECK(opt.reducer().zero_copy_buckets() == opt.reducer().bucket_count());
    }
  }
}

TEST_CASE("DistributedOptimizer: accumulation_steps = 2 on half batches equals one step on the whole batch",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(5);
  Net acc, ref;
  {
    torch::NoGradGuard g;
    for (std::size_t i = 0; i < acc->parameters().size(); ++i) ref->parameters()[i].copy_(acc->parameters()[i]);
  }
  acc->eval();
  ref->eval();
  torch::optim::SGD sa(acc->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD sr(ref->parameters(), torch::optim::SGDOptions(0.1));
  ls::DistributedOptions o;
  o.accumulation_steps = 2;
  lt::DistributedOptimizer opt(b, sa, o);
  const int rows = 24;
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = global_batch(s, rows);
    auto mine_x = rows_of(x, b.rank(), b.size()), mine_y = rows_of(y, b.rank(), b.size());
    const auto half = mine_x.size(0) / 2;
    for (int m = 0; m < 2; ++m) {
      opt.zero_grad();  // inside the cycle: leaves the first micro-batch's gradients
      torch::mse_loss(acc->forward(mine_x.narrow(0, m * half, half)), mine_y.narrow(0, m * half, half)).backward();
      CHECK(opt.step() == (m == 1));
    }
    sr.zero_grad();
    torch::mse_loss(ref->forward(x), y).backward();
    sr.step();
  }
  CHECK(all_ranks(max_abs_diff(*acc, *ref) < 1e-5f));
  CHECK(replicas_equal(*acc));
}

// lockstep::torch has no explicit accumulation (its divisor is accumulation_steps, the same on
// every rank), so the micro-step counts of the core's ls::accumulate cannot differ here; what a
// user would do instead, a second backward before step() on one rank with accumulation_steps = 1,
// is an InvalidArgument on every rank, the parameters untouched and equal, and the next step works.
TEST_CASE("DistributedOptimizer: a second backward before step() on one rank is refused on every rank",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(9);
  Net net;
  net->eval();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  lt::DistributedOptimizer opt(b, sgd);
  auto [x, y] = global_batch(0, 12);
  auto mine_x = rows_of(x, b.rank(), b.size()), mine_y = rows_of(y, b.rank(), b.size());
  const torch::Tensor before = net->fc1->weight.detach().clone();
  opt.zero_grad();
  const int passes = b.size() > 1 && b.rank() == b.size() - 1 ? 2 : 1;
  for (int k = 0; k < passes; ++k) torch::mse_loss(net->forward(mine_x), mine_y).backward();
  const std::string got = error_of<ls::InvalidArgument>([&] { opt.step(); });
  INFO("rank " << b.rank() << ": " << got);
  if (b.size() > 1) CHECK(all_ranks(mentions(got, "produced twice") && torch::equal(net->fc1->weight, before)));
  else CHECK(got.empty());
  CHECK(replicas_equal(*net));
  opt.zero_grad();
  torch::mse_loss(net->forward(mine_x), mine_y).backward();
  CHECK(all_ranks(error_of<ls::Error>([&] { CHECK(opt.step()); }).empty()));
  CHECK(replicas_equal(*net));
}

namespace {
struct BranchyImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, side{nullptr};
  BranchyImpl() {
    a = register_module("a", torch::nn::Linear(4, 2));
    side = register_module("side", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_side) {
    auto y = a->forward(x);
    return use_side ? y + side->forward(x) : y;
  }
};
TORCH_MODULE(Branchy);
}  // namespace

TEST_CASE("DistributedOptimizer: a parameter without gradient on some rank is an error on every rank, or zero",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(9);
  Branchy net;
  lt::synchronize(b, *net, 0);
  const auto x = torch::ones({3, 4});
  const bool skip_side = b.rank() == b.size() - 1;  // the last rank does not use "side"
  {
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    lt::DistributedOptimizer opt(b, sgd, {}, {.names_from = net.get()});
    const auto before = net->a->weight.clone();
    opt.zero_grad();
    net->forward(x, !skip_side).sum().backward();
    const std::string e = error_of<ls::InvalidArgument>([&] { opt.step(); });
    CHECK(all_ranks(mentions(e, "side.weight") && mentions(e, "got no gradient")));
    CHECK(torch::equal(before, net->a->weight));  // the step was not taken
    // It recovers: the next step with every parameter used works.
    opt.zero_grad();
    net->forward(x, true).sum().backward();
    CHECK(opt.step());
    CHECK(replicas_equal(*net));
    // A second optimizer over the same parameters is refused on every rank.
    torch::optim::SGD again(net->parameters(), torch::optim::SGDOptions(0.1));
    const std::string twice = error_of<ls::InvalidArgument>([&] { lt::DistributedOptimizer other(b, again); });
    CHECK(all_ranks(mentions(twice, "already wrapped")));
  }

  // With UnusedParameters::zero the missing gradient counts as zero: side's gradient is the
  // mean over the ranks that used it (N-1 of N).
  torch::optim::SGD sgd2(net->parameters(), torch::optim::SGDOptions(1.0));
  lt::DistributedOptimizer zero(b, sgd2, {}, {.unused_parameters = lt::UnusedParameters::zero});
  const auto side_before = net->side->bias.clone();
  zero.zero_grad();
  net->forward(x, !skip_side).sum().backward();
  CHECK(zero.step());
  // d(sum)/d(bias) = 3 rows on the ranks that used it: the mean is 3 (N-1)/N.
  const float expect = 3.0f * static_cast<float>(b.size() - 1) / static_cast<float>(b.size());
  CHECK(all_ranks(torch::allclose(side_before - net->side->bias, torch::full({2}, expect), 1e-5, 1e-6)));
  CHECK(replicas_equal(*net));
}

TEST_CASE("DistributedOptimizer: a NaN on one rank skips the step on every rank (skip_non_finite)", "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(11);
  Net net;
  net->eval();
  lt::synchronize(b, *net, 0);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  ls::DistributedOptions o;
  o.skip_non_finite = true;
  o.check_replicas_every = 1;
  lt::DistributedOptimizer opt(b, adam, o, {.names_from = net.get()});
  auto [x, y] = global_batch(0, 8);
  if (b.rank() == b.size() - 1) x[0][0] = std::nan("");
  const auto before = net->fc1->weight.clone();
  opt.zero_grad();
  torch::mse_loss(net->forward(x), y).backward();
  CHECK_FALSE(opt.step());
  CHECK(opt.skipped_steps() == 1);
  CHECK(torch::equal(before, net->fc1->weight));
  CHECK(adam.state().empty());  // Adam never stepped
  auto [x2, y2] = global_batch(1, 8);
  opt.zero_grad();
  torch::mse_loss(net->forward(x2), y2).backward();
  CHECK(opt.step());  // and check_replicas_every = 1 compared parameters and Adam's state
  CHECK(opt.applied_steps() == 1);
}

TEST_CASE("DistributedOptimizer: LibTorch's own zero_grad works on the bucket buffers", "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(13);
  Net net;
  net->eval();
  lt::synchronize(b, *net, 0);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  lt::DistributedOptimizer opt(b, sgd);
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = global_batch(s, 8);
    sgd.zero_grad();  // torch's own: no "Can't detach views in-place"
    torch::mse_loss(net->forward(x), y).backward();
    CHECK(opt.step());
  }
  // The gradients still live in the buffers, and hold the average (equal on every rank).
  std::map<std::string, ls::Tensor> grads;
  for (const auto& p : net->named_parameters()) grads.emplace(p.key(), lt::borrow(p.value().grad()));
  CHECK_NOTHROW(ls::check_replicas(b, grads));
  CHECK(replicas_equal(*net));
}

TEST_CASE("DistributedOptimizer: ranks that wrap different optimizers get a MismatchError on every rank",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  if (b.size() < 2) {  // one rank always agrees with itself: it constructs
    Net one;
    torch::optim::SGD s1(one->parameters(), torch::optim::SGDOptions(0.1));
    CHECK_NOTHROW(lt::DistributedOptimizer(b, s1));
    return;
  }
  Net net(6, b.rank() == 1 ? 5 : 8, 3);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  const std::string e = error_of<ls::MismatchError>([&] { lt::DistributedOptimizer opt(b, sgd); });
  CHECK(all_ranks(!e.empty() && !mentions(e, "other:")));
  ls::DistributedOptions o;
  o.bucket_bytes = b.rank() == 1 ? 64 : 128;
  Net same;
  torch::optim::SGD s2(same->parameters(), torch::optim::SGDOptions(0.1));
  const std::string e2 = error_of<ls::MismatchError>([&] { lt::DistributedOptimizer opt(b, s2, o); });
  CHECK(all_ranks(mentions(e2, "bucket_bytes")));
}

namespace {
// Two layers of the same shape: a rank that freezes one and a rank that freezes the other have
// trainable lists that differ by name only.
struct TwinsImpl : torch::nn::Module {
  torch::nn::Linear l1{nullptr}, l2{nullptr}, out{nullptr};
  TwinsImpl() {
    l1 = register_module("l1", torch::nn::Linear(4, 4));
    l2 = register_module("l2", torch::nn::Linear(4, 4));
    out = register_module("out", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out->forward(l2->forward(l1->forward(x))); }
};
TORCH_MODULE(Twins);
std::vector<torch::Tensor> trainable(torch::nn::Module& m) {
  std::vector<torch::Tensor> v;
  for (auto& p : m.parameters())
    if (p.requires_grad()) v.push_back(p);
  return v;
}
bool no_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters())
    if (p.grad().defined()) return false;
  return true;
}
}  // namespace

TEST_CASE("DistributedOptimizer: ranks that train different parameters of the same shape get a MismatchError "
          "naming the parameter, at setup",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  if (b.size() < 2) {
    Twins one;
    torch::optim::SGD s1(one->parameters(), torch::optim::SGDOptions(0.1));
    CHECK_NOTHROW(lt::DistributedOptimizer(b, s1, {}, {.names_from = one.get()}));
    return;
  }
  // The last rank freezes l1, the others l2: the same shapes, floats and count of gradients.
  const bool odd = b.rank() == b.size() - 1;
  auto freeze = [&](Twins& t) {
    for (auto& p : (odd ? t->l1 : t->l2)->parameters()) p.set_requires_grad(false);
  };
  SECTION("an optimizer over every parameter, named by the module") {
    Twins net;
    freeze(net);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    const std::string e =
        error_of<ls::MismatchError>([&] { lt::DistributedOptimizer opt(b, sgd, {}, {.names_from = net.get()}); });
    CHECK(all_ranks(mentions(e, "l1.weight") && mentions(e, "frozen") && mentions(e, "rank " + std::to_string(b.size() - 1))));
    CHECK(all_ranks(no_grads(*net)));  // nothing changed: no gradient buffers were installed
  }
  SECTION("an optimizer over every parameter, named by position") {
    Twins net;
    freeze(net);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    const std::string e = error_of<ls::MismatchError>([&] { lt::DistributedOptimizer opt(b, sgd); });
    CHECK(all_ranks(mentions(e, "param_groups.0.params.0") && mentions(e, "frozen")));
  }
  SECTION("an optimizer over the trainable parameters only, named by the module") {
    Twins net;
    freeze(net);
    torch::optim::SGD sgd(trainable(*net), torch::optim::SGDOptions(0.1));
    const std::string e =
        error_of<ls::MismatchError>([&] { lt::DistributedOptimizer opt(b, sgd, {}, {.names_from = net.get()}); });
    CHECK(all_ranks(mentions(e, "'l2.weight'") && mentions(e, "'l1.weight'")));
    CHECK(all_ranks(no_grads(*net)));
  }
  SECTION("synchronize(optimizer) and save_checkpoint compare the same") {
    Twins net;
    freeze(net);
    torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
    net->forward(torch::ones({2, 4})).sum().backward();
    adam.step();  // local state: for l2 on the last rank, l1 on the others
    const std::string e = error_of<ls::MismatchError>([&] { lt::synchronize(b, adam, 0); });
    CHECK(all_ranks(mentions(e, "param_groups.0.params.0") && mentions(e, "frozen")));
    const auto path = std::filesystem::temp_directory_path() /
                      ("lockstep-torch-twins-" + std::to_string(b.size()) + ".safetensors");
    const std::string e2 = error_of<ls::MismatchError>([&] { lt::save_checkpoint(b, path, *net, adam); });
    CHECK(all_ranks(mentions(e2, "'l1.weight'") && mentions(e2, "frozen")));
  }
  SECTION("the same parameters frozen everywhere: it trains") {
    Twins net;
    lt::synchronize(b, *net, 0);
    for (auto& p : net->l1->parameters()) p.set_requires_grad(false);
    torch::optim::SGD sgd(trainable(*net), torch::optim::SGDOptions(0.1));
    lt::DistributedOptimizer opt(b, sgd, {}, {.names_from = net.get()});
    auto [x, y] = global_batch(0, 12);
    opt.zero_grad();
    net->forward(rows_of(x, b.rank(), b.size()).narrow(1, 0, 4)).sum().backward();
    CHECK(opt.step());
    CHECK(replicas_equal(*net));
  }
}

TEST_CASE("DistributedOptimizer: a rank whose epoch ends inside an accumulation cycle, or that has no batch for "
          "a micro-step, keeps the replicas equal: every cycle is k step() calls, divided by k everywhere",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const int n = b.size();
  const bool odd = b.rank() == n - 1;
  auto w = torch::zeros({3}, torch::requires_grad());
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(1.0));
  ls::DistributedOptions o;
  o.accumulation_steps = 2;
  lt::DistributedOptimizer opt(b, sgd, o);
  // Each backward adds 1 to every gradient element. The odd rank's first epoch has 3 batches,
  // its second 0 (its last micro-step has no batch); the others have 2 and 2.
  auto micro = [&](bool backward) {
    opt.zero_grad();
    if (backward) w.sum().backward();
    return opt.step();
  };
  int stepped = 0;
  for (int e = 0; e < 2; ++e) {
    const int batches = odd ? (e == 0 ? 3 : 0) : 2;
    for (int i = 0; i < batches; ++i) stepped += micro(true);
  }
  if (odd) stepped += micro(false);  // the cut-short cycle's last call: no batch, still a micro-step
  CHECK(stepped == 2);
  CHECK(opt.applied_steps() == 2);
  // Cycle 1: every rank summed 2, divided by 2 and averaged over n: 1. Cycle 2: the odd rank
  // summed 1, the others 2: (2 (n - 1) + 1) / (2 n).
  const double expect = -1.0 - (2.0 * (n - 1) + 1.0) / (2.0 * n);
  CHECK(all_ranks(torch::allclose(w.detach(), torch::full({3}, expect), 1e-6, 1e-6)));
  std::map<std::string, ls::Tensor> x;
  x.emplace("w", lt::borrow(w.detach()));
  CHECK_NOTHROW(ls::check_replicas(b, x));
}

namespace {
struct BagImpl : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
  BagImpl() {
    emb = register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 3).sparse(true)));
    head = register_module("head", torch::nn::Linear(3, 2));
  }
  torch::Tensor forward(const torch::Tensor& idx) { return head->forward(emb->forward(idx)); }
};
TORCH_MODULE(Bag);
}  // namespace

TEST_CASE("DistributedOptimizer: sparse gradients (Embedding(sparse)) after zero_grad(set_to_none) on some or "
          "all ranks",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(21);
  Bag dist, ref;
  {
    torch::NoGradGuard g;
    for (std::size_t i = 0; i < dist->parameters().size(); ++i) ref->parameters()[i].copy_(dist->parameters()[i]);
  }
  torch::optim::SGD sd(dist->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD sr(ref->parameters(), torch::optim::SGDOptions(0.1));
  // A sparse gradient already there when the optimizer is wrapped is kept (densified).
  dist->emb->forward(torch::tensor({1, 1, 4}, torch::kLong)).sum().backward();
  REQUIRE(dist->emb->weight.grad().is_sparse());
  const auto kept = dist->emb->weight.grad().to_dense();
  lt::DistributedOptimizer opt(b, sd, {}, {.names_from = dist.get()});
  CHECK(dist->emb->weight.grad().layout() == torch::kStrided);
  CHECK(torch::equal(dist->emb->weight.grad(), kept));
  const int rows = 12;
  for (int s = 0; s < 4; ++s) {
    torch::manual_seed(500 + s);
    const auto idx = torch::randint(0, 10, {rows}, torch::kLong);
    const auto y = torch::randn({rows, 2});
    // Step 0: this optimizer's zero_grad; 1: torch's zero_grad(set_to_none) on every rank; 2: on
    // the last rank only; 3: on every rank again.
    if (s == 0 || (s == 2 && b.rank() != b.size() - 1))
      opt.zero_grad();
    else
      dist->zero_grad(/*set_to_none=*/true);
    torch::mse_loss(dist->forward(rows_of(idx, b.rank(), b.size())), rows_of(y, b.rank(), b.size())).backward();
    std::string e;
    try {
      CHECK(opt.step());
    } catch (const std::exception& ex) {
      e = ex.what();
    }
    INFO("step " << s);
    CHECK(all_ranks(e.empty()));
    UNSCOPED_INFO(e);
    sr.zero_grad();
    torch::mse_loss(ref->forward(idx), y).backward();
    sr.step();
  }
  CHECK(all_ranks(max_abs_diff(*dist, *ref) < 1e-5f));
  CHECK(replicas_equal(*dist));
  // The gradient is the bucket buffer again, dense.
  CHECK(dist->emb->weight.grad().layout() == torch::kStrided);
}

TEST_CASE("DistributedOptimizer: an error in a gradient hook on one rank is the same error on every rank, "
          "promptly; the step is not taken and the next one works",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(23);
  Net net;
  net->eval();
  lt::synchronize(b, *net, 0);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  for (std::size_t bucket : {std::size_t{0}, ls::kDefaultBucketBytes}) {
    for (int k : {1, 2}) {
      ls::DistributedOptions o;
      o.bucket_bytes = bucket;
      o.accumulation_steps = k;
      lt::DistributedOptimizer opt(b, sgd, o, {.names_from = net.get()});
      const auto before = net->fc1->weight.clone();
      auto [x, y] = global_batch(0, 12);
      const auto t0 = std::chrono::steady_clock::now();
      std::string e;
      for (int m = 0; m < k; ++m) {
        // The last rank's hook fails in the cycle's first micro-step.
        if (m == 0 && b.rank() == b.size() - 1) lt::testing::fail_next_gradient("injected hook failure");
        opt.zero_grad();
        torch::mse_loss(net->forward(rows_of(x, b.rank(), b.size())), rows_of(y, b.rank(), b.size())).backward();
        e = error_of<ls::Error>([&] { opt.step(); });
        if (m + 1 < k) CHECK(e.empty());  // an accumulate-only micro-step keeps it for the cycle's end
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      INFO("bucket_bytes " << bucket << " accumulation_steps " << k << ": " << e);
      CHECK(all_ranks(mentions(e, "injected hook failure") && mentions(e, "taking the gradient of 'fc") &&
                      mentions(e, "rank " + std::to_string(b.size() - 1)) && mentions(e, "not taken")));
      CHECK(all_ranks(seconds < 30));
      CHECK(torch::equal(before, net->fc1->weight));  // the step was not taken anywhere
      for (int m = 0; m < k; ++m) {
        opt.zero_grad();
        torch::mse_loss(net->forward(rows_of(x, b.rank(), b.size())), rows_of(y, b.rank(), b.size())).backward();
        CHECK(opt.step() == (m + 1 == k));
      }
      CHECK(replicas_equal(*net));
    }
  }
}

TEST_CASE("checkpoints: module and optimizer state, resumed bitwise; a different model changes nothing",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "lockstep-torch-test";
  if (b.rank() == 0) std::filesystem::create_directories(dir);
  const std::filesystem::path path = dir / ("ck-" + std::to_string(b.size()) + ".safetensors");
  for (Which w : {Which::adam, Which::sgd, Which::mine}) {
    torch::manual_seed(17);
    Net net;
    net->eval();
    lt::synchronize(b, *net, 0);
    auto inner = make_optimizer(w, net);
    auto run_steps = [&](Net& n, torch::optim::Optimizer& o, int from, int to) {
      lt::DistributedOptimizer opt(b, o);
      for (int s = from; s < to; ++s) {
        auto [x, y] = global_batch(s, 12);
        opt.zero_grad();
        torch::mse_loss(n->forward(rows_of(x, b.rank(), b.size())), rows_of(y, b.rank(), b.size())).backward();
        opt.step();
      }
    };
    run_steps(net, *inner, 0, 2);
    lt::save_checkpoint(b, path, *net, *inner, {{"epoch", "2"}});
    // Uninterrupted: two more steps.
    run_steps(net, *inner, 2, 4);
    // Resumed: a fresh model and optimizer (no state yet) loaded from the file, two steps.
    torch::manual_seed(99);
    Net resumed;
    resumed->eval();
    auto inner2 = make_optimizer(w, resumed);
    const auto meta = lt::load_checkpoint(b, path, *resumed, *inner2);
    CHECK(meta == std::map<std::string, std::string>{{"epoch", "2"}});
    run_steps(resumed, *inner2, 2, 4);
    INFO("optimizer " << static_cast<int>(w));
    CHECK(all_ranks(max_abs_diff(*net, *resumed) == 0.0f));  // bitwise
    // A different model: CheckpointError on every rank, nothing changed.
    Net other(6, 7, 3);
    const auto before = other->fc1->weight.clone();
    torch::optim::SGD so(other->parameters(), torch::optim::SGDOptions(0.1));
    const std::string e = error_of<ls::CheckpointError>([&] { lt::load_checkpoint(b, path, *other, so); });
    CHECK(all_ranks(!e.empty() && !mentions(e, "other:")));
    CHECK(torch::equal(before, other->fc1->weight));
  }
  // The names are the module's own.
  if (b.rank() == 0) {
    const ls::Checkpoint ck = ls::load_checkpoint(path);
    std::vector<std::string> names;
    for (const auto& [n, t] : ck.tensors) names.push_back(n);
    CHECK(std::find(names.begin(), names.end(), "fc1.weight") != names.end());
    CHECK(std::find(names.begin(), names.end(), "bn.running_mean") != names.end());
    CHECK(std::find(names.begin(), names.end(), "optimizer.torch_archive") != names.end());
  }
}

namespace {
struct ExportNetImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  ExportNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::relu(bn->forward(fc1->forward(x)))); }
};
TORCH_MODULE(ExportNet);
}  // namespace

// Hidden (run by the torch_checkpoint_python test only): writes a checkpoint of a module and
// Adam after two steps to $LOCKSTEP_TORCH_EXPORT_DIR, with an input batch and the module's output
// on it beside it; read_checkpoint.py loads it in Python and checks the output.
TEST_CASE("export a checkpoint for Python", "[.export]") {
  const char* d = std::getenv("LOCKSTEP_TORCH_EXPORT_DIR");
  REQUIRE(d != nullptr);
  const std::filesystem::path dir = d;
  std::filesystem::create_directories(dir);
  auto& b = backend();
  torch::manual_seed(1);
  ExportNet net;
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  lt::DistributedOptimizer opt(b, adam, {}, {.names_from = net.get()});
  for (int s = 0; s < 2; ++s) {  // training mode: BatchNorm's running statistics move
    opt.zero_grad();
    torch::mse_loss(net->forward(torch::randn({16, 6})), torch::randn({16, 3})).backward();
    CHECK(opt.step());
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
  CHECK(std::filesystem::exists(dir / "model.safetensors"));
}

}  // namespace torch_tests
