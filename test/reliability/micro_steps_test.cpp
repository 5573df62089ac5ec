// The ranks' agreement on the number of micro-steps a reduction holds (issue 41, item 7), at no
// collective of its own: ls::accumulate called a different number of times per rank before
// update (accumulation_steps = 1) is a MismatchError on every rank naming the counts, in every
// form the step's collectives take (plain, the communication thread or not, ready reports, small
// buckets and slices, the 16-bit wire, sharded with and without tails, f64, op sum; and, run
// with LOCKSTEP_TEST_HOST_SIZE, the hierarchical path with its inter-host 16-bit wire). After the
// error the next cycle is right on every rank. Counts that agree cost no collective more than a
// step without accumulation.
//
// Each case runs under LOCKSTEP_TIMEOUT (test/tests_50_reliability.cmake): a hang ends as a
// TimeoutError, which fails the checks.
#include <catch2/catch.hpp>

#include <lockstep/lockstep.hpp>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "training_common.hpp"

namespace ls = lockstep;
using namespace lstest;

namespace {
ls::MPIBackend& backend() { return world_backend(); }

using Model = std::map<std::string, ls::Tensor>;

Model make(const std::vector<std::int64_t>& sizes, ls::DType dt) {
  Model m;
  for (std::size_t k = 0; k < sizes.size(); ++k) m["p" + std::to_string(k)] = ls::Tensor::zeros({sizes[k]}, dt);
  return m;
}

void fill(Model& g, double v) {
  for (auto& [k, t] : g) {
    if (t.dtype() == ls::DType::f64) for (auto& x : t.span<double>()) x = v;
    else for (auto& x : t.span<float>()) x = static_cast<float>(v);
  }
}

// The largest distance of any parameter from v, on this rank.
double distance(const Model& m, double v) {
  double worst = 0;
  for (const auto& [k, t] : m) {
    if (t.dtype() == ls::DType::f64) for (double x : t.span<const double>()) worst = std::max(worst, std::fabs(x - v));
    else for (float x : t.span<const float>()) worst = std::max(worst, std::fabs(static_cast<double>(x) - v));
  }
  return worst;
}

struct Case {
  std::string name;
  ls::DistributedOptions o;
  std::vector<std::int64_t> sizes;
  ls::DType dtype = ls::DType::f32;
  bool report = false;  // report every gradient ready (begin_step, grad_ready) before update
};

// One micro-step: fill the gradients with v and accumulate them, or, at the last, update.
void micro(ls::DistributedState<ls::SGD>& st, Model& model, Model& grads, double v, bool last, bool report) {
  fill(grads, v);
  if (!last) {
    ls::accumulate(st, grads);
    return;
  }
  if (report) {
    st.begin_step(grads);
    for (auto it = grads.rbegin(); it != grads.rend(); ++it) st.grad_ready(it->second);
  }
  ls::update(st, model, grads);
}

// The odd rank (the last) accumulates `extra` micro-steps more than the others before the update:
// MismatchError on every rank, naming the counts, the parameters untouched; then a cycle of two
// micro-steps on every rank gives the right step on every rank.
void differing_counts(const Case& c, int extra) {
  ls::MPIBackend& b = backend();
  const int r = b.rank(), n = b.size();
  const bool odd = n > 1 && r == n - 1;
  Model model = make(c.sizes, c.dtype), grads = make(c.sizes, c.dtype);
  auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 1.0f}, c.o);
  auto st = ls::setup(opt, model);
  const std::string got = outcome([&] {
    for (int k = 0; k < 1 + (odd ? extra : 0); ++k) micro(st, model, grads, 3.0 + r, false, c.report);
    micro(st, model, grads, 1.0 + r, true, c.report);
  });
  const bool untouched = distance(model, 0.0) == 0.0;
  const std::string counts = n > 1 ? "rank " + std::to_string(n - 1) + ": " + std::to_string(2 + extra) : "";
  const bool refused = contains(got, "MismatchError") || contains(got, "different numbers of micro-steps");
  INFO(c.name << ", rank " << r << ": " << got);
  if (n == 1) {
    CHECK(got == "no exception");
  } else {
    CHECK(all_ranks(b, refused && contains(got, "different numbers of micro-steps") && contains(got, counts) &&
                           contains(got, "fewest 2 on") && untouched));
  }
  // The next cycle: two micro-steps on every rank.
  fill(model, 0.0);
  const std::string again = outcome([&] {
    micro(st, model, grads, 3.0 + r, false, c.report);
    micro(st, model, grads, 1.0 + r, true, c.report);
  });
  // avg: the mean over ranks and micro-steps of (3 + r) and (1 + r) is 2 + (n - 1) / 2; sum:
  // the sum over ranks of 4 + 2r is n (n + 3).
  const double want = c.o.op == ls::ReduceOp::avg ? -(2.0 + (n - 1) / 2.0) : -static_cast<double>(n) * (n + 3);
  const double tol = c.o.wire_dtype ? 0.02 * std::fabs(want) : 1e-5 * std::fabs(want);
  INFO(c.name << ", rank " << r << ", next cycle: " << again << ", distance " << distance(model, want));
  CHECK(all_ranks(b, again == "no exception" && distance(model, want) <= tol));
  CHECK(all_ranks(b, same_on_all_ranks(b, content_hash(model))));
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const std::vector<std::int64_t> mixed{20000, 700, 3, 0, 5};  // 20000 f32: sliced at 64 KiB
  out.push_back({"default options", {}, mixed});
  out.push_back({"no communication thread, 1 KiB buckets", {.bucket_bytes = 1024, .comm_thread = false}, mixed});
  out.push_back({"ready reports, communication thread", {.bucket_bytes = 1024}, mixed, ls::DType::f32, true});
  out.push_back({"ready reports, no communication thread", {.bucket_bytes = 1024, .comm_thread = false}, mixed,
                 ls::DType::f32, true});
  out.push_back({"one bucket per tensor", {.bucket_bytes = 0}, mixed});
  out.push_back({"bf16 wire", {.wire_dtype = ls::DType::bf16}, mixed});
  out.push_back({"f16 wire, no thread", {.bucket_bytes = 1024, .comm_thread = false, .wire_dtype = ls::DType::f16}, mixed});
  out.push_back({"f64", {.bucket_bytes = 1024}, mixed, ls::DType::f64});
  out.push_back({"op sum", {.op = ls::ReduceOp::sum}, mixed});
  // Sharded: buckets with a tail (numel % ranks != 0 at 2-4 ranks), and buckets of multiples of
  // 12 elements (no tail at 2, 3 or 4 ranks: the reduce-scatter carries the count).
  out.push_back({"sharded, tails", {.bucket_bytes = 1024, .shard_optimizer_state = true}, {701, 13, 3}});
  out.push_back({"sharded, no tail", {.bucket_bytes = 1024, .shard_optimizer_state = true}, {1200, 240, 12}});
  out.push_back({"sharded, no tail, bf16 wire",
                 {.bucket_bytes = 1024, .shard_optimizer_state = true, .wire_dtype = ls::DType::bf16}, {1200, 240, 12}});
  out.push_back({"sharded, tails, no thread",
                 {.bucket_bytes = 1024, .comm_thread = false, .shard_optimizer_state = true}, {701, 13, 3}});
  // The carried call at the hierarchical path's 64 KiB threshold (micro_steps.hierarchical): 16320
  // f32 and the trailer are 65536 bytes exactly, 16319 one element below, 16321 one above.
  for (std::int64_t n : {16319, 16320, 16321})
    out.push_back({"at the 64 KiB threshold, " + std::to_string(n), {}, {n}});
  return out;
}
}  // namespace

// Before: each rank divided the reduced sum by its own count (2 on the odd rank, 1 elsewhere) and
// the replicas differed without a word.
TEST_CASE("explicit accumulation a different number of times per rank: MismatchError everywhere, every form") {
  for (const Case& c : cases()) differing_counts(c, 1);
}

// Counts that differ in a high bit only (257 and 1 micro-steps: bit 8; 257 is not a bf16 number),
// on the bf16 wire, where sums of the counts themselves would be rounded.
TEST_CASE("counts of 258 and 2 on the bf16 wire are told apart; 258 everywhere is accepted") {
  differing_counts({"bf16 wire, 256 more", {.wire_dtype = ls::DType::bf16}, {40, 3}}, 256);
  differing_counts({"sharded, bf16 wire, 256 more",
                    {.bucket_bytes = 1024, .shard_optimizer_state = true, .wire_dtype = ls::DType::bf16}, {48, 12}},
                   256);
  ls::MPIBackend& b = backend();
  const int r = b.rank(), n = b.size();
  Model model = make({40, 3}, ls::DType::f32), grads = make({40, 3}, ls::DType::f32);
  auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 1.0f}, {.wire_dtype = ls::DType::bf16});
  auto st = ls::setup(opt, model);
  const std::string got = outcome([&] {
    for (int k = 0; k < 257; ++k) micro(st, model, grads, 1.0 + r, false, false);
    micro(st, model, grads, 1.0 + r, true, false);
  });
  const double want = -(1.0 + (n - 1) / 2.0);
  INFO("rank " << r << ": " << got << ", distance " << distance(model, want));
  CHECK(all_ranks(b, got == "no exception" && distance(model, want) <= 0.02 * std::fabs(want)));
}

// The count rides on one of the step's own calls: a cycle of accumulation makes exactly the calls
// of a step without it (before: one allgather more with accumulation_steps > 1), whether the
// micro-steps are counted by accumulation_steps or by ls::accumulate.
TEST_CASE("agreeing on the micro-step count costs no collective") {
  ls::MPIBackend& world = backend();
  const std::vector<std::int64_t> sizes{20000, 700, 3};
  auto calls = [&](int steps, bool explicit_accumulate) {
    CountingBackend cb(world);
    Model model = make(sizes, ls::DType::f32), grads = make(sizes, ls::DType::f32);
    ls::DistributedOptions o{.bucket_bytes = 1024};
    if (!explicit_accumulate) o.accumulation_steps = steps;
    auto opt = ls::DistributedOptimizer(cb, ls::SGD{.lr = 1.0f}, o);
    auto st = ls::setup(opt, model);
    cb.reset();
    for (int k = 0; k < steps; ++k) {
      fill(grads, 1.0);
      if (explicit_accumulate && k + 1 < steps) ls::accumulate(st, grads);
      else ls::update(st, model, grads);
    }
    return std::vector<int>{cb.allreduces, cb.allgathers, cb.broadcasts, cb.other};
  };
  const std::vector<int> plain = calls(1, false);
  INFO("one step: " << plain[0] << " allreduces, " << plain[1] << " allgathers");
  CHECK(plain[1] == 0);
  CHECK(calls(3, false) == plain);
  CHECK(calls(3, true) == plain);
}
