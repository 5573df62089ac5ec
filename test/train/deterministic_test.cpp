// Deterministic mode (DistributedOptions::deterministic), at 1 to 4 ranks and as two simulated
// machines: a step over M micro-batch gradients, dealt to the ranks in contiguous blocks of
// uneven sizes (a rank may have none), gives bitwise the parameters of one process that
// accumulates all M itself, in any order; the exact mean is at least as accurate as the f32 sum
// in order (against an f64 reference); non-finite values and the refused combinations.
#include <catch2/catch.hpp>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "test_support.hpp"

namespace ls = lockstep;

namespace {

ls::MPIBackend& backend() { return ls::get_distributed_backend<ls::MPIBackend>(); }

bool all_ranks(bool ok) {
  int v = ok ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return v == 1;
}

struct Model {
  ls::Tensor a, b;
};
LOCKSTEP_FIELDS(Model, a, b)

Model zeros(std::int64_t na, std::int64_t nb) { return Model{ls::Tensor::zeros({na}), ls::Tensor::zeros({nb})}; }

// Micro-batch m's gradient: values over a wide range of magnitudes and both signs, the same on
// every rank (seeded by m alone).
void gradient_of(int m, Model& g) {
  std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(m));
  std::uniform_real_distribution<double> mant(-1.0, 1.0);
  std::uniform_int_distribution<int> expo(-30, 10);
  for (ls::Tensor* t : {&g.a, &g.b})
    for (std::int64_t i = 0; i < t->numel(); ++i)
      t->data<float>()[i] = static_cast<float>(std::ldexp(mant(rng), i % 7 == 0 ? expo(rng) : 0));
}

// [first, first + count) of M micro-batches for `rank` of n: contiguous, uneven.
std::pair<int, int> share(int M, int rank, int n) {
  const int first = static_cast<int>(static_cast<std::int64_t>(M) * rank / n);
  const int last = static_cast<int>(static_cast<std::int64_t>(M) * (rank + 1) / n);
  return {first, last - first};
}

bool same_bits(const Model& x, const Model& y) {
  return x.a.numel() == y.a.numel() && x.b.numel() == y.b.numel() &&
         std::memcmp(x.a.raw_data(), y.a.raw_data(), x.a.nbytes()) == 0 &&
         std::memcmp(x.b.raw_data(), y.b.raw_data(), x.b.nbytes()) == 0;
}

// One deterministic SGD step (lr 1: the parameters become minus the mean gradient) on `b` over
// micro-batches `order`.
Model step_over(ls::Backend& b, const std::vector<int>& order, std::int64_t na, std::int64_t nb,
                ls::DistributedOptions o = {}) {
  Model model = zeros(na, nb), g = zeros(na, nb);
  o.deterministic = true;
  auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 1.0f}, o);
  auto state = ls::setup(opt, model);
  for (int m : order) {
    gradient_of(m, g);
    ls::accumulate(state, g);
  }
  ls::apply_accumulated(state, model);
  return model;
}

}  // namespace

TEST_CASE("deterministic: N ranks on uneven blocks of micro-batches equal one process, bit for bit", "[deterministic]") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank(), n = b.size();
  ls::MPIBackend self(MPI_COMM_SELF);
  for (int M : {1, 3, 7, 30}) {
    for (std::int64_t na : {std::int64_t{1}, std::int64_t{100}, std::int64_t{4099}}) {
      const auto [first, count] = share(M, rank, n);
      std::vector<int> mine;
      for (int m = first; m < first + count; ++m) mine.push_back(m);
      const Model got = step_over(b, mine, na, 65);
      std::vector<int> all, reversed;
      for (int m = 0; m < M; ++m) all.push_back(m);
      reversed.assign(all.rbegin(), all.rend());
      const Model one = step_over(self, all, na, 65);
      const Model back = step_over(self, reversed, na, 65);
      INFO("M " << M << " na " << na << " rank " << rank << " holds " << count);
      CHECK(same_bits(one, back));  // the order of the micro-batches does not matter
      CHECK(all_ranks(same_bits(got, one)));
      // The ordinary mode at several ranks is not this (the check can fail): a sum in f32.
    }
  }
}

TEST_CASE("deterministic: the same bits with any bucket size and with update() for the last micro-batch",
          "[deterministic]") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank(), n = b.size();
  const int M = 9;
  const auto [first, count] = share(M, rank, n);
  std::vector<int> mine;
  for (int m = first; m < first + count; ++m) mine.push_back(m);
  const Model ref = step_over(b, mine, 3000, 10);
  const Model small = step_over(b, mine, 3000, 10, ls::DistributedOptions{.bucket_bytes = 256, .comm_thread = false});
  CHECK(all_ranks(same_bits(ref, small)));
  // update() adds its own gradients as the last micro-batch (every rank here has one).
  if (M >= n) {
    Model model = zeros(3000, 10), g = zeros(3000, 10);
    auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 1.0f}, ls::DistributedOptions{.deterministic = true});
    auto state = ls::setup(opt, model);
    for (std::size_t k = 0; k + 1 < mine.size(); ++k) {
      gradient_of(mine[k], g);
      ls::accumulate(state, g);
    }
    gradient_of(mine.back(), g);
    ls::update(state, model, g);
    CHECK(all_ranks(same_bits(model, ref)));
  }
}

// Micro-batch m's gradient over the whole f32 range: subnormals, values near 2^100, zeros of
// both signs, a block of zeros, every element's magnitude drawn alone.
void wide_gradient_of(int m, Model& g) {
  std::mt19937_64 rng(5000 + static_cast<std::uint64_t>(m));
  std::uniform_real_distribution<double> mant(-1.0, 1.0);
  std::uniform_int_distribution<int> expo(-160, 100);
  for (ls::Tensor* t : {&g.a, &g.b})
    for (std::int64_t i = 0; i < t->numel(); ++i) {
      float v = static_cast<float>(std::ldexp(mant(rng), expo(rng)));
      if (i % 11 == 3) v = (i % 2 == 0) ? 0.0f : -0.0f;
      if (i >= 128 && i < 192) v = 0.0f;
      t->data<float>()[i] = v;
    }
}

TEST_CASE("deterministic: a last micro-batch given to update() adds exactly what accumulate() adds", "[deterministic]") {
  // update() reads its gradients where they lie (never cut into bins when they are the rank's
  // only micro-batch of the step): ranks doing that beside ranks with several micro-batches
  // and ranks with none still give one process's bits.
  ls::MPIBackend& b = backend();
  const int rank = b.rank(), n = b.size();
  ls::MPIBackend self(MPI_COMM_SELF);
  for (int M : {1, 2, 5, 6}) {
    const auto [first, count] = share(M, rank, n);
    Model model = zeros(300, 65), g = zeros(300, 65);
    auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 1.0f}, ls::DistributedOptions{.deterministic = true});
    auto state = ls::setup(opt, model);
    for (int m = first; m < first + count; ++m) {
      wide_gradient_of(m, g);
      if (m + 1 < first + count)
        ls::accumulate(state, g);
      else
        ls::update(state, model, g);
    }
    if (count == 0) ls::apply_accumulated(state, model);
    // One process, every micro-batch through accumulate().
    Model one = zeros(300, 65), h = zeros(300, 65);
    auto opt1 = ls::DistributedOptimizer(self, ls::SGD{.lr = 1.0f}, ls::DistributedOptions{.deterministic = true});
    auto state1 = ls::setup(opt1, one);
    for (int m = 0; m < M; ++m) {
      wide_gradient_of(m, h);
      ls::accumulate(state1, h);
    }
    ls::apply_accumulated(state1, one);
    INFO("M " << M << " rank " << rank << " holds " << count);
    CHECK(all_ranks(same_bits(model, one)));
  }
  // A NaN in the only micro-batch of the last rank: its block is NaN on every rank.
  Model model = zeros(200, 3), g = zeros(200, 3);
  auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 1.0f}, ls::DistributedOptions{.deterministic = true});
  auto state = ls::setup(opt, model);
  gradient_of(rank, g);
  if (rank == n - 1) g.a.data<float>()[130] = -std::numeric_limits<float>::infinity();
  ls::update(state, model, g);
  CHECK(all_ranks(std::isnan(model.a.data<float>()[128]) && std::isnan(model.a.data<float>()[191]) &&
                  !std::isnan(model.a.data<float>()[127]) && !std::isnan(model.a.data<float>()[192])));
}

// Rank r's values drawn as bits: zeros of both signs, subnormals, mixed signs, magnitudes from
// 2^-149 to 2^126 within one block, and blocks of one narrow range (both kinds of window).
void bits_gradient_of(int r, Model& g) {
  std::mt19937_64 rng(9000 + static_cast<std::uint64_t>(r));
  std::uniform_int_distribution<std::uint32_t> frac(0, 0x7fffff), biased(1, 253), kind(0, 9);
  for (ls::Tensor* t : {&g.a, &g.b})
    for (std::int64_t i = 0; i < t->numel(); ++i) {
      const std::uint32_t sign = static_cast<std::uint32_t>(rng() & 1) << 31;
      std::uint32_t u = 0;
      switch (i / 64 % 3 == 2 ? 9 : kind(rng)) {
        case 0: u = 0; break;                                  // zero (either sign below)
        case 1: u = frac(rng); break;                          // subnormal
        case 2: u = (253u << 23) | frac(rng); break;           // near 2^126
        case 9: u = ((120u + i % 5) << 23) | frac(rng); break;  // a narrow block
        default: u = (biased(rng) << 23) | frac(rng);
      }
      u |= sign;
      std::memcpy(t->data<float>() + i, &u, sizeof u);
    }
}

TEST_CASE("deterministic: the shared-memory path's fused exact sum gives the int64 path's bits", "[deterministic]") {
  // One micro-batch per rank: on one machine MPIBackend folds the f32 values inside its
  // shared-memory reduction (exact_sums_fused counts it); through a user's Backend over it, which
  // has no fused form, the exact sum takes its int64 path over allreduce. Both give the same
  // reduced gradients, bit for bit (signs of zero included), and the bits of one process that
  // accumulates every rank's micro-batch (through the counters), mean and sum, over several
  // shared-memory slices (2.4 MB) and a tail of 37 elements. A step's result is written into the
  // gradients it reads (in place) on both paths; apply_accumulated's into the reducer's tensors.
  ls::MPIBackend& b = backend();
  const int rank = b.rank(), n = b.size();
  lstest::ForwardingBackend plain(b);
  ls::MPIBackend self(MPI_COMM_SELF);
  const std::int64_t na = 600'013, nb = 37;
  for (ls::ReduceOp op : {ls::ReduceOp::avg, ls::ReduceOp::sum}) {
    for (int poison : {0, 1}) {
      auto grad = [&](int r, Model& g) {
        bits_gradient_of(r, g);
        // A NaN and an infinity: their blocks (64 elements) are NaN on every rank, alike.
        if (poison && r == n - 1) g.a.data<float>()[70] = std::numeric_limits<float>::quiet_NaN();
        if (poison && r == 0) g.a.data<float>()[300'000] = std::numeric_limits<float>::infinity();
      };
      const ls::DistributedOptions o{.op = op, .deterministic = true};
      // The reduced gradients themselves (an optimizer's update would hide the sign of a zero):
      // rank micro-batches rs through accumulate(), then the step's exact sum.
      auto accumulated = [&](ls::Backend& be, const std::vector<int>& rs) {
        Model g = zeros(na, nb), got = zeros(na, nb);
        ls::GradientReducer red(be, g, o);
        const std::vector<ls::Tensor*> ptrs{&g.a, &g.b};
        for (int r : rs) {
          grad(r, g);
          ls::detail::ReducerSteps::bind(red, ptrs);
          ls::detail::ReducerSteps::accumulate(red);
        }
        const auto& out = ls::detail::ReducerSteps::reduce_accumulated(red);
        std::memcpy(got.a.raw_data(), out[0]->raw_data(), got.a.nbytes());
        std::memcpy(got.b.raw_data(), out[1]->raw_data(), got.b.nbytes());
        return got;
      };
      const std::uint64_t before = b.exact_sums_fused();
      // This rank's micro-batch read where it lies (reduce(): the gradients given to the step).
      Model fused = zeros(na, nb);
      {
        ls::GradientReducer red(b, fused, o);
        grad(rank, fused);
        red.reduce();
      }
      const Model fused_copy = accumulated(b, {rank});  // the copy the first accumulate() keeps
      const std::uint64_t after = b.exact_sums_fused();
      const Model int64 = accumulated(plain, {rank});
      // The int64 path writing into the gradients it reads (in place, block by block).
      Model int64_in_place = zeros(na, nb);
      {
        ls::GradientReducer red(plain, int64_in_place, o);
        grad(rank, int64_in_place);
        red.reduce();
      }
      const std::uint64_t later = b.exact_sums_fused();
      std::vector<int> all;
      for (int r = 0; r < n; ++r) all.push_back(r);
      const Model one = accumulated(self, all);  // every rank's micro-batch through the counters
      INFO("op " << ls::name(op) << " poison " << poison << " rank " << rank << " of " << n);
      CHECK(all_ranks(after == before + (b.shared_memory() ? 2 : 0) && later == after));
      CHECK(all_ranks(same_bits(fused, int64)));
      CHECK(all_ranks(same_bits(fused_copy, int64)));
      CHECK(all_ranks(same_bits(int64_in_place, int64)));
      CHECK(all_ranks(same_bits(fused, one)));
      const float* a = fused.a.data<float>();
      if (poison) {
        CHECK(all_ranks(std::isnan(a[64]) && std::isnan(a[127]) && !std::isnan(a[63]) && !std::isnan(a[128]) &&
                        std::isnan(a[299'968]) && std::isnan(a[300'031]) && !std::isnan(a[300'032])));
      } else {
        bool finite = true;
        for (std::int64_t i = 0; i < na; ++i) finite = finite && !std::isnan(a[i]);
        CHECK(all_ranks(finite));
      }
    }
  }
}

TEST_CASE("deterministic: the exact mean is at least as accurate as the f32 sum (f64 reference)", "[deterministic]") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank(), n = b.size();
  const int M = 30;
  const std::int64_t na = 2048, nb = 7;
  const auto [first, count] = share(M, rank, n);
  std::vector<int> mine;
  for (int m = first; m < first + count; ++m) mine.push_back(m);
  const Model got = step_over(b, mine, na, nb);
  // References on every rank: f64 and f32 sums of all M in order.
  std::vector<double> exact(static_cast<std::size_t>(na + nb), 0.0);
  std::vector<float> naive(static_cast<std::size_t>(na + nb), 0.0f);
  Model g = zeros(na, nb);
  for (int m = 0; m < M; ++m) {
    gradient_of(m, g);
    for (std::int64_t i = 0; i < na + nb; ++i) {
      const float v = i < na ? g.a.data<float>()[i] : g.b.data<float>()[i - na];
      exact[static_cast<std::size_t>(i)] += v;
      naive[static_cast<std::size_t>(i)] += v;
    }
  }
  double err_exact = 0, err_naive = 0;
  for (std::int64_t i = 0; i < na + nb; ++i) {
    const double want = -exact[static_cast<std::size_t>(i)] / M;
    const double mine_v = i < na ? got.a.data<float>()[i] : got.b.data<float>()[i - na];
    const double f32_mean = -static_cast<double>(static_cast<float>(naive[static_cast<std::size_t>(i)] / M));
    err_exact = std::max(err_exact, std::abs(mine_v - want));
    err_naive = std::max(err_naive, std::abs(f32_mean - want));
  }
  INFO("max abs error: exact " << err_exact << ", f32 in order " << err_naive);
  CHECK(err_exact <= err_naive);
}

TEST_CASE("deterministic: a tensor of no elements beside others, reduced in place", "[deterministic]") {
  // The step's result goes into the gradients where they lie, tensor by tensor: an empty one
  // (here the first, at the same flat offset as the next) holds nothing and must not stop the
  // others' writes. One micro-batch per rank (the fused path on one machine) and through a
  // Backend without a fused form (the int64 path); both against one process.
  ls::MPIBackend& b = backend();
  const int rank = b.rank(), n = b.size();
  lstest::ForwardingBackend plain(b);
  ls::MPIBackend self(MPI_COMM_SELF);
  struct Three {
    ls::Tensor e, a, b;
  };
  auto make = [] { return Three{ls::Tensor::zeros({0}), ls::Tensor::zeros({300}), ls::Tensor::zeros({5})}; };
  auto fill = [](int r, Three& t) {
    Model m{ls::Tensor::borrow(t.a.data<float>(), {300}, ls::DType::f32, ls::Device::cpu()),
            ls::Tensor::borrow(t.b.data<float>(), {5}, ls::DType::f32, ls::Device::cpu())};
    gradient_of(r, m);
  };
  auto reduced = [&](ls::Backend& be, const std::vector<int>& rs) {
    Three g = make();
    const std::vector<ls::Tensor*> ptrs{&g.e, &g.a, &g.b};
    ls::GradientReducer red(be, ptrs, {"e", "a", "b"}, ls::DistributedOptions{.deterministic = true});
    for (std::size_t k = 0; k + 1 < rs.size(); ++k) {
      fill(rs[k], g);
      ls::detail::ReducerSteps::bind(red, ptrs);
      ls::detail::ReducerSteps::accumulate(red);
    }
    fill(rs.back(), g);
    red.reduce();
    return g;
  };
  auto same = [](const Three& x, const Three& y) {
    return std::memcmp(x.a.raw_data(), y.a.raw_data(), x.a.nbytes()) == 0 &&
           std::memcmp(x.b.raw_data(), y.b.raw_data(), x.b.nbytes()) == 0;
  };
  std::vector<int> all;
  for (int r = 0; r < n; ++r) all.push_back(r);
  const Three one = reduced(self, all);
  CHECK(all_ranks(same(reduced(b, {rank}), one)));
  CHECK(all_ranks(same(reduced(plain, {rank}), one)));
}

TEST_CASE("deterministic: a rank with no micro-batch, and a non-finite gradient", "[deterministic]") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank();
  // Only rank 0 has micro-batches: the others contribute nothing, the mean is rank 0's.
  std::vector<int> mine;
  if (rank == 0) mine = {0, 1};
  const Model got = step_over(b, mine, 100, 3);
  ls::MPIBackend self(MPI_COMM_SELF);
  const Model one = step_over(self, {0, 1}, 100, 3);
  CHECK(all_ranks(same_bits(got, one)));

  // A NaN on the last rank: its element's block (64 elements) becomes NaN on every rank; with
  // skip_non_finite the step is skipped on every rank.
  for (bool skip : {false, true}) {
    Model model = zeros(200, 3), g = zeros(200, 3);
    auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 1.0f},
                                        ls::DistributedOptions{.skip_non_finite = skip, .deterministic = true});
    auto state = ls::setup(opt, model);
    gradient_of(rank, g);
    if (rank == b.size() - 1) g.a.data<float>()[70] = std::numeric_limits<float>::quiet_NaN();
    ls::accumulate(state, g);
    ls::apply_accumulated(state, model);
    if (skip) {
      CHECK(all_ranks(state.skipped_steps() == 1 && model.a.data<float>()[70] == 0.0f));
    } else {
      CHECK(all_ranks(std::isnan(model.a.data<float>()[70]) && std::isnan(model.a.data<float>()[64]) &&
                      !std::isnan(model.a.data<float>()[63]) && !std::isnan(model.a.data<float>()[128])));
    }
  }
}

TEST_CASE("deterministic: refused combinations, on every rank at setup", "[deterministic]") {
  ls::MPIBackend& b = backend();
  auto refused = [&](ls::DistributedOptions o, auto model, const char* part) {
    o.deterministic = true;
    std::string text;
    try {
      auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 1.0f}, o);
      auto state = ls::setup(opt, model);
    } catch (const ls::InvalidArgument& e) {
      text = e.what();
    }
    INFO(text);
    CHECK(all_ranks(text.find(part) != std::string::npos));
  };
  refused(ls::DistributedOptions{.shard_optimizer_state = true}, zeros(10, 10), "shard_optimizer_state");
  refused(ls::DistributedOptions{.wire_dtype = ls::DType::bf16}, zeros(10, 10), "wire_dtype");
  refused(ls::DistributedOptions{}, ls::Tensor::zeros({10}, ls::DType::f64), "f64");
  // apply_accumulated outside deterministic mode.
  Model model = zeros(4, 4);
  auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 1.0f});
  auto state = ls::setup(opt, model);
  std::string text;
  try {
    ls::apply_accumulated(state, model);
  } catch (const ls::InvalidArgument& e) {
    text = e.what();
  }
  CHECK(text.find("only in deterministic mode") != std::string::npos);
}
