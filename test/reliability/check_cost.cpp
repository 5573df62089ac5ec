// Cost of the reliability checks on a ResNet-50 gradient sync: 25,557,032 f32 gradients averaged
// in buckets, either one blocking allreduce per 25 MiB bucket (PyTorch DDP's default size) or,
// as DistributedOptimizer does, one iallreduce per 1 MiB bucket, all issued, then waited for.
// Runs the same sync with checks off, at level first, at level always, and with a deadline (the
// polled path), interleaved, and prints the median of each. Not a test: speed belongs in
// benchmarks; run it by hand:
//   mpiexec -n 2 ./lockstep_check_cost [reps] [bucket_kib] [blocking|nonblocking]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"

namespace ls = lockstep;

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 15;
  const bool nonblocking = argc > 3 && std::string(argv[3]) == "nonblocking";
  const std::int64_t bucket = (argc > 2 ? std::atoll(argv[2]) : (nonblocking ? 1024 : 25600)) * 1024 / 4;
  const std::int64_t total = 25'557'032;  // ResNet-50 parameters
  ls::initialize<ls::MPIBackend>();
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  ls::Tensor grads = ls::Tensor::full({total}, 1.0);

  struct Mode {
    const char* name;
    ls::CheckLevel level;
    double timeout;
  };
  const Mode modes[] = {{"off", ls::CheckLevel::off, 0},
                        {"first", ls::CheckLevel::first, 0},
                        {"always", ls::CheckLevel::always, 0},
                        {"always + timeout 60 s", ls::CheckLevel::always, 60},
                        {"off + timeout 60 s", ls::CheckLevel::off, 60}};
  std::vector<std::vector<double>> times(std::size(modes));
  for (int rep = 0; rep < reps + 1; ++rep) {
    for (std::size_t m = 0; m < std::size(modes); ++m) {
      ls::set_check_level(modes[m].level, 3);
      ls::set_timeout(modes[m].timeout);
      MPI_Barrier(MPI_COMM_WORLD);
      auto t0 = std::chrono::steady_clock::now();
      if (nonblocking) {
        std::vector<ls::Request> reqs;
        for (std::int64_t off = 0; off < total; off += bucket)
          reqs.push_back(b.iallreduce(grads.view().slice(off, std::min(bucket, total - off)), ls::ReduceOp::avg));
        for (auto& r : reqs) r.wait();
      } else {
        for (std::int64_t off = 0; off < total; off += bucket)
          ls::allreduce(b, grads.view().slice(off, std::min(bucket, total - off)), ls::ReduceOp::avg);
      }
      double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (rep > 0) times[m].push_back(t);  // the first round warms up
    }
  }
  // The fixed cost per collective, where it is most visible: a one-element allreduce.
  std::vector<double> small(std::size(modes));
  ls::Tensor one = ls::Tensor::full({1}, 1.0);
  const int small_iters = 2000;
  for (int i = 0; i < small_iters; ++i) ls::allreduce(b, one, ls::ReduceOp::sum);  // warm-up
  for (std::size_t m = 0; m < std::size(modes); ++m) {
    ls::set_check_level(modes[m].level, 3);
    ls::set_timeout(modes[m].timeout);
    MPI_Barrier(MPI_COMM_WORLD);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < small_iters; ++i) ls::allreduce(b, one, ls::ReduceOp::sum);
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    small[m] = t / small_iters;
  }
  if (b.rank() == 0) {
    std::printf("one-element allreduce, mean of %d calls:\n", small_iters);
    for (std::size_t m = 0; m < std::size(modes); ++m)
      std::printf("  %-24s %8.2f us\n", modes[m].name, small[m] * 1e6);
    std::printf("ResNet-50 gradient sync (%lld f32, %s %lld-element buckets), %d ranks, median of %d\n",
                static_cast<long long>(total), nonblocking ? "iallreduce of" : "allreduce of",
                static_cast<long long>(bucket), b.size(), reps);
    double base = 0;
    for (std::size_t m = 0; m < std::size(modes); ++m) {
      auto& v = times[m];
      std::sort(v.begin(), v.end());
      double med = v[v.size() / 2];
      if (m == 0) base = med;
      std::printf("  %-24s %8.2f ms  %+6.2f%%\n", modes[m].name, med * 1e3, (med / base - 1) * 100);
    }
  }
  ls::finalize<ls::MPIBackend>();
  return 0;
}
