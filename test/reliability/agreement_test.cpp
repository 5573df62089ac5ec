// Trust, round 3 (issue 25): what decides which numbers of one rank meet which of another must
// be agreed by the ranks before any number moves. Each case gives the ranks setups that differ
// only in names, order, shape or micro-step count (never in what a hash of dtype and size would
// see), and checks that EVERY rank gets MismatchError naming the difference, and that nothing
// was averaged. Run at 1-4 ranks (at 1 rank nothing can differ: the cases check that the same
// setup is accepted).
#include <catch2/catch.hpp>

#include <lockstep/lockstep.hpp>

#include <map>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace ls = lockstep;
using namespace lstest;

namespace {
ls::MPIBackend& backend() { return world_backend(); }
}  // namespace

TEST_CASE("GradientReducer: the same tensors in another order on one rank is a MismatchError on every rank") {
  ls::MPIBackend& b = backend();
  const int r = b.rank(), n = b.size();
  ls::Tensor a = ls::Tensor::full({64}, 1.0 + r), bb = ls::Tensor::full({64}, 2.0 + r), c = ls::Tensor::full({64}, 3.0 + r);
  // The last rank lists c first: same dtypes and sizes in every position, other names.
  const bool odd = n > 1 && r == n - 1;
  std::vector<ls::Tensor*> grads = odd ? std::vector<ls::Tensor*>{&c, &bb, &a} : std::vector<ls::Tensor*>{&a, &bb, &c};
  std::vector<std::string> names = odd ? std::vector<std::string>{"c", "b", "a"} : std::vector<std::string>{"a", "b", "c"};
  const std::string got = outcome([&] { ls::GradientReducer red(b, grads, names); });
  bool ok;
  if (n == 1) {
    ok = got == "no exception";
  } else {
    ok = contains(got, "different structures") && contains(got, "GradientReducer") && contains(got, "'c'") && contains(got, "'a'");
  }
  // Nothing was averaged.
  ok = ok && a.data<float>()[0] == 1.0f + r && c.data<float>()[63] == 3.0f + r;
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("GradientReducer: same names, same element counts, other shapes is a MismatchError on every rank") {
  ls::MPIBackend& b = backend();
  const int r = b.rank(), n = b.size();
  ls::Tensor w = r == n - 1 && n > 1 ? ls::Tensor::zeros({3, 2}) : ls::Tensor::zeros({2, 3});
  std::vector<ls::Tensor*> grads{&w};
  const std::string got = outcome([&] { ls::GradientReducer red(b, grads, {"w"}); });
  const bool ok = n == 1 ? got == "no exception"
                         : contains(got, "different structures") && contains(got, "'w'") && contains(got, "[3, 2]") &&
                               contains(got, "[2, 3]");
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("DistributedOptimizer over map keys: {dec, enc} on one rank and {enc, head} on another is refused") {
  ls::MPIBackend& b = backend();
  const int r = b.rank(), n = b.size();
  std::map<std::string, ls::Tensor> model;
  const bool other = n > 1 && r == n - 1;
  model[other ? "head" : "dec"] = ls::Tensor::full({16}, 1.0);
  model["enc"] = ls::Tensor::full({16}, 2.0);
  auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 0.1});
  const std::string got = outcome([&] { auto state = ls::setup(opt, model); });
  const bool ok = n == 1 ? got == "no exception"
                         : contains(got, "DistributedOptimizer setup") && contains(got, "different structures") &&
                               (contains(got, "head") || contains(got, "dec"));
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("GradientReducer: a cycle cut short on one rank is a MismatchError on every rank, then it works again") {
  ls::MPIBackend& b = backend();
  const int r = b.rank(), n = b.size();
  ls::Tensor g = ls::Tensor::zeros({1000});
  std::vector<ls::Tensor*> grads{&g};
  ls::GradientReducer red(b, grads, {"g"}, ls::DistributedOptions{.accumulation_steps = 3});
  auto fill = [&](float v) {
    for (auto& x : g.span<float>()) x = v;
  };
  // Rank 0 accumulates two micro-steps and reduces a third; the others flush after one.
  const int micro = (r == 0 || n == 1) ? 2 : 1;
  bool ok = true;
  const std::string got = outcome([&] {
    for (int i = 0; i < micro; ++i) {
      fill(1.0f);
      ls::detail::ReducerSteps::bind(red, grads);
      ls::detail::ReducerSteps::accumulate(red);
    }
    fill(1.0f);
    ls::detail::ReducerSteps::bind(red, grads);
    (void)ls::detail::ReducerSteps::reduce_bound(red);
  });
  if (n == 1) {
    ok = got == "no exception";
  } else {
    ok = contains(got, "different numbers of micro-steps") && contains(got, "rank 0: 3") &&
         contains(got, "rank 1: 2");
  }
  INFO("rank " << r << ": " << got);
  // The reducer is usable afterwards: a whole cycle on every rank averages as it should.
  for (int step = 0; step < 3; ++step) {
    fill(static_cast<float>(r + step));
    if (red.reduce()) ok = ok && g.data<float>()[999] == Approx((n - 1) / 2.0 + 1.0);
  }
  CHECK(red.accumulated() == 0);
  CHECK(all_ranks(b, ok));
}
