// bench_remote: remote calls (remote.hpp) against raw MPI in the same run, between ranks 0 and
// 1 (run with mpiexec -n 2). Prints the round trip of an empty call beside a 0-byte
// MPI_Send/MPI_Recv ping-pong, then, for tensor arguments of 1 KiB to 256 MiB, the round trip
// of echo(t) (t sent there, the same tensor sent back) beside a ping-pong of the same size, with
// one buffer reused (raw_us), with rank 0 receiving into a second reused buffer (rawapart_us)
// and with a new buffer per message (rawfresh_us). The calls are
// timed twice, in sessions of the same run: with the session's receive cache (remote_us: large
// received tensors land in reused buffers) and without it (nocache_us,
// RemoteOptions::receive_cache_bytes = 0: every received tensor is new memory). Per size, the
// five take turns, `rounds` times (default 5): every figure is the median over the rounds, and
// every ratio the median of the rounds' ratios, each of a raw and a remote figure measured
// within about a second of each other.
//   bench_remote [max_bytes] [--rounds N]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "../src/remote/test_hooks.hpp"  // receive_cache_stats: the cache's counters (not installed)
#include "lockstep/lockstep.hpp"
#include "lockstep_cli.hpp"

namespace ls = lockstep;

namespace {
void empty() {}
ls::Tensor echo(ls::Tensor t) { return t; }
LOCKSTEP_REMOTE(empty)
LOCKSTEP_REMOTE(echo)

double now() { return MPI_Wtime(); }

int reps_for(std::size_t bytes) {
  return static_cast<int>(std::clamp<std::size_t>((std::size_t{512} << 20) / std::max<std::size_t>(bytes, 1), 5, 2000));
}

/// Where rank 0 receives the reply of a raw ping-pong: into the buffer it sent from (`same`);
/// into a second reused buffer (`apart`: a call's result is another tensor than its argument, so
/// its messages touch twice the memory); into newly allocated memory on both ranks (`fresh`: a
/// remote call receives into a new tensor, so the cost of new memory, the page faults of large
/// allocations, is counted too).
enum class Into { same, apart, fresh };

/// Seconds per round trip of a raw ping-pong of `bytes` between ranks 0 and 1.
double pingpong(MPI_Comm comm, int rank, std::size_t bytes, int reps, Into into = Into::same) {
  const std::size_t cap = std::max<std::size_t>(bytes, 1);
  std::vector<char> buf(cap), back(into == Into::apart ? cap : 0);
  const int n = static_cast<int>(bytes);
  double t0 = 0;
  for (int i = -2; i < reps; ++i) {  // two warm-up round trips
    if (i == 0) t0 = now();
    std::unique_ptr<char[]> mem(into == Into::fresh ? new char[cap] : nullptr);
    // What this rank receives into (rank 1 sends it back from there).
    char* in = mem ? mem.get() : rank == 0 && into == Into::apart ? back.data() : buf.data();
    if (rank == 0) {
      MPI_Send(buf.data(), n, MPI_BYTE, 1, 0, comm);
      MPI_Recv(in, n, MPI_BYTE, 1, 0, comm, MPI_STATUS_IGNORE);
    } else if (rank == 1) {
      MPI_Recv(in, n, MPI_BYTE, 0, 0, comm, MPI_STATUS_IGNORE);
      MPI_Send(in, n, MPI_BYTE, 0, 0, comm);
    }
  }
  return (now() - t0) / reps;
}
}  // namespace

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  std::size_t max_bytes = std::size_t{256} << 20;
  lockstep_cli::App app("bench_remote", "remote calls (remote.hpp) against raw MPI ping-pong, between ranks 0 and 1");
  int rounds = 5;
  app.add_option("max_bytes", max_bytes, "largest tensor argument")->check(lockstep_cli::at_least(0));
  app.add_option("--rounds", rounds, "turns of raw, uncached and cached timings (medians are printed)")
      ->check(lockstep_cli::at_least(1));
  if (const auto rc = lockstep_cli::parse(app, argc, argv)) return *rc;
  if (b.size() < 2) {
    std::fprintf(stderr, "bench_remote needs 2 ranks\n");
    ls::finalize<ls::MPIBackend>();
    return 77;
  }
  MPI_Comm comm;
  MPI_Comm_dup(b.comm(), &comm);
  const int rank = b.rank();
  std::vector<std::size_t> sizes;
  for (std::size_t s = 1024; s <= max_bytes; s *= 4) sizes.push_back(s);
  // Per size, `rounds` turns of: the raw ping-pongs (outside any remote session), the calls in a
  // session without the receive cache, the calls in one with it. Every figure is the median over
  // the rounds, and each ratio the median of the rounds' own ratios: a raw and a remote figure of
  // one round were measured within a second of each other, so that a machine whose speed
  // changes during the run (a virtual machine's cores do) affects both alike.
  struct Row {
    std::vector<double> raw, fresh, apart, nocache, cache;
  };
  ls::detail::remote::ReceiveCacheStats stats{};
  auto calls = [&](std::size_t cache_bytes, std::size_t s, bool empty_call) {
    ls::RemoteSession session(b, ls::RemoteOptions{.receive_cache_bytes = cache_bytes});
    const double t = ls::run_driver(b, [&] {
      if (empty_call) {
        for (int i = 0; i < 200; ++i) ls::remote_sync_call(b, 1, empty);
        const int n0 = 5000;
        const double t0 = now();
        for (int i = 0; i < n0; ++i) ls::remote_sync_call(b, 1, empty);
        return (now() - t0) / n0;
      }
      auto t = ls::Tensor::zeros({static_cast<std::int64_t>(s)}, ls::DType::u8);
      const int reps = reps_for(s);
      for (int i = 0; i < 2; ++i) (void)ls::remote_sync_call(b, 1, echo, t);
      const double t0 = now();
      for (int i = 0; i < reps; ++i) (void)ls::remote_sync_call(b, 1, echo, t);
      return (now() - t0) / reps;
    });
    if (cache_bytes > 0) {
      const auto st = ls::detail::remote::receive_cache_stats(b);
      stats.hits += st.hits;
      stats.misses += st.misses;
    }
    session.close();
    return t;
  };
  std::vector<Row> rows(sizes.size() + 1);  // rows[0]: the empty call
  for (std::size_t i = 0; i <= sizes.size(); ++i) {
    const bool empty_call = i == 0;
    const std::size_t s = empty_call ? 0 : sizes[i - 1];
    for (int k = 0; k < rounds; ++k) {
      rows[i].raw.push_back(pingpong(comm, rank, s, empty_call ? 5000 : reps_for(s)));
      rows[i].fresh.push_back(empty_call ? 0.0 : pingpong(comm, rank, s, reps_for(s), Into::fresh));
      rows[i].apart.push_back(empty_call ? 0.0 : pingpong(comm, rank, s, reps_for(s), Into::apart));
      rows[i].nocache.push_back(calls(0, s, empty_call));
      rows[i].cache.push_back(calls(ls::RemoteOptions{}.receive_cache_bytes, s, empty_call));
    }
  }
  // Both ranks' receive cache figures, on rank 0 (rank 1 receives the arguments, rank 0 the
  // results).
  unsigned long long mine[2] = {stats.hits, stats.misses};
  std::vector<unsigned long long> all(2 * static_cast<std::size_t>(b.size()));
  MPI_Gather(mine, 2, MPI_UNSIGNED_LONG_LONG, all.data(), 2, MPI_UNSIGNED_LONG_LONG, 0, comm);
  MPI_Comm_free(&comm);
  if (rank != 0) {  // the calls were timed on rank 0
    ls::finalize<ls::MPIBackend>();
    return 0;
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  auto ratio = [&](const std::vector<double>& a, const std::vector<double>& r) {
    std::vector<double> q;
    for (std::size_t k = 0; k < a.size(); ++k) q.push_back(a[k] / r[k]);
    return median(q);
  };
  {
    std::printf("# remote calls between ranks 0 and 1 vs raw MPI ping-pong (same run; per size %d rounds, "
                "medians; ratios: the median of the rounds' ratios)\n",
                rounds);
    std::printf("# receive cache (every cached session): rank 0 %llu hits, %llu misses; rank 1 %llu hits, %llu misses\n",
                all[0], all[1], all[2], all[3]);
    std::printf("%-10s %11s %11s %7s %11s %7s %11s %7s %11s %7s %11s %11s\n", "bytes", "remote_us", "raw_us", "ratio",
                "rawapart_us", "ratio_a", "rawfresh_us", "ratio_f", "nocache_us", "ratio_n", "remote_GB/s", "raw_GB/s");
    const Row& e = rows[0];
    std::printf("%-10s %11.2f %11.2f %7.2f %11s %7s %11s %7s %11.2f %7.2f %11s %11s\n", "empty", median(e.cache) * 1e6,
                median(e.raw) * 1e6, ratio(e.cache, e.raw), "-", "-", "-", "-", median(e.nocache) * 1e6,
                ratio(e.nocache, e.raw), "-", "-");
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const auto s = sizes[k];
      const Row& r = rows[k + 1];
      const double rt = median(r.cache), raw = median(r.raw);
      std::printf("%-10zu %11.2f %11.2f %7.2f %11.2f %7.2f %11.2f %7.2f %11.2f %7.2f %11.3f %11.3f\n", s, rt * 1e6,
                  raw * 1e6, ratio(r.cache, r.raw), median(r.apart) * 1e6, ratio(r.cache, r.apart),
                  median(r.fresh) * 1e6, ratio(r.cache, r.fresh), median(r.nocache) * 1e6, ratio(r.nocache, r.raw),
                  2.0 * s / rt / 1e9, 2.0 * s / raw / 1e9);
    }
    std::fflush(stdout);
  }
  ls::finalize<ls::MPIBackend>();
  return 0;
}
