// A rank that finalises Lockstep with a remote session still open (issue 25, item 5), run by
// reliability/run_trust.sh, which checks every rank's lines and the time the job took.
//
// Usage: remote_finalize <worker|driver>   (2 ranks or more)
//   The rank that leaves (worker: rank 1, driver: rank 0) calls finalize<MPIBackend>() while
//   its RemoteSession is open and a call from the caller (the other one of ranks 0 and 1) is
//   queued on it unanswered. It used to end in std::terminate and MPI_ABORT (the session's
//   progress thread went on calling MPI, a joinable thread in a static table), and the caller
//   waited for its call's deadline. Now finalize leaves the session (it tells the others), and:
//   - the leaving rank's finalize returns normally, and MPI is finalised;
//   - the caller's pending call and a later call to the leaving rank each end in a TimeoutError
//     naming it within seconds (the session's timeout is 60 s);
//   - every other rank's close of the session ends, and every rank returns from main normally.
#include <chrono>
#include <string>
#include <thread>

#include "lockstep/lockstep.hpp"
#include "reliability/scenario.hpp"

namespace ls = lockstep;
using namespace lstest::scenario;

namespace {
int twice(int x) { return 2 * x; }
}  // namespace
LOCKSTEP_REMOTE(twice)

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  ls::MPIBackend* world = start();
  if (world == nullptr) return 0;
  auto& b = *world;
  const int r = b.rank();
  if (b.size() < 2) {
    say("needs 2 ranks or more");
    return 77;
  }
  if (b.size() < 2 || (mode != "worker" && mode != "driver" && mode != "driver_in_run")) {
    say("needs 2 ranks or more and a mode (worker or driver)");
    return 77;
  }
  if (mode == "driver_in_run") {
    // The driver's function finalises Lockstep while the other ranks serve in run_driver: they
    // end their run_driver with a TimeoutError naming the driver at once (not after the
    // session's 60 s), and the driver's run_driver ends in an Error instead of sending on a
    // session that is gone.
    ls::RemoteSession session(b, ls::RemoteOptions{.timeout = 60});
    const auto t0 = std::chrono::steady_clock::now();
    say("run_driver: " + outcome([&] {
          ls::run_driver(b, [&] {
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
            say("finalize: " + outcome([] { ls::finalize<ls::MPIBackend>(); }));
          });
        }));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    say(secs < 10 ? "ended within 10 s" : "ended after " + std::to_string(secs) + " s");
    if (r != 0) say("close: " + outcome([&] { session.close(); }));
    say("returning");
    return 0;
  }
  const int leaver = mode == "worker" ? 1 : 0;
  const int caller = 1 - leaver;
  ls::RemoteSession session(b, ls::RemoteOptions{.timeout = 60});
  b.barrier();
  say("session open");
  if (r == leaver) {
    // The caller's call comes and is queued here (this rank's code never waits on the session,
    // so nothing runs it); then this rank finalises with the session open.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    say("finalize: " + outcome([] { ls::finalize<ls::MPIBackend>(); }));
    say(std::string("MPI finalised: ") + (ls::is_available() ? "no" : "yes"));
    say("returning");
    return 0;
  }
  if (r == caller) {
    const auto t0 = std::chrono::steady_clock::now();
    ls::Future<int> f = ls::remote_async_call(b, leaver, twice, 21);
    say("pending call: " + outcome([&] { (void)f.wait(); }));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    say(secs < 10 ? "answered within 10 s" : "answered after " + std::to_string(secs) + " s");
    say("later call: " + outcome([&] { (void)ls::remote_sync_call(b, leaver, twice, 1); }));
  }
  say("close: " + outcome([&] { session.close(); }));
  say("returning");
  return 0;
}
