// A rank killed with SIGKILL while remote calls are pending (issue 15, item 4): the job must
// end within seconds (Open MPI's runtime ends a job one of whose processes dies), never hang.
// run_fault.sh runs this under mpiexec (--abort --max-ms-after-fault) and checks that mpiexec
// names the dead rank. The deadlines are off (LOCKSTEP_TIMEOUT=0), so no TimeoutError can end
// the pending calls: only the end of the job can.
//
// Usage: remote_kill <outdir> <calls> <worker|driver>
//   worker: the driver queues `calls` slow calls on every worker, then kills rank 1 with
//           SIGKILL (kill -9 from outside: no destructor, no message) while they are pending.
//   driver: rank 1, in a call of the driver, kills the driver (rank 0) while the driver waits on
//           that call and on the slow calls queued on every worker.
// The rank that kills prints "at unix time ms N" just before, which run_fault.sh times from.
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "lockstep/lockstep.hpp"

namespace ls = lockstep;

namespace {

std::string g_outdir;

void report(const std::string& text) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::ofstream(g_outdir + "/rank" + std::to_string(rank) + ".txt") << text << "\n";
  std::cerr << "[rank " << rank << "] " << text << std::endl;
}

void kill_now(int victim_rank, int pid) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  std::cerr << "remote_kill: rank " << ls::world_info().rank << " kills rank " << victim_rank << " (pid " << pid
            << ") with SIGKILL, remote calls pending, at unix time ms " << ms << std::endl;
  ::kill(static_cast<pid_t>(pid), SIGKILL);
}

int pid_of() { return static_cast<int>(::getpid()); }
double slow(double seconds) {
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  return seconds;
}
ls::Tensor echo(ls::Tensor t) { return t; }
double kill_driver(int pid) {
  kill_now(0, pid);
  return 0;
}
LOCKSTEP_REMOTE(pid_of)
LOCKSTEP_REMOTE(slow)
LOCKSTEP_REMOTE(echo)
LOCKSTEP_REMOTE(kill_driver)

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: remote_kill <outdir> <calls> <worker|driver>\n";
    return 2;
  }
  g_outdir = argv[1];
  const int calls = std::atoi(argv[2]);
  const std::string mode = argv[3];
  if (mode != "worker" && mode != "driver") {
    std::cerr << "remote_kill: unknown mode '" << mode << "'\n";
    return 2;
  }
  ls::initialize<ls::MPIBackend>();
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  if (b.size() < 2) {
    report("SKIP: needs 2 ranks or more");
    ls::finalize<ls::MPIBackend>();
    return 77;
  }
  try {
    ls::run_driver(b, [&] {
      const int victim_pid = ls::remote_sync_call(b, 1, pid_of);
      std::vector<ls::Future<double>> pending;
      std::vector<ls::Future<ls::Tensor>> tensors;
      for (int i = 0; i < calls; ++i)
        for (int r = 1; r < b.size(); ++r) pending.push_back(ls::remote_async_call(b, r, slow, 0.05));
      for (int r = 1; r < b.size(); ++r) tensors.push_back(ls::remote_async_call(b, r, echo, ls::Tensor::ones({1 << 22})));
      if (mode == "worker") {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // rank 1 is inside a call now
        kill_now(1, victim_pid);
      } else {
        pending.push_back(ls::remote_async_call(b, 1, kill_driver, pid_of()));
      }
      (void)ls::wait_all(pending);  // cannot return: the job ends first
      (void)ls::wait_all(tensors);
    });
    report("FAIL: the calls pending on the dead rank returned");
  } catch (const std::exception& e) {
    report(std::string("FAIL: ") + e.what());
  }
  ls::finalize<ls::MPIBackend>();
  return 0;
}
