// Remote calls under mpiexec at 2 and 3 ranks (issue 25, the remote-calls round's notes):
// - a reply dropped as malformed is answered: its caller gets a RemoteError at once, and the
//   graceful close, whose rounds wait until every call is answered, completes (the reply used to
//   be dropped uncounted: the caller waited for its deadline, the close for ever);
// - a request whose tensors cannot be received, sent while an earlier request from the same rank
//   is still arriving, is failed in its turn, after the earlier one ran (it used to overtake it).
// Checks that need both sides are made after the collectives (no REQUIRE between them).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "lockstep/lockstep.hpp"
#include "remote/remote_test_support.hpp"

namespace ls = lockstep;

namespace {

using namespace remote_test;


// Returns x; its own reply goes out malformed (a test hook: the lengths in its header do not add up).
int order_malformed_echo(int x) {
  ls::detail::remote::test_hooks().malformed_replies.store(1);
  return x;
}
int order_echo(int x) { return x; }
// The earlier request: a large tensor, and it takes a second to run.
std::atomic<int> g_big_ran{0};
double order_big(ls::Tensor t) {
  std::this_thread::sleep_for(std::chrono::seconds(1));
  g_big_ran.fetch_add(1);
  return static_cast<double>(t.numel());
}
// The later request: its tensor finds no memory on the called rank (a test hook).
double order_small(ls::Tensor t) { return static_cast<double>(t.numel()); }
LOCKSTEP_REMOTE(order_malformed_echo)
LOCKSTEP_REMOTE(order_echo)
LOCKSTEP_REMOTE(order_big)
LOCKSTEP_REMOTE(order_small)

}  // namespace

TEST_CASE("a reply dropped as malformed is a RemoteError at its caller at once, and the session closes") {
  auto& b = backend();
  if (b.size() < 2) return;
  ls::RemoteSession session(b, ls::RemoteOptions{.timeout = 20});
  std::string first, second;
  double secs = -1;
  std::optional<std::string> driver_error;
  try {
    ls::run_driver(b, [&] {
      const auto t0 = Clock::now();
      try {
        (void)ls::remote_sync_call(b, 1, order_malformed_echo, 7);
        first = "no exception";
      } catch (const ls::RemoteError& e) {
        first = std::string("RemoteError: ") + e.what();
      } catch (const std::exception& e) {
        first = std::string("other: ") + e.what();
      }
      secs = since(t0);
      second = std::to_string(ls::remote_sync_call(b, b.size() - 1, order_echo, 5));
    });
  } catch (const std::exception& e) {
    driver_error = e.what();
  }
  std::optional<std::string> close_error;
  const auto t0 = Clock::now();
  try {
    session.close();
  } catch (const std::exception& e) {
    close_error = e.what();
  }
  const double close_secs = since(t0);
  CHECK(!driver_error);
  CHECK(!close_error);
  CHECK(close_secs < 10);
  if (b.rank() == 0) {
    INFO(first);
    CHECK(first.rfind("RemoteError: ", 0) == 0);
    CHECK(first.find("malformed") != std::string::npos);
    CHECK(first.find("on rank 1") != std::string::npos);
    CHECK(secs >= 0);
    CHECK(secs < 5);  // not the call's deadline (20 s)
    CHECK(second == "5");
  }
}

TEST_CASE("a request that fails while an earlier one from the same rank is still arriving fails after it ran") {
  auto& b = backend();
  if (b.size() < 2) return;
  g_big_ran = 0;
  ls::RemoteSession session(b, ls::RemoteOptions{.background = true, .timeout = 30});
  const std::int64_t big_numel = std::int64_t{128} << 20;  // 512 MiB of f32: arrives over many ms
  std::mutex mu;
  std::shared_ptr<ls::Future<double>> fa;
  std::thread sender;
  if (b.rank() == 0) {
    sender = std::thread([&] {
      ls::Tensor big = ls::Tensor::zeros({big_numel});
      auto f = std::make_shared<ls::Future<double>>(ls::remote_async_call(b, 1, order_big, big));
      std::lock_guard lk(mu);
      fa = std::move(f);
    });
  }
  bool armed = false;
  if (b.rank() == 1) {
    // The earlier request's header has come when its tensor's buffer was taken from the session's
    // receive cache; then the next tensor this rank receives finds no memory.
    const auto t0 = Clock::now();
    while (ls::detail::remote::receive_cache_stats(b).misses == 0 && since(t0) < 20)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    armed = ls::detail::remote::receive_cache_stats(b).misses > 0;
    ls::detail::remote::test_hooks().fail_allocations.store(1);
  }
  b.barrier();  // rank 0 sends the later request only now
  std::string later;
  bool big_ready_then = false;
  double later_secs = -1;
  if (b.rank() == 0) {
    const auto t0 = Clock::now();
    try {
      (void)ls::remote_sync_call(b, 1, order_small, ls::Tensor::zeros({4}));
      later = "no exception";
    } catch (const std::exception& e) {
      later = e.what();
    }
    later_secs = since(t0);
    {
      std::lock_guard lk(mu);
      big_ready_then = fa && fa->ready();  // its reply was sent before the later one's error
    }
    sender.join();
    CHECK(fa->wait() == static_cast<double>(big_numel));
  }
  b.barrier();
  const int big_ran = g_big_ran.load();
  ls::detail::remote::test_hooks().fail_allocations.store(0);
  session.close();
  if (b.rank() == 1) {
    CHECK(armed);
    CHECK(big_ran == 1);
  }
  if (b.rank() == 0) {
    INFO(later);
    CHECK(later.find("cannot be received") != std::string::npos);
    CHECK(big_ready_then);
    CHECK(later_secs >= 0.9);  // the earlier request ran (1 s) before the later one failed
  }
}
