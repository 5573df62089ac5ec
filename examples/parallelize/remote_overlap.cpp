// remote_overlap: remote_async_call overlapping work on several ranks (docs/remote.md).
//
// Rank 0 drives: it sends one slow task (a numerical integral that takes a while) to every rank
// with remote_async_call, keeps the futures, and waits for them all with wait_all; the tasks
// run at the same time on their ranks (the driver's own task runs while it waits), so the whole
// takes about as long as one task rather than one per rank. Then the same work through
// remote_parallelize_async with a list of ranks and a user's reducer.
//
// Run (from the repository root, after building into build/):
//   mpiexec -n 4 --oversubscribe build/examples/parallelize/remote_overlap
#include <lockstep/lockstep.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

namespace ls = lockstep;

namespace {
/// The integral of sin(x)^2 over [a, b] by the midpoint rule with n steps (slow on purpose).
double integral(double a, double b, long n) {
  const double h = (b - a) / static_cast<double>(n);
  double s = 0;
  for (long i = 0; i < n; ++i) {
    const double x = a + (static_cast<double>(i) + 0.5) * h;
    s += std::sin(x) * std::sin(x);
  }
  return s * h;
}
}  // namespace
LOCKSTEP_REMOTE(integral)

int main() {
  ls::initialize<ls::MPIBackend>();
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const long steps = 20'000'000;
  ls::run_driver(b, [&] {
    const int n = b.size();
    using clock = std::chrono::steady_clock;
    // One task alone, for scale.
    auto t0 = clock::now();
    const double one = ls::remote_sync_call(b, n - 1, integral, 0.0, 1.0, steps);
    const double t_one = std::chrono::duration<double>(clock::now() - t0).count();
    // One task per rank, all in flight at once: [0, n] cut into n pieces.
    t0 = clock::now();
    std::vector<ls::Future<double>> fs;
    for (int r = 0; r < n; ++r) fs.push_back(ls::remote_async_call(b, r, integral, r * 1.0, r + 1.0, steps));
    double total = 0;
    for (double v : ls::wait_all(fs)) total += v;
    const double t_all = std::chrono::duration<double>(clock::now() - t0).count();
    // The same through remote_parallelize_async: every rank gets the whole range; the user's reducer
    // checks that they agree and keeps one.
    auto everyone = std::vector<int>(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) everyone[r] = r;
    auto same = ls::remote_parallelize_async(b, everyone, [](std::vector<double> v) {
      for (double x : v)
        if (x != v[0]) throw ls::Error("the ranks disagree");
      return v[0];
    }, integral);
    const double whole = same(0.0, 1.0, steps).wait();
    const double exact = n / 2.0 - std::sin(2.0 * n) / 4.0;
    std::printf("one task: %.3f s; %d tasks in flight: %.3f s (%.1fx the time of one)\n", t_one, n, t_all,
                t_all / t_one);
    std::printf("integral of sin^2 over [0, %d]: %.9f (exact %.9f); over [0, 1] %.9f = %.9f\n", n, total, exact,
                one, whole);
    std::fflush(stdout);
  });
  return 0;
}
