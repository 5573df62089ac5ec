// Graceful close of remote sessions (remote.cpp: close_rounds, close_engine, silent_rank,
// tell_others) and auto_init_rpc, attacked, under mpiexec at 1 to 3 ranks: background sessions
// closing while their executors run calls longer than the session's timeout; calls with 4 MiB
// tensors (arguments and late replies) in flight at the close; chains of nested calls around the
// ranks (A calls B calls C calls A ...) started just before every rank closes; run_driver on an
// explicit session whose driver drops its futures, then an immediate close; a call the caller
// gave up on (its deadline passed) still running on its rank at the close; ranks that close up to
// twice the session's timeout apart (1 s) with remote functions fanning out calls meanwhile;
// auto_init_rpc whose func throws on a rank other than 0 while rank 0 still calls it, and
// auto_init_rpc several times in a row with other options each time; many threads of one rank
// making calls while another thread of it closes. Every call carries a key of its own: the rank
// it runs on records it, and a key seen twice is a call run twice; the counts of calls run are
// compared exactly with what was sent, and every future kept past a close is checked for its
// value. Every rank checks what it saw locally (no REQUIRE between collectives); counts that one
// rank needs from another travel in allreduces on the backend after the session is closed.
#include <catch2/catch.hpp>
#include <mpi.h>

#include <algorithm>
#include <condition_variable>
#include <iostream>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "remote/remote_test_support.hpp"

namespace ls = lockstep;

namespace {

using namespace remote_test;



// ---- what the calls run on this rank did ----
// Per calling rank: calls run, the sum of their values; every call's key (a key seen twice is a
// call run twice).
std::mutex g_mu;
std::vector<long> g_calls(64), g_sums(64);
std::set<std::int64_t> g_keys;
long g_dupes = 0;
long g_bad_args = 0;  // tensor elements that arrived wrong, on the called rank
void reset() {
  std::lock_guard lk(g_mu);
  std::fill(g_calls.begin(), g_calls.end(), 0);
  std::fill(g_sums.begin(), g_sums.end(), 0);
  g_keys.clear();
  g_dupes = 0;
  g_bad_args = 0;
}
void note(int from, std::int64_t key, long v) {
  std::lock_guard lk(g_mu);
  if (from >= 0 && from < 64) {
    g_calls[static_cast<std::size_t>(from)] += 1;
    g_sums[static_cast<std::size_t>(from)] += v;
  }
  if (!g_keys.insert(key).second) ++g_dupes;
}
long calls_from(int r) {
  std::lock_guard lk(g_mu);
  return g_calls[static_cast<std::size_t>(r)];
}
long sums_from(int r) {
  std::lock_guard lk(g_mu);
  return g_sums[static_cast<std::size_t>(r)];
}
long dupes() {
  std::lock_guard lk(g_mu);
  return g_dupes;
}
long bad_args() {
  std::lock_guard lk(g_mu);
  return g_bad_args;
}
// A key unique to (test, calling rank, index): the index below 2^40.
std::int64_t key(int test, int from, std::int64_t i) {
  return (static_cast<std::int64_t>(test) << 52) | (static_cast<std::int64_t>(from) << 44) | i;
}

// Waits for kept futures of int: how many are not `want[i]` (errors included), and the first
// error.
long wrong_ints(std::vector<ls::Future<int>>& fs, const std::vector<int>& want, std::string& first) {
  long wrong = 0;
  for (std::size_t i = 0; i < fs.size(); ++i) {
    try {
      const int got = fs[i].wait();
      if (got != want[i]) {
        ++wrong;
        if (first.empty()) first = "future " + std::to_string(i) + ": " + std::to_string(got) + " where " +
                                   std::to_string(want[i]) + " was due";
      }
    } catch (...) {
      ++wrong;
      if (first.empty()) first = "future " + std::to_string(i) + ": " + describe(std::current_exception());
    }
  }
  return wrong;
}

// The sum over the ranks of a value (an allreduce on the backend, not the session).
long sum_all(long v) { return static_cast<long>(ls::allreduce(backend(), static_cast<std::int64_t>(v), ls::ReduceOp::sum)); }

// ---- remote functions ----
int adv_add(int from, std::int64_t k, int v) {
  note(from, k, v);
  return v + 1;
}
// adv_add after `secs` of work.
int adv_slow_add(int from, std::int64_t k, int v, double secs) {
  sleep_s(secs);
  note(from, k, v);
  return v + 1;
}
// The tensor back, each element plus k (its arrival checked here against its seed).
ls::Tensor adv_big(ls::Tensor t, int from, std::int64_t k, std::uint64_t seed, float add) {
  const long bad = bad_elems(t, t.numel(), seed, 0.0f);
  {
    std::lock_guard lk(g_mu);
    g_bad_args += bad;
  }
  note(from, k, 1);
  for (auto& x : t.span<float>()) x += add;
  return t;
}
// A new tensor of n elements of `seed`'s pattern, its tensor messages sent `delay` s after the
// reply's header.
ls::Tensor adv_big_late(int from, std::int64_t k, std::int64_t n, std::uint64_t seed, double delay) {
  ls::detail::remote::delay_reply_tensors_for_test(delay);
  note(from, k, 1);
  return make(n, seed);
}
// One hop of a chain of nested calls: runs on path[pos] (recording the hop), calls the next hop
// on path[pos + 1] and waits for it. The chain's value: id * 100 + its length.
int adv_chain(std::vector<int> path, int pos, int from, std::int64_t id) {
  note(from, key(3, from, id * 64 + pos), 1);
  const auto p = static_cast<std::size_t>(pos);
  if (p + 1 == path.size()) return static_cast<int>(id) * 100 + 1;
  return ls::remote_sync_call(backend(), ls::CallOptions{.timeout = 60}, path[p + 1], adv_chain, path, pos + 1, from,
                              id) +
         1;
}
// Fans out adv_add to every rank (keys base + r), waits for all: the sum of their values.
int adv_fan(int from, std::int64_t base, int v) {
  std::vector<ls::Future<int>> fs;
  for (int r = 0; r < world(); ++r)
    fs.push_back(ls::remote_async_call(backend(), ls::CallOptions{.timeout = 60}, r, adv_add, from, base + r, v));
  int s = 0;
  for (auto& f : fs) s += f.wait();
  return s;
}
int g_init_value = -1;
int adv_init_value() { return g_init_value; }
LOCKSTEP_REMOTE(adv_add)
LOCKSTEP_REMOTE(adv_slow_add)
LOCKSTEP_REMOTE(adv_big)
LOCKSTEP_REMOTE(adv_big_late)
LOCKSTEP_REMOTE(adv_chain)
LOCKSTEP_REMOTE(adv_fan)
LOCKSTEP_REMOTE(adv_init_value)

}  // namespace

TEST_CASE("adversarial close: a background session closes while its executors run calls past the session's timeout") {
  // Timeout 1 s, background serving. Every rank sends its next rank two calls that work 1.3 s
  // and 1.2 s (the first's future dropped), then 15 quick calls to every rank (kept, queued
  // behind the long ones on the executor), and closes at once. Every close must wait for the
  // long calls (past the session's timeout: the busy ranks' heartbeats say they are alive) and
  // end without error; every call must run once; the kept futures hold their values after it.
  auto& b = backend();
  reset();
  ls::barrier(b);
  const auto t0 = Clock::now();
  ls::RemoteSession s(b, ls::RemoteOptions{.background = true, .timeout = 1.0});
  const ls::CallOptions patient{.timeout = 30};
  const int next = (me() + 1) % world();
  constexpr int kQuick = 15;
  std::vector<ls::Future<int>> kept;
  std::vector<int> want;
  (void)ls::remote_async_call(b, patient, next, adv_slow_add, me(), key(1, me(), 0), 1000, 1.3);
  kept.push_back(ls::remote_async_call(b, patient, next, adv_slow_add, me(), key(1, me(), 1), 2000, 1.2));
  want.push_back(2001);
  for (int i = 0; i < kQuick; ++i)
    for (int r = 0; r < world(); ++r) {
      const int v = 10 * i + r;
      kept.push_back(ls::remote_async_call(b, patient, r, adv_add, me(), key(1, me(), 100 + i * 8 + r), v));
      want.push_back(v + 1);
    }
  const auto c = close_session(s);
  INFO("rank " << me() << ": close took " << c.seconds << " s: " << c.error);
  CHECK(c.error.empty());
  CHECK(c.seconds > 1.5);  // the long calls (2.5 s of work on each executor) were waited for
  CHECK(since(t0) < 15);
  std::string first;
  CHECK(wrong_ints(kept, want, first) == 0);
  INFO("first wrong kept future: " << first);
  CHECK(first.empty());
  const int prev = (me() + world() - 1) % world();
  for (int from = 0; from < world(); ++from) {
    INFO("calls from rank " << from);
    const long longs = from == prev ? 2 : 0;
    CHECK(calls_from(from) == kQuick + longs);
    long quick_sum = 0;
    for (int i = 0; i < kQuick; ++i) quick_sum += 10 * i + me();
    CHECK(sums_from(from) == quick_sum + (longs ? 3000 : 0));
  }
  CHECK(dupes() == 0);
  ls::barrier(b);
}

TEST_CASE("adversarial close: calls with 4 MiB tensors in flight at the close, and late 4 MiB replies") {
  // Non-background, timeout 30. Every rank sends every rank two 4 MiB calls it keeps, two it
  // drops, and one whose 4 MiB reply's tensors are sent 0.3 s after its header (kept); rank 0
  // first sleeps 0.2 s, so calls to it pile up; every rank closes at once. Every argument must
  // arrive intact, every call run once, every kept result be intact after the close.
  auto& b = backend();
  reset();
  ls::barrier(b);
  ls::RemoteSession s(b, ls::RemoteOptions{.timeout = 30});
  const std::int64_t n = std::int64_t{1} << 20;  // 4 MiB of f32
  struct KeptBig {
    ls::Future<ls::Tensor> f;
    std::uint64_t seed;
    float add;
  };
  std::vector<KeptBig> kept;
  long failed_sends = 0;
  std::string first_send_error;
  for (int r = 0; r < world(); ++r)
    for (int i = 0; i < 5; ++i) {
      const std::uint64_t seed = static_cast<std::uint64_t>(me() * 1000 + r * 10 + i);
      const auto k = key(2, me(), r * 10 + i);
      try {
        if (i == 4) {
          kept.push_back(KeptBig{ls::remote_async_call(b, r, adv_big_late, me(), k, n, seed, 0.3), seed, 0.0f});
        } else {
          auto f = ls::remote_async_call(b, r, adv_big, make(n, seed), me(), k, seed, static_cast<float>(i + 1));
          if (i < 2) kept.push_back(KeptBig{std::move(f), seed, static_cast<float>(i + 1)});
        }
      } catch (...) {
        ++failed_sends;
        if (first_send_error.empty()) first_send_error = describe(std::current_exception());
      }
    }
  INFO("first failed send: " << first_send_error);
  CHECK(failed_sends == 0);
  if (me() == 0) sleep_s(0.2);
  const auto c = close_session(s);
  INFO("rank " << me() << ": close took " << c.seconds << " s: " << c.error);
  CHECK(c.error.empty());
  long bad = 0, errors = 0;
  std::string first;
  for (auto& kb : kept) {
    try {
      bad += bad_elems(kb.f.wait(), n, kb.seed, kb.add);
    } catch (...) {
      ++errors;
      if (first.empty()) first = describe(std::current_exception());
    }
  }
  INFO("first error of a kept future: " << first);
  CHECK(errors == 0);
  CHECK(bad == 0);
  CHECK(bad_args() == 0);
  for (int from = 0; from < world(); ++from) {
    INFO("calls from rank " << from);
    CHECK(calls_from(from) == 5);
  }
  CHECK(dupes() == 0);
  ls::barrier(b);
}

TEST_CASE("adversarial close: chains of nested calls around the ranks, started just before every rank closes") {
  // Every rank starts 6 chains of 7 hops, hop p on rank (start + 1 + p) mod world (A calls B
  // calls C calls A ...), keeps the futures of half, and closes at once (the last rank after
  // 0.15 s). Once without and once with background serving. Every hop must run exactly once (the
  // rank counts the hops it runs against those due to it), every kept chain must hold its value.
  auto& b = backend();
  constexpr int kChains = 6, kLen = 7;
  for (const bool bg : {false, true}) {
    INFO("background " << bg);
    reset();
    ls::barrier(b);
    ls::RemoteSession s(b, ls::RemoteOptions{.background = bg, .timeout = 30});
    std::vector<int> path;
    for (int p = 0; p < kLen; ++p) path.push_back((me() + 1 + p) % world());
    std::vector<ls::Future<int>> kept;
    std::vector<int> want;
    for (int c = 0; c < kChains; ++c) {
      auto f = ls::remote_async_call(b, ls::CallOptions{.timeout = 60}, path[0], adv_chain, path, 0, me(),
                                     std::int64_t{c});
      if (c % 2 == 0) {
        kept.push_back(std::move(f));
        want.push_back(c * 100 + kLen);
      }
    }
    if (me() == world() - 1) sleep_s(0.15);
    const auto cl = close_session(s);
    INFO("rank " << me() << ": close took " << cl.seconds << " s: " << cl.error);
    CHECK(cl.error.empty());
    std::string first;
    CHECK(wrong_ints(kept, want, first) == 0);
    INFO("first wrong chain: " << first);
    CHECK(first.empty());
    for (int from = 0; from < world(); ++from) {
      long due = 0;
      for (int p = 0; p < kLen; ++p) due += (from + 1 + p) % world() == me() ? kChains : 0;
      INFO("hops of rank " << from << "'s chains");
      CHECK(calls_from(from) == due);
    }
    CHECK(dupes() == 0);
    ls::barrier(b);
  }
}

TEST_CASE("adversarial close: run_driver on an explicit session, the driver dropping futures, then an immediate close") {
  // An explicit session (without, then with, background serving). In run_driver the driver
  // sends 150 calls to every worker and drops their futures, sends 20 more whose futures it moves
  // out of f, and returns at once; every rank closes the session right after run_driver. The
  // futures kept past run_driver and the close must hold their values; every call must have run
  // once by the end of the close. (docs/remote.md: "a worker runs the calls the driver did not
  // wait for before its run_driver returns": checked too, at the return of run_driver.)
  auto& b = backend();
  constexpr int kDropped = 150, kKept = 20;
  for (const bool bg : {false, true}) {
    INFO("background " << bg);
    reset();
    ls::barrier(b);
    ls::RemoteSession s(b, ls::RemoteOptions{.background = bg, .timeout = 30});
    std::vector<ls::Future<int>> kept;
    std::vector<int> want;
    const int r = ls::run_driver(b, [&] {
      for (int w = 1; w < world(); ++w) {
        for (int i = 0; i < kDropped; ++i) (void)ls::remote_async_call(b, w, adv_add, 0, key(4, w, i), i);
        for (int i = 0; i < kKept; ++i) {
          kept.push_back(ls::remote_async_call(b, w, adv_add, 0, key(4, w, 1000 + i), 1000 + i));
          want.push_back(1001 + i);
        }
      }
      return 11;
    });
    const long at_return = calls_from(0);
    const auto c = close_session(s);
    INFO("rank " << me() << ": close took " << c.seconds << " s: " << c.error);
    CHECK(r == 11);
    CHECK(c.error.empty());
    std::string first;
    CHECK(wrong_ints(kept, want, first) == 0);
    INFO("first wrong kept future: " << first);
    CHECK(first.empty());
    if (me() != 0) {
      const long due = kDropped + kKept;
      const long due_sum = kDropped * (kDropped - 1) / 2 + kKept * 1000L + kKept * (kKept - 1) / 2;
      CHECK(calls_from(0) == due);
      CHECK(sums_from(0) == due_sum);
      INFO("calls of the driver run on this worker when its run_driver returned: " << at_return);
      if (!bg) CHECK(at_return == due);
    }
    CHECK(dupes() == 0);
    ls::barrier(b);
  }
}

TEST_CASE("adversarial close: a call its caller gave up on still runs at the close, and is waited for") {
  // Background serving, timeout 5. Rank 0 calls a 1.5 s function on the last rank with a 0.2 s
  // deadline: a TimeoutError at the caller, the call goes on there. Every rank closes at once:
  // the close must wait for the abandoned call (its answer is owed), end without error, and the
  // call must have run once; its late reply is dropped.
  auto& b = backend();
  reset();
  ls::barrier(b);
  ls::RemoteSession s(b, ls::RemoteOptions{.background = true, .timeout = 5});
  const int last = world() - 1;
  std::string got;
  const auto t0 = Clock::now();
  if (me() == 0) {
    try {
      (void)ls::remote_sync_call(b, ls::CallOptions{.timeout = 0.2}, last, adv_slow_add, 0, key(5, 0, 0), 9, 1.5);
      got = "no error";
    } catch (...) {
      got = describe(std::current_exception());
    }
  }
  const auto c = close_session(s);
  INFO("rank " << me() << ": the call: " << got << "; close took " << c.seconds << " s: " << c.error);
  CHECK(c.error.empty());
  if (me() == 0) CHECK(got.rfind("TimeoutError", 0) == 0);
  CHECK(since(t0) > 1.3);  // every close waited for the abandoned call
  CHECK(since(t0) < 10);
  if (me() == last) {
    CHECK(calls_from(0) == 1);
    CHECK(sums_from(0) == 9);
  }
  ls::barrier(b);
}

TEST_CASE("adversarial close: ranks close up to twice the session's timeout apart, remote functions calling meanwhile") {
  // Timeout 1 s. Every rank sends every rank 10 calls it keeps (deadline 30 s) and 10 it drops,
  // and its next rank 2 calls of adv_fan (which call adv_add on every rank from there, the late
  // ranks included); then rank r sleeps r * 2 / (world - 1) s (the last rank 2 s) and closes.
  // Without, then with, background serving. The early ranks must wait for the late ones (their
  // heartbeats), no close may fail, every call must run once, every kept future hold its value.
  auto& b = backend();
  constexpr int kEach = 10, kFans = 2;
  for (const bool bg : {false, true}) {
    INFO("background " << bg);
    reset();
    ls::barrier(b);
    ls::RemoteSession s(b, ls::RemoteOptions{.background = bg, .timeout = 1.0});
    const ls::CallOptions patient{.timeout = 30};
    std::vector<ls::Future<int>> kept;
    std::vector<int> want;
    for (int i = 0; i < kEach; ++i)
      for (int r = 0; r < world(); ++r) {
        kept.push_back(ls::remote_async_call(b, patient, r, adv_add, me(), key(6, me(), i * 8 + r), i));
        want.push_back(i + 1);
        (void)ls::remote_async_call(b, patient, r, adv_add, me(), key(6, me(), 1000 + i * 8 + r), 100 + i);
      }
    const int next = (me() + 1) % world();
    for (int j = 0; j < kFans; ++j) {
      kept.push_back(ls::remote_async_call(b, patient, next, adv_fan, me(), key(6, me(), 100000 + j * 64), 5000));
      want.push_back(5001 * world());
    }
    const double nap = world() > 1 ? 2.0 * me() / (world() - 1) : 0.0;
    sleep_s(nap);
    const auto c = close_session(s);
    INFO("rank " << me() << ": slept " << nap << " s, close took " << c.seconds << " s: " << c.error);
    CHECK(c.error.empty());
    if (world() > 1 && me() == 0) CHECK(c.seconds > 1.5);  // waited for the last rank, past the timeout
    std::string first;
    CHECK(wrong_ints(kept, want, first) == 0);
    INFO("first wrong kept future: " << first);
    CHECK(first.empty());
    for (int from = 0; from < world(); ++from) {
      INFO("calls from rank " << from);
      CHECK(calls_from(from) == 2 * kEach + kFans);
      CHECK(sums_from(from) == kEach * (kEach - 1) / 2 + (100L * kEach + kEach * (kEach - 1) / 2) + 5000L * kFans);
    }
    CHECK(dupes() == 0);
    ls::barrier(b);
  }
}

TEST_CASE("adversarial close: auto_init_rpc whose func throws on a rank other than 0 while rank 0 still calls it") {
  // The thrower (the last rank; rank 0 alone at 1 rank, after its calls) throws at once; rank 0
  // sleeps 0.2 s, then makes 30 calls to every rank it waits for and 30 it drops. The thrower's
  // exception must come out of it unchanged, after its close served every call (counted
  // exactly); rank 0 and the others return their func's result.
  reset();
  ls::barrier(backend());
  const int thrower = world() - 1;
  constexpr int kSync = 30, kDropped = 30;
  long rank0_wrong = 0;
  std::string rank0_first;
  auto run = ls::auto_init_rpc(nullptr, ls::RemoteOptions{.timeout = 30})([&]() -> int {
    auto& mb = ls::get_distributed_backend<ls::MPIBackend>();
    if (me() == 0) {
      sleep_s(0.2);
      for (int i = 0; i < kSync; ++i)
        for (int r = 0; r < world(); ++r) {
          try {
            rank0_wrong += ls::remote_sync_call(mb, r, adv_add, 0, key(7, r, i), i) != i + 1;
          } catch (...) {
            ++rank0_wrong;
            if (rank0_first.empty()) rank0_first = describe(std::current_exception());
          }
          (void)ls::remote_async_call(mb, r, adv_add, 0, key(7, r, 1000 + i), 1);
        }
    }
    if (me() == thrower) throw std::runtime_error("func failed on rank " + std::to_string(me()));
    return 40 + me();
  });
  std::string thrown;
  int got = -1;
  try {
    got = run();
  } catch (const std::runtime_error& x) {
    thrown = x.what();
  }
  INFO("rank " << me() << ": returned " << got << ", threw '" << thrown << "'; rank 0's first error: " << rank0_first);
  if (me() == thrower) {
    CHECK(thrown == "func failed on rank " + std::to_string(me()));
  } else {
    CHECK(thrown.empty());
    CHECK(got == 40 + me());
  }
  if (me() == 0) CHECK(rank0_wrong == 0);
  CHECK(calls_from(0) == kSync + kDropped);
  CHECK(sums_from(0) == kSync * (kSync - 1) / 2 + kDropped);
  CHECK(dupes() == 0);
  ls::barrier(backend());
}

TEST_CASE("adversarial close: auto_init_rpc five times in a row, with other options each time") {
  // Each round: worker_init sets a value of its round on every rank; func on every rank reads
  // its next rank's value (it must be this round's), sends every rank 10 calls it drops, and
  // returns. Every round's calls must all have run by the time it returns, once.
  struct Opt {
    bool bg;
    double timeout;
    std::size_t cache;
  };
  const std::vector<Opt> opts{{false, 30, 0}, {true, 2.0, std::size_t{64} << 20}, {false, 1.0, std::size_t{64} << 20},
                              {true, 30, 0}, {false, 5.0, std::size_t{512} << 20}};
  ls::barrier(backend());
  constexpr int kCalls = 10;
  for (int round = 0; round < static_cast<int>(opts.size()); ++round) {
    INFO("round " << round);
    reset();
    const Opt& o = opts[static_cast<std::size_t>(round)];
    int inits = 0;
    auto init = [&] {
      g_init_value = 100 * round + me();
      ++inits;
    };
    int seen = -1;
    auto f = ls::auto_init_rpc(init, ls::RemoteOptions{.background = o.bg, .timeout = o.timeout,
                                                       .receive_cache_bytes = o.cache})([&](int x) {
      auto& mb = ls::get_distributed_backend<ls::MPIBackend>();
      seen = ls::remote_sync_call(mb, (me() + 1) % world(), adv_init_value);
      for (int i = 0; i < kCalls; ++i)
        for (int r = 0; r < world(); ++r) (void)ls::remote_async_call(mb, r, adv_add, me(), key(8, me(), i * 8 + r), i);
      return x + round;
    });
    const auto t0 = Clock::now();
    std::string err;
    int got = -1;
    try {
      got = f(1000);
    } catch (...) {
      err = describe(std::current_exception());
    }
    INFO("rank " << me() << ": " << err << " (" << since(t0) << " s)");
    CHECK(err.empty());
    CHECK(got == 1000 + round);
    CHECK(inits == 1);
    CHECK(seen == 100 * round + (me() + 1) % world());
    for (int from = 0; from < world(); ++from) {
      INFO("calls from rank " << from);
      CHECK(calls_from(from) == kCalls);
      CHECK(sums_from(from) == kCalls * (kCalls - 1) / 2);
    }
    CHECK(dupes() == 0);
    CHECK(since(t0) < 10);
  }
  ls::barrier(backend());
}

TEST_CASE("adversarial close: many threads of rank 0 make calls while its main thread closes") {
  // Four threads of rank 0 call adv_add (waiting for each) on every rank in turn, without pause,
  // until a call fails; 0.15 s after they start, rank 0's main thread closes the session (the
  // other ranks close at once and serve). Without, then with, background serving. A call may be
  // refused at its start once the session is closing (InvalidArgument: "closing", or no session
  // any more); a call that was accepted and sent must be answered (docs/remote.md: "until ...
  // every call made on it has been answered"). So every thread must end with a refusal, never
  // with another error; the calls run on each rank must be exactly the calls answered there.
  auto& b = backend();
  constexpr int kThreads = 4;
  for (const bool bg : {false, true}) {
    INFO("background " << bg);
    reset();
    ls::barrier(b);
    ls::RemoteSession s(b, ls::RemoteOptions{.background = bg, .timeout = 30});
    std::vector<long> ok(static_cast<std::size_t>(world()), 0);  // answered, per rank (rank 0)
    std::vector<std::string> ends(kThreads);
    long wrong = 0, refused = 0, lost = 0;
    std::string first_lost;
    Closed c{"", 0};
    if (me() == 0) {
      std::mutex m;
      std::vector<std::thread> ts;
      std::atomic<int> started{0};
      for (int t = 0; t < kThreads; ++t)
        ts.emplace_back([&, t] {
          ++started;
          for (std::int64_t i = 0; i < 200000; ++i) {
            const int r = static_cast<int>((i + t) % world());
            try {
              const int v = static_cast<int>(i % 1000);
              const int got = ls::remote_sync_call(b, r, adv_add, 0, key(9, 0, t * 1000000 + i), v);
              std::lock_guard lk(m);
              ok[static_cast<std::size_t>(r)] += 1;
              wrong += got != v + 1;
            } catch (const ls::InvalidArgument& x) {
              std::lock_guard lk(m);
              ++refused;
              ends[static_cast<std::size_t>(t)] = std::string("refused: ") + x.what();
              return;
            } catch (...) {
              std::lock_guard lk(m);
              ++lost;
              ends[static_cast<std::size_t>(t)] = "lost: " + describe(std::current_exception());
              if (first_lost.empty()) first_lost = ends[static_cast<std::size_t>(t)];
              return;
            }
          }
          ends[static_cast<std::size_t>(t)] = "ran out of calls";
        });
      while (started.load() < kThreads) std::this_thread::yield();
      sleep_s(0.15);
      c = close_session(s);
      for (auto& t : ts) t.join();
    } else {
      c = close_session(s);
    }
    INFO("rank " << me() << ": close took " << c.seconds << " s: " << c.error);
    CHECK(c.error.empty());
    if (me() == 0) {
      long total = 0;
      for (long x : ok) total += x;
      INFO("answered calls " << total << ", refused " << refused << ", accepted but not answered " << lost
                             << "; first of those: " << first_lost);
      std::string how;
      for (int t = 0; t < kThreads; ++t) how += "; thread " + std::to_string(t) + " ended: " + ends[static_cast<std::size_t>(t)];
      INFO("threads" << how);
      CHECK(total > 0);
      CHECK(wrong == 0);
      CHECK(lost == 0);
      CHECK(refused == kThreads);
    }
    // Every rank compares the calls of rank 0 it ran with those rank 0 had answered by it.
    long ran_here = calls_from(0);
    std::vector<long> answered(static_cast<std::size_t>(world()));
    for (int r = 0; r < world(); ++r) answered[static_cast<std::size_t>(r)] = sum_all(me() == 0 ? ok[static_cast<std::size_t>(r)] : 0);
    INFO("rank " << me() << ": ran " << ran_here << " calls of rank 0, rank 0 had " << answered[static_cast<std::size_t>(me())]
                 << " answered");
    CHECK(ran_here == answered[static_cast<std::size_t>(me())]);
    CHECK(dupes() == 0);
    ls::barrier(b);
  }
}

TEST_CASE("adversarial close: auto_init_rpc whose worker_init throws on the last rank") {
  // Timeout 2 s. worker_init throws on the last rank (rank 0 alone at 1 rank): its session
  // closes (the destructor, serving) before the barrier after worker_init, which the other ranks
  // wait in. Every rank must come out within a few times the timeout: the thrower with its
  // exception, the others with an error (the barrier's TimeoutError, or their close's), and the
  // backend must work after (an allreduce on it). Last in the file: should the ranks hang (as
  // they did: the thrower's close_rounds allreduce met the others' barrier on the session's
  // communicator), a watchdog ends the job after 12 s with a message, instead of the ctest timeout.
  ls::barrier(backend());
  std::mutex wd_mu;
  std::condition_variable wd_cv;
  bool wd_done = false;
  std::thread watchdog([&] {
    std::unique_lock lk(wd_mu);
    if (!wd_cv.wait_for(lk, std::chrono::seconds(12), [&] { return wd_done; })) {
      std::cerr << "remote_close_adversarial: rank " << me()
                << ": 'auto_init_rpc whose worker_init throws on the last rank' hung for 12 s (in the close of its "
                   "session); aborting the job"
                << std::endl;
      MPI_Abort(MPI_COMM_WORLD, 3);
    }
  });
  struct Join {
    std::mutex& m;
    std::condition_variable& cv;
    bool& done;
    std::thread& t;
    ~Join() {
      {
        std::lock_guard lk(m);
        done = true;
      }
      cv.notify_all();
      t.join();
    }
  } join{wd_mu, wd_cv, wd_done, watchdog};
  const int thrower = world() - 1;
  bool func_ran = false;
  auto f = ls::auto_init_rpc([&] {
    if (me() == thrower) throw std::runtime_error("worker_init failed on rank " + std::to_string(me()));
  }, ls::RemoteOptions{.timeout = 2.0})([&] {
    func_ran = true;
    return 1;
  });
  const auto t0 = Clock::now();
  std::string err;
  try {
    (void)f();
  } catch (...) {
    err = describe(std::current_exception());
  }
  const double secs = since(t0);
  INFO("rank " << me() << ": " << err << " after " << secs << " s");
  if (me() == thrower) CHECK(err == "std::exception: worker_init failed on rank " + std::to_string(me()));
  else CHECK(!err.empty());
  CHECK_FALSE(func_ran);
  CHECK(secs < 10);
  CHECK(sum_all(1) == world());
  ls::barrier(backend());
}
