// A late delivery after a timeout: one rank is frozen (LOCKSTEP_FAULT kind=freeze: the whole
// process stopped, every thread) when it enters a collective; the others give up at their
// deadline (LOCKSTEP_TIMEOUT) with TimeoutError, write into the buffer they had passed, churn the
// heap and keep MPI progressing while the frozen rank comes back and sends its part. Every rank's
// buffer must keep what it wrote after the failure: no request the library started may still
// target the caller's memory once the collective has thrown. Memory of the library's own that a
// pending request targets must stay allocated: under the sanitizers (CI's sanitize stage runs
// this test) a late write into freed memory is a heap-use-after-free report and ends the rank.
//
// Usage: late_delivery OUTDIR COUNT LINGER_S (the most it waits for the others). Each rank writes OUTDIR/rank.R, one line:
//   "rank R: timeout|completed|error: ... after T s; buffer changed after the failure: N of COUNT"
// and leaves without MPI_Finalize (the communicator is unusable after the stall); run by
// late_delivery.sh, which checks the lines.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/lockstep.hpp"

namespace ls = lockstep;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: late_delivery OUTDIR COUNT LINGER_S\n");
    return 2;
  }
  const std::string outdir = argv[1];
  const std::int64_t count = std::atoll(argv[2]);
  const double linger = std::atof(argv[3]);
  ls::initialize<ls::MPIBackend>();
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = b.rank();

  // Collective #0 connects the ranks; the fault (after=1) freezes its rank at collective #1.
  ls::Tensor warm = ls::Tensor::full({count}, 1.0f);
  b.allreduce(warm.view(), ls::ReduceOp::sum);

  ls::Tensor x = ls::Tensor::full({count}, static_cast<float>(rank + 1));
  std::string outcome;
  const auto t0 = Clock::now();
  try {
    b.allreduce(x.view(), ls::ReduceOp::sum);
    outcome = "completed";
  } catch (const ls::TimeoutError&) {
    outcome = "timeout";
  } catch (const std::exception& e) {
    outcome = std::string("error: ") + e.what();
  }
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();

  // The caller's buffer is its own again: it writes into it, frees and reuses memory, and MPI
  // keeps progressing (as the watchdog's own queries make it do) until every rank has been
  // through its collective (the frozen one too) and two seconds more.
  float* v = x.data<float>();
  for (std::int64_t i = 0; i < count; ++i) v[i] = -7.0f;
  const auto file = [&](int r, const char* what) { return outdir + "/" + what + "." + std::to_string(r); };
  const auto all_there = [&](const char* what) {
    for (int r = 0; r < b.size(); ++r)
      if (!std::ifstream(file(r, what)).good()) return false;
    return true;
  };
  std::ofstream(file(rank, "through")) << outcome << "\n";
  const auto give_up = Clock::now() + std::chrono::duration<double>(linger);
  auto progress_until = [&](auto&& done) {
    while (!done() && Clock::now() < give_up) {
      std::vector<std::vector<char>> churn;
      for (int k = 0; k < 16; ++k) churn.emplace_back(static_cast<std::size_t>(count) * sizeof(float) / 4 + 4096, 'c');
      int flag = 0;
      MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  };
  progress_until([&] { return all_there("through"); });
  const auto two_more = Clock::now() + std::chrono::seconds(2);
  progress_until([&] { return Clock::now() > two_more; });
  std::int64_t changed = 0;
  for (std::int64_t i = 0; i < count; ++i) changed += v[i] == -7.0f ? 0 : 1;

  std::ofstream(file(rank, "rank")) << "rank " << rank << ": " << outcome << " after " << waited
                                   << " s; buffer changed after the failure: " << changed << " of " << count << "\n";
  // Leave together: mpiexec ends the job when the first rank exits without MPI_Finalize.
  progress_until([&] { return all_there("rank"); });
  std::fflush(nullptr);
  std::_Exit(0);  // no MPI_Finalize: the communicator is unusable after the stall
}
