// synchronize (MPI, 1 to 4 ranks): from every root, on nested structures (separate and flat
// allocations, mixed layouts across ranks), tuples of references and optimizer state; bitwise
// equality with root afterwards. Mismatched structures throw MismatchError on every rank,
// naming the leaf.
#include <catch2/catch.hpp>

#include <array>
#include <map>
#include <optional>
#include <tuple>

#include "training_common.hpp"

using namespace lstest;

namespace sync_test {

struct Inner {
  ls::Tensor a;
  std::vector<ls::Tensor> list;
  int count = 0;
};
LOCKSTEP_FIELDS(Inner, a, list, count)

struct Outer {
  Inner inner;
  std::map<std::string, Inner> named;
  std::optional<ls::Tensor> maybe;
  std::tuple<double, std::int64_t, bool, float> scalars{0.0, 0, false, 0.0f};
  std::array<ls::Tensor, 2> arr;
  ls::Tensor big;    // 256 KiB: broadcast in place when flat
  ls::Tensor ints;   // i64
  ls::Tensor halfs;  // f16
};
LOCKSTEP_FIELDS(Outer, inner, named, maybe, scalars, arr, big, ints, halfs)

// Rank-dependent contents, identical structure.
void fill(ls::Tensor& t, int who, std::uint64_t leaf) {
  auto* bytes = static_cast<unsigned char*>(t.raw_data());
  for (std::size_t i = 0; i < t.nbytes(); ++i)
    bytes[i] = static_cast<unsigned char>(noise(static_cast<std::uint64_t>(who) + 1, leaf, i) * 127 + 128);
}

Inner make_inner(int who, std::uint64_t base, int list_len = 3) {
  Inner in;
  in.a = ls::Tensor::zeros({4, 5});
  fill(in.a, who, base);
  for (int i = 0; i < list_len; ++i) {
    in.list.push_back(ls::Tensor::zeros({i + 1}, ls::DType::f64));
    fill(in.list.back(), who, base + 1 + static_cast<std::uint64_t>(i));
  }
  in.count = 1000 * who + static_cast<int>(base);
  return in;
}

Outer make_outer(int who) {
  Outer o;
  o.inner = make_inner(who, 10);
  o.named["x"] = make_inner(who, 20);
  o.named["y"] = make_inner(who, 30, 1);
  o.maybe = ls::Tensor::zeros({7});
  fill(*o.maybe, who, 40);
  o.scalars = {0.5 + who, -3 * who, who % 2 == 1, 0.25f * who};
  o.arr[0] = ls::Tensor::zeros({2, 2});
  o.arr[1] = ls::Tensor::zeros({0});
  fill(o.arr[0], who, 50);
  o.big = ls::Tensor::zeros({65536});
  fill(o.big, who, 60);
  o.ints = ls::Tensor::zeros({9}, ls::DType::i64);
  fill(o.ints, who, 70);
  o.halfs = ls::Tensor::zeros({11}, ls::DType::f16);
  fill(o.halfs, who, 80);
  return o;
}

}  // namespace sync_test

using namespace sync_test;

TEST_CASE("synchronize makes nested structures bitwise equal to root's, from every root", "[synchronize]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = b.rank(), n = b.size();
  bool ok = true;
  std::string why;
  for (int root = 0; root < n; ++root) {
    const auto expected = content_hash(make_outer(root));
    // Separate allocations.
    Outer x = make_outer(rank);
    ls::synchronize(b, x, root);
    if (content_hash(x) != expected) ok = false, why = "separate, root " + std::to_string(root);
    // Flat allocations on every rank (the big run goes in place).
    auto fx = ls::flat_copy(make_outer(rank));
    ls::synchronize(b, *fx, root);
    if (content_hash(*fx) != expected) ok = false, why = "flat, root " + std::to_string(root);
    // Flat on some ranks only: the ranks disagree on the layout and fall back to packing.
    if (rank % 2 == 0) {
      auto mx = ls::flat_copy(make_outer(rank));
      ls::synchronize(b, *mx, root);
      if (content_hash(*mx) != expected) ok = false, why = "mixed flat, root " + std::to_string(root);
    } else {
      Outer mx = make_outer(rank);
      ls::synchronize(b, mx, root);
      if (content_hash(mx) != expected) ok = false, why = "mixed separate, root " + std::to_string(root);
    }
    // A tuple of references, and a lone scalar.
    ls::Tensor t = ls::Tensor::full({3}, rank);
    double d = rank + 0.5;
    ls::synchronize(b, std::tie(t, d), root);
    if (t.data<float>()[2] != static_cast<float>(root) || d != root + 0.5) ok = false, why = "tie";
  }
  INFO(why);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("synchronize copies optimizer state from every root", "[synchronize]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = b.rank(), n = b.size();
  // A rank's state after `who + 1` steps with rank-dependent gradients: a deterministic
  // function of who, so the expected state of root is computed locally.
  auto make_state = [](int who, Mlp& model) {
    model = make_mlp(static_cast<std::uint64_t>(who));
    auto st = ls::setup(ls::Adam{.lr = 0.01f}, model);
    Mlp g = ls::zeros_like(model);
    for (int s = 0; s <= who; ++s) {
      zero_grads(g);
      backward(model, make_batch(s + who, 4), 0, 4, g, 0.25);
      ls::update(st, model, g);
    }
    return st;
  };
  bool ok = true;
  for (int root = 0; root < n; ++root) {
    Mlp m, mr;
    auto st = make_state(rank, m);
    const auto expected_state = content_hash(make_state(root, mr));
    ls::synchronize(b, std::tie(m, st), root);
    ok = ok && content_hash(st) == expected_state && content_hash(m) == content_hash(mr) &&
         st.step == root + 1;
    // A DistributedOptimizer's state is traversed the same way.
    auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 0.1f, .momentum = 0.9f});
    auto ds = ls::setup(opt, m);
    ds.inner.step = rank;
    ds.inner.slots[0].momentum_buffer.copy_from(ls::Tensor::full({kIn, kHidden}, rank).view());
    ls::synchronize(b, ds, root);
    ok = ok && ds.inner.step == root && ds.inner.slots[0].momentum_buffer.data<float>()[3] == root;
  }
  CHECK(all_ranks(b, ok));
}

namespace {
// Runs synchronize, expecting MismatchError naming `needle`; true if so.
template <class X>
bool throws_mismatch(ls::Backend& b, X& x, int root, const std::string& needle, std::string& msg) {
  try {
    ls::synchronize(b, x, root);
  } catch (const ls::MismatchError& e) {
    msg = e.what();
    return msg.find(needle) != std::string::npos;
  } catch (const std::exception& e) {
    msg = std::string("wrong exception: ") + e.what();
    return false;
  }
  msg = "no exception";
  return false;
}
}  // namespace

TEST_CASE("mismatched structures throw MismatchError on every rank, naming the leaf", "[synchronize]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = b.rank(), n = b.size();
  if (n < 2) {
    SUCCEED("needs two ranks");
    return;
  }
  const int last = n - 1;
  std::string msg;
  bool ok = true;
  std::string why;
  auto expect = [&](bool r, const char* what) {
    if (!r) ok = false, why = std::string(what) + ": " + msg;
  };
  {  // a vector one longer on the last rank
    Outer x = make_outer(rank);
    if (rank == last) x.inner.list.push_back(ls::Tensor::zeros({1}, ls::DType::f64));
    expect(throws_mismatch(b, x, 0, "inner.list", msg), "vector length");
  }
  {  // a shape differs on rank 1, root is the last rank
    Outer x = make_outer(rank);
    if (rank == 1) x.inner.a = ls::Tensor::zeros({5, 4});
    expect(throws_mismatch(b, x, last, "inner.a", msg), "shape");
    expect(msg.find("[5, 4]") != std::string::npos, "shape in message");
  }
  {  // a dtype differs
    Outer x = make_outer(rank);
    if (rank == last) x.big = ls::Tensor::zeros({65536}, ls::DType::i32);
    expect(throws_mismatch(b, x, 0, "big", msg), "dtype");
  }
  {  // a map key differs
    Outer x = make_outer(rank);
    if (rank == last) {
      x.named["z"] = std::move(x.named["y"]);
      x.named.erase("y");
    }
    expect(throws_mismatch(b, x, 0, "named", msg), "map key");
  }
  {  // an optional is empty on root only
    Outer x = make_outer(rank);
    if (rank == 0) x.maybe.reset();
    expect(throws_mismatch(b, x, 0, "maybe", msg), "optional");
  }
  {  // different models for a DistributedOptimizer
    Mlp m = make_mlp(1);
    if (rank == last) m.b2 = ls::Tensor::zeros({kOut + 1});
    auto opt = ls::DistributedOptimizer(b, ls::Adam{});
    try {
      auto st = ls::setup(opt, m);
      expect(false, "DistributedOptimizer setup did not throw");
    } catch (const ls::MismatchError& e) {
      msg = e.what();
      expect(msg.find("b2") != std::string::npos, "DistributedOptimizer setup message");
    }
  }
  {  // the same model, but the last rank skips non-finite steps and the others do not
    Mlp m = make_mlp(1);
    ls::DistributedOptions o;
    o.skip_non_finite = rank == last;
    auto opt = ls::DistributedOptimizer(b, ls::Adam{}, o);
    try {
      auto st = ls::setup(opt, m);
      expect(false, "DistributedOptimizer setup with different options did not throw");
    } catch (const ls::MismatchError& e) {
      msg = e.what();
      expect(msg.find("skip_non_finite") != std::string::npos, "DistributedOptimizer options message");
    }
  }
  // The ranks are still in step: a collective after all that completes.
  INFO(why);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("an invalid root is rejected on every rank before communicating", "[synchronize]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  ls::Tensor t = ls::Tensor::zeros({2});
  CHECK_THROWS_AS(ls::synchronize(b, t, b.size()), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::synchronize(b, t, -1), ls::InvalidArgument);
  CHECK(all_ranks(b, true));
}

TEST_CASE("synchronize moves the data in few large broadcasts", "[synchronize]") {
  auto& mpi = ls::get_distributed_backend<ls::MPIBackend>();
  CountingBackend b(mpi);
  // 40 small tensors in separate allocations and 40 scalars: one structure allgather and one
  // packed broadcast.
  std::vector<std::tuple<ls::Tensor, double>> many;
  for (int i = 0; i < 40; ++i) many.emplace_back(ls::Tensor::full({i + 1}, mpi.rank()), mpi.rank());
  ls::synchronize(b, many, 0);
  bool ok = b.allgathers == 1 && b.broadcasts == 1 && b.allreduces == 0 && b.other == 0;
  for (auto& [t, d] : many) ok = ok && t.data<float>()[0] == 0.0f && d == 0.0;
  // A flat model: its 256 KiB run goes in place, the rest in the packed buffer.
  auto flat = ls::flat_copy(make_outer(mpi.rank()));
  b.reset();
  ls::synchronize(b, flat, 0);
  ok = ok && b.allgathers == 1 && b.broadcasts == 2 && content_hash(*flat) == content_hash(make_outer(0));
  CHECK(all_ranks(mpi, ok));
}

TEST_CASE("a tensor moved from on one rank is a MismatchError on every rank, not a wrong broadcast",
          "[synchronize][move]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = b.rank(), n = b.size();
  if (n < 2) {
    SUCCEED("needs two ranks");
    return;
  }
  // A moved-from tensor is empty (shape [0]), so the structure check sees it on every rank.
  Outer x = make_outer(rank);
  ls::Tensor taken;
  if (rank == n - 1) taken = std::move(x.inner.a);
  std::string msg;
  const bool ok = throws_mismatch(b, x, 0, "inner.a", msg);
  INFO(msg);
  CHECK(all_ranks(b, ok));
  if (rank == n - 1) CHECK(msg.find("[0]") != std::string::npos);
}

namespace {
struct Metrics {
  double loss = 0;
  std::int64_t correct = 0;
  float lr = 0;
  int seen = 0;
  ls::Tensor hist = ls::Tensor::zeros({3});
};
LOCKSTEP_FIELDS(Metrics, loss, correct, lr, seen, hist)

template <class T, int N>
struct Pair {
  T a;
  std::array<T, N> b;
};
LOCKSTEP_TEMPLATE_FIELDS((class T, int N), (Pair<T, N>), a, b)
static_assert(ls::Traversable<Pair<double, 2>>);
}  // namespace

TEST_CASE("allreduce of scalars and small structs (metrics); LOCKSTEP_TEMPLATE_FIELDS", "[synchronize][metrics]") {
  auto& backend = ls::get_distributed_backend<ls::MPIBackend>();
  const int r = backend.rank(), n = backend.size();
  CHECK(ls::allreduce(backend, 1.5, ls::ReduceOp::sum) == Approx(1.5 * n));
  CHECK(ls::allreduce(backend, static_cast<float>(r), ls::ReduceOp::max) == static_cast<float>(n - 1));
  CHECK(ls::allreduce(backend, std::int64_t{r}, ls::ReduceOp::sum) == std::int64_t{n} * (n - 1) / 2);
  CHECK(ls::allreduce(backend, static_cast<short>(2), ls::ReduceOp::sum) == 2 * n);
  CHECK(ls::allreduce(backend, r == 0, ls::ReduceOp::max) == true);
  CHECK(ls::allreduce(backend, 2.0 * r, ls::ReduceOp::avg) == Approx(n - 1.0));
  Metrics m;
  m.loss = 0.5 * r;
  m.correct = r + 1;
  m.lr = 0.25f;
  m.seen = 10;
  m.hist.data<float>()[1] = 1.0f;
  ls::allreduce(backend, m, ls::ReduceOp::sum);
  CHECK(m.loss == Approx(0.25 * n * (n - 1)));
  CHECK(m.correct == std::int64_t{n} * (n + 1) / 2);
  CHECK(m.lr == Approx(0.25f * n));
  CHECK(m.seen == 10 * n);
  CHECK(m.hist.data<float>()[1] == static_cast<float>(n));
  // A class template's fields, through LOCKSTEP_TEMPLATE_FIELDS.
  Pair<double, 2> p{1.0, {2.0, static_cast<double>(r)}};
  ls::allreduce(backend, p, ls::ReduceOp::sum);
  CHECK(p.a == Approx(n));
  CHECK(p.b[1] == Approx(n * (n - 1) / 2.0));
  std::vector<std::string> paths;
  ls::for_each_leaf_with_path(p, [&](const std::string& path, auto&) { paths.push_back(path); });
  CHECK(paths == std::vector<std::string>{"a", "b[0]", "b[1]"});
}
