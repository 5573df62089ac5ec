// Remote calls (remote.hpp) under mpiexec at 1 to 4 ranks: serialization, dispatch, futures,
// partitioners and reducers, run_driver, errors and timeouts, background serving, many calls
// and a large tensor. Checks inside the driver's function run on rank 0 only; every rank
// checks what run_driver returns or throws locally (no REQUIRE between collectives).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "remote/remote_test_support.hpp"
#include "test_support.hpp"

namespace ls = lockstep;

namespace rt {
struct Model {
  ls::Tensor w;
  std::vector<double> b;
  std::string name;
  std::map<std::string, std::int32_t> counts;
  std::optional<float> scale;
  std::vector<std::vector<std::uint8_t>> nested;
  std::pair<bool, std::int64_t> flag;
};
LOCKSTEP_FIELDS(Model, w, b, name, counts, scale, nested, flag)

// The model back, changed in every field so that a copy cannot pass by accident.
Model transform(const Model& m, int k) {
  Model out;
  out.w = m.w.clone();
  for (auto& x : out.w.span<float>()) x = x * static_cast<float>(k);
  out.b = m.b;
  for (auto& x : out.b) x += k;
  out.name = m.name + "@" + std::to_string(ls::world_info().rank);
  out.counts = m.counts;
  out.counts["k"] = k;
  out.scale = m.scale ? std::optional<float>(*m.scale * 2) : std::nullopt;
  out.nested = m.nested;
  out.nested.push_back({static_cast<std::uint8_t>(k)});
  out.flag = {!m.flag.first, m.flag.second + k};
  return out;
}
}  // namespace rt
LOCKSTEP_REMOTE(rt::transform)

namespace {

using namespace remote_test;


int add(int a, int b) { return a + b; }
int whoami() { return me(); }
void nothing() {}
double fail_with(int code) { throw std::runtime_error("boom " + std::to_string(code)); }
double sleeper(double s) {
  std::this_thread::sleep_for(std::chrono::duration<double>(s));
  return s;
}
double sum_of(const ls::Tensor& t) {
  double s = 0;
  for (float x : t.span<float>()) s += x;
  return s;
}
ls::Tensor scaled(const ls::Tensor& t, float k) {
  ls::Tensor out = t.clone();
  for (auto& x : out.span<float>()) x *= k;
  return out;
}
std::atomic<long> g_calls{0};
long tick(long i) {
  g_calls.fetch_add(1);
  return i * 3 + me();
}
long calls_so_far() { return g_calls.load(); }
void reset_calls() { g_calls = 0; }
// Mean of the elements of a partition (mean_reducer weights it by the partition's rows).
double mean_of(const ls::Tensor& x) { return sum_of(x) / static_cast<double>(x.numel()); }
// Column sums of a [rows, cols] partition.
ls::Tensor column_sums(const ls::Tensor& x) {
  const auto rows = x.dim(0), cols = x.dim(1);
  auto out = ls::Tensor::zeros({cols});
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) out.data<float>()[c] += x.data<float>()[r * cols + c];
  return out;
}
// The row count of a partition, as an i32 tensor (mean_reducer must refuse it, as parallelize does).
ls::Tensor row_count_i32(const ls::Tensor& x) { return ls::Tensor::full({1}, static_cast<double>(x.dim(0)), ls::DType::i32); }
// Number of elements (dim_partitioner(1) splits columns); plus the offset it was given.
std::int64_t count_plus(const ls::Tensor& x, std::int64_t offset) { return x.numel() + offset; }

// A remote function that itself calls rank 0 (the driver, which is waiting and so serves it).
int nested(int x) { return ls::remote_sync_call(ls::get_distributed_backend<ls::MPIBackend>(), 0, add, x, 1000); }

// The tensor back, as received (no copy): its memory is the buffer it arrived in.
ls::Tensor echo_t(ls::Tensor t) { return t; }
// The same, with the reply's tensor messages sent `delay` seconds after its header (a test hook
// of the engine): late data, for the receiving rank to give up on.
ls::Tensor late_echo(ls::Tensor t, double delay) {
  ls::detail::remote::delay_reply_tensors_for_test(delay);
  return t;
}
LOCKSTEP_REMOTE(late_echo)
// echo_t, noting on this rank where the argument arrived; landings() hands the notes over.
std::mutex g_landed_mu;
std::vector<std::uint64_t> g_landed;
ls::Tensor echo_noting(ls::Tensor t) {
  std::lock_guard lk(g_landed_mu);
  g_landed.push_back(reinterpret_cast<std::uintptr_t>(t.raw_data()));
  return t;
}
std::vector<std::uint64_t> landings() {
  std::lock_guard lk(g_landed_mu);
  return std::exchange(g_landed, {});
}
LOCKSTEP_REMOTE(echo_noting)
LOCKSTEP_REMOTE(landings)
// Calls noting their order of arrival on this rank: one with a large tensor, one without.
std::vector<int> g_order;
int note_with_tensor(const ls::Tensor& t, int i) {
  std::lock_guard lk(g_landed_mu);
  g_order.push_back(i);
  return static_cast<int>(t.numel() > 0);
}
void note_plain(int i) {
  std::lock_guard lk(g_landed_mu);
  g_order.push_back(i);
}
std::vector<int> order_seen() {
  std::lock_guard lk(g_landed_mu);
  return std::exchange(g_order, {});
}
LOCKSTEP_REMOTE(note_with_tensor)
LOCKSTEP_REMOTE(note_plain)
LOCKSTEP_REMOTE(order_seen)

LOCKSTEP_REMOTE(add)
LOCKSTEP_REMOTE(row_count_i32)
LOCKSTEP_REMOTE(echo_t)
LOCKSTEP_REMOTE(nested)
LOCKSTEP_REMOTE(whoami)
LOCKSTEP_REMOTE(nothing)
LOCKSTEP_REMOTE(fail_with)
LOCKSTEP_REMOTE(sleeper)
LOCKSTEP_REMOTE(sum_of)
LOCKSTEP_REMOTE(scaled)
LOCKSTEP_REMOTE(tick)
LOCKSTEP_REMOTE(calls_so_far)
LOCKSTEP_REMOTE(reset_calls)
LOCKSTEP_REMOTE(mean_of)
LOCKSTEP_REMOTE(column_sums)
LOCKSTEP_REMOTE(count_plus)

int not_registered(int x) { return x; }

ls::Tensor iota(std::int64_t rows, std::int64_t cols) {
  auto t = ls::Tensor::zeros({rows, cols});
  for (std::int64_t i = 0; i < rows * cols; ++i) t.data<float>()[i] = static_cast<float>(i % 97) * 0.5f;
  return t;
}

}  // namespace

TEST_CASE("remote: arguments and results of every supported kind round-trip to every rank") {
  auto& b = backend();
  ls::run_driver(b, [&] {
    rt::Model m;
    m.w = ls::Tensor::from(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
    m.b = {0.5, -1.5};
    m.name = "net";
    m.counts = {{"a", 1}, {"b", 2}};
    m.scale = 1.25f;
    m.nested = {{1, 2}, {}};
    m.flag = {true, 40};
    for (int r = 0; r < world(); ++r) {
      rt::Model out = ls::remote_sync_call(b, r, rt::transform, m, 3);
      CHECK(out.w.shape() == ls::Shape{2, 3});
      CHECK(out.w.data<float>()[5] == 18.0f);
      CHECK(out.b == std::vector<double>{3.5, 1.5});
      CHECK(out.name == "net@" + std::to_string(r));
      CHECK(out.counts.at("k") == 3);
      CHECK(out.counts.at("b") == 2);
      CHECK(out.scale == std::optional<float>(2.5f));
      CHECK(out.nested.size() == 3);
      CHECK(out.nested[2] == std::vector<std::uint8_t>{3});
      CHECK(out.flag == std::pair<bool, std::int64_t>{false, 43});
      CHECK(ls::remote_sync_call(b, r, whoami) == r);
      CHECK(ls::remote_sync_call(b, r, add, 2, 40) == 42);
      ls::remote_sync_call(b, r, nothing);  // a void function: ls::Done
    }
    m.scale.reset();
    CHECK_FALSE(ls::remote_sync_call(b, world() - 1, rt::transform, m, 1).scale.has_value());
  });
}

TEST_CASE("remote: futures (ready, then, wait_all), calls to self and empty futures") {
  auto& b = backend();
  ls::run_driver(b, [&] {
    std::vector<ls::Future<int>> fs;
    for (int r = 0; r < world(); ++r) fs.push_back(ls::remote_async_call(b, r, add, r, 100));
    auto results = ls::wait_all(fs);
    for (int r = 0; r < world(); ++r) CHECK(results[r] == r + 100);
    for (auto& f : fs) CHECK_FALSE(f.valid());

    auto chained = ls::remote_async_call(b, 0, add, 1, 2).then([](int x) { return std::to_string(x * 2); });
    CHECK(chained.wait() == "6");
    auto f = ls::remote_async_call(b, world() - 1, whoami);
    ls::Future<int> g = std::move(f);
    CHECK_FALSE(f.valid());
    CHECK_THROWS_AS(f.wait(), ls::InvalidArgument);
    const auto t0 = std::chrono::steady_clock::now();
    while (!g.ready() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20)) {
      if (world() == 1) break;  // a call to self runs when this rank waits
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    CHECK(g.wait() == world() - 1);
    // An error passes through then() without calling the continuation.
    bool called = false;
    auto bad = ls::remote_async_call(b, 0, fail_with, 1).then([&](double) { called = true; });
    CHECK_THROWS_AS(bad.wait(), ls::RemoteError);
    CHECK_FALSE(called);
  });
}

TEST_CASE("remote: errors at the caller") {
  auto& b = backend();
  ls::run_driver(b, [&] {
    for (int r = 0; r < world(); ++r) {
      try {
        ls::remote_sync_call(b, r, fail_with, 7);
        FAIL("no RemoteError");
      } catch (const ls::RemoteError& e) {
        CHECK(e.rank() == r);
        CHECK(e.function() == "fail_with");
        CHECK(e.message() == "boom 7");
        CHECK_THAT(e.what(), Catch::Contains("rank " + std::to_string(r)));
      }
    }
    // A rank outside the world, and a function this rank did not register.
    CHECK_THROWS_WITH(ls::remote_sync_call(b, world(), add, 1, 2), Catch::Contains("outside the world"));
    CHECK_THROWS_AS(ls::remote_sync_call(b, -1, add, 1, 2), ls::InvalidArgument);
    CHECK_THROWS_WITH(ls::remote_sync_call(b, 0, not_registered, 1), Catch::Contains("LOCKSTEP_REMOTE"));

    namespace rd = ls::detail::remote;
    auto raw = [&](int rank, rd::FnInfo info, rd::Encoder args) {
      return ls::Future<int>(std::make_unique<rd::CallState<int>>(rd::start_call(b, rank, info, std::move(args), {})));
    };
    auto add_info = *rd::find_fn(reinterpret_cast<const void*>(&add));
    for (int r = 0; r < world(); ++r) {
      // What a rank built from other code sees: a name it does not know, another signature.
      auto unknown = add_info;
      unknown.name = "no_such_function";
      CHECK_THROWS_WITH(raw(r, unknown, rd::encode_args<int (*)(int, int)>(1, 2)).wait(),
                        Catch::Contains("'no_such_function' is not registered on rank " + std::to_string(r)));
      auto other = add_info;
      other.sig = "another signature";
      CHECK_THROWS_WITH(raw(r, other, rd::encode_args<int (*)(int, int)>(1, 2)).wait(),
                        Catch::Contains("another signature"));
      // Arguments that do not decode: a string where an int is expected, and one argument short.
      CHECK_THROWS_WITH(raw(r, add_info, rd::encode_args<int (*)(std::string, int)>(std::string("x"), 2)).wait(),
                        Catch::Contains("do not decode"));
      CHECK_THROWS_WITH(raw(r, add_info, rd::encode_args<int (*)(int)>(1)).wait(), Catch::Contains("do not decode"));
    }
    // Still serving after all of that.
    CHECK(ls::remote_sync_call(b, world() - 1, add, 20, 22) == 42);
  });
  // Outside a session.
  CHECK_THROWS_WITH(ls::remote_sync_call(b, 0, add, 1, 2), Catch::Contains("RemoteSession"));
}

TEST_CASE("remote: a function unregistered on the called rank is a RemoteError") {
  auto& b = backend();
  const int target = world() - 1;
  // The target forgets sum_of; everyone else keeps it.
  if (me() == target) ls::unregister_remote("sum_of");
  std::string what;
  ls::run_driver(b, [&] {
    if (me() == target) return;  // at 1 rank the driver itself forgot it: nothing to call
    try {
      ls::remote_sync_call(b, target, sum_of, ls::Tensor::ones({3}));
    } catch (const ls::RemoteError& e) {
      what = e.what();
    }
    CHECK_THAT(what, Catch::Contains("not registered on rank " + std::to_string(target)));
  });
  if (me() == target) ls::register_remote("sum_of", &sum_of);
}

TEST_CASE("remote: per-call timeout is a TimeoutError naming the rank; background serving") {
  auto& b = backend();
  ls::RemoteSession session(b, ls::RemoteOptions{.background = true, .timeout = 60});
  const int target = world() - 1;
  ls::run_driver(b, [&] {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      ls::remote_sync_call(b, ls::CallOptions{.timeout = 0.3}, target, sleeper, 1.5);
      FAIL("no TimeoutError");
    } catch (const ls::TimeoutError& e) {
      CHECK_THAT(e.what(), Catch::Contains("on rank " + std::to_string(target)));
      CHECK_THAT(e.what(), Catch::Contains("sleeper"));
    }
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));
    // The late reply is dropped; the next call on that rank gets its own result.
    CHECK(ls::remote_sync_call(b, target, add, 1, 1) == 2);
  });
  // Background: a rank busy in its own code (not serving, not waiting) still answers.
  double waited = 0;
  if (me() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(ls::remote_sync_call(b, target, add, 3, 4) == 7);
    waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (me() == target && me() != 0) std::this_thread::sleep_for(std::chrono::seconds(2));  // "computing"
  if (me() == 0 && target != 0) CHECK(waited < 1.5);
  session.close();
}

TEST_CASE("remote: 10k small concurrent calls, nothing lost or duplicated") {
  auto& b = backend();
  ls::run_driver(b, [&] {
    for (int r = 0; r < world(); ++r) ls::remote_sync_call(b, r, reset_calls);
    constexpr long kCalls = 10000;
    std::vector<ls::Future<long>> fs;
    fs.reserve(kCalls);
    for (long i = 0; i < kCalls; ++i) fs.push_back(ls::remote_async_call(b, static_cast<int>(i % world()), tick, i));
    auto rs = ls::wait_all(fs);
    long bad = 0;
    for (long i = 0; i < kCalls; ++i)
      if (rs[i] != i * 3 + i % world()) ++bad;
    CHECK(bad == 0);
    long total = 0;
    for (int r = 0; r < world(); ++r) {
      const long n = ls::remote_sync_call(b, r, calls_so_far);
      CHECK(n == kCalls / world() + (r < kCalls % world() ? 1 : 0));
      total += n;
    }
    CHECK(total == kCalls);
  });
}

TEST_CASE("remote: a 100 MiB tensor there and back") {
  auto& b = backend();
  ls::run_driver(b, [&] {
    const std::int64_t n = 100LL * 1024 * 1024 / 4;
    auto t = ls::Tensor({n});
    for (std::int64_t i = 0; i < n; ++i) t.data<float>()[i] = static_cast<float>(i % 1000);
    const int target = world() - 1;
    auto fs = ls::remote_async_call(b, target, sum_of, t);
    auto back = ls::remote_sync_call(b, target, scaled, t, 2.0f);
    double expect = 0;
    for (std::int64_t i = 0; i < 1000; ++i) expect += static_cast<double>(i);
    expect *= static_cast<double>(n / 1000);
    for (std::int64_t i = n / 1000 * 1000; i < n; ++i) expect += static_cast<double>(i % 1000);
    CHECK(fs.wait() == Approx(expect).epsilon(1e-9));
    REQUIRE(back.numel() == n);
    long bad = 0;
    for (std::int64_t i = 0; i < n; ++i)
      if (back.data<float>()[i] != 2.0f * static_cast<float>(i % 1000)) ++bad;
    CHECK(bad == 0);
  });
}

TEST_CASE("remote: concurrent 100 MiB calls to every rank, each result its own") {
  auto& b = backend();
  ls::run_driver(b, [&] {
    const std::int64_t n = 100LL * 1024 * 1024 / 4;
    auto t = ls::Tensor({n});
    for (std::int64_t i = 0; i < n; ++i) t.data<float>()[i] = static_cast<float>(i % 1000);
    std::vector<ls::Future<ls::Tensor>> fs;
    for (int r = 0; r < world(); ++r) fs.push_back(ls::remote_async_call(b, r, scaled, t, static_cast<float>(r + 1)));
    auto rs = ls::wait_all(fs);
    for (int r = 0; r < world(); ++r) {
      REQUIRE(rs[r].numel() == n);
      long bad = 0;
      for (std::int64_t i = 0; i < n; ++i)
        if (rs[r].data<float>()[i] != static_cast<float>(r + 1) * static_cast<float>(i % 1000)) ++bad;
      CHECK(bad == 0);
      for (int q = 0; q < r; ++q) CHECK_FALSE(ls::memory_overlaps(rs[r], rs[q]));
    }
  });
}

TEST_CASE("Tensor::adopt: the owner's deleter runs when the last tensor over the memory goes") {
  int released = 0;
  std::vector<float> mem(16, 2.0f);
  {
    std::shared_ptr<void> owner(mem.data(), [&](void*) { ++released; });
    ls::Tensor t = ls::Tensor::adopt(mem.data(), std::move(owner), {4, 4}, ls::DType::f32);
    CHECK(t.owns_memory());
    CHECK(t.raw_data() == mem.data());
    ls::Tensor v = t.slice_view(4, {4});
    t = ls::Tensor();
    CHECK(released == 0);  // the view still holds it
    CHECK(v.data<float>()[3] == 2.0f);
  }
  CHECK(released == 1);
  CHECK_THROWS_AS(ls::Tensor::adopt(nullptr, nullptr, {4}, ls::DType::f32), ls::InvalidArgument);
}

TEST_CASE("remote: a host tensor argument is sent from its own memory") {
  namespace rd = ls::detail::remote;
  auto t = ls::Tensor::ones({1024});
  rd::Encoder e = rd::encode_args<double (*)(const ls::Tensor&)>(t);
  REQUIRE(e.tensors().size() == 1);
  CHECK(e.tensors()[0].raw_data() == t.raw_data());  // referenced, not copied
  CHECK(e.bytes().size() < 256);                      // the data is not in the header message
}

TEST_CASE("remote: received tensors reuse the session's buffers, never one still held") {
  auto& b = backend();
  const std::size_t limit = std::size_t{5} << 20;
  ls::RemoteSession session(b, ls::RemoteOptions{.timeout = 120, .receive_cache_bytes = limit});
  ls::run_driver(b, [&] {
    const int target = world() - 1;
    const std::int64_t n = 1 << 18;  // 1 MiB of f32: over the cache's lower bound (64 KiB)
    // Results held at once: each is its own memory with its own contents.
    std::vector<ls::Tensor> held;
    for (int i = 0; i < 4; ++i) held.push_back(ls::remote_sync_call(b, target, echo_t, ls::Tensor::full({n}, i + 1.0)));
    for (int i = 0; i < 4; ++i) {
      CHECK(held[i].owns_memory());
      for (int j = 0; j < i; ++j) CHECK_FALSE(ls::memory_overlaps(held[i], held[j]));
    }
    // A view keeps its buffer held as well: released tensors make room, the view's memory is
    // not handed out again.
    ls::Tensor view = held[0].slice_view(n - 100, {100});
    held.clear();
    std::vector<ls::Tensor> more;
    for (int i = 0; i < 4; ++i) {
      more.push_back(ls::remote_sync_call(b, target, echo_t, ls::Tensor::full({n}, 10.0 + i)));
      CHECK_FALSE(ls::memory_overlaps(more.back(), view));
    }
    long bad = 0;
    for (float x : view.span<float>()) bad += x != 1.0f;
    for (int i = 0; i < 4; ++i)
      for (float x : more[i].span<float>()) bad += x != 10.0f + static_cast<float>(i);
    CHECK(bad == 0);
    more.clear();
    view = ls::Tensor();
    // Released buffers are used again (after the first call of this loop, every reply on this
    // rank lands in one), and what is kept stays within the limit.
    const auto before = ls::detail::remote::receive_cache_stats(b);
    for (int i = 0; i < 20; ++i) {
      auto r = ls::remote_sync_call(b, target, echo_t, ls::Tensor::full({n}, 100.0 + i));
      CHECK(r.data<float>()[0] == 100.0f + static_cast<float>(i));
      CHECK(r.data<float>()[n - 1] == 100.0f + static_cast<float>(i));
    }
    const auto after = ls::detail::remote::receive_cache_stats(b);
    CHECK(after.hits - before.hits >= 20);
    CHECK(after.kept_bytes <= limit);
    CHECK(after.kept_buffers >= 1);
    // A worker that echoes one size over and over receives into one buffer: the reply's
    // tensor is let go once sent, before the next request is received (else the next request,
    // which can arrive in the pass that sees the reply sent, takes a second buffer, and the
    // two take turns: twice the memory through the CPU's caches). Likewise every result here.
    (void)ls::remote_sync_call(b, target, landings);
    std::vector<std::uint64_t> results;
    for (int i = 0; i < 20; ++i) {
      auto r = ls::remote_sync_call(b, target, echo_noting, ls::Tensor::full({n}, 1.0));
      results.push_back(reinterpret_cast<std::uintptr_t>(r.raw_data()));
    }
    const auto landed = ls::remote_sync_call(b, target, landings);
    REQUIRE(landed.size() == 20);
    auto changes = [](const std::vector<std::uint64_t>& v) {
      int c = 0;
      for (std::size_t i = 1; i < v.size(); ++i) c += v[i] != v[i - 1];
      return c;
    };
    if (target != me()) {  // (calls to itself hold both ends' buffers at once)
      CHECK(changes(landed) <= 3);  // a rare pass by the progress thread may take another
      CHECK(changes(results) == 0);
    }
    // Small tensors are left to the allocator.
    const auto small0 = ls::detail::remote::receive_cache_stats(b);
    (void)ls::remote_sync_call(b, target, echo_t, ls::Tensor::full({1000}, 1.0));
    const auto small1 = ls::detail::remote::receive_cache_stats(b);
    CHECK(small1.hits == small0.hits);
    CHECK(small1.misses == small0.misses);
  });
  // A received tensor outlives its session: its memory is freed when it is released.
  ls::Tensor kept = ls::run_driver(b, [&] { return ls::Tensor::full({1 << 18}, 3.0); });
  session.close();
  CHECK(kept.data<float>()[(1 << 18) - 1] == 3.0f);
  kept = ls::Tensor();
  // Without the cache, every received tensor is new memory.
  ls::RemoteSession plain(b, ls::RemoteOptions{.timeout = 120, .receive_cache_bytes = 0});
  ls::run_driver(b, [&] {
    for (int i = 0; i < 3; ++i) (void)ls::remote_sync_call(b, world() - 1, echo_t, ls::Tensor::full({1 << 18}, 1.0));
    const auto st = ls::detail::remote::receive_cache_stats(b);
    CHECK(st.hits == 0);
    CHECK(st.kept_bytes == 0);
  });
  plain.close();
}

TEST_CASE("remote: with background serving, a rank inside a collective of training still answers") {
  auto& b = backend();
  ls::RemoteSession session(b, ls::RemoteOptions{.background = true, .timeout = 120});
  auto x = ls::Tensor::full({1000}, me() + 1.0);
  if (me() == 0) {
    // The others are (or are about to be) inside the allreduce below, waiting for this rank:
    // only their background executors can answer.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    for (int r = 1; r < world(); ++r) {
      CHECK(ls::remote_sync_call(b, ls::CallOptions{.timeout = 60}, r, whoami) == r);
      CHECK(ls::remote_sync_call(b, ls::CallOptions{.timeout = 60}, r, sum_of, ls::Tensor::full({1 << 16}, 2.0)) ==
            2.0 * (1 << 16));
    }
  }
  // The calls' messages travel on the session's communicator, the allreduce on the backend's:
  // neither disturbs the other.
  ls::allreduce(b, x, ls::ReduceOp::sum);
  long bad = 0;
  for (float v : x.span<float>()) bad += v != static_cast<float>(world() * (world() + 1) / 2);
  CHECK(bad == 0);
  session.close();
}

TEST_CASE("remote: a call's default deadline is the session's timeout, by default lockstep::timeout()") {
  auto& b = backend();
  const int target = world() - 1;
  // The session's timeout also bounds its own collectives (creating, agreeing, closing): the
  // barriers on the backend (whose deadline is not that short) line the ranks up before them,
  // so that a loaded machine does not make them late.
  auto timed_out = [&](const char* within) {
    ls::run_driver(b, [&] {
      try {
        ls::remote_sync_call(b, target, sleeper, 3.5);  // no CallOptions: the session's deadline
        FAIL("no TimeoutError");
      } catch (const ls::TimeoutError& e) {
        CHECK_THAT(e.what(), Catch::Contains("'sleeper' on rank " + std::to_string(target) + " (host "));
        CHECK_THAT(e.what(), Catch::Contains(std::string(") did not answer within ") + within));
      }
      // Waits behind the sleeper (one background executor per rank).
      CHECK(ls::remote_sync_call(b, ls::CallOptions{.timeout = 60}, target, add, 1, 2) == 3);
    });
    ls::barrier(b);
  };
  // RemoteOptions::timeout unset: lockstep::timeout() (LOCKSTEP_TIMEOUT) when the session starts.
  // (Background serving, so that at one rank the call to self runs beside the waiting driver.)
  const double saved = ls::timeout();
  ls::barrier(b);
  ls::set_timeout(2.0);
  {
    ls::RemoteSession session(b, ls::RemoteOptions{.background = true});
    ls::set_timeout(saved);  // the session keeps what it read
    timed_out("2 s");
    session.close();
  }
  ls::barrier(b);
  {
    ls::RemoteSession session(b, ls::RemoteOptions{.background = true, .timeout = 2.5});
    timed_out("2.5 s");
    session.close();
  }
}

TEST_CASE("remote: partitioners and reducers") {
  auto& b = backend();
  ls::run_driver(b, [&] {
    const std::int64_t rows = 10, cols = 3;
    auto x = iota(rows, cols);
    const double full_mean = sum_of(x) / static_cast<double>(rows * cols);
    // batch_partitioner + mean_reducer weighted by rows: the mean over the whole batch.
    CHECK(ls::remote_sync_call(b, ls::batch_partitioner, ls::mean_reducer, mean_of, x) == Approx(full_mean));
    // sum_reducer of tensors: the column sums of the whole batch.
    ls::Tensor cs = ls::remote_sync_call(b, ls::batch_partitioner, ls::sum_reducer, column_sums, x);
    ls::Tensor want = column_sums(x);
    for (std::int64_t c = 0; c < cols; ++c) CHECK(cs.data<float>()[c] == Approx(want.data<float>()[c]));
    // exclusive_batch_partitioner: one call per row (dimension removed), a user's reducer.
    auto per_row = ls::remote_sync_call(b, ls::exclusive_batch_partitioner,
                                        [](std::vector<double> v) { return v; }, sum_of, x);
    REQUIRE(per_row.size() == static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r) {
      double s = 0;
      for (std::int64_t c = 0; c < cols; ++c) s += x.data<float>()[r * cols + c];
      CHECK(per_row[r] == Approx(s));
    }
    // dim_partitioner(1): columns; non-tensor arguments go to every partition.
    const auto parts = std::min<std::int64_t>(cols, world());
    CHECK(ls::remote_sync_call(b, ls::dim_partitioner(1), ls::sum_reducer, count_plus, x, std::int64_t{5}) ==
          rows * cols + 5 * parts);
    // A list of ranks, a single rank.
    CHECK(ls::remote_sync_call(b, std::vector<int>{0, world() - 1}, ls::sum_reducer, whoami) == world() - 1);
    CHECK(ls::remote_sync_call(b, world() - 1, ls::sum_reducer, whoami) == world() - 1);
    // A user's partitioner: (rank, arguments) pairs.
    auto mine = [&](int a, int c) {
      std::vector<std::pair<int, std::tuple<int, int>>> out;
      for (int r = 0; r < world(); ++r) out.push_back({r, {a * r, c}});
      return out;
    };
    int expect = 0;
    for (int r = 0; r < world(); ++r) expect += 2 * r + 1;
    CHECK(ls::remote_sync_call(b, mine, ls::sum_reducer, add, 2, 1) == expect);
    // mean_reducer over integer results: refused as parallelize refuses them (one rule: floating
    // point only), naming what was integer; the same calls with sum_reducer add up exactly.
    const std::string int_scalar = lstest::expect_throw<ls::InvalidArgument>(
        [&] { (void)ls::remote_sync_call(b, ls::batch_partitioner, ls::mean_reducer, count_plus, x, std::int64_t{0}); });
    CHECK(int_scalar.find("remote call: mean_reducer needs floating-point results (use sum_reducer)") != std::string::npos);
    CHECK(int_scalar.find("integer scalar") != std::string::npos);
    const std::string int_tensor = lstest::expect_throw<ls::InvalidArgument>(
        [&] { (void)ls::remote_sync_call(b, ls::batch_partitioner, ls::mean_reducer, row_count_i32, x); });
    CHECK(int_tensor.find("remote call: mean_reducer needs floating-point results") != std::string::npos);
    CHECK(int_tensor.find("i32") != std::string::npos);
    CHECK(ls::remote_sync_call(b, ls::batch_partitioner, ls::sum_reducer, row_count_i32, x).data<std::int32_t>()[0] == rows);
    // remote_parallelize_async / remote_parallelize_sync.
    auto par = ls::remote_parallelize_async(b, ls::batch_partitioner, ls::mean_reducer, mean_of);
    ls::Future<double> pf = par(x);
    CHECK(pf.wait() == Approx(full_mean));
    auto pars = ls::remote_parallelize_sync(b, ls::batch_partitioner, ls::sum_reducer, column_sums);
    ls::Tensor pt = pars(x);
    CHECK(pt.data<float>()[0] == Approx(want.data<float>()[0]));
    // Their 0.2 names forward, deprecated, for one release.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    CHECK(ls::parallelize_async(b, ls::batch_partitioner, ls::mean_reducer, mean_of)(x).wait() == Approx(full_mean));
    CHECK(ls::parallelize_sync(b, ls::batch_partitioner, ls::sum_reducer, column_sums)(x).data<float>()[0] ==
          Approx(want.data<float>()[0]));
#pragma GCC diagnostic pop
    // Bad input to the partitioner: a clear error before anything is sent.
    CHECK_THROWS_AS(ls::remote_sync_call(b, ls::batch_partitioner, ls::sum_reducer, whoami), ls::InvalidArgument);
    CHECK_THROWS_AS(ls::remote_sync_call(b, std::vector<int>{0, world()}, ls::sum_reducer, whoami), ls::InvalidArgument);
  });
}

TEST_CASE("remote: run_driver returns f's result and f's error on every rank") {
  auto& b = backend();
  const std::string r = ls::run_driver(b, [&] { return std::string("done-") + std::to_string(world()); });
  CHECK(r == "done-" + std::to_string(world()));
  auto t = ls::run_driver(b, [&] { return ls::Tensor::full({4}, 2.5); });
  CHECK(t.data<float>()[3] == 2.5f);

  std::string what;
  bool invalid = false;
  try {
    ls::run_driver(b, [&]() -> int {
      ls::remote_sync_call(b, world() - 1, add, 1, 1);
      throw ls::InvalidArgument("bad input in the driver");
    });
  } catch (const ls::InvalidArgument& e) {
    invalid = true;
    what = e.what();
  }
  CHECK(invalid);
  CHECK(what == "bad input in the driver");

  // A RemoteError that escapes f reaches every rank as a RemoteError with the same parts.
  int rrank = -2;
  try {
    ls::run_driver(b, [&] { ls::remote_sync_call(b, world() - 1, fail_with, 3); });
  } catch (const ls::RemoteError& e) {
    rrank = e.rank();
    CHECK(e.message() == "boom 3");
  }
  CHECK(rrank == world() - 1);

  // Rank 0 must drive: serve on rank 0 is a MismatchError on every rank.
  bool mismatch = false;
  try {
    if (me() == 0) ls::serve(b);
    else ls::run_driver(b, [] {});
  } catch (const ls::MismatchError& e) {
    mismatch = true;
  }
  CHECK(mismatch);
  // The workers' half of run_driver, written as serve().
  int got = -1;
  if (me() == 0) got = ls::run_driver(b, [&] { return ls::remote_sync_call(b, world() - 1, add, 40, 2); });
  else ls::serve(b);
  if (me() == 0) CHECK(got == 42);
}

TEST_CASE("remote: a remote function may call back to the waiting driver") {
  auto& b = backend();
  ls::run_driver(b, [&] {
    for (int r = 0; r < world(); ++r) CHECK(ls::remote_sync_call(b, r, nested, r) == r + 1000);
  });
}

TEST_CASE("remote: sessions whose options differ are a MismatchError on every rank") {
  auto& b = backend();
  if (world() == 1) return;  // one rank always agrees with itself
  bool mismatch = false;
  std::string what;
  try {
    ls::RemoteSession s(b, ls::RemoteOptions{.background = me() == 0, .timeout = 30});
  } catch (const ls::MismatchError& e) {
    mismatch = true;
    what = e.what();
  }
  CHECK(mismatch);
  CHECK_THAT(what, Catch::Contains("rank 1: timeout 30 s, background off (differs)"));
  // Nothing is left behind: a new session works.
  ls::RemoteSession ok(b, ls::RemoteOptions{.timeout = 30});
  ok.close();
}

TEST_CASE("remote: a waiting thread is not held up by the late tensors of another reply") {
  // Rank 0 starts a call whose reply's tensors come 3 s after the reply's header, and then,
  // while they are owed, calls itself (and, at 3 ranks or more, another rank). A pass that
  // receives a header posts the receives of its tensors and goes on, so these calls complete
  // at once; a pass that waited for the tensors would hold every other message back for 3 s.
  if (world() == 1) return;  // the late reply would be this rank's own: its thread sleeps in it
  auto& b = backend();
  ls::RemoteSession session(b, ls::RemoteOptions{.timeout = 60});
  const std::int64_t n = 1 << 18;  // 1 MiB: sent by rendezvous over shared memory
  ls::run_driver(b, [&] {
    auto late = ls::remote_async_call(b, 1, late_echo, ls::Tensor::full({n}, 5.0), 3.0);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the late reply's header is in
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 5; ++i) CHECK(ls::remote_sync_call(b, 0, add, i, 1) == i + 1);
    if (world() > 2) CHECK(ls::remote_sync_call(b, 2, sum_of, ls::Tensor::full({n}, 1.0)) == Approx(n));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1500));
    CHECK_FALSE(late.ready());
    auto r = late.wait();
    long bad = 0;
    for (float x : r.span<float>()) bad += x != 5.0f;
    CHECK(bad == 0);
  });
  session.close();
}

TEST_CASE("remote: one rank's calls to another start in the order they were sent") {
  // A call with a 16 MiB tensor, then one without, ten times over. A rank receives a message's
  // tensors while it goes on receiving other messages, and hands a request on only after the
  // earlier ones from its rank; a sender, for its part, waits until each message is taken. So
  // one thread's calls start in the order it made them.
  auto& b = backend();
  ls::RemoteSession session(b, ls::RemoteOptions{.timeout = 60});
  ls::run_driver(b, [&] {
    const int target = world() - 1;
    (void)ls::remote_sync_call(b, target, order_seen);
    auto big = ls::Tensor::full({1 << 22}, 1.0);
    std::vector<ls::Future<int>> with;
    std::vector<ls::Future<std::monostate>> plain;
    for (int i = 0; i < 10; ++i) {
      with.push_back(ls::remote_async_call(b, target, note_with_tensor, big, 2 * i));
      plain.push_back(ls::remote_async_call(b, target, note_plain, 2 * i + 1));
    }
    for (auto& f : with) CHECK(f.wait() == 1);
    for (auto& f : plain) f.wait();
    const auto order = ls::remote_sync_call(b, target, order_seen);
    REQUIRE(order.size() == 20);
    for (int i = 0; i < 20; ++i) CHECK(order[i] == i);
  });
  session.close();
}

TEST_CASE("remote: tensor messages given up on are never taken by a later call when the tags wrap") {
  // Data tags come from the call ids modulo the tag space; with 8 tags they repeat every 4 calls
  // of a rank. Two ways of leaving tensor data behind: (1) a reply whose tensors come after the
  // receiving rank gave up (1.5 s late, given up after 0.5 s: the call fails with a
  // TimeoutError naming the rank), (2) a reply whose tensors find no memory on the receiving
  // rank (the call fails with an Error). Then the tags wrap many times over, with tensors of the
  // same size: every result must be the call's own, never the data left behind.
  auto& b = backend();
  auto& hooks = ls::detail::remote::test_hooks();
  hooks.tag_span = 8;
  hooks.data_timeout = 0.5;
  ls::RemoteSession session(b, ls::RemoteOptions{.timeout = 60});
  hooks.tag_span = 0;
  hooks.data_timeout = -1.0;
  const int target = world() - 1;
  const std::int64_t n = 1 << 18;  // 1 MiB: sent by rendezvous over shared memory
  ls::run_driver(b, [&] {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      (void)ls::remote_sync_call(b, ls::CallOptions{.timeout = 30}, target, late_echo, ls::Tensor::full({n}, -1.0), 1.5);
      FAIL("no TimeoutError");
    } catch (const ls::TimeoutError& e) {
      CHECK_THAT(e.what(), Catch::Contains("'late_echo' on rank " + std::to_string(target)));
      CHECK_THAT(e.what(), Catch::Contains("did not arrive on rank 0 within 0.5 s"));
    }
    // Failed at the data's deadline, not at the call's (the one executor of the target is still
    // holding the data back then, so at one rank this thread is: the failure is seen after).
    if (world() > 1) CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1400));
    hooks.fail_allocations = 1;
    CHECK_THROWS_WITH(ls::remote_sync_call(b, target, echo_t, ls::Tensor::full({n}, -2.0)),
                      Catch::Contains("cannot be received on rank 0") && Catch::Contains("echo_t"));
    CHECK(hooks.fail_allocations.load() <= 0);
    hooks.fail_allocations = 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the late data has been sent by now
    long bad = 0;
    for (int i = 0; i < 24; ++i) {
      auto r = ls::remote_sync_call(b, target, echo_t, ls::Tensor::full({n}, 10.0 + i));
      for (float x : r.span<float>()) bad += x != 10.0f + static_cast<float>(i);
    }
    CHECK(bad == 0);
    // Requests wrap as well: arguments, each its own.
    for (int i = 0; i < 12; ++i)
      CHECK(ls::remote_sync_call(b, target, sum_of, ls::Tensor::full({n}, 1.0 + i)) ==
            Approx((1.0 + i) * static_cast<double>(n)));
  });
  session.close();
}
