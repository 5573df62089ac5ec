// lockstep::torch::DistributedOptimizer with shard_optimizer_state (PyTorch's
// ZeroRedundancyOptimizer) and with wire_dtype (16-bit gradients), under mpiexec at 1-3 ranks:
// the sharded form trains the same model as the replicated one, keeps 1/N of the state per
// rank, writes the same checkpoint file and reads any file at any number of ranks (written at 2,
// read at 1 and 3); errors on every rank. The wire rounds the gradients to 16 bits and trains
// close to f32.
#include <torch/torch.h>

#include <catch2/catch.hpp>
#include <mpi.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

#include "lockstep/lockstep.hpp"
#include "lockstep/mpi/mpi_backend.hpp"
#include "lockstep/torch.hpp"
#include "torch_test_support.hpp"

namespace ls = lockstep;
namespace lt = lockstep::torch;

// This file's helpers and test cases (test_torch compiles the LibTorch tests as one unit).
namespace sharded_tests {

using namespace lttest;

namespace {

// A model with many tensors of varied sizes: `layers` Linear layers (weight and bias each).
torch::nn::Sequential deep(int layers = 12, int in = 6, int out = 3) {
  torch::nn::Sequential s;
  int w = in;
  for (int i = 0; i < layers; ++i) {
    const int next = i + 1 == layers ? out : 8 + (i * 5) % 13;
    s->push_back(torch::nn::Linear(w, next));
    if (i + 1 < layers) s->push_back(torch::nn::Tanh());
    w = next;
  }
  return s;
}

void copy_params(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard g;
  auto a = from.parameters(), b = to.parameters();
  for (std::size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
}

enum class Which { adam, adamw, sgd };
std::unique_ptr<torch::optim::Optimizer> make_optimizer(Which w, torch::nn::Module& m) {
  switch (w) {
    case Which::adam: return std::make_unique<torch::optim::Adam>(m.parameters(), torch::optim::AdamOptions(1e-2));
    case Which::adamw:
      return std::make_unique<torch::optim::AdamW>(m.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    case Which::sgd:
      return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return nullptr;
}

// k steps of the rows of this rank of every global batch (12 rows: divisible by 1, 2 and 3).
void train(ls::Backend& b, torch::nn::Module& net, lt::DistributedOptimizer& opt, int from, int to) {
  auto& seq = dynamic_cast<torch::nn::SequentialImpl&>(net);
  for (int s = from; s < to; ++s) {
    auto [x, y] = global_batch(s, 12);
    opt.zero_grad();
    torch::mse_loss(seq.forward(rows_of(x, b.rank(), b.size())), rows_of(y, b.rank(), b.size())).backward();
    opt.step();
  }
}

std::string file_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A scratch directory, the same on every rank of `b`.
std::filesystem::path scratch(ls::Backend& b) {
  std::string d;
  if (b.rank() == 0) {
    d = (std::filesystem::temp_directory_path() / ("lockstep-torch-sharded-" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(d);
  }
  return ls::detail::broadcast_string(b, d, 0);
}

// An Adam whose step() fails on one rank (Lockstep sees an Adam: sharding accepts it).
class FailingAdam : public torch::optim::Adam {
 public:
  FailingAdam(std::vector<torch::Tensor> p, bool fail) : torch::optim::Adam(std::move(p)), fail_(fail) {}
  torch::Tensor step(LossClosure closure = nullptr) override {
    if (fail_) throw std::runtime_error("this Adam refuses to step");
    return torch::optim::Adam::step(std::move(closure));
  }

 private:
  bool fail_;
};

}  // namespace

TEST_CASE("sharded: the same parameters as the replicated form after k steps; each rank keeps only its "
          "share of the state", "[torch][mpi][sharded]") {
  torch::set_num_threads(1);
  auto& b = backend();
  for (Which w : {Which::adam, Which::adamw, Which::sgd}) {
    for (std::size_t bucket : {std::size_t{0}, std::size_t{256}, ls::kDefaultBucketBytes}) {
      INFO("optimizer " << static_cast<int>(w) << " bucket_bytes " << bucket);
      torch::manual_seed(5);
      auto rep = deep(), sh = deep();
      copy_params(*rep, *sh);
      lt::synchronize(b, *rep, 0);
      lt::synchronize(b, *sh, 0);
      auto rep_inner = make_optimizer(w, *rep), sh_inner = make_optimizer(w, *sh);
      ls::DistributedOptions o;
      o.bucket_bytes = bucket;
      lt::DistributedOptimizer rep_opt(b, *rep_inner, o);
      o.shard_optimizer_state = true;
      o.check_replicas_every = 2;  // sharded: the parameters and learning rates are compared
      lt::DistributedOptimizer sh_opt(b, *sh_inner, o);
      CHECK(sh_opt.sharded());
      CHECK_FALSE(rep_opt.sharded());
      train(b, *rep, rep_opt, 0, 4);
      train(b, *sh, sh_opt, 0, 4);
      const float d = max_abs_diff(*rep, *sh);
      UNSCOPED_INFO("max |replicated - sharded| = " << d);
      CHECK(all_ranks(d == 0.0f));  // the same optimizer code on the same averaged gradients: bitwise
      CHECK(replicas_equal(b, *sh));
      // Every rank computed the same owners.
      std::vector<std::int32_t> owners(sh_opt.owners().begin(), sh_opt.owners().end()), root = owners;
      b.broadcast(ls::TensorView{root.data(), static_cast<std::int64_t>(root.size()), ls::DType::i32,
                                 ls::Device::cpu()}, 0);
      CHECK(all_ranks(owners == root));
      CHECK(owners.size() == sh->parameters().size());
      // The shares add up to the whole, in parameters and in state; each rank's state is exactly
      // that of its own parameters.
      std::int64_t sums[3] = {sh_opt.owned_bytes(), lt::state_bytes(*sh_inner), 0};
      std::int64_t total_params = 0;
      for (auto& p : sh->parameters()) total_params += static_cast<std::int64_t>(p.nbytes());
      b.allreduce(ls::TensorView{sums, 3, ls::DType::i64, ls::Device::cpu()}, ls::ReduceOp::sum);
      CHECK(sums[0] == total_params);
      CHECK(sums[1] == lt::state_bytes(*rep_inner));
      const std::int64_t per_param = w == Which::sgd ? 1 : 2;  // momentum, or Adam's two moments
      CHECK(all_ranks(lt::state_bytes(*sh_inner) == per_param * sh_opt.owned_bytes()));
      CHECK(sh_inner->state().size() ==
            static_cast<std::size_t>(std::count(owners.begin(), owners.end(), b.rank())));
      if (b.size() > 1 && bucket == 0) CHECK(sh_opt.broadcast_count() == sh->parameters().size());
      if (b.size() > 1 && bucket == ls::kDefaultBucketBytes) CHECK(sh_opt.broadcast_count() == std::size_t(b.size()));
      if (b.size() == 1) CHECK(sh_opt.broadcast_count() == 0);
    }
  }
}

TEST_CASE("sharded: with accumulation_steps = 2 and skip_non_finite, the same as the replicated form",
          "[torch][mpi][sharded]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(6);
  auto rep = deep(4), sh = deep(4);
  copy_params(*rep, *sh);
  lt::synchronize(b, *rep, 0);
  lt::synchronize(b, *sh, 0);
  torch::optim::Adam ra(rep->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam sa(sh->parameters(), torch::optim::AdamOptions(1e-2));
  ls::DistributedOptions o;
  o.accumulation_steps = 2;
  o.skip_non_finite = true;
  lt::DistributedOptimizer ro(b, ra, o);
  o.shard_optimizer_state = true;
  lt::DistributedOptimizer so(b, sa, o);
  train(b, *rep, ro, 0, 6);  // 3 cycles of 2 micro-steps
  train(b, *sh, so, 0, 6);
  CHECK(so.applied_steps() == 3);
  CHECK(all_ranks(max_abs_diff(*rep, *sh) == 0.0f));
  CHECK(replicas_equal(b, *sh));
}

TEST_CASE("sharded: on a model with many tensors each rank holds 1/N of the state within 10%",
          "[torch][mpi][sharded]") {
  torch::set_num_threads(1);
  auto& b = backend();
  torch::manual_seed(8);
  auto net = deep(40);  // 80 tensors, 7 to 380 floats each
  lt::synchronize(b, *net, 0);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  lt::DistributedOptimizer opt(b, adam, {.shard_optimizer_state = true});
  train(b, *net, opt, 0, 1);
  std::int64_t mine = lt::state_bytes(adam), total = mine;
  b.allreduce(ls::TensorView{&total, 1, ls::DType::i64, ls::Device::cpu()}, ls::ReduceOp::sum);
  std::int64_t params = 0;
  for (auto& p : net->parameters()) params += static_cast<std::int64_t>(p.nbytes());
  CHECK(total == 2 * params);  // Adam: exp_avg and exp_avg_sq, once over all ranks
  const double share = static_cast<double>(mine) / (static_cast<double>(total) / b.size());
  UNSCOPED_INFO("rank " << b.rank() << ": " << mine << " of " << total << " state bytes, " << share << " of 1/N");
  CHECK(all_ranks(std::abs(share - 1.0) <= 0.10));
}

TEST_CASE("sharded: save_checkpoint writes the replicated form's file; a file written at 2 ranks is read "
          "at 1 and 3, sharded or not", "[torch][mpi][sharded]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const auto dir = scratch(b);
  // Written at N ranks, sharded and replicated, after the same steps: the same bytes.
  for (Which w : {Which::adam, Which::sgd}) {
    torch::manual_seed(11);
    auto rep = deep(), sh = deep();
    copy_params(*rep, *sh);
    lt::synchronize(b, *rep, 0);
    lt::synchronize(b, *sh, 0);
    auto rep_inner = make_optimizer(w, *rep), sh_inner = make_optimizer(w, *sh);
    {
      lt::DistributedOptimizer rep_opt(b, *rep_inner);
      lt::DistributedOptimizer sh_opt(b, *sh_inner, {.shard_optimizer_state = true});
      train(b, *rep, rep_opt, 0, 3);
      train(b, *sh, sh_opt, 0, 3);
      lt::save_checkpoint(b, dir / "rep.safetensors", *rep, *rep_inner);
      lt::save_checkpoint(b, dir / "sh.safetensors", *sh, *sh_inner);
      // The state stays sharded after the save.
      std::int64_t n = static_cast<std::int64_t>(sh_inner->state().size()), total = n;
      b.allreduce(ls::TensorView{&total, 1, ls::DType::i64, ls::Device::cpu()}, ls::ReduceOp::sum);
      CHECK(total == static_cast<std::int64_t>(sh->parameters().size()));
    }
    // The DistributedOptimizer is gone, its state still split: the same file again.
    lt::save_checkpoint(b, dir / "sh-after.safetensors", *sh, *sh_inner);
    bool same = true;
    if (b.rank() == 0)
      same = file_bytes(dir / "rep.safetensors") == file_bytes(dir / "sh.safetensors") &&
             file_bytes(dir / "rep.safetensors") == file_bytes(dir / "sh-after.safetensors");
    INFO("optimizer " << static_cast<int>(w));
    CHECK(all_ranks(same));
  }

  // Written sharded at 2 ranks (ranks 0 and 1 of the world), then read at 3 (the world, at -n 3)
  // and at 1 (rank 0 alone): saved again, the same bytes; trained on, the same as replicated.
  const int writers = std::min(2, b.size());
  MPI_Comm sub;
  MPI_Comm_split(b.comm(), b.rank() < writers ? 0 : 1, b.rank(), &sub);
  const auto two = dir / "two.safetensors";
  if (b.rank() < writers) {
    ls::MPIBackend wb(sub);
    torch::manual_seed(12);
    auto net = deep();
    lt::synchronize(wb, *net, 0);
    torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
    lt::DistributedOptimizer opt(wb, adam, {.shard_optimizer_state = true});
    train(wb, *net, opt, 0, 3);
    lt::save_checkpoint(wb, two, *net, adam);
  }
  MPI_Comm_free(&sub);
  b.barrier();
  auto read_back = [&](ls::Backend& rb, const std::string& tag) {
    // Sharded and replicated, each loaded before (sharded: after too) wrapping, saved again.
    torch::manual_seed(99);
    auto sh = deep(), rep = deep(), late = deep();
    torch::optim::Adam sh_adam(sh->parameters(), torch::optim::AdamOptions(1e-2));
    torch::optim::Adam rep_adam(rep->parameters(), torch::optim::AdamOptions(1e-2));
    torch::optim::Adam late_adam(late->parameters(), torch::optim::AdamOptions(1e-2));
    lt::load_checkpoint(rb, two, *sh, sh_adam);
    lt::load_checkpoint(rb, two, *rep, rep_adam);
    lt::DistributedOptimizer sh_opt(rb, sh_adam, {.shard_optimizer_state = true});
    lt::DistributedOptimizer rep_opt(rb, rep_adam);
    lt::DistributedOptimizer late_opt(rb, late_adam, {.shard_optimizer_state = true});
    lt::load_checkpoint(rb, two, *late, late_adam);  // into an already sharded optimizer
    // Only this rank's share of the state is kept.
    CHECK(sh_adam.state().size() ==
          static_cast<std::size_t>(std::count(sh_opt.owners().begin(), sh_opt.owners().end(), rb.rank())));
    CHECK(late_adam.state().size() == sh_adam.state().size());
    lt::save_checkpoint(rb, dir / ("again-" + tag + ".safetensors"), *sh, sh_adam);
    lt::save_checkpoint(rb, dir / ("late-" + tag + ".safetensors"), *late, late_adam);
    bool same = true;
    if (rb.rank() == 0)
      same = file_bytes(two) == file_bytes(dir / ("again-" + tag + ".safetensors")) &&
             file_bytes(two) == file_bytes(dir / ("late-" + tag + ".safetensors"));
    INFO("read at " << rb.size() << " rank(s)");
    CHECK(all_ranks(rb, same));
    train(rb, *sh, sh_opt, 3, 5);
    train(rb, *rep, rep_opt, 3, 5);
    train(rb, *late, late_opt, 3, 5);
    CHECK(all_ranks(rb, max_abs_diff(*sh, *rep) <= 1e-6f && max_abs_diff(*late, *rep) <= 1e-6f));
  };
  {
    read_back(b, "world");  // N ranks (3 at -n 3)
  }
  if (b.rank() == 0) {
    ls::MPIBackend self(MPI_COMM_SELF);
    read_back(self, "one");
  }
  b.barrier();
  if (b.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("sharded: clear errors on every rank", "[torch][mpi][sharded]") {
  torch::set_num_threads(1);
  auto& b = backend();
  // An optimizer Lockstep does not know field by field.
  {
    auto net = deep(2);
    MyDescent mine(net->parameters(), 0.1);
    const std::string e =
        error_of<ls::InvalidArgument>([&] { lt::DistributedOptimizer opt(b, mine, {.shard_optimizer_state = true}); });
    CHECK(all_ranks(mentions(e, "shard_optimizer_state needs Adam")));
  }
  // A sharded optimizer is not synchronized (there is no root state to copy).
  {
    auto net = deep(2);
    torch::optim::Adam adam(net->parameters());
    lt::DistributedOptimizer opt(b, adam, {.shard_optimizer_state = true});
    const std::string e = error_of<ls::InvalidArgument>([&] { lt::synchronize(b, adam, 0); });
    CHECK(all_ranks(mentions(e, "sharded")));
  }
  // The inner step fails on the last rank only: every rank throws its error.
  {
    torch::manual_seed(3);
    auto net = deep(3);
    lt::synchronize(b, *net, 0);
    FailingAdam adam(net->parameters(), b.rank() == b.size() - 1);
    lt::DistributedOptimizer opt(b, adam, {.shard_optimizer_state = true});
    const std::string e = error_of<ls::Error>([&] { train(b, *net, opt, 0, 1); });
    CHECK(all_ranks(mentions(e, "this Adam refuses to step") && mentions(e, "rank " + std::to_string(b.size() - 1))));
    CHECK(replicas_equal(b, *net));
  }
  if (b.size() < 2) return;
  // A rank whose parameters differ in shape.
  {
    auto net = b.rank() == 1 ? deep(3, 7) : deep(3);
    torch::optim::Adam adam(net->parameters());
    const std::string e =
        error_of<ls::MismatchError>([&] {
          lt::DistributedOptimizer opt(b, adam, {.shard_optimizer_state = true}, {.names_from = net.get()});
        });
    CHECK(all_ranks(mentions(e, "0.weight")));
  }
  // One rank sharded, the others not.
  {
    auto net = deep(2);
    torch::optim::Adam adam(net->parameters());
    ls::DistributedOptions o;
    o.shard_optimizer_state = b.rank() == 0;
    const std::string e = error_of<ls::MismatchError>([&] { lt::DistributedOptimizer opt(b, adam, o); });
    CHECK(all_ranks(mentions(e, "shard_optimizer_state")));
  }
}

TEST_CASE("wire_dtype: gradients travel as bf16 or f16, the optimizer sees f32; a model trains close to f32; "
          "a non-f32 parameter is refused on every rank", "[torch][mpi][wire]") {
  torch::set_num_threads(1);
  auto& b = backend();
  // 1 + 2^-10 has no bf16 (8 significant bits): the wire rounds it to 1 on every rank.
  for (auto wire : {ls::DType::bf16, ls::DType::f16}) {
    auto w = torch::zeros({64}, torch::requires_grad());
    torch::optim::SGD sgd({w}, torch::optim::SGDOptions(1.0));
    ls::DistributedOptions o;
    o.wire_dtype = wire;
    lt::DistributedOptimizer opt(b, sgd, o);
    opt.zero_grad();
    const float c = 1.0f + std::ldexp(1.0f, -10);
    (w * c).sum().backward();
    opt.step();
    INFO("wire " << ls::name(wire) << " w[0] " << w[0].item<float>());
    if (wire == ls::DType::bf16) {
      CHECK(all_ranks(torch::all(w == -1.0f).item<bool>()));  // the sum of N ones is exact in bf16
    } else {
      // f16 has 11 significant bits: c is exact there, but Open MPI's reduction rounds each
      // partial sum (3c is not): within f16's rounding of the sum.
      CHECK(all_ranks(torch::all((w + c).abs() <= 2e-3f).item<bool>()));
    }
  }
  // A model: bf16 wire against f32, replicated and sharded.
  torch::manual_seed(21);
  auto f32 = deep(), bf = deep(), bfs = deep();
  copy_params(*f32, *bf);
  copy_params(*f32, *bfs);
  torch::optim::Adam a1(f32->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam a2(bf->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam a3(bfs->parameters(), torch::optim::AdamOptions(1e-2));
  lt::DistributedOptimizer o1(b, a1);
  lt::DistributedOptimizer o2(b, a2, {.wire_dtype = ls::DType::bf16});
  lt::DistributedOptimizer o3(b, a3, {.shard_optimizer_state = true, .wire_dtype = ls::DType::bf16});
  train(b, *f32, o1, 0, 3);
  train(b, *bf, o2, 0, 3);
  train(b, *bfs, o3, 0, 3);
  const float d = max_abs_diff(*f32, *bf);
  UNSCOPED_INFO("max |f32 - bf16 wire| after 3 Adam steps of lr 1e-2: " << d);
  CHECK(all_ranks(d < 1e-2f));  // measured 4e-4 at 3 ranks
  CHECK(all_ranks(max_abs_diff(*bf, *bfs) <= 1e-6f));
  CHECK(replicas_equal(b, *bf));
  // An f64 parameter: InvalidArgument on every rank, naming it.
  {
    auto net = deep(2);
    net->to(torch::kDouble);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    ls::DistributedOptions o;
    o.wire_dtype = ls::DType::bf16;
    const std::string e = error_of<ls::InvalidArgument>(
        [&] { lt::DistributedOptimizer opt(b, sgd, o, {.names_from = net.get()}); });
    CHECK(all_ranks(mentions(e, "'0.weight'") && mentions(e, "f32")));
  }
  {
    auto net = deep(2);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    ls::DistributedOptions o;
    o.wire_dtype = ls::DType::f32;
    const std::string e = error_of<ls::InvalidArgument>([&] { lt::DistributedOptimizer opt(b, sgd, o); });
    CHECK(all_ranks(mentions(e, "bf16 or f16")));
  }
}

namespace {
// One trained tensor (fewer than the ranks at -n 2 and 3: the other ranks own nothing).
torch::nn::Sequential one_tensor() {
  return torch::nn::Sequential(torch::nn::Linear(torch::nn::LinearOptions(6, 3).bias(false)));
}
// One tensor of 1.2 MB (more than the default bucket: broadcast in place), a frozen layer and a
// frozen bias among trained ones.
torch::nn::Sequential huge_and_frozen() {
  torch::nn::Sequential s(torch::nn::Linear(6, 50000), torch::nn::Tanh(), torch::nn::Linear(50000, 4),
                          torch::nn::Tanh(), torch::nn::Linear(4, 3));
  for (auto& p : s[2]->parameters()) p.requires_grad_(false);
  s[4]->as<torch::nn::LinearImpl>()->bias.requires_grad_(false);
  return s;
}
}  // namespace

TEST_CASE("sharded: fewer trained tensors than ranks, one huge tensor, frozen parameters: the replicated form's "
          "parameters and checkpoint; the file read back sharded at N and at 1 trains on as replicated",
          "[torch][mpi][sharded]") {
  torch::set_num_threads(1);
  auto& b = backend();
  const auto dir = scratch(b);
  for (int model = 0; model < 2; ++model) {
    auto make = model == 0 ? one_tensor : huge_and_frozen;
    INFO((model == 0 ? "one tensor" : "a huge tensor and frozen parameters"));
    torch::manual_seed(21);
    auto rep = make(), sh = make();
    copy_params(*rep, *sh);
    lt::synchronize(b, *rep, 0);
    lt::synchronize(b, *sh, 0);
    torch::optim::Adam ra(rep->parameters(), torch::optim::AdamOptions(1e-2));
    torch::optim::Adam sa(sh->parameters(), torch::optim::AdamOptions(1e-2));
    const auto frozen_before = sh[model == 0 ? 0 : 2]->parameters()[0].clone();
    {
      lt::DistributedOptimizer ro(b, ra);
      lt::DistributedOptimizer so(b, sa, {.shard_optimizer_state = true});
      train(b, *rep, ro, 0, 3);
      train(b, *sh, so, 0, 3);
      CHECK(all_ranks(max_abs_diff(*rep, *sh) == 0.0f));
      CHECK(replicas_equal(b, *sh));
      std::int64_t owned = so.owned_bytes(), total = owned;
      b.allreduce(ls::TensorView{&total, 1, ls::DType::i64, ls::Device::cpu()}, ls::ReduceOp::sum);
      std::int64_t trained = 0;
      for (auto& p : sh->parameters())
        if (p.requires_grad()) trained += static_cast<std::int64_t>(p.nbytes());
      CHECK(total == trained);
      CHECK(all_ranks(lt::state_bytes(sa) == 2 * owned));
    }
    if (model == 1) CHECK(torch::equal(frozen_before, sh[2]->parameters()[0]));
    const auto rep_file = dir / ("rep-" + std::to_string(model) + ".safetensors");
    const auto sh_file = dir / ("sh-" + std::to_string(model) + ".safetensors");
    lt::save_checkpoint(b, rep_file, *rep, ra);
    lt::save_checkpoint(b, sh_file, *sh, sa);
    bool same = b.rank() != 0 || file_bytes(rep_file) == file_bytes(sh_file);
    CHECK(all_ranks(same));
    auto read_back = [&](ls::Backend& rb) {
      torch::manual_seed(99);
      auto a = make(), r = make();
      torch::optim::Adam aa(a->parameters(), torch::optim::AdamOptions(1e-2));
      torch::optim::Adam rr(r->parameters(), torch::optim::AdamOptions(1e-2));
      lt::load_checkpoint(rb, sh_file, *a, aa);
      lt::load_checkpoint(rb, sh_file, *r, rr);
      lt::DistributedOptimizer ao(rb, aa, {.shard_optimizer_state = true});
      lt::DistributedOptimizer ro(rb, rr);
      train(rb, *a, ao, 3, 5);
      train(rb, *r, ro, 3, 5);
      INFO("read at " << rb.size());
      CHECK(all_ranks(rb, max_abs_diff(*a, *r) == 0.0f));
    };
    read_back(b);
    if (b.rank() == 0) {
      ls::MPIBackend self(MPI_COMM_SELF);
      read_back(self);
    }
    b.barrier();
  }
  if (b.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("wire_dtype with shard_optimizer_state: fewer trained tensors than ranks, a huge tensor, frozen "
          "parameters (an f64 one among them: only trained ones must be f32) train as the replicated wire",
          "[torch][mpi][wire][sharded]") {
  torch::set_num_threads(1);
  auto& b = backend();
  for (int model = 0; model < 2; ++model) {
    auto make = model == 0 ? one_tensor : huge_and_frozen;
    INFO((model == 0 ? "one tensor" : "a huge tensor and frozen parameters"));
    torch::manual_seed(31);
    auto rep = make(), sh = make();
    copy_params(*rep, *sh);
    lt::synchronize(b, *rep, 0);
    lt::synchronize(b, *sh, 0);
    // A frozen f64 tensor the optimizer holds too (a table the forward does not use).
    auto frozen_rep = rep->register_parameter("table", torch::ones({5}, torch::kDouble), /*requires_grad=*/false);
    auto frozen_sh = sh->register_parameter("table", torch::ones({5}, torch::kDouble), /*requires_grad=*/false);
    torch::optim::Adam ra(rep->parameters(), torch::optim::AdamOptions(1e-2));
    torch::optim::Adam sa(sh->parameters(), torch::optim::AdamOptions(1e-2));
    lt::DistributedOptimizer ro(b, ra, {.wire_dtype = ls::DType::bf16});
    lt::DistributedOptimizer so(b, sa, {.shard_optimizer_state = true, .wire_dtype = ls::DType::bf16});
    train(b, *rep, ro, 0, 3);
    train(b, *sh, so, 0, 3);
    CHECK(all_ranks(max_abs_diff(*rep, *sh) <= 1e-6f));
    CHECK(replicas_equal(b, *sh));
    CHECK(torch::equal(frozen_sh, torch::ones({5}, torch::kDouble)));
  }
}

}  // namespace sharded_tests
