// lt::SyncBatchNorm and lt::convert_sync_batchnorm under mpiexec at 1-4 ranks: N ranks with
// batch b train a conv net as one process with torch::nn::BatchNorm2d on batch N*b (declared and
// converted), uneven batches (one rank with 0 rows), BatchNorm1d without affine or running
// statistics, collectives per forward/backward (none in eval), convert refusing a BatchNorm held
// by a custom module's member on every rank, and BatchNorm's state_dict names and checkpoints;
// lt::Join with 0, 1 and many extra batches on one rank (SyncBatchNorm taking part); f64, f16,
// bf16, channels_last and non-contiguous inputs; one rank's refused input (dimensionality,
// channels, dtype) an InvalidArgument on every rank; an input needing a gradient on some ranks;
// a Join rank that has a batch again refused on every rank; a forward or backward after the
// backend was destroyed refused.
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <filesystem>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "lockstep/torch.hpp"
#include "lockstep/torch/join.hpp"
#include "lockstep/torch/sync_batchnorm.hpp"
#include "torch_test_support.hpp"

namespace ls = lockstep;
namespace lt = lockstep::torch;

// This file's helpers and test cases (test_torch compiles the LibTorch tests as one unit).
namespace sync_batchnorm_tests {

using namespace lttest;

namespace {

// Counts the collectives that reach the real backend.
class Counting final : public lstest::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  int calls = 0;

 protected:
  void on_call(Call, const ls::TensorView&) override { ++calls; }
  void abandon(const CallInfo& call, const std::exception& e) override { forward_abandon(inner(), call, e); }
};

// The conv net: Conv2d(1 => 4, 3x3, pad 1), BatchNorm2d(4), ReLU, Linear(4*6*6 => 3). `Bn` is
// torch::nn::BatchNorm2d (the reference) or lt::SyncBatchNorm2d (declared).
template <class Bn>
struct ConvNetImpl : torch::nn::Module {
  torch::nn::Conv2d conv{nullptr};
  Bn bn{nullptr};
  torch::nn::Linear fc{nullptr};
  template <class... A>
  explicit ConvNetImpl(A&&... bn_args) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    bn = register_module("bn", Bn(std::forward<A>(bn_args)..., torch::nn::BatchNorm2dOptions(4).momentum(0.2)));
    fc = register_module("fc", torch::nn::Linear(4 * 6 * 6, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(torch::relu(bn->forward(conv->forward(x))).flatten(1)); }
};

// The same as a Sequential (for convert_sync_batchnorm).
torch::nn::Sequential seq_net() {
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)),
                               torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(4).momentum(0.2)),
                               torch::nn::Functional(torch::relu), torch::nn::Flatten(),
                               torch::nn::Linear(4 * 6 * 6, 3));
}

// Copies every parameter and buffer of `from` into `to` by name (the names must be the same).
void copy_state(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto src = from.named_parameters();
  for (auto& p : to.named_parameters()) p.value().copy_(src[p.key()]);
  auto bsrc = from.named_buffers();
  for (auto& b : to.named_buffers()) b.value().copy_(bsrc[b.key()]);
}

std::vector<std::string> names_of(torch::nn::Module& m) {
  std::vector<std::string> n;
  for (const auto& p : m.named_parameters()) n.push_back(p.key());
  for (const auto& b : m.named_buffers()) n.push_back(b.key());
  return n;
}

// The largest difference of a from b, relative to 1 + |b| (float rounding on values of any size).
double diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.numel() == 0) return 0;
  const auto bd = b.to(torch::kDouble);
  return ((a.to(torch::kDouble) - bd).abs() / (bd.abs() + 1)).max().item<double>();
}

// Largest difference over the parameters and buffers of two modules with the same names.
double max_diff(torch::nn::Module& a, torch::nn::Module& b) {
  double d = 0;
  auto pb = b.named_parameters();
  for (const auto& p : a.named_parameters()) d = std::max(d, diff(p.value(), pb[p.key()]));
  auto bb = b.named_buffers();
  for (const auto& x : a.named_buffers()) d = std::max(d, diff(x.value(), bb[x.key()]));
  return d;
}

// The global batch of step s, the same on every rank.
std::pair<torch::Tensor, torch::Tensor> conv_batch(int s, std::int64_t rows) {
  torch::manual_seed(500 + s);
  return {torch::randn({rows, 1, 6, 6}) * 2 + 0.5, torch::randn({rows, 3})};
}

// Trains `dist` (on this rank's rows of each global batch, per-rank counts `rows`) and `ref` (a
// copy in this process, on the whole batch) with SGD for 3 steps; loss = sum of squared errors
// / global rows, gradients summed across ranks: the same gradient as the reference's. Returns
// the largest relative difference after training, outputs in eval mode included.
double train_both(torch::nn::Module& dist, const std::function<torch::Tensor(const torch::Tensor&)>& dist_fwd,
                  torch::nn::Module& ref, const std::function<torch::Tensor(const torch::Tensor&)>& ref_fwd,
                  const std::vector<std::int64_t>& rows) {
  auto& b = backend();
  std::int64_t total = 0, lo = 0;
  for (std::size_t r = 0; r < rows.size(); ++r) {
    if (static_cast<int>(r) < b.rank()) lo += rows[r];
    total += rows[r];
  }
  const std::int64_t mine = rows[static_cast<std::size_t>(b.rank())];
  copy_state(ref, dist);
  torch::optim::SGD sgd_ref(ref.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD sgd(dist.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  ls::DistributedOptions o;
  o.op = ls::ReduceOp::sum;
  lt::DistributedOptimizer opt(b, sgd, o);
  double d = 0;
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = conv_batch(s, total);
    sgd_ref.zero_grad();
    const auto ref_out = ref_fwd(x);
    ((ref_out - y).pow(2).sum() / total).backward();
    sgd_ref.step();
    opt.zero_grad();
    const auto out = dist_fwd(x.narrow(0, lo, mine));
    ((out - y.narrow(0, lo, mine)).pow(2).sum() / total).backward();
    opt.step();
    // Forward in training mode: this rank's rows normalised with the global batch's statistics.
    d = std::max(d, diff(out, ref_out.narrow(0, lo, mine)));
  }
  d = std::max(d, max_diff(dist, ref));
  dist.eval();
  ref.eval();
  auto [x, y] = conv_batch(99, 5);
  d = std::max(d, diff(dist_fwd(x), ref_fwd(x)));
  return d;
}

}  // namespace

TEST_CASE("SyncBatchNorm2d: N ranks with batch b train as one process with BatchNorm2d on batch N*b, declared "
          "and converted; uneven batches and a rank with 0 rows are weighted by their rows",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const int n = b.size();
  std::vector<std::int64_t> even(static_cast<std::size_t>(n), 4), uneven;
  for (int r = 0; r < n; ++r) uneven.push_back(n == 1 ? 5 : (r == 1 ? 0 : 2 + 3 * r));  // rank 1: no rows
  for (const auto* rows : {&even, &uneven}) {
    INFO((rows == &even ? "even" : "uneven") << " batches");
    {
      torch::manual_seed(7);
      ConvNetImpl<torch::nn::BatchNorm2d> ref;
      ConvNetImpl<lt::SyncBatchNorm2d> dist(b);
      const double d = train_both(
          dist, [&](const torch::Tensor& x) { return dist.forward(x); }, ref,
          [&](const torch::Tensor& x) { return ref.forward(x); }, *rows);
      UNSCOPED_INFO("declared: largest difference " << d);
      CHECK(all_ranks(d < 1e-4));
      CHECK(dist.bn->num_batches_tracked.item<std::int64_t>() == 3);
    }
    {
      torch::manual_seed(7);
      auto ref = seq_net();
      auto dist = seq_net();
      CHECK(lt::convert_sync_batchnorm(b, *dist) == 1);
      CHECK(dist[1]->as<lt::SyncBatchNorm2dImpl>() != nullptr);
      CHECK(names_of(*dist) == names_of(*ref));
      const double d = train_both(
          *dist, [&](const torch::Tensor& x) { return dist->forward(x); }, *ref,
          [&](const torch::Tensor& x) { return ref->forward(x); }, *rows);
      UNSCOPED_INFO("converted: largest difference " << d);
      CHECK(all_ranks(d < 1e-4));
    }
  }
}

TEST_CASE("SyncBatchNorm1d without affine, with a cumulative average or without running statistics, equals "
          "BatchNorm1d on the global batch (forward, input gradient, running statistics)",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const std::int64_t per = 3, total = per * b.size();
  for (bool track : {true, false}) {
    INFO("track_running_stats " << track);
    const auto opts = torch::nn::BatchNorm1dOptions(5).affine(false).momentum(c10::nullopt).track_running_stats(track);
    lt::SyncBatchNorm1d sync(b, opts);
    torch::nn::BatchNorm1d ref(opts);
    double d = 0;
    for (int s = 0; s < 2; ++s) {
      torch::manual_seed(40 + s);
      auto x = (torch::randn({total, 5, 4}) * 3 + 1).requires_grad_(true);
      auto w = torch::randn({total, 5, 4});
      auto xs = x.detach().narrow(0, per * b.rank(), per).clone().requires_grad_(true);
      auto y_ref = ref->forward(x);
      (y_ref * w).sum().backward();
      auto y = sync->forward(xs);
      (y * w.narrow(0, per * b.rank(), per)).sum().backward();
      d = std::max(d, diff(y, y_ref.narrow(0, per * b.rank(), per)));
      d = std::max(d, diff(xs.grad(), x.grad().narrow(0, per * b.rank(), per)));
    }
    if (track) {
      d = std::max(d, diff(sync->running_mean, ref->running_mean));
      d = std::max(d, diff(sync->running_var, ref->running_var));
    } else {
      CHECK(!sync->running_mean.defined());
      // Eval without running statistics: this rank's own batch, as BatchNorm1d on it.
      sync->eval();
      ref->eval();
      torch::manual_seed(60 + b.rank());
      auto x = torch::randn({4, 5, 2});
      d = std::max(d, diff(sync->forward(x), ref->forward(x)));
    }
    UNSCOPED_INFO("largest difference " << d);
    CHECK(all_ranks(d < 1e-4));
  }
}

TEST_CASE("SyncBatchNorm: one collective per training forward and one per backward, none in eval mode; fewer "
          "than 2 values per channel is an error on every rank",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  Counting counting(backend());
  lt::SyncBatchNorm2d bn(counting, torch::nn::BatchNorm2dOptions(3));
  auto x = torch::randn({2, 3, 4, 4}, torch::requires_grad());
  auto y = bn->forward(x);
  CHECK(counting.calls == 1);
  y.sum().backward();
  CHECK(counting.calls == 2);
  bn->eval();
  const auto mean = bn->running_mean.clone();
  {
    torch::NoGradGuard no_grad;
    bn->forward(x);
  }
  bn->forward(x).sum().backward();
  CHECK(counting.calls == 2);
  CHECK(torch::equal(mean, bn->running_mean));
  // A global batch of one value per channel: every rank throws (rank 0 has one row, the rest none).
  bn->train();
  auto one = torch::randn({backend().rank() == 0 ? 1 : 0, 3, 1, 1});
  const std::string e = error_of<ls::InvalidArgument>([&] { bn->forward(one); });
  UNSCOPED_INFO(e);
  CHECK(all_ranks(mentions(e, "more than 1 value per channel")));
}

namespace {
// A BatchNorm held by a custom module's own member: convert cannot swap it.
struct MemberNetImpl : torch::nn::Module {
  torch::nn::Sequential head{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  MemberNetImpl() {
    head = register_module("head", torch::nn::Sequential(torch::nn::BatchNorm2d(2), torch::nn::ReLU()));
    bn = register_module("bn", torch::nn::BatchNorm2d(2));
  }
};
TORCH_MODULE(MemberNet);
}  // namespace

TEST_CASE("convert_sync_batchnorm: ModuleList and ModuleDict too, weights and running statistics kept; a BatchNorm "
          "held by a custom member is an InvalidArgument on every rank naming it, nothing changed",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  {
    torch::nn::ModuleList list(torch::nn::BatchNorm1d(3), torch::nn::Linear(3, 3));
    torch::nn::ModuleDict dict(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
        {"norm", torch::nn::BatchNorm3d(2).ptr()}});
    torch::nn::Sequential inner(torch::nn::BatchNorm2d(4));
    torch::nn::Module outer;  // a custom module holding containers: their BatchNorms can be swapped
    outer.register_module("seq", inner);
    outer.register_module("list", list);
    outer.register_module("dict", dict);
    {
      torch::NoGradGuard no_grad;
      list[0]->as<torch::nn::BatchNorm1dImpl>()->weight.fill_(3);
      list[0]->as<torch::nn::BatchNorm1dImpl>()->running_var.fill_(7);
    }
    list[0]->eval();
    const auto old_weight = list[0]->as<torch::nn::BatchNorm1dImpl>()->weight;
    CHECK(lt::convert_sync_batchnorm(b, outer) == 3);
    auto* s1 = list[0]->as<lt::SyncBatchNorm1dImpl>();
    REQUIRE(s1 != nullptr);
    CHECK(s1->weight.is_same(old_weight));  // the tensor itself: an optimizer built before still trains it
    CHECK(s1->running_var.eq(7).all().item<bool>());
    CHECK(!s1->is_training());
    CHECK(dict["norm"]->as<lt::SyncBatchNorm3dImpl>() != nullptr);
    CHECK(inner->ptr(0)->as<lt::SyncBatchNorm2dImpl>() != nullptr);
    // Sequential's forward goes through the new module (its type-erased AnyModule was replaced).
    Counting counting(b);
    torch::nn::Sequential seq(torch::nn::BatchNorm1d(3));
    lt::convert_sync_batchnorm(counting, *seq);
    seq->forward(torch::randn({4, 3}));
    CHECK(counting.calls == 2);  // the agreement in convert, then the forward's one
  }
  {
    // Rank 0 holds a BatchNorm in a member; the others' models are convertible: every rank throws,
    // naming rank 0's module, and no rank changed anything.
    MemberNet member;
    torch::nn::Sequential fine(torch::nn::BatchNorm2d(2));
    torch::nn::Module& mine = b.rank() == 0 ? static_cast<torch::nn::Module&>(*member) : *fine;
    const std::string e = error_of<ls::InvalidArgument>([&] { lt::convert_sync_batchnorm(b, mine); });
    UNSCOPED_INFO(e);
    CHECK(all_ranks(mentions(e, "BatchNorm2d 'bn' is held by a module's own member")));
    CHECK(all_ranks(!mentions(e, "'head.0'")));
    CHECK(member->head[0]->as<torch::nn::BatchNorm2dImpl>() != nullptr);
    CHECK(fine[0]->as<torch::nn::BatchNorm2dImpl>() != nullptr);
  }
}

TEST_CASE("SyncBatchNorm2d has BatchNorm2d's state_dict names and loads its checkpoints (torch::save/load)",
          "[torch][mpi]") {
  auto& b = backend();
  torch::nn::BatchNorm2d bn(torch::nn::BatchNorm2dOptions(3));
  lt::SyncBatchNorm2d sync(b, torch::nn::BatchNorm2dOptions(3));
  CHECK(names_of(*bn) == names_of(*sync));
  CHECK(names_of(*sync) ==
        std::vector<std::string>{"weight", "bias", "running_mean", "running_var", "num_batches_tracked"});
  {
    torch::NoGradGuard no_grad;
    bn->weight.uniform_();
    bn->running_mean.uniform_();
    bn->num_batches_tracked.fill_(11);
  }
  const auto dir = std::filesystem::temp_directory_path() /
                   ("lockstep-syncbn-" + std::to_string(::getpid()) + "-" + std::to_string(b.rank()));
  std::filesystem::create_directories(dir);
  torch::save(bn, (dir / "bn.pt").string());
  torch::load(sync, (dir / "bn.pt").string());
  CHECK(max_diff(*bn, *sync) == 0);
  torch::save(sync, (dir / "sync.pt").string());
  torch::nn::BatchNorm2d back(torch::nn::BatchNorm2dOptions(3));
  torch::load(back, (dir / "sync.pt").string());
  CHECK(max_diff(*back, *sync) == 0);
  std::filesystem::remove_all(dir);
}

namespace {
struct MlpImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Sequential bn{nullptr};
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 6));
    bn = register_module("bn", torch::nn::Sequential(torch::nn::BatchNorm1d(6)));
    fc2 = register_module("fc2", torch::nn::Linear(6, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::relu(bn->forward(fc1->forward(x)))); }
};
TORCH_MODULE(Mlp);

// A reference Mlp from `seed` and a copy of it (the same parameters) whose BatchNorm1d
// convert_sync_batchnorm made a SyncBatchNorm1d.
std::pair<Mlp, Mlp> reference_and_sync(ls::Backend& b, std::uint64_t seed) {
  torch::manual_seed(seed);
  Mlp ref;
  Mlp dist;
  {
    torch::NoGradGuard no_grad;
    auto src = ref->named_parameters();
    for (auto& p : dist->named_parameters()) p.value().copy_(src[p.key()]);
  }
  CHECK(lt::convert_sync_batchnorm(b, *dist) == 1);
  return {ref, dist};
}

// Trains `dist` through `join` until every rank ran out of batches (rank r has batches_of(r),
// each `rows` rows of the global batch drawn from seed + step; a joined rank steps on 0 rows),
// and `ref` in this process on the active ranks' rows: each active rank's summed squared error
// over 2 outputs, divided by rows x 2 x n (with by_active: x the active ranks instead of n, which
// `dist` gets by scaling its mean loss by n / active_ranks()). Returns the steps run.
std::int64_t train_joined(ls::Backend& b, Mlp& ref, Mlp& dist, torch::optim::Optimizer& ref_opt,
                          lt::DistributedOptimizer& opt, lt::Join& join, const std::function<std::int64_t(int)>& batches_of,
                          std::int64_t rows, int seed, bool by_active) {
  const int n = b.size();
  const std::int64_t mine = batches_of(b.rank());
  std::int64_t i = 0;
  for (; join.next(i < mine); ++i) {
    torch::manual_seed(seed + static_cast<int>(i));
    const auto x = torch::randn({n * rows, 4}), y = torch::randn({n * rows, 2});
    // The reference: the active ranks' rows, each rank's mean loss, summed and divided by n.
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < n; ++r)
      if (i < batches_of(r)) {
        xs.push_back(x.narrow(0, r * rows, rows));
        ys.push_back(y.narrow(0, r * rows, rows));
      }
    CHECK(join.active_ranks() == static_cast<int>(xs.size()));
    ref_opt.zero_grad();
    const double divisor = static_cast<double>(rows * 2 * (by_active ? static_cast<std::int64_t>(xs.size()) : n));
    ((ref->forward(torch::cat(xs)) - torch::cat(ys)).pow(2).sum() / divisor).backward();
    ref_opt.step();
    const std::int64_t k = i < mine ? rows : 0;  // a joined rank: 0 rows
    opt.zero_grad();
    const double scale = by_active ? static_cast<double>(n) / join.active_ranks() : 1.0;
    (torch::nn::functional::mse_loss(dist->forward(x.narrow(0, b.rank() * rows, k)), y.narrow(0, b.rank() * rows, k)) *
     scale)
        .backward();
    CHECK(opt.step());
  }
  return i;
}
}  // namespace

TEST_CASE("Join: a rank with 0, 1 or many extra batches; the others take part with 0 rows until it is done, "
          "SyncBatchNorm too; the same model as one process on the active ranks' rows, divided by the world size",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const int n = b.size();
  const std::int64_t rows = 3, base = 2;
  for (int extra : {0, 1, 5})
  for (bool by_active : {false, true}) {
    // by_active: the mean over the ranks that had a batch (DDP's divide_by_initial_world_size=False),
    // by scaling the loss by size() / active_ranks().
    INFO(extra << " extra batches on the last rank; divided by " << (by_active ? "the active ranks" : "the world size"));
    // Rank r has base batches, the last rank base + extra.
    auto batches_of = [&](int r) { return base + (r == n - 1 ? extra : 0); };
    auto [ref, dist] = reference_and_sync(b, 3);
    torch::optim::SGD sgd(dist->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD sgd_ref(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    lt::DistributedOptimizer opt(b, sgd);  // ReduceOp::avg: divided by the world size
    lt::Join join(b);
    const std::int64_t i = train_joined(b, ref, dist, sgd_ref, opt, join, batches_of, rows, 800, by_active);
    CHECK(i == base + extra);
    CHECK(join.steps() == base + extra);
    CHECK(join.joined_steps() == (b.rank() == n - 1 ? 0 : extra));
    CHECK(join.active_ranks() == 0);
    CHECK(all_ranks(max_diff(*dist, *ref) < 1e-4));
    UNSCOPED_INFO("largest difference " << max_diff(*dist, *ref));
    CHECK(replicas_equal(b, *dist));
  }
}

namespace {
// Sums a tensor over the ranks (f64): a SyncBatchNorm's weight and bias gradients are each
// rank's share of the global batch's.
torch::Tensor sum_over_ranks(const torch::Tensor& t) {
  auto d = t.to(torch::kDouble).contiguous().clone();
  backend().allreduce(lt::view(d), ls::ReduceOp::sum);
  return d;
}

// One training step of SyncBatchNorm2d on this rank's rows of a global batch [total, C, 3, 3]
// (`prep` turns this rank's rows into the input it is given: another dtype, channels_last,
// non-contiguous) against torch::nn::BatchNorm2d on the whole batch in f64: the output, the input
// gradient, the summed weight and bias gradients and the running statistics. Returns the
// largest relative difference.
double step_against_reference(const torch::nn::BatchNormOptions& opts, const std::vector<std::int64_t>& rows,
                              const std::function<torch::Tensor(const torch::Tensor&)>& prep,
                              torch::Dtype module_type = torch::kFloat, bool input_grad = true) {
  auto& b = backend();
  std::int64_t total = 0, lo = 0;
  for (std::size_t r = 0; r < rows.size(); ++r) {
    if (static_cast<int>(r) < b.rank()) lo += rows[r];
    total += rows[r];
  }
  const std::int64_t mine = rows[static_cast<std::size_t>(b.rank())];
  const std::int64_t c = opts.num_features();
  torch::manual_seed(77);
  auto x = torch::randn({total, c, 3, 3}, torch::kDouble) * 3 + 2;
  auto w = torch::randn({total, c, 3, 3}, torch::kDouble);
  torch::nn::BatchNorm2d ref(opts);
  ref->to(torch::kDouble);
  lt::SyncBatchNorm2d sync(b, opts);
  sync->to(module_type);
  if (opts.affine()) {
    torch::NoGradGuard no_grad;
    ref->weight.uniform_(0.5, 1.5);
    ref->bias.uniform_(-1, 1);
    sync->weight.copy_(ref->weight);
    sync->bias.copy_(ref->bias);
  }
  auto xr = x.clone().requires_grad_(true);
  auto yr = ref->forward(xr);
  (yr * w).sum().backward();
  auto xs = prep(x.narrow(0, lo, mine)).detach().requires_grad_(input_grad);
  auto y = sync->forward(xs);
  (y * prep(w.narrow(0, lo, mine))).sum().backward();
  double d = diff(y, yr.narrow(0, lo, mine));
  CHECK(y.scalar_type() == xs.scalar_type());
  if (input_grad) {
    d = std::max(d, diff(xs.grad(), xr.grad().narrow(0, lo, mine)));
    CHECK(xs.grad().scalar_type() == xs.scalar_type());
  }
  UNSCOPED_INFO("output/input gradient difference " << d << ", output " << y.scalar_type());
  if (opts.affine()) {
    const double dw = diff(sum_over_ranks(sync->weight.grad()), ref->weight.grad());
    const double db = diff(sum_over_ranks(sync->bias.grad()), ref->bias.grad());
    UNSCOPED_INFO("weight and bias gradient differences " << dw << ", " << db);
    d = std::max({d, dw, db});
  }
  if (opts.track_running_stats()) {
    const double dm = diff(sync->running_mean, ref->running_mean), dv = diff(sync->running_var, ref->running_var);
    UNSCOPED_INFO("running mean and variance differences " << dm << ", " << dv);
    d = std::max({d, dm, dv});
  }
  return d;
}
}  // namespace

TEST_CASE("SyncBatchNorm2d: f64, f16 and bf16, channels_last and non-contiguous inputs equal BatchNorm2d on the "
          "global batch (output, gradients, running statistics)",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  const int n = backend().size();
  std::vector<std::int64_t> rows;
  for (int r = 0; r < n; ++r) rows.push_back(n == 1 ? 5 : (r == 1 ? 0 : 2 + r));
  const auto opts = torch::nn::BatchNorm2dOptions(3).momentum(0.3);
  auto as = [](torch::Dtype t) { return [t](const torch::Tensor& x) { return x.to(t); }; };
  SECTION("f64 input, f64 module") {
    CHECK(all_ranks(step_against_reference(opts, rows, as(torch::kDouble), torch::kDouble) < 1e-10));
  }
  SECTION("f64 input, f32 module") { CHECK(all_ranks(step_against_reference(opts, rows, as(torch::kDouble)) < 1e-5)); }
  SECTION("f32") { CHECK(all_ranks(step_against_reference(opts, rows, as(torch::kFloat)) < 1e-5)); }
  SECTION("f16") { CHECK(all_ranks(step_against_reference(opts, rows, as(torch::kHalf)) < 1e-2)); }
  SECTION("bf16") { CHECK(all_ranks(step_against_reference(opts, rows, as(torch::kBFloat16)) < 5e-2)); }
  SECTION("channels_last") {
    CHECK(all_ranks(step_against_reference(opts, rows, [](const torch::Tensor& x) {
                      return x.to(torch::kFloat).contiguous(torch::MemoryFormat::ChannelsLast);
                    }) < 1e-5));
  }
  SECTION("non-contiguous (a transposed view)") {
    CHECK(all_ranks(step_against_reference(opts, rows, [](const torch::Tensor& x) {
                      return x.to(torch::kFloat).transpose(2, 3).contiguous().transpose(2, 3);
                    }) < 1e-5));
  }
  SECTION("no affine, cumulative average") {
    CHECK(all_ranks(step_against_reference(torch::nn::BatchNorm2dOptions(3).affine(false).momentum(c10::nullopt), rows,
                                           as(torch::kFloat)) < 1e-5));
  }
}

TEST_CASE("SyncBatchNorm: a rank's refused input (wrong dimensionality, channels or dtype) is an InvalidArgument on "
          "every rank naming the rank; 0 rows on every rank too",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const int last = b.size() - 1;
  const bool bad = b.rank() == last;
  lt::SyncBatchNorm2d bn(b, torch::nn::BatchNorm2dOptions(3));
  const auto good = torch::randn({2, 3, 2, 2});
  const std::vector<std::pair<torch::Tensor, std::string>> cases{
      {torch::randn({2, 4, 2, 2}), "channels"}, {torch::randn({2, 3, 2}), "4D input"},
      {torch::ones({2, 3, 2, 2}, torch::kLong), "Long"}};
  for (const auto& [input, what] : cases) {
    INFO("rank " << last << ": " << what);
    const std::string e = error_of<ls::InvalidArgument>([&] { bn->forward(bad ? input : good); });
    UNSCOPED_INFO(e);
    CHECK(all_ranks(mentions(e, "rank " + std::to_string(last))));
    CHECK(all_ranks(mentions(e, what)));
    CHECK(all_ranks(!mentions(e, "other: ")));
  }
  if (b.size() >= 3) {
    // Every rank but 0 refuses: every rank names the lowest, and the others.
    const std::string e = error_of<ls::InvalidArgument>([&] { bn->forward(b.rank() == 0 ? good : cases[0].first); });
    UNSCOPED_INFO(e);
    CHECK(all_ranks(mentions(e, "rank 1's input has 4 channels, the module 3 (also rank")));
    CHECK(all_ranks(mentions(e, std::to_string(last) + ")")));
  }
  // The module still works, and counted no batch.
  CHECK(bn->num_batches_tracked.item<std::int64_t>() == 0);
  bn->forward(good).sum().backward();
  CHECK(bn->num_batches_tracked.item<std::int64_t>() == 1);
  // Every rank with 0 rows.
  const std::string e = error_of<ls::InvalidArgument>([&] { bn->forward(torch::randn({0, 3, 2, 2})); });
  UNSCOPED_INFO(e);
  CHECK(all_ranks(mentions(e, "more than 1 value per channel")));
}

TEST_CASE("SyncBatchNorm: an input that needs a gradient on some ranks only; backward on every rank gives each "
          "the global batch's gradient; a rank whose forward records no graph then is an error on every rank",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const std::vector<std::int64_t> rows(static_cast<std::size_t>(b.size()), 2);
  // Rank 0's input needs a gradient, the others' do not; the weights are trained everywhere.
  const double d = step_against_reference(
      torch::nn::BatchNorm2dOptions(3), rows, [&](const torch::Tensor& x) { return x.to(torch::kFloat); },
      torch::kFloat, /*input_grad=*/b.rank() == 0);
  CHECK(all_ranks(d < 1e-5));
  // A training forward under no_grad on every rank: no graph anywhere, the statistics counted.
  lt::SyncBatchNorm2d bn(b, torch::nn::BatchNorm2dOptions(3));
  const auto x = torch::randn({2, 3, 2, 2}, torch::requires_grad());
  {
    torch::NoGradGuard no_grad;
    CHECK_FALSE(bn->forward(x).requires_grad());
  }
  CHECK(bn->num_batches_tracked.item<std::int64_t>() == 1);
  if (b.size() > 1) {
    // Rank 0's input needs a gradient, the last rank's forward records no graph: its backward
    // would never run while rank 0's waits for it. An error in forward, on every rank.
    const int last = b.size() - 1;
    const std::string e = error_of<ls::InvalidArgument>([&] {
      if (b.rank() == last) {
        torch::NoGradGuard no_grad;
        bn->forward(x);
      } else {
        bn->forward(x);
      }
    });
    UNSCOPED_INFO(e);
    CHECK(all_ranks(mentions(e, "rank 0's input needs a gradient, but rank " + std::to_string(last) +
                                    "'s forward records no autograd graph")));
    CHECK(bn->num_batches_tracked.item<std::int64_t>() == 1);
  }
}

TEST_CASE("Join: a SyncBatchNorm error on one rank inside the loop is thrown on every rank; caught, the ranks "
          "stay in step and the loop ends everywhere",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const int n = b.size(), last = n - 1;
  const std::int64_t mine = 2 + (b.rank() == last ? 2 : 0);  // the last rank has 2 extra batches
  torch::manual_seed(3);
  Mlp net;
  lt::synchronize(b, *net, 0);
  CHECK(lt::convert_sync_batchnorm(b, *net) == 1);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  lt::DistributedOptimizer opt(b, sgd);
  lt::Join join(b);
  std::int64_t i = 0;
  int caught = 0;
  for (; join.next(i < mine); ++i) {
    torch::manual_seed(900 + static_cast<int>(i) + 10 * b.rank());
    const std::int64_t k = i < mine ? 3 : 0;
    auto x = torch::randn({k, 4});
    try {
      opt.zero_grad();
      auto h = net->fc1->forward(x);
      // Step 1: the last rank's batch reaches the SyncBatchNorm with 5 features instead of 6.
      if (i == 1 && b.rank() == last) h = torch::cat({h, h}, 1).narrow(1, 0, 5);
      net->fc2->forward(torch::relu(net->bn->forward(h))).pow(2).mean().backward();
      opt.step();
    } catch (const ls::InvalidArgument& e) {
      ++caught;
      UNSCOPED_INFO(e.what());
      CHECK(mentions(e.what(), "rank " + std::to_string(last) + "'s input has 5 channels, the module 6"));
    }
  }
  CHECK(all_ranks(caught == 1));
  CHECK(i == 4);
  CHECK(join.steps() == 4);
  CHECK(replicas_equal(b, *net));
}

TEST_CASE("Join: every rank runs out at a different step (rank r has r batches, rank 0 none), SyncBatchNorm and "
          "a sharded SGD inside; the same model as one process on the active ranks' rows",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const int n = b.size();
  const std::int64_t rows = 3;
  const std::int64_t mine = b.rank();
  auto [ref, dist] = reference_and_sync(b, 4);
  // SGD with momentum (state to shard). Not Adam: fc1's bias, which the BatchNorm subtracts
  // again, has a true gradient of 0, and Adam turns its rounding noise into steps of lr's size.
  torch::optim::SGD sgd(dist->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD sgd_ref(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  lt::DistributedOptimizer opt(b, sgd, {.shard_optimizer_state = true});
  lt::Join join(b);
  const std::int64_t i =
      train_joined(b, ref, dist, sgd_ref, opt, join, [](int r) { return std::int64_t{r}; }, rows, 700, false);
  // At one rank no rank has a batch: the loop ends at once, nothing trained.
  CHECK(i == std::max(0, n - 1));
  CHECK(join.joined_steps() == i - mine);
  UNSCOPED_INFO("largest difference " << max_diff(*dist, *ref));
  CHECK(all_ranks(max_diff(*dist, *ref) < 1e-4));
  CHECK(replicas_equal(b, *dist));
}

TEST_CASE("Join: a rank that ran out of data and has a batch again is refused on every rank, naming it; a new loop "
          "after the end may start again",
          "[torch][mpi]") {
  auto& b = backend();
  const int n = b.size(), last = n - 1;
  lt::Join join(b);
  // The last rank: a batch for step 0, none for step 1, one again for step 2 (data that came
  // back: a second dataloader, an iterator reset by mistake). Every other rank: 3 batches.
  const auto has = [&](int i) { return b.rank() == last ? i != 1 : i < 3; };
  CHECK(join.next(has(0)));
  if (n > 1) {
    CHECK(join.next(has(1)));
    CHECK(join.joined_steps() == (b.rank() == last ? 1 : 0));
    const std::string e = error_of<ls::InvalidArgument>([&] { (void)join.next(has(2)); });
    UNSCOPED_INFO(e);
    CHECK(all_ranks(mentions(e, "rank " + std::to_string(last) + " has a batch for step 2 but had none for step 1")));
    // Every rank threw, none is left in a collective: the ranks are still in step.
    CHECK(all_ranks(true));
    // Rejoining is refused as long as the loop lasts, also when that rank says it has no batch
    // in between.
    CHECK(all_ranks(mentions(error_of<ls::InvalidArgument>([&] { (void)join.next(b.rank() == last); }),
                             "rank " + std::to_string(last) + " has a batch")));
  }
  // The loop ends (no rank has a batch); a new loop with the same Join starts afresh.
  CHECK_FALSE(join.next(false));
  CHECK(join.next(true));
  CHECK_FALSE(join.next(false));
}

TEST_CASE("SyncBatchNorm: a forward or backward after its backend was destroyed is an InvalidArgument saying so, "
          "not a use of freed memory",
          "[torch][mpi]") {
  torch::set_num_threads(1);
  auto local = std::make_unique<ls::MPIBackend>(MPI_COMM_WORLD);
  lt::SyncBatchNorm1d bn(*local, torch::nn::BatchNormOptions(3));
  torch::manual_seed(11 + backend().rank());
  const auto x = torch::randn({4, 3}, torch::requires_grad());
  const auto y = bn->forward(x);
  local.reset();  // every rank destroys it, with y's graph still holding the layer's backward
  const std::string e = error_of<ls::InvalidArgument>([&] { y.pow(2).sum().backward(); });
  UNSCOPED_INFO(e);
  CHECK(all_ranks(mentions(e, "lockstep::torch::SyncBatchNorm1d: backward after its backend was destroyed")));
  const std::string f = error_of<ls::InvalidArgument>([&] { (void)bn->forward(x); });
  UNSCOPED_INFO(f);
  CHECK(all_ranks(mentions(f, "lockstep::torch::SyncBatchNorm1d: forward after its backend was destroyed")));
  // Eval mode needs no backend.
  bn->eval();
  CHECK(all_ranks(bn->forward(x).defined()));
}

}  // namespace sync_batchnorm_tests
