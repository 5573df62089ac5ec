// Unit tests of the optimizer rules (against values computed by hand from PyTorch's update
// formulas), the shared elementwise math, setup/update, and the traversal (LOCKSTEP_FIELDS,
// built-in containers, paths, flat buffers).
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <optional>
#include <tuple>

#include "lockstep/lockstep.hpp"

namespace ls = lockstep;

namespace {

// PyTorch semantics, p0 = 1 and gradients 0.5, -0.25, 1.0 (the same on every element);
// expected parameters after steps 1..3, from the formulas of torch.optim written out by hand in
// double precision.
const double kGrads[3] = {0.5, -0.25, 1.0};

template <class T, class Rule>
std::vector<double> run_rule(const Rule& rule, std::int64_t numel = 37) {
  ls::Tensor p = ls::Tensor::full({numel}, 1.0, ls::dtype_of_v<T>);
  ls::Tensor g = ls::Tensor::zeros({numel}, ls::dtype_of_v<T>);
  auto st = ls::setup(rule, p);
  std::vector<double> out;
  for (double gv : kGrads) {
    for (auto& x : g.span<T>()) x = static_cast<T>(gv);
    ls::update(st, p, g);
    // Every element must agree (the vectorised body and the scalar tail alike).
    for (auto x : p.span<T>())
      if (x != p.span<T>()[0]) return {};
    out.push_back(static_cast<double>(p.span<T>()[0]));
  }
  return out;
}

template <class Rule>
void check_rule(const Rule& rule, const std::vector<double>& expected) {
  auto d = run_rule<double>(rule);
  auto f = run_rule<float>(rule);
  REQUIRE(d.size() == 3);
  REQUIRE(f.size() == 3);
  for (int i = 0; i < 3; ++i) {
    INFO("step " << i + 1);
    // Hyperparameters are floats (e.g. 0.1f), so even f64 carries their rounding (~1e-8).
    CHECK(d[i] == Approx(expected[i]).epsilon(1e-7));
    CHECK(f[i] == Approx(expected[i]).epsilon(1e-6));
  }
}

}  // namespace

TEST_CASE("SGD follows torch.optim.SGD", "[rules]") {
  SECTION("momentum, dampening, weight decay") {
    check_rule(ls::SGD{.lr = 0.1f, .momentum = 0.9f, .dampening = 0.1f, .weight_decay = 0.01f},
               {0.949, 0.9247459, 0.81208493869});
  }
  SECTION("nesterov") {
    check_rule(ls::SGD{.lr = 0.1f, .momentum = 0.9f, .nesterov = true}, {0.905, 0.912, 0.7058});
  }
  SECTION("plain, weight decay") {
    check_rule(ls::SGD{.lr = 0.1f, .weight_decay = 0.01f}, {0.949, 0.973051, 0.872077949});
  }
}

TEST_CASE("Adam and AdamW follow torch.optim.Adam / AdamW with bias correction", "[rules]") {
  SECTION("Adam") {
    check_rule(ls::Adam{.lr = 0.1f}, {0.900000002, 0.8733662987078463, 0.8075551396770898});
  }
  SECTION("Adam with L2 weight decay") {
    check_rule(ls::Adam{.lr = 0.1f, .weight_decay = 0.1f},
               {0.9000000016666666, 0.8544413674617625, 0.7815043998631659});
  }
  SECTION("AdamW") {
    check_rule(ls::Adam{.lr = 0.1f, .weight_decay = 0.1f, .decoupled_weight_decay = true},
               {0.890000002, 0.8544662986878463, 0.7801104766702113});
    check_rule(ls::AdamW(0.1f, 0.1f), {0.890000002, 0.8544662986878463, 0.7801104766702113});
  }
}

TEST_CASE("span loops equal the per-element functions bitwise", "[rules]") {
  namespace m = ls::math;
  const std::int64_t n = 1001;
  std::vector<float> p(n), g(n), a(n), b(n);
  for (std::int64_t i = 0; i < n; ++i) {
    p[i] = std::sin(0.1f * i);
    g[i] = std::cos(0.37f * i);
    a[i] = 0.01f * (i % 7);
    b[i] = 0.001f * (i % 5);
  }
  for (int step = 1; step <= 3; ++step) {
    auto c = m::adam_coeffs<float>(1e-2, 0.9, 0.999, 1e-8, 0.05, step % 2 == 0, step);
    auto p1 = p, a1 = a, b1 = b, p2 = p, a2 = a, b2 = b;
    m::adam_update(p1.data(), g.data(), a1.data(), b1.data(), n, c);
    for (std::int64_t i = 0; i < n; ++i) m::adam_element(p2[i], g[i], a2[i], b2[i], c);
    CHECK(p1 == p2);
    CHECK(a1 == a2);
    CHECK(b1 == b2);
    auto s = m::sgd_coeffs<float>(0.1, 0.9, 0.1, 0.01, step == 3, step);
    auto q1 = p, q2 = p, m1 = a, m2 = a;
    m::sgd_update(q1.data(), g.data(), m1.data(), n, s);
    for (std::int64_t i = 0; i < n; ++i) m::sgd_element(q2[i], g[i], m2[i], s);
    CHECK(q1 == q2);
    CHECK(m1 == m2);
  }
}

namespace app {
struct Layer {
  ls::Tensor w, b;
  double scale = 1.0;
};
LOCKSTEP_FIELDS(Layer, w, b, scale)
struct Net {
  std::vector<Layer> layers;
  std::map<std::string, ls::Tensor> heads;
  std::optional<ls::Tensor> extra;
  std::tuple<int, float> counters{0, 0.0f};
  std::array<ls::Tensor, 2> pair_of;
  std::pair<ls::Tensor, std::int64_t> tagged;
  ls::Tensor steps = ls::Tensor::zeros({1}, ls::DType::i64);  // not trainable
};
LOCKSTEP_FIELDS(Net, layers, heads, extra, counters, pair_of, tagged, steps)

// A class template made traversable for all its instantiations at once.
template <class T>
struct Pair {
  ls::Tensor w;
  T tag{};
};
template <class T, class V>
void lockstep_visit_fields(Pair<T>& x, V&& v) {
  v("w", x.w);
  v("tag", x.tag);
}
template <class T, class V>
void lockstep_visit_fields(const Pair<T>& x, V&& v) {
  v("w", x.w);
  v("tag", x.tag);
}

Net make_net() {
  Net n;
  n.layers.resize(2);
  n.layers[0].w = ls::Tensor::ones({2, 3});
  n.layers[0].b = ls::Tensor::ones({3});
  n.layers[1].w = ls::Tensor::ones({3, 1}, ls::DType::f64);
  n.layers[1].b = ls::Tensor::ones({1}, ls::DType::f64);
  n.heads["cls"] = ls::Tensor::ones({4});
  n.heads["box"] = ls::Tensor::ones({2});
  n.extra = ls::Tensor::ones({5});
  n.pair_of[0] = ls::Tensor::ones({1});
  n.pair_of[1] = ls::Tensor::ones({2});
  n.tagged.first = ls::Tensor::ones({3});
  return n;
}
}  // namespace app

static_assert(ls::Traversable<app::Net>);
static_assert(ls::Traversable<std::vector<ls::Tensor>>);
static_assert(!ls::Traversable<std::string>);
static_assert(ls::Traversable<app::Pair<int>>);
static_assert(ls::Traversable<app::Pair<double>>);

TEST_CASE("traversal visits every leaf with its path", "[traverse]") {
  app::Net net = app::make_net();
  std::vector<std::string> paths;
  ls::for_each_leaf_with_path(net, [&](const std::string& p, auto&) { paths.push_back(p); });
  const std::vector<std::string> expected = {
      "layers[0].w", "layers[0].b", "layers[0].scale", "layers[1].w", "layers[1].b",
      "layers[1].scale", "heads.box", "heads.cls", "extra", "counters[0]",
      "counters[1]", "pair_of[0]", "pair_of[1]", "tagged[0]", "tagged[1]", "steps"};
  CHECK(paths == expected);
  CHECK(ls::leaf_count(net) == expected.size());
  CHECK(ls::tensor_leaves(net).size() == 11);
  CHECK(ls::trainable_leaves(net).size() == 10);  // the i64 tensor is not trained

  ls::Tensor a = ls::Tensor::ones({2}), b = ls::Tensor::ones({3});
  double s = 2;
  std::vector<std::string> tied;
  ls::for_each_leaf_with_path(std::tie(a, b, s), [&](const std::string& p, auto&) { tied.push_back(p); });
  CHECK(tied == std::vector<std::string>{"[0]", "[1]", "[2]"});

  std::size_t n = 0;
  ls::for_each_leaf(ls::Tensor::ones({1}), [&](auto&) { ++n; });
  CHECK(n == 1);

  app::Pair<double> pr{ls::Tensor::ones({2}), 3.0};
  CHECK(ls::tensor_paths(pr) == std::vector<std::string>{"w"});
  CHECK(ls::leaf_count(pr) == 2);
}

TEST_CASE("zeros_like, clone_tree and flat buffers keep the structure", "[traverse]") {
  app::Net net = app::make_net();
  app::Net z = ls::zeros_like(net);
  CHECK(ls::tensor_paths(z) == ls::tensor_paths(net));
  for (auto* t : ls::tensor_leaves(z))
    for (std::int64_t i = 0; i < t->numel(); ++i)
      CHECK(static_cast<const std::byte*>(t->raw_data())[0] == std::byte{0});
  app::Net c = ls::clone_tree(net);
  auto tn = ls::tensor_leaves(net);
  auto tc = ls::tensor_leaves(c);
  for (std::size_t i = 0; i < tn.size(); ++i) {
    CHECK(ls::bitwise_equal(*tn[i], *tc[i]));
    CHECK(tn[i]->raw_data() != tc[i]->raw_data());
  }

  ls::Flat<app::Net> flat = ls::flat_copy(net);
  CHECK(flat.buffers().size() == 3);  // f32, f64, i64
  auto tf = ls::tensor_leaves(*flat);
  for (std::size_t i = 0; i < tf.size(); ++i) CHECK(ls::bitwise_equal(*tf[i], *tn[i]));
  // Consecutive f32 tensors lie back to back.
  const auto* w0 = static_cast<const std::byte*>(flat->layers[0].w.raw_data());
  CHECK(static_cast<const std::byte*>(flat->layers[0].b.raw_data()) == w0 + flat->layers[0].w.nbytes());
  // Moving the Flat keeps the tensors valid (the allocation does not move).
  ls::Flat<app::Net> moved = std::move(flat);
  CHECK(moved->layers[0].w.raw_data() == w0);
  CHECK(moved->layers[0].w.data<float>()[0] == 1.0f);
  // A Flat is traversed as the structure it holds (same paths), so it can be passed directly.
  CHECK(ls::tensor_paths(moved) == ls::tensor_paths(net));
  auto st = ls::setup(ls::SGD{.lr = 0.5f}, moved);
  auto g = ls::flat_copy(net);
  ls::update(st, moved, g);
  CHECK(moved->layers[0].w.data<float>()[0] == 0.5f);
}

TEST_CASE("setup and update over a model; mismatched gradients are named", "[rules]") {
  app::Net net = app::make_net();
  auto st = ls::setup(ls::Adam{.lr = 0.1f}, net);
  CHECK(st.slots.size() == 10);
  CHECK(st.step == 0);
  app::Net g = ls::zeros_like(net);
  for (auto* t : ls::trainable_leaves(g)) t->copy_from(ls::Tensor::full(t->shape(), 0.5, t->dtype()).view());
  ls::update(st, net, g);
  CHECK(st.step == 1);
  CHECK(net.layers[0].w.data<float>()[0] == Approx(0.9));
  CHECK(net.layers[1].w.data<double>()[0] == Approx(0.9));
  CHECK(net.steps.data<std::int64_t>()[0] == 0);  // untouched

  // Optimizer state is traversable: step, then each slot's moments.
  std::vector<std::string> paths;
  ls::for_each_leaf_with_path(st, [&](const std::string& p, auto&) { paths.push_back(p); });
  CHECK(paths.size() == 21);
  CHECK(paths[0] == "step");
  CHECK(paths[1] == "slots[0].exp_avg");

  // Same numel, transposed shape: still a mismatch.
  app::Net gt = ls::zeros_like(net);
  gt.layers[0].w = ls::Tensor::zeros({3, 2});
  try {
    ls::update(st, net, gt);
    FAIL("no exception");
  } catch (const ls::InvalidArgument& e) {
    CHECK_THAT(e.what(), Catch::Contains("layers[0].w") && Catch::Contains("[3, 2]"));
  }
  g.heads["cls"] = ls::Tensor::zeros({5});
  try {
    ls::update(st, net, g);
    FAIL("no exception");
  } catch (const ls::InvalidArgument& e) {
    CHECK_THAT(e.what(), Catch::Contains("heads.cls"));
  }
  CHECK(st.step == 1);  // nothing applied
  g.heads.erase("cls");
  CHECK_THROWS_AS(ls::update(st, net, g), ls::InvalidArgument);
}

TEST_CASE("f16 parameters are rejected by the CPU rules", "[rules]") {
  ls::Tensor p = ls::Tensor::zeros({3}, ls::DType::f16);
  auto st = ls::setup(ls::SGD{}, p);
  ls::Tensor g = ls::Tensor::zeros({3}, ls::DType::f16);
  CHECK_THROWS_AS(ls::update(st, p, g), ls::InvalidArgument);
}

TEST_CASE("a moved-from OptState has no slots and is refused by update; self-move keeps it", "[rules][move]") {
  app::Net net = app::make_net();
  app::Net g = ls::zeros_like(net);
  auto st = ls::setup(ls::Adam{.lr = 0.1f}, net);
  ls::update(st, net, g);
  REQUIRE(st.step == 1);
  REQUIRE(st.slots.size() == 10);

  auto moved = std::move(st);
  CHECK(moved.step == 1);
  CHECK(moved.slots.size() == 10);
  CHECK(moved.rule.lr == 0.1f);
  CHECK(st.step == 0);
  CHECK(st.slots.empty());
  CHECK(st.rule.lr == 0.1f);  // the hyperparameters stay
  try {
    ls::update(st, net, g);
    FAIL("no exception");
  } catch (const ls::InvalidArgument& e) {
    CHECK_THAT(e.what(), Catch::Contains("0 slots") && Catch::Contains("moved from"));
  }
  CHECK(st.step == 0);  // nothing applied

  // Self-move keeps the slots (a defaulted one emptied them: std::vector's self-move).
  auto& alias = moved;
  moved = std::move(alias);
  CHECK(moved.slots.size() == 10);
  CHECK(moved.step == 1);
  ls::update(moved, net, g);
  CHECK(moved.step == 2);

  // Move-assignment onto a live state; brace initialisation still works.
  auto other = ls::setup(ls::Adam{.lr = 0.5f}, net);
  other = std::move(moved);
  CHECK(other.step == 2);
  CHECK(other.rule.lr == 0.1f);
  CHECK(other.slots.size() == 10);
  CHECK(moved.slots.empty());
  ls::OptState<ls::SGD> braced{ls::SGD{.lr = 2.0f}, 7, {}};
  CHECK(braced.step == 7);
  CHECK(braced.rule.lr == 2.0f);
}

TEST_CASE("parameters, gradients and optimizer state that share memory are refused", "[rules][alias]") {
  // The update loops take restrict pointers: shared memory is undefined behaviour there.
  ls::Tensor p = ls::Tensor::full({8}, 1.0);
  auto sgd = ls::setup(ls::SGD{.lr = 0.5f}, p);
  try {
    ls::update(sgd, p, p);
    FAIL("no exception");
  } catch (const ls::InvalidArgument& e) {
    CHECK_THAT(e.what(), Catch::Contains("shares memory"));
  }
  CHECK(sgd.step == 0);
  CHECK(p.data<float>()[0] == 1.0f);

  // A partial overlap through borrowed views, given to the rule directly.
  ls::Tensor base = ls::Tensor::full({9}, 1.0);
  ls::Tensor param = ls::Tensor::borrow(base.data<float>(), {8}, ls::DType::f32);
  ls::Tensor grad = ls::Tensor::borrow(base.data<float>() + 1, {8}, ls::DType::f32);
  ls::SGD::Slot none{};
  CHECK_THROWS_WITH(ls::SGD{}.apply(none, param, grad, 1), Catch::Contains("overlap"));
  ls::SGD momentum{.momentum = 0.9f};
  ls::Tensor g = ls::Tensor::full({8}, 1.0);
  ls::SGD::Slot shared{param.reshape_view({8})};
  CHECK_THROWS_WITH(momentum.apply(shared, param, g, 1), Catch::Contains("momentum buffer"));

  ls::Adam adam;
  ls::Adam::Slot moments = adam.init(param);
  moments.exp_avg_sq = moments.exp_avg.reshape_view({8});
  CHECK_THROWS_WITH(adam.apply(moments, param, g, 1), Catch::Contains("exp_avg_sq"));
  ls::Adam::Slot ok = adam.init(param);
  adam.apply(ok, param, g, 1);  // disjoint buffers: fine
  CHECK(param.data<float>()[0] < 1.0f);
}
