// Scenarios of the trust tests that end a process or the job (run by run_trust.sh, which checks
// what every rank printed and how long the job took). Each rank prints one line
// "rank R: <outcome>" per step, flushed, so that the script sees it even if the job is killed.
#include <lockstep/lockstep.hpp>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "reliability/scenario.hpp"

namespace ls = lockstep;
using namespace lstest::scenario;

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  ls::MPIBackend* world = start();
  if (world == nullptr) {
    if (scenario == "finalize_after_refused_init") {
      // initialize was refused (a malformed setting on some rank), and the program calls
      // finalize as a tidy program does: it must not throw the reported error again, and must
      // finalise MPI (mpiexec would otherwise report the job as exiting improperly).
      say("finalize: " + outcome([] { ls::finalize<ls::MPIBackend>(); }));
      say(std::string("MPI finalised: ") + (ls::is_available() ? "no" : "yes"));
    }
    return 0;
  }
  auto& b = *world;
  const int r = b.rank();
  say("started");
  if (scenario == "uncaught" && r == 1) throw std::runtime_error("cannot open data.bin: no such file");
  if (scenario == "returns_early") {
    // A rank-local error that the program handles by returning from main: the others must not
    // wait for it until the deadline.
    if (r == 1) {
      say("returning early");
      return 1;
    }
    b.barrier();
    say("OK");
    return 0;
  }
  try {
    if (scenario == "settings") {
      say("OK");
    } else if (scenario == "finalize_after_stall") {
      // Rank 1 stops calling collectives for a long time; rank 0's deadline passes, it catches the
      // TimeoutError and returns from main: the job must end soon after, not when rank 1 is back.
      if (r == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
      b.barrier();
      say("OK");
    } else if (scenario == "uncaught") {
      b.barrier();
      say("OK");
    } else if (scenario == "stop_in_shm" || scenario == "kill_in_shm") {
      ls::Tensor x = ls::Tensor::ones({std::int64_t{16} << 20});  // 64 MiB: the shared-memory path
      b.allreduce(x, ls::ReduceOp::sum);
      say(b.shared_memory() ? "shared memory on" : "shared memory off");
      if (r == 1) {
        std::thread([scenario] {
          std::this_thread::sleep_for(std::chrono::milliseconds(30));
          say(scenario == "kill_in_shm" ? "killing myself" : "stopping myself");
          raise(scenario == "kill_in_shm" ? SIGKILL : SIGSTOP);
        }).detach();
      }
      for (int i = 0; i < 100000; ++i) b.allreduce(x, ls::ReduceOp::sum);
      say("OK");
    } else if (scenario == "refused") {
      // The last rank passes a null pointer: the front end refuses it there. Unchecked (the
      // default), the others are told; nobody waits forever.
      ls::Tensor x = ls::Tensor::ones({8});
      ls::TensorView bad{nullptr, 8, ls::DType::f32, ls::Device::cpu()};
      b.allreduce(r == b.size() - 1 ? bad : x.view(), ls::ReduceOp::sum);
      say("OK");
    } else if (scenario == "nonblocking_mpi_error") {
      // Counts that differ in a nonblocking allreduce (600 against 500) under a deadline: MPI
      // reports an error through MPI_Test, which must come back as an exception.
      ls::Tensor x = ls::Tensor::ones({r == 0 ? 600 : 500});
      ls::Request req = b.iallreduce(x, ls::ReduceOp::sum);
      req.wait();
      say("OK");
    } else if (scenario == "mpi_error_iallreduce" || scenario == "mpi_error_allreduce") {
      // Counts that differ (600 on rank 0, 500 elsewhere), no check level: MPI fails on some
      // rank (MPI_ERR_TRUNCATE), where it is an MpiError. The others used to wait for the
      // default deadline (600 s); now they are told, and raise MpiError naming that rank and
      // its error within a second or two.
      ls::Tensor x = ls::Tensor::ones({r == 0 ? 600 : 500});
      const auto t0 = std::chrono::steady_clock::now();
      if (scenario == "mpi_error_iallreduce") {
        say("wait: " + outcome([&] {
              ls::Request req = b.iallreduce(x, ls::ReduceOp::sum);
              req.wait();
            }));
      } else {
        say("allreduce: " + outcome([&] { b.allreduce(x, ls::ReduceOp::sum); }));
      }
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      say(secs < 5 ? "raised within 5 s" : "raised after " + std::to_string(secs) + " s");
      say("next barrier: " + outcome([&] { b.barrier(); }));
      say("usable " + std::to_string(b.usable() ? 1 : 0));
    } else {
      say("unknown scenario " + scenario);
      return 2;
    }
  } catch (const std::exception& e) {
    report(e);
    return 0;  // handled: returns from main (finalize must not then wait for the others)
  }
  return 0;
}
