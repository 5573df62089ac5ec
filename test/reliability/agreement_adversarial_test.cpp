// Adversarial tests of trust round 3 (issue 25): the ranks must agree, before any number moves,
// on everything that decides which numbers of one rank meet which of another (names, order,
// shapes, dtypes, device kinds, options, the nested structure a name comes from, and the number
// of micro-steps at each reduction). Each case gives one rank (the last) a setup that differs in a
// way a naive signature could hide, and checks the outcome on EVERY rank: a MismatchError naming
// the difference where the ranks differ, the right average where they do not, and never a hang
// (the test runs under LOCKSTEP_TIMEOUT, so a hang ends as a TimeoutError). At one rank nothing
// can differ: the cases check that the same setup is accepted.
//
// Cases tagged [!mayfail] are defects found by this file (see the comment above each).
#include <catch2/catch.hpp>

#include <lockstep/lockstep.hpp>

#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "test_support.hpp"

namespace ls = lockstep;
using namespace lstest;

namespace {
ls::MPIBackend& backend() { return world_backend(); }

void fill(ls::Tensor& t, float v) {
  for (auto& x : t.span<float>()) x = v;
}
bool all_equal(const ls::Tensor& t, float v) {
  for (float x : t.span<const float>())
    if (!(std::fabs(x - v) <= 1e-5f * std::max(1.0f, std::fabs(v)))) return false;
  return true;
}
// The last rank is the odd one out (none at one rank).
bool odd_rank(const ls::Backend& b) { return b.size() > 1 && b.rank() == b.size() - 1; }

// Builds a reducer from these tensors and names on this rank: the outcome.
std::string make_reducer(ls::Backend& b, std::vector<ls::Tensor*> g, std::vector<std::string> names,
                         ls::DistributedOptions o = {}) {
  return outcome([&] { ls::GradientReducer red(b, g, names, o); });
}

// A setup mismatch: MismatchError "different structures" on every rank (no exception at 1 rank).
bool refused_everywhere(const ls::Backend& b, const std::string& got, const std::string& what) {
  if (b.size() == 1) return got == "no exception";
  return contains(got, "exception: ") && contains(got, what) && contains(got, "different structures");
}

// The same value on every rank (for replicas that must stay equal).
bool same_everywhere(ls::Backend& b, double v) {
  double lo = v, hi = v;
  b.allreduce(ls::TensorView{&lo, 1, ls::DType::f64, ls::Device::cpu()}, ls::ReduceOp::min);
  b.allreduce(ls::TensorView{&hi, 1, ls::DType::f64, ls::Device::cpu()}, ls::ReduceOp::max);
  return lo == hi;
}
}  // namespace

// ---- names a naive concatenation would run together --------------------------------------------

TEST_CASE("names that run together without separators or with ';' '=' ':' in them are told apart") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  const bool odd = odd_rank(b);
  // (the others' names, the odd rank's names); one tensor of 8 elements per name.
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> pairs = {
      {{"ab", "c"}, {"a", "bc"}},
      {{"a;b"}, {"a=b"}},
      {{"a", ""}, {"", "a"}},
      {{"x:8;", "y"}, {"x", ":8;y"}},
      {{"w=tensor f32 [8] on cpu:8;1:x", "y"}, {"w", "x=tensor f32 [8] on cpu:8;1:y"}},
      {{"1:a", "1:b"}, {"1:a;1:b", ""}},
      {{"layer.0.w"}, {"layer.0.w "}},
  };
  int k = 0;
  for (const auto& [mine, other] : pairs) {
    const auto& names = odd ? other : mine;
    std::vector<ls::Tensor> ts;
    ts.reserve(names.size());
    for (std::size_t i = 0; i < names.size(); ++i) ts.push_back(ls::Tensor::full({8}, 1.0 + r));
    std::vector<ls::Tensor*> ps;
    for (auto& t : ts) ps.push_back(&t);
    const std::string got = make_reducer(b, ps, names);
    bool ok = refused_everywhere(b, got, "GradientReducer");
    for (auto& t : ts) ok = ok && all_equal(t, 1.0f + r);  // nothing was averaged
    INFO("pair " << k << ", rank " << r << ": " << got);
    CHECK(all_ranks(b, ok));
    ++k;
  }
}

// Was a defect (fixed: serialize length-prefixes every field). A name holding a NUL byte on rank 0 (the root of the
// structure check): the check's explanation serialises root's entries with NUL separators
// (synchronize.cpp, serialize), so the other ranks' deserialize finds an odd number of NULs, its
// last find() returns npos and `pos = b + 1` wraps to 0: an endless loop that grows a vector until
// memory runs out, while rank 0 waits in the explanations' allgather until LOCKSTEP_TIMEOUT and the
// job was ended as a stall.
TEST_CASE("a name with a NUL byte on the root rank", "[nul]") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  const std::string name = odd_rank(b) ? std::string("a\0c", 3) : std::string("a\0b", 3);
  ls::Tensor t = ls::Tensor::full({8}, 1.0 + r);
  const std::string got = make_reducer(b, {&t}, {name});
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, refused_everywhere(b, got, "GradientReducer") && all_equal(t, 1.0f + r)));
}

// ---- nested structures ---------------------------------------------------------------------------

TEST_CASE("a vector of maps split differently on one rank is refused on every rank") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  using Layers = std::vector<std::map<std::string, ls::Tensor>>;
  Layers g;
  if (odd_rank(b)) {
    g.resize(2);
    g[0]["a"] = ls::Tensor::full({4}, 1.0 + r);
    g[1]["b"] = ls::Tensor::full({4}, 1.0 + r);
  } else {
    g.resize(1);
    g[0]["a"] = ls::Tensor::full({4}, 1.0 + r);
    g[0]["b"] = ls::Tensor::full({4}, 1.0 + r);
  }
  const std::string got = outcome([&] { ls::GradientReducer red(b, g); });
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, refused_everywhere(b, got, "GradientReducer") && all_equal(g[0].begin()->second, 1.0f + r)));
}

TEST_CASE("an optional gradient present on one rank only is refused on every rank") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  std::map<std::string, std::optional<ls::Tensor>> g;
  g["a"] = ls::Tensor::full({4}, 1.0 + r);
  g["b"] = ls::Tensor::full({4}, 1.0 + r);
  g["c"] = ls::Tensor::full({4}, 1.0 + r);
  if (odd_rank(b)) g["b"].reset();  // a, c here; a, b, c elsewhere (c meets b if only sizes count)
  const std::string got = outcome([&] { ls::GradientReducer red(b, g); });
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, refused_everywhere(b, got, "GradientReducer") && all_equal(*g["c"], 1.0f + r)));
}

TEST_CASE("an optional present on one rank before the same tensors: one outcome on every rank") {
  // An empty optional<Tensor> on one rank and an integer tensor in it elsewhere: neither is a
  // trainable gradient, so the gradients meet as they should. Accepting and refusing are both
  // fine; what is not is an outcome that differs between ranks.
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  std::pair<std::optional<ls::Tensor>, ls::Tensor> g;
  if (!odd_rank(b)) g.first = ls::Tensor::zeros({3}, ls::DType::i32);
  g.second = ls::Tensor::full({4}, 1.0 + r);
  const std::string got = outcome([&] {
    ls::GradientReducer red(b, g);
    red.reduce();
  });
  const bool accepted = got == "no exception";
  const int a = allreduce(b, accepted ? 1 : 0, ls::ReduceOp::sum);
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, (a == 0 || a == b.size()) && (!accepted || all_equal(g.second, (b.size() + 1) / 2.0f))));
}

TEST_CASE("map keys with a '.' that make the same path from other nestings: one outcome on every rank") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  std::map<std::string, std::map<std::string, ls::Tensor>> g;
  if (odd_rank(b)) g["a.b"]["c"] = ls::Tensor::full({4}, 1.0 + r);
  else g["a"]["b.c"] = ls::Tensor::full({4}, 1.0 + r);
  const std::string got = outcome([&] {
    ls::GradientReducer red(b, g);
    red.reduce();
  });
  const bool accepted = got == "no exception";
  const int a = allreduce(b, accepted ? 1 : 0, ls::ReduceOp::sum);
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, a == 0 || a == b.size()));
}

// ---- zero-element tensors, shapes, scalars -------------------------------------------------------

TEST_CASE("zero-element tensors: order, shape [0,3] against [3,0], and a working reduction") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  const bool odd = odd_rank(b);
  {
    ls::Tensor e = ls::Tensor::zeros({0}), w = ls::Tensor::full({8}, 1.0 + r), v = ls::Tensor::full({8}, 2.0 + r);
    // e, w, v elsewhere; w, e, v here: the same sizes in the positions that hold elements.
    auto ps = odd ? std::vector<ls::Tensor*>{&w, &e, &v} : std::vector<ls::Tensor*>{&e, &w, &v};
    auto ns = odd ? std::vector<std::string>{"w", "e", "v"} : std::vector<std::string>{"e", "w", "v"};
    const std::string got = make_reducer(b, ps, ns);
    INFO("order, rank " << r << ": " << got);
    CHECK(all_ranks(b, refused_everywhere(b, got, "GradientReducer") && all_equal(w, 1.0f + r)));
  }
  {
    ls::Tensor e = odd ? ls::Tensor::zeros({3, 0}) : ls::Tensor::zeros({0, 3});
    const std::string got = make_reducer(b, {&e}, {"e"});
    INFO("shape, rank " << r << ": " << got);
    CHECK(all_ranks(b, refused_everywhere(b, got, "GradientReducer")));
  }
  {
    ls::Tensor s = odd ? ls::Tensor::zeros({1}) : ls::Tensor::zeros({});
    const std::string got = make_reducer(b, {&s}, {"s"});
    INFO("scalar, rank " << r << ": " << got);
    CHECK(all_ranks(b, refused_everywhere(b, got, "GradientReducer")));
  }
  {
    // The same setup everywhere, zero-element tensors between others, one bucket per tensor,
    // accumulation: the average is right.
    ls::Tensor e0 = ls::Tensor::zeros({0}), w = ls::Tensor::zeros({5}), e1 = ls::Tensor::zeros({2, 0}),
               v = ls::Tensor::zeros({3});
    std::vector<ls::Tensor*> ps{&e0, &w, &e1, &v};
    bool ok = true;
    const std::string got = outcome([&] {
      ls::GradientReducer red(b, ps, {"e0", "w", "e1", "v"},
                              ls::DistributedOptions{.bucket_bytes = 0, .accumulation_steps = 2});
      for (int step = 0; step < 4; ++step) {
        fill(w, static_cast<float>(r + 1));
        fill(v, static_cast<float>(2 * (r + 1)));
        if (red.reduce()) ok = ok && all_equal(w, (b.size() + 1) / 2.0f) && all_equal(v, b.size() + 1.0f);
      }
    });
    INFO("working, rank " << r << ": " << got);
    CHECK(all_ranks(b, ok && got == "no exception"));
  }
}

// ---- options ----------------------------------------------------------------------------------------

TEST_CASE("options that differ on one rank are refused on every rank, naming the options") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  const bool odd = odd_rank(b);
  struct Variant {
    const char* what;
    ls::DistributedOptions mine, other;
  };
  const std::vector<Variant> variants = {
      {"bucket_bytes", {.bucket_bytes = 4096}, {.bucket_bytes = 4100}},
      {"bucket_bytes 0", {.bucket_bytes = 0}, {.bucket_bytes = 1}},
      {"device_bucket_bytes", {.device_bucket_bytes = 1 << 20}, {.device_bucket_bytes = 2 << 20}},
      {"op", {.op = ls::ReduceOp::avg}, {.op = ls::ReduceOp::sum}},
      {"accumulation_steps", {.accumulation_steps = 2}, {.accumulation_steps = 3}},
      {"comm_thread", {.comm_thread = true}, {.comm_thread = false}},
      {"wire_dtype", {.wire_dtype = ls::DType::bf16}, {.wire_dtype = ls::DType::f16}},
      {"wire_dtype none", {}, {.wire_dtype = ls::DType::bf16}},
  };
  for (const auto& v : variants) {
    ls::Tensor a = ls::Tensor::full({3000}, 1.0 + r), c = ls::Tensor::full({3000}, 1.0 + r);
    const std::string got = make_reducer(b, {&a, &c}, {"a", "c"}, odd ? v.other : v.mine);
    INFO(v.what << ", rank " << r << ": " << got);
    CHECK(all_ranks(b, refused_everywhere(b, got, "options") && all_equal(a, 1.0f + r)));
  }
}

// ---- DistributedOptimizer, sharded ------------------------------------------------------------------

TEST_CASE("sharded DistributedOptimizer: other names, other bucket_bytes, or sharded on one rank only") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  const bool odd = odd_rank(b);
  const ls::DistributedOptions sharded{.bucket_bytes = 256, .shard_optimizer_state = true};
  {
    std::map<std::string, ls::Tensor> model;
    model[odd ? "head" : "dec"] = ls::Tensor::full({100}, 1.0);
    model["enc"] = ls::Tensor::full({100}, 2.0);
    auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 0.1f}, sharded);
    const std::string got = outcome([&] { auto st = ls::setup(opt, model); });
    INFO("names, rank " << r << ": " << got);
    CHECK(all_ranks(b, refused_everywhere(b, got, "DistributedOptimizer setup")));
  }
  {
    std::map<std::string, ls::Tensor> model;
    model["dec"] = ls::Tensor::full({100}, 1.0);
    model["enc"] = ls::Tensor::full({100}, 2.0);
    ls::DistributedOptions o = sharded;
    if (odd) o.bucket_bytes = 512;
    auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 0.1f}, o);
    const std::string got = outcome([&] { auto st = ls::setup(opt, model); });
    INFO("bucket_bytes, rank " << r << ": " << got);
    CHECK(all_ranks(b, refused_everywhere(b, got, "bucket_bytes")));
  }
  {
    std::map<std::string, ls::Tensor> model;
    model["dec"] = ls::Tensor::full({100}, 1.0);
    model["enc"] = ls::Tensor::full({100}, 2.0);
    ls::DistributedOptions o = sharded;
    if (odd) o.shard_optimizer_state = false;
    auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 0.1f}, o);
    const std::string got = outcome([&] { auto st = ls::setup(opt, model); });
    INFO("sharded on some ranks, rank " << r << ": " << got);
    CHECK(all_ranks(b, refused_everywhere(b, got, "shard_optimizer_state")));
  }
  {
    // The same setup everywhere, with a zero-element tensor and a bucket smaller than the ranks:
    // one step gives the same parameters on every rank.
    std::map<std::string, ls::Tensor> model, grads;
    model["a"] = ls::Tensor::full({101}, 1.0);
    model["e"] = ls::Tensor::zeros({0});
    model["t"] = ls::Tensor::full({1}, 1.0);
    for (auto& [k, t] : model) grads[k] = ls::Tensor::full(t.shape(), 1.0 + r);
    auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 1.0f}, ls::DistributedOptions{.bucket_bytes = 4,
                                                                                      .shard_optimizer_state = true});
    bool ok = true;
    const std::string got = outcome([&] {
      auto st = ls::setup(opt, model);
      ls::update(st, model, grads);
      ok = all_equal(model["a"], 1.0f - (b.size() + 1) / 2.0f) && all_equal(model["t"], 1.0f - (b.size() + 1) / 2.0f);
    });
    INFO("working, rank " << r << ": " << got);
    CHECK(all_ranks(b, ok && got == "no exception"));
  }
}

// ---- micro-step counts ----------------------------------------------------------------------------

namespace {
// Three gradients of 1000 f32 in buckets of `bucket_bytes` (several buckets, sliced). Rank 0
// cuts its cycle short (reduces after `short_micro` micro-steps, `report_ready`: with every
// gradient reported ready first); the others run whole cycles of accumulation_steps micro-steps,
// reporting ready gradients (the odd rank in reverse order). Then every rank must have thrown
// MismatchError naming the counts, and two whole cycles through reduce() must average right.
void short_cycle(ls::DistributedOptions o, bool report_ready, int short_micro) {
  ls::MPIBackend& b = backend();
  const int r = b.rank(), n = b.size();
  const int k = o.accumulation_steps;
  ls::Tensor g0 = ls::Tensor::zeros({1000}), g1 = ls::Tensor::zeros({1000}), g2 = ls::Tensor::zeros({1000});
  std::vector<ls::Tensor*> grads{&g0, &g1, &g2};
  ls::GradientReducer red(b, grads, {"g0", "g1", "g2"}, o);
  auto fill_all = [&](float v) {
    for (auto* g : grads) fill(*g, v);
  };
  auto mark = [&] {
    if (!report_ready) return;
    if (odd_rank(b))
      for (auto it = grads.rbegin(); it != grads.rend(); ++it) red.grad_ready(**it);
    else
      for (auto* g : grads) red.grad_ready(*g);
  };
  const int micro = (r == 0 && n > 1) ? short_micro : k;
  const std::string got = outcome([&] {
    for (int i = 0; i + 1 < micro; ++i) {
      fill_all(1.0f);
      ls::detail::ReducerSteps::bind(red, grads);
      ls::detail::ReducerSteps::accumulate(red);
    }
    fill_all(1.0f);
    ls::detail::ReducerSteps::bind(red, grads);
    mark();
    (void)ls::detail::ReducerSteps::reduce_bound(red);
  });
  bool ok;
  if (n == 1) {
    ok = got == "no exception";
  } else {
    ok = contains(got, "different numbers of micro-steps") && contains(got, "rank 0: " + std::to_string(short_micro)) &&
         contains(got, "rank 1: " + std::to_string(k));
  }
  INFO("rank " << r << ": " << got);
  // The reducer works again: whole cycles on every rank, with ready reports.
  std::string again = outcome([&] {
    for (int cycle = 0; cycle < 2; ++cycle) {
      for (int s = 0; s < k; ++s) {
        fill_all(static_cast<float>((r + 1) * (s + 1)));
        if (report_ready) {
          for (auto* g : grads) red.grad_ready(*g);
        }
        const bool done = red.reduce();
        if (done) {
          const float want = (n + 1) / 2.0f * (k + 1) / 2.0f;
          for (auto* g : grads) ok = ok && all_equal(*g, want);
        }
        ok = ok && done == (s == k - 1);
      }
    }
  });
  INFO("afterwards, rank " << r << ": " << again);
  ok = ok && again == "no exception" && red.accumulated() == 0;
  CHECK(all_ranks(b, ok));
}
}  // namespace

TEST_CASE("short cycle: plain, blocking, several buckets") {
  short_cycle({.bucket_bytes = 1024, .accumulation_steps = 2, .comm_thread = false}, false, 1);
}

TEST_CASE("short cycle: a cycle run long (accumulate called more than accumulation_steps - 1 times)") {
  short_cycle({.bucket_bytes = 1024, .accumulation_steps = 2, .comm_thread = false}, false, 3);
}

TEST_CASE("short cycle: the 16-bit wire (bf16), comm_thread on and off") {
  short_cycle({.bucket_bytes = 1024, .accumulation_steps = 2, .comm_thread = true, .wire_dtype = ls::DType::bf16},
              false, 1);
  short_cycle({.bucket_bytes = 1024, .accumulation_steps = 3, .comm_thread = false, .wire_dtype = ls::DType::f16},
              true, 2);
}

TEST_CASE("short cycle: comm_thread with ready reports (the whole ranks launch on the thread)") {
  short_cycle({.bucket_bytes = 1024, .accumulation_steps = 2, .comm_thread = true}, true, 1);
  short_cycle({.bucket_bytes = 1024, .accumulation_steps = 3, .comm_thread = true}, true, 2);
}

// Was a defect (fixed: without the communication thread host buckets are launched by reduce_bound only, blocking, on every rank). Without the
// communication thread, the whole ranks' final micro-step launches its buckets from grad_ready
// as nonblocking allreduces (bucket_collectives.cpp, launch: iallreduce), while the short rank (not
// at its final micro-step, so grad_ready launches nothing) reduces them in reduce_bound with
// blocking calls (communicate: allreduce). The blocking and the nonblocking call never match:
// a stall on every rank (TimeoutError at LOCKSTEP_TIMEOUT, the default deadline otherwise) instead
// of the MismatchError on the micro-step counts, which is agreed only after the buckets. Run it
// with: test_agreement_adversarial "[hang_short_cycle]".
TEST_CASE("short cycle: ready reports without the communication thread", "[hang_short_cycle]") {
  short_cycle({.bucket_bytes = 1024, .accumulation_steps = 2, .comm_thread = false}, true, 1);
}

TEST_CASE("step by step, whole cycles, ready reported in another order on one rank: right average") {
  ls::MPIBackend& b = backend();
  const int r = b.rank(), n = b.size();
  for (bool thread : {false, true}) {
    ls::Tensor g0 = ls::Tensor::zeros({700}), g1 = ls::Tensor::zeros({10}), g2 = ls::Tensor::zeros({700}),
               g3 = ls::Tensor::zeros({10});
    std::vector<ls::Tensor*> grads{&g0, &g1, &g2, &g3};
    ls::GradientReducer red(b, grads, {"g0", "g1", "g2", "g3"},
                            {.bucket_bytes = 1024, .accumulation_steps = 3, .comm_thread = thread});
    bool ok = true;
    const std::string got = outcome([&] {
      for (int cycle = 0; cycle < 2; ++cycle) {
        for (int s = 0; s < 3; ++s) {
          for (std::size_t j = 0; j < grads.size(); ++j) fill(*grads[j], static_cast<float>((r + 1) * (j + 1)));
          ls::detail::ReducerSteps::bind(red, grads);
          std::vector<std::size_t> order{0, 1, 2, 3};
          if (odd_rank(b)) order = {2, 0, 3, 1};
          else if (r == 0) order = {3, 2, 1, 0};
          for (auto j : order) red.grad_ready(*grads[j]);
          if (!ls::detail::ReducerSteps::final_micro_step(red)) {
            ls::detail::ReducerSteps::accumulate(red);
            continue;
          }
          const auto& out = ls::detail::ReducerSteps::reduce_bound(red);
          for (std::size_t j = 0; j < out.size(); ++j) ok = ok && all_equal(*out[j], (n + 1) / 2.0f * (j + 1));
        }
      }
    });
    INFO("comm_thread " << thread << ", rank " << r << ": " << got);
    CHECK(all_ranks(b, ok && got == "no exception"));
  }
}

// One rank reports no gradient ready (a branch of its model that did not run), the others report
// every one: the others launch their buckets from grad_ready, that rank in reduce_bound.
static void partial_ready(bool thread) {
  ls::MPIBackend& b = backend();
  const int r = b.rank(), n = b.size();
  {
    ls::Tensor g0 = ls::Tensor::zeros({700}), g1 = ls::Tensor::zeros({700});
    std::vector<ls::Tensor*> grads{&g0, &g1};
    ls::GradientReducer red(b, grads, {"g0", "g1"}, {.bucket_bytes = 1024, .comm_thread = thread});
    bool ok = true;
    const std::string got = outcome([&] {
      fill(g0, r + 1.0f);
      fill(g1, r + 1.0f);
      ls::detail::ReducerSteps::bind(red, grads);
      if (!odd_rank(b)) {
        red.grad_ready(g1);
        red.grad_ready(g0);
      }
      (void)ls::detail::ReducerSteps::reduce_bound(red);
      ok = all_equal(g0, (n + 1) / 2.0f) && all_equal(g1, (n + 1) / 2.0f);
    });
    const int errs = allreduce(b, got == "no exception" ? 0 : 1, ls::ReduceOp::sum);
    INFO("comm_thread " << thread << ", rank " << r << ": " << got);
    CHECK(all_ranks(b, errs == n || (errs == 0 && ok)));
  }
}

TEST_CASE("ready reported on some ranks only, with the communication thread: right average, no hang") {
  partial_ready(true);
}

// Was a defect (fixed as above): without the communication thread the ranks that reported launched
// nonblocking allreduces from grad_ready, the rank that did not reduces the same buckets with
// blocking allreduces in reduce_bound: they never match, a stall on every rank. Run it with:
// test_agreement_adversarial "[hang_partial_ready]".
TEST_CASE("ready reported on some ranks only, without the communication thread", "[hang_partial_ready]") {
  partial_ready(false);
}

// DistributedOptimizer's accumulate(state, grads) (PyTorch's no_sync) is public whatever
// accumulation_steps is; with accumulation_steps = 1 a rank that accumulated before its update
// divides the reduced sum by 2 and the others by 1. Was a defect (the counts were agreed only
// with accumulation_steps > 1; at 2 ranks w = -1.25 on rank 0, -2.5 on rank 1): the counts now
// ride on one of the step's calls (src/train/micro_steps.cpp; every form: test_micro_steps).
TEST_CASE("accumulate() on one rank with accumulation_steps = 1: the replicas must not differ silently") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  std::map<std::string, ls::Tensor> model, grads;
  model["w"] = ls::Tensor::zeros({16});
  grads["w"] = ls::Tensor::zeros({16});
  auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 1.0f});
  auto st = ls::setup(opt, model);
  const std::string got = outcome([&] {
    if (r == 0 && b.size() > 1) {
      fill(grads["w"], 3.0f);
      ls::accumulate(st, grads);
    }
    fill(grads["w"], 1.0f);
    ls::update(st, model, grads);
  });
  const bool same = same_everywhere(b, model["w"].data<float>()[0]);
  const int errs = allreduce(b, got == "no exception" ? 0 : 1, ls::ReduceOp::sum);
  INFO("rank " << r << ": " << got << ", w[0] = " << model["w"].data<float>()[0]);
  // Either every rank refused (MismatchError), or every rank applied the same step.
  CHECK(all_ranks(b, (errs == b.size() && contains(got, "micro-steps")) || (errs == 0 && same)));
}

// update() aligns the gradients with the model by position, comparing shapes and dtypes only:
// gradients whose names are not the model's (here the odd rank's grads hold b's gradient under
// the first key and a's under the second) are accepted, and a's update on that rank is b's.
// DEFECT (a local check, beyond the cross-rank agreement): detail::check_grads_match (rules.cpp)
// compares shapes and dtypes only, not the gradients' paths with the model's, so gradients
// keyed "x", "y" for a model keyed "a", "b" are applied by position without a word.
TEST_CASE("update with gradients named otherwise than the model on one rank", "[!mayfail]") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  std::map<std::string, ls::Tensor> model;
  model["a"] = ls::Tensor::zeros({8});
  model["b"] = ls::Tensor::zeros({8});
  std::map<std::string, ls::Tensor> grads;
  grads[odd_rank(b) ? "x" : "a"] = ls::Tensor::full({8}, 1.0);
  grads[odd_rank(b) ? "y" : "b"] = ls::Tensor::full({8}, 2.0);
  auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 1.0f});
  auto st = ls::setup(opt, model);
  const std::string got = outcome([&] { ls::update(st, model, grads); });
  const int errs = allreduce(b, got == "no exception" ? 0 : 1, ls::ReduceOp::sum);
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, b.size() == 1 ? errs == 0 : errs == b.size()));
}

// ---- remote calls' reducers ---------------------------------------------------------------------------

namespace adv_remote {
// Each partition's result depends on the rank that ran it: its keys, its shape, its length.
std::map<std::string, double> keyed_by_rank(const ls::Tensor& x) {
  std::map<std::string, double> m;
  m["r" + std::to_string(ls::world_info().rank)] = static_cast<double>(x.numel());
  return m;
}
ls::Tensor shaped_by_rank(const ls::Tensor& /*x*/) {
  return ls::world_info().rank == 0 ? ls::Tensor::full({2, 3}, 1.0) : ls::Tensor::full({3, 2}, 1.0);
}
std::vector<double> long_by_rank(const ls::Tensor& /*x*/) {
  return std::vector<double>(static_cast<std::size_t>(1 + ls::world_info().rank), 1.0);
}
std::pair<double, bool> with_bool(const ls::Tensor& x) { return {static_cast<double>(x.numel()), true}; }
std::map<std::string, std::int16_t> int_map(const ls::Tensor& x) { return {{"n", static_cast<std::int16_t>(x.numel())}}; }
}  // namespace adv_remote
LOCKSTEP_REMOTE(adv_remote::keyed_by_rank)
LOCKSTEP_REMOTE(adv_remote::shaped_by_rank)
LOCKSTEP_REMOTE(adv_remote::long_by_rank)
LOCKSTEP_REMOTE(adv_remote::with_bool)
LOCKSTEP_REMOTE(adv_remote::int_map)

// Item 3: mean_reducer refuses integer results however they are nested (a bool, an int16 in a map).
TEST_CASE("remote mean_reducer: integer leaves nested in the result are refused with InvalidArgument") {
  ls::MPIBackend& b = backend();
  std::string r1 = "not run", r2 = "not run";
  ls::run_driver(b, [&] {
    ls::Tensor x = ls::Tensor::full({6, 2}, 1.0);
    r1 = expect_throw<ls::InvalidArgument>(
        [&] { (void)ls::remote_sync_call(b, ls::batch_partitioner, ls::mean_reducer, adv_remote::with_bool, x); });
    r2 = expect_throw<ls::InvalidArgument>(
        [&] { (void)ls::remote_sync_call(b, ls::batch_partitioner, ls::mean_reducer, adv_remote::int_map, x); });
  });
  if (b.rank() == 0) {
    INFO(r1 << "\n" << r2);
    CHECK((is_ok(r1) && contains(r1, "integer") && is_ok(r2) && contains(r2, "integer")));
  }
}

// DEFECT (remote calls, the reducers' own "which numbers meet which"): reduce_results
// (remote.hpp) combines the partitions' results with detail::scale_into (data.hpp), which
// compares only the number of tensors, each tensor's element count and dtype (add_scaled,
// parallelize.cpp), and walks the scalars in step without comparing their number or their keys.
// parallelize compares the results' structures across ranks first (describe_result); remote calls
// do not: a map keyed differently per partition is averaged key against key, a [2,3] tensor
// against a [3,2] one, and a longer vector's extra numbers are dropped, all without a word.
TEST_CASE("remote mean/sum_reducer: partition results of other structures are refused", "[!mayfail]") {
  ls::MPIBackend& b = backend();
  std::string r1 = "not run", r2 = "not run", r3 = "not run";
  ls::run_driver(b, [&] {
    ls::Tensor x = ls::Tensor::full({6, 2}, 1.0);
    r1 = outcome([&] {
      auto m = ls::remote_sync_call(b, ls::batch_partitioner, ls::mean_reducer, adv_remote::keyed_by_rank, x);
      std::string keys;
      for (auto& [k, v] : m) keys += k + " ";
      throw std::runtime_error("accepted: keys " + keys);
    });
    r2 = outcome([&] {
      ls::Tensor t = ls::remote_sync_call(b, ls::batch_partitioner, ls::sum_reducer, adv_remote::shaped_by_rank, x);
      throw std::runtime_error("accepted: shape " + ls::to_string(t.shape()));
    });
    r3 = outcome([&] {
      auto v = ls::remote_sync_call(b, ls::batch_partitioner, ls::sum_reducer, adv_remote::long_by_rank, x);
      throw std::runtime_error("accepted: length " + std::to_string(v.size()));
    });
  });
  if (b.rank() == 0) {
    INFO(r1 << "\n" << r2 << "\n" << r3);
    if (b.size() == 1) {
      CHECK((contains(r1, "accepted") && contains(r2, "accepted") && contains(r3, "accepted")));
    } else {
      CHECK((!contains(r1, "accepted") && !contains(r2, "accepted") && !contains(r3, "accepted")));
    }
  }
}
