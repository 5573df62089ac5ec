// Remote sessions closing gracefully (remote.cpp: close_rounds), and auto_init_rpc, under
// mpiexec at 1 to 4 ranks. A rank that closes serves the calls still owed to it until every rank
// has closed and every call made on the session has been answered: calls whose futures were
// dropped still run, futures kept past the close hold their results, a rank still busy past the
// session's timeout is waited for (its heartbeats say it is alive), calls made by a remote
// function while ranks close are answered. auto_init_rpc runs worker_init on every rank before
// any func, func on every rank, and serves until every func has returned. Every rank checks
// what it saw locally (no REQUIRE between collectives).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "remote/remote_test_support.hpp"

namespace ls = lockstep;

namespace {

using namespace remote_test;



// What the calls to this rank did: calls from each rank, and the sum of their values.
std::vector<std::atomic<long>> g_calls(64), g_sums(64);
void reset() {
  for (auto& c : g_calls) c = 0;
  for (auto& s : g_sums) s = 0;
}
long calls_from_all() {
  long n = 0;
  for (int r = 0; r < world(); ++r) n += g_calls[static_cast<std::size_t>(r)];
  return n;
}

// ---- remote functions ----
int cl_add(int from, int v) {
  g_calls[static_cast<std::size_t>(from)] += 1;
  g_sums[static_cast<std::size_t>(from)] += v;
  return v + 1;
}
// cl_add on rank `to`, called from the rank this runs on (a call made while ranks close).
int cl_relay(int from, int to, int v) { return ls::remote_sync_call(backend(), to, cl_add, from, v) + 10; }
int g_init_value = -1;
int cl_init_value() { return g_init_value; }
// A result whose non-tensor part is n bytes.
std::string cl_text(int n) { return std::string(static_cast<std::size_t>(n), 'x'); }
LOCKSTEP_REMOTE(cl_text)
// cl_add after `secs` of work.
int cl_slow_add(int from, int v, double secs) {
  std::this_thread::sleep_for(std::chrono::duration<double>(secs));
  return cl_add(from, v);
}
LOCKSTEP_REMOTE(cl_slow_add)
LOCKSTEP_REMOTE(cl_add)
LOCKSTEP_REMOTE(cl_relay)
LOCKSTEP_REMOTE(cl_init_value)

// Closes s, returning its error ("" if none) and how long the close took.
std::pair<std::string, double> close_timed(ls::RemoteSession& s) {
  const auto t0 = Clock::now();
  std::string err;
  try {
    s.close();
  } catch (const std::exception& x) {
    err = x.what();
  }
  return {err, since(t0)};
}

}  // namespace

TEST_CASE("close: the calls still owed to a rank run before its session closes") {
  // SPMD, no background serving: a rank runs the calls to it only while it waits or serves.
  // Every rank sends 40 calls to every rank (itself too), keeps the futures of half and drops the
  // others, and closes at once; rank 0 first sleeps, so calls to it pile up. Before closes were
  // graceful, a close dropped the calls queued on its rank, and the kept futures failed.
  auto& b = backend();
  reset();
  ls::barrier(b);
  ls::RemoteSession s(b, ls::RemoteOptions{.timeout = 30});
  constexpr int kCalls = 40;
  std::vector<ls::Future<int>> kept;
  std::vector<int> kept_v;
  for (int i = 0; i < kCalls; ++i)
    for (int r = 0; r < world(); ++r) {
      const int v = 1000 * me() + i;
      auto f = ls::remote_async_call(b, r, cl_add, me(), v);
      if (i % 2 == 0) {
        kept.push_back(std::move(f));
        kept_v.push_back(v);
      }
    }
  if (me() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto [err, secs] = close_timed(s);
  INFO("rank " << me() << ": close took " << secs << " s: " << err);
  CHECK(err.empty());
  for (int from = 0; from < world(); ++from) {
    INFO("calls from rank " << from);
    CHECK(g_calls[static_cast<std::size_t>(from)] == kCalls);
    CHECK(g_sums[static_cast<std::size_t>(from)] == kCalls * 1000L * from + kCalls * (kCalls - 1) / 2);
  }
  long wrong = 0;
  std::string first_error;
  for (std::size_t i = 0; i < kept.size(); ++i) {
    try {
      wrong += kept[i].wait() != kept_v[i] + 1;
    } catch (const std::exception& x) {
      ++wrong;
      if (first_error.empty()) first_error = x.what();
    }
  }
  INFO("first error of a kept future: " << first_error);
  CHECK(wrong == 0);
  ls::barrier(b);
}

TEST_CASE("close: a rank still busy past the session's timeout is waited for, and its calls answered") {
  // The session's timeout is 1 s; the last rank works 2.5 s before it calls rank 0 and closes.
  // The others are closing meanwhile: they hear its heartbeats, wait, serve its call, and close
  // with it. (Before, their close gave up after 1 s with a TimeoutError.)
  auto& b = backend();
  reset();
  ls::barrier(b);
  ls::RemoteSession s(b, ls::RemoteOptions{.timeout = 1.0});
  const int late = world() - 1;
  int got = -1;
  if (me() == late) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    got = ls::remote_sync_call(b, 0, cl_add, me(), 5);
  }
  const auto [err, secs] = close_timed(s);
  INFO("rank " << me() << ": close took " << secs << " s: " << err);
  CHECK(err.empty());
  if (me() == late) CHECK(got == 6);
  if (me() == 0) {
    CHECK(g_calls[static_cast<std::size_t>(late)] == 1);
    if (late != 0) CHECK(secs > 2.0);  // it waited for the busy rank, past the session's timeout
  }
  CHECK(secs < 20);
  ls::barrier(b);
}

TEST_CASE("close: calls that remote functions make while the ranks close are answered") {
  // Rank 1 (or 0 alone) calls cl_relay on rank 0 late, which calls cl_add on the last rank: both
  // are closing by then. Every relayed call must run once.
  auto& b = backend();
  reset();
  ls::barrier(b);
  ls::RemoteSession s(b, ls::RemoteOptions{.timeout = 30});
  const int caller = world() > 1 ? 1 : 0, last = world() - 1;
  constexpr int kRelays = 20;
  std::vector<ls::Future<int>> fs;
  if (me() == caller) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    for (int i = 0; i < kRelays; ++i) fs.push_back(ls::remote_async_call(b, 0, cl_relay, me(), last, i));
  }
  const auto [err, secs] = close_timed(s);
  INFO("rank " << me() << ": close took " << secs << " s: " << err);
  CHECK(err.empty());
  long wrong = 0;
  for (int i = 0; i < static_cast<int>(fs.size()); ++i) {
    try {
      wrong += fs[static_cast<std::size_t>(i)].wait() != i + 11;
    } catch (const std::exception&) {
      ++wrong;
    }
  }
  CHECK(wrong == 0);
  if (me() == last) {
    CHECK(g_calls[static_cast<std::size_t>(caller)] == kRelays);
    CHECK(g_sums[static_cast<std::size_t>(caller)] == kRelays * (kRelays - 1) / 2);
  }
  ls::barrier(b);
}

TEST_CASE("run_driver: calls the driver did not wait for run before the run ends") {
  // The driver sends 200 calls to every worker, drops their futures, and returns at once. Every
  // worker must have run all of them when run_driver returns. (Before, a worker stopped serving at
  // the driver's end of run and the calls still queued were dropped.)
  auto& b = backend();
  reset();
  ls::barrier(b);
  constexpr int kCalls = 200;
  const int r = ls::run_driver(b, [&] {
    for (int i = 0; i < kCalls; ++i)
      for (int w = 1; w < world(); ++w) (void)ls::remote_async_call(b, w, cl_add, 0, i);
    return 3;
  });
  CHECK(r == 3);
  if (me() != 0) {
    CHECK(g_calls[0] == kCalls);
    CHECK(g_sums[0] == kCalls * (kCalls - 1) / 2);
  }
  ls::barrier(b);
}

TEST_CASE("auto_init_rpc: worker_init on every rank first, func on every rank, serving until all returned") {
  auto& b = backend();
  reset();
  g_init_value = -1;
  ls::barrier(b);
  std::atomic<int> inits{0};
  auto init = [&] {
    g_init_value = 100 + me();
    ++inits;
  };
  constexpr int kCalls = 50;
  std::vector<int> seen;  // rank 0: each rank's worker_init value, read by a call
  auto train = ls::auto_init_rpc(init, ls::RemoteOptions{.timeout = 30})([&](int x) {
    auto& mb = ls::get_distributed_backend<ls::MPIBackend>();
    if (ls::world_info().rank != 0) return x + me();  // returns at once, then serves
    for (int r = 0; r < world(); ++r) seen.push_back(ls::remote_sync_call(mb, r, cl_init_value));
    for (int i = 0; i < kCalls; ++i)
      for (int r = 1; r < world(); ++r) (void)ls::remote_async_call(mb, r, cl_add, 0, i);  // not waited for
    return x + 1000;
  });
  for (int round = 0; round < 2; ++round) {  // the wrapped function may be called again
    reset();
    seen.clear();
    const int got = train(7);
    INFO("round " << round);
    CHECK(got == (me() == 0 ? 1007 : 7 + me()));
    if (me() == 0) {
      REQUIRE(static_cast<int>(seen.size()) == world());
      for (int r = 0; r < world(); ++r) CHECK(seen[static_cast<std::size_t>(r)] == 100 + r);
    } else {
      CHECK(g_calls[0] == kCalls);
    }
  }
  CHECK(inits == 2);
  ls::barrier(b);  // the backend works after
}

TEST_CASE("auto_init_rpc: an exception in func on the driver ends it there, the others return") {
  auto& b = backend();
  reset();
  ls::barrier(b);
  auto run = ls::auto_init_rpc(nullptr, ls::RemoteOptions{.timeout = 30})([&]() -> int {
    if (me() != 0) return 1;
    auto& mb = ls::get_distributed_backend<ls::MPIBackend>();
    for (int r = 1; r < world(); ++r) (void)ls::remote_async_call(mb, r, cl_add, 0, 1);
    throw std::runtime_error("the driver failed");
  });
  const auto t0 = Clock::now();
  if (me() == 0) {
    CHECK_THROWS_WITH(run(), "the driver failed");
  } else {
    CHECK(run() == 1);
    CHECK(g_calls[0] == 1);  // the call sent before the driver threw still ran
  }
  CHECK(since(t0) < 20);
  ls::barrier(b);
}

TEST_CASE("close: a reply that cannot be sent is an error at the caller, and the session still closes") {
  // Messages over 2 KiB of non-tensor data are refused (a test hook standing for the 2 GiB
  // limit): the called rank cannot send its 4 KiB result, sends an error reply instead, and the
  // caller gets a RemoteError naming the reason (not a TimeoutError at its deadline). The close
  // must still find every call answered.
  auto& b = backend();
  ls::barrier(b);
  auto& hooks = ls::detail::remote::test_hooks();
  hooks.max_message_bytes = 2048;
  ls::RemoteSession s(b, ls::RemoteOptions{.timeout = 30});
  const int target = (me() + 1) % world();
  std::string err;
  const auto t0 = Clock::now();
  try {
    (void)ls::remote_sync_call(b, target, cl_text, 4096);
  } catch (const ls::RemoteError& x) {
    err = x.message();
  } catch (const std::exception& x) {
    err = std::string("another error: ") + x.what();
  }
  INFO("rank " << me() << ": " << err);
  CHECK(err.find("the reply could not be sent from rank " + std::to_string(target)) == 0);
  CHECK(err.find("over 2048 bytes") != std::string::npos);
  CHECK(since(t0) < 10);
  CHECK(ls::remote_sync_call(b, target, cl_text, 100) == std::string(100, 'x'));  // small ones still go
  const auto [cerr, secs] = close_timed(s);
  CHECK(cerr.empty());
  hooks.max_message_bytes = 0;
  ls::barrier(b);
}

TEST_CASE("run_driver: a worker running the calls the driver left is not taken for one whose driver went silent") {
  // Session timeout 1 s. The driver leaves four 0.5 s calls on every worker and returns; the
  // worker has the end of the run at once but runs the calls first, 2 s, longer than the
  // timeout after the driver's last message (the driver, closing, heartbeats only closing ranks).
  // The run must end normally on every rank, every call run. (Before, the worker threw "heard
  // nothing from the driver" halfway.)
  auto& b = backend();
  reset();
  ls::barrier(b);
  ls::RemoteSession s(b, ls::RemoteOptions{.timeout = 1.0});
  std::string err;
  int r = -1;
  try {
    r = ls::run_driver(b, [&] {
      for (int i = 0; i < 4; ++i)
        for (int w = 1; w < world(); ++w) (void)ls::remote_async_call(b, w, cl_slow_add, 0, i, 0.5);
      return 4;
    });
  } catch (const std::exception& x) {
    err = x.what();
  }
  INFO("rank " << me() << ": " << err);
  CHECK(err.empty());
  CHECK(r == 4);
  if (me() != 0) CHECK(g_calls[0] == 4);
  const auto [cerr, secs] = close_timed(s);
  CHECK(cerr.empty());
  ls::barrier(b);
}
