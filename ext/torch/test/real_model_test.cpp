// What a real model (a transformer: examples/torch/gpt.cpp) brings to lockstep::torch, under
// mpiexec at 1-3 ranks, each against one process on the global batch with LibTorch alone: a tied
// weight (the embedding and the output head sharing one tensor, listed by LibTorch under both
// names) refused when given twice, reduced once when given once, broadcast, saved, loaded and
// hashed once; parameters that get no gradient in a step (on every rank) with clipping; the
// global norm of TorchOptions::max_grad_norm across ranks, replicated and sharded (ZeRO-1) and in
// deterministic mode, equal to torch::nn::utils::clip_grad_norm_ in one process.
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "lockstep/torch.hpp"
#include "torch_test_support.hpp"

namespace ls = lockstep;
namespace lt = lockstep::torch;

namespace real_model_tests {

using namespace lttest;

namespace {

// Each tensor once, in named_parameters order (what an optimizer must be given).
std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.named_parameters()) {
    bool dup = false;
    for (const auto& q : out) dup = dup || q.unsafeGetTensorImpl() == p.value().unsafeGetTensorImpl();
    if (!dup) out.push_back(p.value());
  }
  return out;
}

float max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  float d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, (a[i] - b[i]).abs().max().item<float>());
  return d;
}

// A language model's skeleton: embedding, a linear layer, LayerNorm, and a head tied to the
// embedding (the weight registered a second time, as "head.weight").
struct TiedHeadImpl : torch::nn::Module {
  torch::Tensor weight;
  explicit TiedHeadImpl(const torch::Tensor& shared) { weight = register_parameter("weight", shared); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight); }
};
TORCH_MODULE(TiedHead);
struct TiedNetImpl : torch::nn::Module {
  torch::nn::Embedding wte{nullptr};
  torch::nn::Linear mid{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  TiedHead head{nullptr};
  TiedNetImpl() {
    wte = register_module("wte", torch::nn::Embedding(11, 6));
    mid = register_module("mid", torch::nn::Linear(6, 6));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})));
    head = register_module("head", TiedHead(wte->weight));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    return head->forward(ln->forward(torch::gelu(mid->forward(wte->forward(idx)))));
  }
};
TORCH_MODULE(TiedNet);

// Step s's global batch of token sequences (the same on every rank), and this rank's rows.
std::pair<torch::Tensor, torch::Tensor> tokens(int s, int rows) {
  torch::manual_seed(500 + s);
  return {torch::randint(0, 11, {rows, 5}, torch::kLong), torch::randint(0, 11, {rows, 5}, torch::kLong)};
}
torch::Tensor rows_of(const torch::Tensor& t, int rank, int size) {
  const auto per = t.size(0) / size;
  return t.narrow(0, rank * per, per);
}
torch::Tensor lm_loss(TiedNet& net, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(net->forward(x).reshape({-1, 11}), y.reshape({-1}));
}

}  // namespace

TEST_CASE("tied weight: given twice refused on every rank; given once, reduced once: N ranks equal one process; "
          "clipped by one global norm",
          "[torch][mpi][real_model]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(3 + b.rank());  // different on every rank: synchronize makes them root's
  TiedNet net;
  const auto named = net->named_parameters();
  REQUIRE(named["wte.weight"].unsafeGetTensorImpl() == named["head.weight"].unsafeGetTensorImpl());
  lt::synchronize(b, *net, 0);
  // The tie survives synchronize (written in place, once).
  CHECK(net->head->weight.unsafeGetTensorImpl() == net->wte->weight.unsafeGetTensorImpl());

  // net->parameters() lists the tied weight twice: refused, naming it and the reason.
  {
    torch::optim::AdamW twice(net->parameters(), torch::optim::AdamWOptions(1e-2));
    const std::string e = error_of<ls::InvalidArgument>(
        [&] { lt::DistributedOptimizer opt(b, twice, {}, {.names_from = net.get()}); });
    INFO(e);
    CHECK(all_ranks(mentions(e, "'wte.weight' is in the optimizer twice") && mentions(e, "tied weight")));
  }

  // Given once: N ranks on their rows equal one process with LibTorch alone on the global batch,
  // clipped by the global norm (small enough to clip every step).
  TiedNet ref;
  {
    torch::NoGradGuard g;
    auto src = unique_parameters(*net), dst = unique_parameters(*ref);
    for (std::size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  torch::optim::AdamW adamw(unique_parameters(*net), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW ref_adamw(unique_parameters(*ref), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  lt::DistributedOptimizer opt(b, adamw, {}, {.names_from = net.get(), .max_grad_norm = 0.05});
  CHECK(opt.buffer_count() == 1);
  std::int64_t numel = 0;
  for (const auto& p : unique_parameters(*net)) numel += p.numel();
  CHECK(opt.reducer().total_numel() == numel);  // the tied weight has one slot
  CHECK(opt.reducer().names().size() == unique_parameters(*net).size());
  bool close = true, norms = true;
  for (int s = 0; s < 4; ++s) {
    auto [x, y] = tokens(s, 12);
    opt.zero_grad();
    lm_loss(net, rows_of(x, b.rank(), b.size()), rows_of(y, b.rank(), b.size())).backward();
    opt.step();
    ref_adamw.zero_grad();
    lm_loss(ref, x, y).backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(unique_parameters(*ref), 0.05);
    ref_adamw.step();
    norms = norms && std::abs(opt.last_grad_norm() - ref_norm) <= 1e-5 * ref_norm && ref_norm > 0.05;
    close = close && max_abs_diff(unique_parameters(*net), unique_parameters(*ref)) < 2e-5f;
  }
  CHECK(all_ranks(norms));
  CHECK(all_ranks(close));
  CHECK(net->head->weight.unsafeGetTensorImpl() == net->wte->weight.unsafeGetTensorImpl());
}

TEST_CASE("tied weight: saved once under its first name with its optimizer state, loaded into both names, hashed "
          "once; synchronize broadcasts it once",
          "[torch][mpi][real_model]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "lockstep-torch-real-model";
  if (b.rank() == 0) std::filesystem::create_directories(dir);
  const std::filesystem::path path = dir / ("tied-" + std::to_string(b.size()) + ".safetensors");
  torch::manual_seed(8);
  TiedNet net;
  lt::synchronize(b, *net, 0);
  torch::optim::Adam adam(unique_parameters(*net), torch::optim::AdamOptions(1e-2));
  {
    lt::DistributedOptimizer opt(b, adam, {}, {.names_from = net.get()});
    auto [x, y] = tokens(0, 6);
    opt.zero_grad();
    lm_loss(net, rows_of(x, b.rank(), b.size()), rows_of(y, b.rank(), b.size())).backward();
    opt.step();
  }
  const std::string hash = lt::model_hash(*net);
  lt::save_checkpoint(b, path, *net, adam);
  if (b.rank() == 0) {
    ls::Checkpoint ck = ls::load_checkpoint(path);
    std::set<std::string> in_file;
    for (const auto& [n, t] : ck.tensors) in_file.insert(n);
    CHECK(in_file.count("wte.weight") == 1);
    CHECK(in_file.count("head.weight") == 0);
    CHECK(in_file.count("optimizer.state.wte.weight.exp_avg") == 1);
    CHECK(in_file.count("optimizer.state.head.weight.exp_avg") == 0);
    // Parameters once each (wte, mid's two, ln's two) and Adam's step and two moments for each.
    std::size_t params = 0, state = 0;
    for (const auto& n : in_file) {
      params += n.rfind("optimizer.", 0) != 0 ? 1 : 0;
      state += n.rfind("optimizer.state.", 0) == 0 ? 1 : 0;
    }
    CHECK(params == 5);
    CHECK(state == 5 * 3);
    CHECK(in_file.size() == ck.tensors.size());  // no name twice
    // model_hash: the parameters as the file holds them (the tied one once).
    std::map<std::string, ls::Tensor> file_params;
    for (auto& [n, t] : ck.tensors)
      if (n.rfind("optimizer.", 0) != 0) file_params.emplace(n, t.reshape_view(t.shape()));
    CHECK(ls::model_hash(file_params) == hash);
  }
  // Loaded into a fresh model: both names hold the file's values; the tie is kept.
  torch::manual_seed(77);
  TiedNet fresh;
  torch::optim::Adam adam2(unique_parameters(*fresh), torch::optim::AdamOptions(1e-2));
  lt::load_checkpoint(b, path, *fresh, adam2);
  CHECK(all_ranks(torch::equal(fresh->wte->weight, net->wte->weight)));
  CHECK(fresh->head->weight.unsafeGetTensorImpl() == fresh->wte->weight.unsafeGetTensorImpl());
  CHECK(all_ranks(lt::model_hash(*fresh) == hash));
  // A change to the tied tensor changes the hash once (not cancelled by a second copy).
  {
    torch::NoGradGuard g;
    fresh->head->weight[0][0].add_(1.0f);
  }
  CHECK(lt::model_hash(*fresh) != hash);
}

namespace {
// Two branches, one taken per step on every rank: the other gets no gradient anywhere.
struct BranchNetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, out{nullptr};
  BranchNetImpl() {
    a = register_module("a", torch::nn::Linear(4, 5));
    b = register_module("b", torch::nn::Linear(4, 5));
    out = register_module("out", torch::nn::Linear(5, 2));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_b) {
    return out->forward(torch::tanh(use_b ? b->forward(x) : a->forward(x)));
  }
};
TORCH_MODULE(BranchNet);
std::pair<torch::Tensor, torch::Tensor> rows(int s, int n) {
  torch::manual_seed(900 + s);
  return {torch::randn({n, 4}), torch::randn({n, 2})};
}
}  // namespace

TEST_CASE("parameters without gradient in a step (the branch not taken on any rank), clipped: the same norm and "
          "parameters as one process; the untaken branch unchanged by SGD",
          "[torch][mpi][real_model]") {
  torch::set_num_threads(1);
  auto& b = backend();
  for (bool deterministic : {false, true}) {
    INFO("deterministic " << deterministic);
    torch::manual_seed(21);
    BranchNet net, ref;
    {
      torch::NoGradGuard g;
      auto src = net->parameters(), dst = ref->parameters();
      for (std::size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    }
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.5));
    torch::optim::SGD ref_sgd(ref->parameters(), torch::optim::SGDOptions(0.5));
    lt::DistributedOptimizer opt(b, sgd, {.deterministic = deterministic},
                                 {.unused_parameters = lt::UnusedParameters::zero, .names_from = net.get(),
                                  .max_grad_norm = 0.1});
    bool norms = true, close = true, untouched = true;
    for (int s = 0; s < 4; ++s) {
      const bool use_b = s % 2 == 1;
      auto [x, y] = rows(s, 6);
      const auto idle = (use_b ? net->a : net->b)->weight.clone();
      opt.zero_grad();
      if (deterministic) {  // one micro-batch of 2 rows per index, dealt by ls::micro_batches_of
        for (std::int64_t m : ls::micro_batches_of(6, 2, b.rank(), b.size())) {
          torch::mse_loss(net->forward(x.narrow(0, 2 * m, 2), use_b), y.narrow(0, 2 * m, 2)).backward();
          opt.accumulate();
        }
      } else {
        torch::mse_loss(net->forward(rows_of(x, b.rank(), b.size()), use_b), rows_of(y, b.rank(), b.size()))
            .backward();
      }
      opt.step();
      ref_sgd.zero_grad();
      torch::mse_loss(ref->forward(x, use_b), y).backward();
      const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.1);
      ref_sgd.step();
      norms = norms && std::abs(opt.last_grad_norm() - ref_norm) <= 1e-5 * ref_norm;
      close = close && max_abs_diff(net->parameters(), ref->parameters()) < 1e-5f;
      untouched = untouched && torch::equal(idle, (use_b ? net->a : net->b)->weight);
    }
    CHECK(all_ranks(norms));
    CHECK(all_ranks(close));
    CHECK(all_ranks(untouched));
  }
}

TEST_CASE("sharded (ZeRO-1) with max_grad_norm: the global norm across ranks and shards equals one process's; the "
          "parameters follow one process",
          "[torch][mpi][real_model]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(5);
  TiedNet net, ref;
  {
    torch::NoGradGuard g;
    auto src = unique_parameters(*net), dst = unique_parameters(*ref);
    for (std::size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  torch::optim::Adam adam(unique_parameters(*net), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam ref_adam(unique_parameters(*ref), torch::optim::AdamOptions(1e-2));
  lt::DistributedOptimizer opt(b, adam, {.shard_optimizer_state = true},
                               {.names_from = net.get(), .max_grad_norm = 0.05});
  REQUIRE(opt.sharded());
  bool norms = true, close = true;
  for (int s = 0; s < 4; ++s) {
    auto [x, y] = tokens(10 + s, 12);
    opt.zero_grad();
    lm_loss(net, rows_of(x, b.rank(), b.size()), rows_of(y, b.rank(), b.size())).backward();
    opt.step();
    ref_adam.zero_grad();
    lm_loss(ref, x, y).backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(unique_parameters(*ref), 0.05);
    ref_adam.step();
    norms = norms && std::abs(opt.last_grad_norm() - ref_norm) <= 1e-5 * ref_norm && ref_norm > 0.05;
    close = close && max_abs_diff(unique_parameters(*net), unique_parameters(*ref)) < 2e-5f;
  }
  CHECK(all_ranks(norms));
  CHECK(all_ranks(close));
  // Every rank computed the same norm (it is taken from the reduced gradients, whole on every rank).
  double n = opt.last_grad_norm(), lo = n, hi = n;
  b.allreduce(ls::TensorView{&lo, 1, ls::DType::f64, ls::Device::cpu()}, ls::ReduceOp::min);
  b.allreduce(ls::TensorView{&hi, 1, ls::DType::f64, ls::Device::cpu()}, ls::ReduceOp::max);
  CHECK(lo == hi);
}

}  // namespace real_model_tests
