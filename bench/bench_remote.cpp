// bench_remote: remote calls (remote.hpp) against raw MPI in the same run, between ranks 0 and
// 1 (run with mpiexec -n 2). Prints the round trip of an empty call beside a 0-byte
// MPI_Send/MPI_Recv ping-pong, then, for tensor arguments of 1 KiB to 256 MiB, the round trip
// of echo(t) (t sent there, the same tensor sent back) beside a ping-pong of the same size, with
// one buffer reused (raw_us) and with a new buffer per message (rawfresh_us). The calls are
// timed twice, in two sessions of the same run: with the session's receive cache
// (remote_us: large received tensors land in reused buffers) and without it
// (nocache_us, RemoteOptions::receive_cache_bytes = 0: every received tensor is new memory).
// The three (raw ping-pongs, calls without the cache, calls with it) take turns, `rounds` times
// (default 3), and every figure is the median over the rounds, so that a machine whose load
// changes during the run affects them alike.
//   bench_remote [max_bytes] [--rounds N]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

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

/// Seconds per round trip of a raw ping-pong of `bytes` between ranks 0 and 1. fresh: every
/// message is received into a newly allocated buffer (as a remote call receives into a new
/// tensor), so the cost of new memory (page faults of large allocations) is counted too.
double pingpong(MPI_Comm comm, int rank, std::size_t bytes, int reps, bool fresh = false) {
  std::vector<char> buf(std::max<std::size_t>(bytes, 1));
  const int n = static_cast<int>(bytes);
  double t0 = 0;
  for (int i = -2; i < reps; ++i) {  // two warm-up round trips
    if (i == 0) t0 = now();
    if (fresh) {
      std::unique_ptr<char[]> mem(new char[std::max<std::size_t>(bytes, 1)]);
      if (rank == 0) {
        MPI_Send(buf.data(), n, MPI_BYTE, 1, 0, comm);
        MPI_Recv(mem.get(), n, MPI_BYTE, 1, 0, comm, MPI_STATUS_IGNORE);
      } else if (rank == 1) {
        MPI_Recv(mem.get(), n, MPI_BYTE, 0, 0, comm, MPI_STATUS_IGNORE);
        MPI_Send(mem.get(), n, MPI_BYTE, 0, 0, comm);
      }
      continue;
    }
    if (rank == 0) {
      MPI_Send(buf.data(), n, MPI_BYTE, 1, 0, comm);
      MPI_Recv(buf.data(), n, MPI_BYTE, 1, 0, comm, MPI_STATUS_IGNORE);
    } else if (rank == 1) {
      MPI_Recv(buf.data(), n, MPI_BYTE, 0, 0, comm, MPI_STATUS_IGNORE);
      MPI_Send(buf.data(), n, MPI_BYTE, 0, 0, comm);
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
  int rounds = 3;
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
  // Raw MPI (outside any remote session), every size.
  struct Raw {
    double zero = 0;
    std::vector<double> reused, fresh;
  };
  auto raw_sweep = [&] {
    Raw out;
    out.zero = pingpong(comm, rank, 0, 5000);
    for (auto s : sizes) out.reused.push_back(pingpong(comm, rank, s, reps_for(s)));
    for (auto s : sizes) out.fresh.push_back(pingpong(comm, rank, s, reps_for(s), true));
    return out;
  };

  // The calls: one sweep per session (without, then with the receive cache).
  struct Sweep {
    double call0 = 0;
    std::vector<double> rt;
    ls::detail::remote::ReceiveCacheStats stats;
  };
  auto sweep = [&](std::size_t cache_bytes) {
    ls::RemoteSession session(b, ls::RemoteOptions{.receive_cache_bytes = cache_bytes});
    Sweep out;
    ls::run_driver(b, [&] {
      for (int i = 0; i < 200; ++i) ls::remote_sync_call(b, 1, empty);
      const int n0 = 5000;
      double t0 = now();
      for (int i = 0; i < n0; ++i) ls::remote_sync_call(b, 1, empty);
      out.call0 = (now() - t0) / n0;
      for (const auto s : sizes) {
        auto t = ls::Tensor::zeros({static_cast<std::int64_t>(s)}, ls::DType::u8);
        const int reps = reps_for(s);
        for (int i = 0; i < 2; ++i) (void)ls::remote_sync_call(b, 1, echo, t);
        t0 = now();
        for (int i = 0; i < reps; ++i) (void)ls::remote_sync_call(b, 1, echo, t);
        out.rt.push_back((now() - t0) / reps);
      }
    });
    out.stats = ls::detail::remote::receive_cache_stats(b);
    session.close();
    return out;
  };
  std::vector<Raw> raws;
  std::vector<Sweep> offs, ons;
  for (int k = 0; k < rounds; ++k) {
    raws.push_back(raw_sweep());
    offs.push_back(sweep(0));
    ons.push_back(sweep(ls::RemoteOptions{}.receive_cache_bytes));
  }
  MPI_Comm_free(&comm);
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  auto med = [&](auto pick) {
    std::vector<double> v;
    for (int k = 0; k < rounds; ++k) v.push_back(pick(k));
    return median(v);
  };
  if (rank != 0) {  // the calls were timed on rank 0
    ls::finalize<ls::MPIBackend>();
    return 0;
  }
  const double raw0 = med([&](int k) { return raws[k].zero; });
  Sweep off, on;
  on.stats = ons.back().stats;
  off.call0 = med([&](int k) { return offs[k].call0; });
  on.call0 = med([&](int k) { return ons[k].call0; });
  std::vector<double> raw, raw_fresh;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    raw.push_back(med([&](int k) { return raws[k].reused[i]; }));
    raw_fresh.push_back(med([&](int k) { return raws[k].fresh[i]; }));
    off.rt.push_back(med([&](int k) { return offs[k].rt[i]; }));
    on.rt.push_back(med([&](int k) { return ons[k].rt[i]; }));
  }
  {
    std::printf("# remote calls between ranks 0 and 1 vs raw MPI ping-pong (same run, median of %d rounds)\n", rounds);
    std::printf("# receive cache on rank 0 (last round): %llu hits, %llu misses\n", static_cast<unsigned long long>(on.stats.hits),
                static_cast<unsigned long long>(on.stats.misses));
    std::printf("%-10s %11s %11s %7s %11s %7s %11s %7s %11s %11s\n", "bytes", "remote_us", "raw_us", "ratio",
                "rawfresh_us", "ratio_f", "nocache_us", "ratio_n", "remote_GB/s", "raw_GB/s");
    std::printf("%-10s %11.2f %11.2f %7.2f %11s %7s %11.2f %7.2f %11s %11s\n", "empty", on.call0 * 1e6, raw0 * 1e6,
                on.call0 / raw0, "-", "-", off.call0 * 1e6, off.call0 / raw0, "-", "-");
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const auto s = sizes[k];
      const double rt = on.rt[k];
      std::printf("%-10zu %11.2f %11.2f %7.2f %11.2f %7.2f %11.2f %7.2f %11.3f %11.3f\n", s, rt * 1e6, raw[k] * 1e6,
                  rt / raw[k], raw_fresh[k] * 1e6, rt / raw_fresh[k], off.rt[k] * 1e6, off.rt[k] / raw[k],
                  2.0 * s / rt / 1e9, 2.0 * s / raw[k] / 1e9);
    }
    std::fflush(stdout);
  }
  ls::finalize<ls::MPIBackend>();
  return 0;
}
