// A rank that stops answering without dying (SIGSTOP, as a debugger, a swapped-out node or a
// frozen container would leave it), issue 15, item 4.
//
// Usage: remote_stall <worker|driver|closing|lost>   (2 ranks or more; 1 rank: skipped, 77)
//   worker: the driver stops rank 1 with SIGSTOP. A call to it must end in a TimeoutError naming
//           rank 1 within its per-call timeout (1 s), both a small call (its reply never comes)
//           and one with a 16 MiB tensor (its data is never taken); calls to the other ranks go
//           on meanwhile. Rank 1 stays stopped for longer than the session's timeout (3 s), is
//           resumed with SIGCONT, and must then go on serving: not take the driver for silent
//           (the driver's heartbeats came while it was stopped), answer the next calls with
//           their own results (the late replies of the timed-out calls are dropped).
//   driver: rank 1, inside a call of the driver, stops the driver with SIGSTOP. Every serving
//           rank must end its run_driver with a TimeoutError ("heard nothing from the driver")
//           after the session's timeout (3 s), not hang; then rank 1 resumes the driver, whose
//           run_driver completes, and the session closes on every rank.
//   closing: rank 0 stops rank 1 with SIGSTOP before rank 1 closes the session; the others
//           close it (a graceful close waits for every rank while it serves, bounded by
//           heartbeats): each must throw a TimeoutError naming rank 1 about the session's
//           timeout (3 s) later, not hang. Rank 0 then resumes rank 1, whose close must end with
//           an error too, within seconds (the others left), and the backend works after.
//   lost:   run_driver on a session of its own (it creates and closes it), session timeout 3 s,
//           3 ranks or more: the driver stops rank 1 with SIGSTOP and calls it with a 64 KiB
//           tensor (whose send the stopped rank never takes: it stays pending, as a send to a
//           lost host does). The call's TimeoutError comes at its deadline; the rest of
//           run_driver (telling the workers that f threw, closing the session, settling the
//           pending send) must not wait for rank 1 again, it has been silent for the deadline
//           already, and must end (a failed close once waited for ever for that send, which
//           only rank 1 could complete): the driver's run_driver throws the call's error, and every
//           other serving rank a TimeoutError of the close naming rank 1 (or of the driver's
//           leaving, should that notice come first), each less than twice
//           the timeout after the stop (each step used to wait afresh: the deadline, then the
//           close's own timeout for the silent rank, about 6 s and more). Rank 1, resumed, gets
//           an error from its run_driver too.
// Exit status 0 when every rank saw what it should, 1 otherwise.
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "remote_test_support.hpp"

namespace ls = lockstep;

namespace {

using remote_test::Clock;
using remote_test::since;
using namespace remote_test::program;
Clock::time_point g_stopped_driver_at{};
int g_driver_pid = 0;

void say(const std::string& s) { std::cout << "[rank " << g_rank << "] " << s << std::endl; }

// Waits (up to 5 s) until the process is stopped (state T in /proc/<pid>/stat): the signal has
// taken effect, none of its threads runs any more.
bool wait_stopped(int pid) {
  const auto t0 = Clock::now();
  while (since(t0) < 5.0) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
    std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const auto close = all.rfind(')');  // after the command name, which may hold spaces
    if (close != std::string::npos && close + 2 < all.size() && (all[close + 2] == 'T' || all[close + 2] == 't'))
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

int pid_of() { return static_cast<int>(::getpid()); }
int add(int a, int b) { return a + b; }
ls::Tensor echo(ls::Tensor t) { return t; }
// Rank 1 stops the caller (the driver) and returns: the reply waits for the driver to resume.
int stop_caller(int pid) {
  g_driver_pid = pid;
  g_stopped_driver_at = Clock::now();
  ::kill(static_cast<pid_t>(pid), SIGSTOP);
  check(wait_stopped(pid), "the driver did not stop");
  return 7;
}
LOCKSTEP_REMOTE(pid_of)
LOCKSTEP_REMOTE(add)
LOCKSTEP_REMOTE(echo)
LOCKSTEP_REMOTE(stop_caller)

constexpr double kSessionTimeout = 3.0;
constexpr double kCallTimeout = 1.0;

// Calls f, which must throw a TimeoutError naming `parts`, about kCallTimeout after the start.
template <class F>
void expect_call_timeout(const std::string& what, F f, std::initializer_list<std::string> parts) {
  const auto t0 = Clock::now();
  try {
    f();
    check(false, what + ": no TimeoutError");
  } catch (const ls::TimeoutError& e) {
    const double s = since(t0);
    say(what + ": " + e.what() + " after " + std::to_string(s) + " s");
    for (const auto& p : parts) check(contains(e.what(), p), what + ": the message lacks '" + p + "'");
    check(s >= kCallTimeout - 0.05 && s < kCallTimeout + 2.0, what + ": after " + std::to_string(s) + " s");
  } catch (const std::exception& e) {
    check(false, what + ": another error: " + e.what());
  }
}

void stopped_worker(ls::Backend& b) {
  const int size = b.size();
  ls::RemoteSession session(b, ls::RemoteOptions{.timeout = kSessionTimeout});
  int got = -1;
  bool resumed_ok = false;
  try {
    got = ls::run_driver(b, [&] {
      const int pid1 = ls::remote_sync_call(b, 1, pid_of);
      const auto stopped_at = Clock::now();
      ::kill(static_cast<pid_t>(pid1), SIGSTOP);
      check(wait_stopped(pid1), "rank 1 did not stop");
      say("stopped rank 1 (pid " + std::to_string(pid1) + ")");
      const ls::CallOptions quick{.timeout = kCallTimeout};
      expect_call_timeout("a small call to the stopped rank",
                          [&] { (void)ls::remote_sync_call(b, quick, 1, add, 1, 2); },
                          {"'add' on rank 1", "within 1 s"});
      const auto big = ls::Tensor::full({std::int64_t{4} << 20}, -1.0);  // 16 MiB
      expect_call_timeout("a 16 MiB call to the stopped rank",
                          [&] { (void)ls::remote_sync_call(b, quick, 1, echo, big); }, {"'echo'", "rank 1"});
      if (size >= 3) check(ls::remote_sync_call(b, ls::CallOptions{.timeout = 30}, 2, add, 20, 22) == 42,
                           "a call to rank 2 while rank 1 is stopped");
      // Stopped for longer than the session's timeout.
      while (since(stopped_at) < kSessionTimeout + 1.0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ::kill(static_cast<pid_t>(pid1), SIGCONT);
      say("resumed rank 1 after " + std::to_string(since(stopped_at)) + " s");
      const ls::CallOptions patient{.timeout = 30};
      check(ls::remote_sync_call(b, patient, 1, add, 40, 2) == 42, "add on rank 1 after it resumed");
      auto back = ls::remote_sync_call(b, patient, 1, echo, ls::Tensor::full({std::int64_t{4} << 20}, 5.0));
      long bad = 0;
      for (float x : back.span<float>()) bad += x != 5.0f;
      check(bad == 0 && back.numel() == (std::int64_t{4} << 20), "echo on rank 1 after it resumed");
      return 1;
    });
    resumed_ok = true;
  } catch (const std::exception& e) {
    check(false, std::string("run_driver threw: ") + e.what());
  }
  check(resumed_ok && got == 1, "run_driver's result on every rank (rank 1 went on serving after it resumed)");
  try {
    session.close();
  } catch (const std::exception& e) {
    check(false, std::string("closing the session: ") + e.what());
  }
}

void stopped_driver(ls::Backend& b) {
  const int rank = b.rank();
  MPI_Comm workers = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank == 0 ? MPI_UNDEFINED : 1, rank, &workers);
  ls::RemoteSession session(b, ls::RemoteOptions{.timeout = kSessionTimeout});
  const auto t0 = Clock::now();
  try {
    // The call's deadline is longer than the driver stays stopped: a caller that was stopped
    // itself past a deadline takes the clock's jump for a late reply (docs/remote.md).
    const int r = ls::run_driver(
        b, [&] { return ls::remote_sync_call(b, ls::CallOptions{.timeout = 60}, 1, stop_caller, pid_of()); });
    if (rank == 0) {
      check(r == 7, "the driver's call, after it resumed");
      say("the driver resumed; run_driver returned after " + std::to_string(since(t0)) + " s");
    } else {
      check(false, "run_driver returned on a serving rank whose driver was stopped");
    }
  } catch (const ls::TimeoutError& e) {
    const double s = rank == 1 ? since(g_stopped_driver_at) : since(t0);
    say(std::string(e.what()) + " after " + std::to_string(s) + " s");
    check(rank != 0, std::string("a TimeoutError on the driver: ") + e.what());
    check(contains(e.what(), "heard nothing from the driver, rank 0 (host ") && contains(e.what(), "), for 3 s"),
          "the serving rank's message names the driver and its host");
    if (rank == 1) check(s >= kSessionTimeout - 0.7 && s < kSessionTimeout + 3.0, "rank 1: after " + std::to_string(s) + " s");
    else check(s < kSessionTimeout + 6.0, "after " + std::to_string(s) + " s");
  } catch (const std::exception& e) {
    check(false, std::string("run_driver threw another error: ") + e.what());
  }
  if (rank != 0) {
    MPI_Barrier(workers);  // every serving rank has its error: the driver may come back
    if (rank == 1 && g_driver_pid > 0) ::kill(static_cast<pid_t>(g_driver_pid), SIGCONT);
    MPI_Comm_free(&workers);
  }
  try {
    session.close();
  } catch (const std::exception& e) {
    check(false, std::string("closing the session: ") + e.what());
  }
}

void stopped_closing(ls::Backend& b) {
  const int rank = b.rank();
  std::vector<int> pids(static_cast<std::size_t>(b.size()));
  const int mine = pid_of();
  MPI_Allgather(&mine, 1, MPI_INT, pids.data(), 1, MPI_INT, MPI_COMM_WORLD);
  ls::RemoteSession session(b, ls::RemoteOptions{.timeout = kSessionTimeout});
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) {
    ::kill(static_cast<pid_t>(pids[1]), SIGSTOP);
    check(wait_stopped(pids[1]), "rank 1 did not stop");
    say("stopped rank 1 before it closes");
  }
  if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));  // stopped in here
  // Ranks other than 0 and 1 wait for rank 0's word that the signal has taken effect.
  int word = 1;
  if (rank == 0)
    for (int r = 2; r < b.size(); ++r) MPI_Send(&word, 1, MPI_INT, r, 77, MPI_COMM_WORLD);
  else if (rank >= 2)
    MPI_Recv(&word, 1, MPI_INT, 0, 77, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  const auto t0 = Clock::now();
  std::string err;
  try {
    session.close();
  } catch (const ls::TimeoutError& e) {
    err = e.what();
  } catch (const std::exception& e) {
    check(false, std::string("close threw another error: ") + e.what());
  }
  const double s = since(t0);
  say("close: " + (err.empty() ? std::string("no error") : err) + " after " + std::to_string(s) + " s");
  if (rank != 1) {
    check(contains(err, "rank 1 (host ") && contains(err, ") sent nothing for 3 s"),
          "the closing rank's TimeoutError names rank 1 and its host");
    check(s >= kSessionTimeout - 0.7 && s < kSessionTimeout + 4.0, "closed after " + std::to_string(s) + " s");
  } else {
    check(!err.empty(), "rank 1, resumed, gets an error from its close (the others left)");
    check(s < kSessionTimeout + 4.0, "rank 1 closed after " + std::to_string(s) + " s");
  }
  if (rank == 0) {
    ::kill(static_cast<pid_t>(pids[1]), SIGCONT);
    say("resumed rank 1");
  }
}

void lost_worker(ls::Backend& b) {
  const int rank = b.rank();
  if (b.size() < 3) {
    if (rank == 0) say("lost: needs 3 ranks or more (a second serving rank); nothing to do");
    return;
  }
  ls::set_timeout(kSessionTimeout);  // the session run_driver makes takes lockstep::timeout()
  Clock::time_point stopped_at{};
  int pid1 = 0;
  std::string err;
  try {
    ls::run_driver(b, [&] {
      pid1 = ls::remote_sync_call(b, 1, pid_of);
      (void)ls::remote_sync_call(b, 2, add, 1, 1);  // rank 2 answers (and so is heard from)
      stopped_at = Clock::now();
      ::kill(static_cast<pid_t>(pid1), SIGSTOP);
      check(wait_stopped(pid1), "rank 1 did not stop");
      say("stopped rank 1 (pid " + std::to_string(pid1) + ")");
      (void)ls::remote_sync_call(b, 1, echo, ls::Tensor::ones({16 * 1024}));
      check(false, "a call to the stopped rank 1 returned");
    });
    check(false, "run_driver returned although rank 1 was stopped");
  } catch (const ls::TimeoutError& e) {
    err = e.what();
  } catch (const std::exception& e) {
    check(false, std::string("run_driver threw another error: ") + e.what());
  }
  // Rank 0 tells the others when it stopped rank 1 (on its clock: the ranks share the machine).
  std::int64_t at = rank == 0 ? std::chrono::duration_cast<std::chrono::microseconds>(stopped_at.time_since_epoch()).count() : 0;
  const double s = rank == 0 ? since(stopped_at) : 0.0;
  if (rank == 0) {
    say("run_driver: " + err + " after " + std::to_string(s) + " s");
    // (Its send's deadline: the tensor is never taken.)
    check(contains(err, "remote call of 'echo'") && contains(err, "rank 1 (host ") && contains(err, "within 3 s"),
          "the driver's error is its call's, naming rank 1 and its host");
    check(s < 2 * kSessionTimeout - 0.5, "the driver's run_driver ended " + std::to_string(s) + " s after the stop");
    ::kill(static_cast<pid_t>(pid1), SIGCONT);
    say("resumed rank 1");
    for (int r = 2; r < b.size(); ++r) MPI_Send(&at, 1, MPI_INT64_T, r, 78, MPI_COMM_WORLD);
  } else if (rank >= 2) {
    const auto now_us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch()).count();
    MPI_Recv(&at, 1, MPI_INT64_T, 0, 78, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    const double after = static_cast<double>(now_us - at) / 1e6;
    say("run_driver: " + err + " " + std::to_string(after) + " s after the stop");
    // Its close names rank 1 (as rank 0 found it), or, should rank 0's notice of leaving come
    // before its end of run, the driver's leaving.
    check((contains(err, "closing the remote session: rank 1 (host ") && contains(err, ") sent nothing for 3 s")) ||
              contains(err, "left the remote session"),
          "a serving rank's error names rank 1 and its host (or the driver's leaving)");
    check(after < 2 * kSessionTimeout - 0.5, "the serving rank's run_driver ended " + std::to_string(after) +
                                                 " s after the stop");
  } else {
    say("rank 1, resumed: " + err);
    check(!err.empty(), "rank 1, resumed, gets a TimeoutError from its run_driver");
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "worker" && mode != "driver" && mode != "closing" && mode != "lost") {
    std::cerr << "usage: remote_stall <worker|driver|closing|lost>\n";
    return 2;
  }
  ls::initialize<ls::MPIBackend>();
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  g_rank = b.rank();
  if (b.size() < 2) {
    std::cout << "SKIP: needs 2 ranks or more\n";
    ls::finalize<ls::MPIBackend>();
    return 77;
  }
  if (mode == "worker") stopped_worker(b);
  else if (mode == "driver") stopped_driver(b);
  else if (mode == "lost") lost_worker(b);
  else stopped_closing(b);
  int failures = g_failures, any = 0;
  MPI_Allreduce(&failures, &any, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0) std::cout << (any == 0 ? "PASS" : "FAIL") << " (" << mode << ", " << b.size() << " ranks)\n";
  ls::finalize<ls::MPIBackend>();
  return any == 0 ? 0 : 1;
}
