// bench_link: what raw MPI gets through the link between two ranks, to tell whether a shaped
// link (tc tbf) lets TCP fill its rate and to give the link bound of bench/multihost.sh a
// measured rate. Plain MPI only (no Lockstep), ranks 0 and 1 (start one rank per host):
//   one way:    rank 0 sends MSG-byte messages back to back, rank 1 receives (MPI_Send/Recv);
//   both ways:  both send MSG bytes to each other at once (MPI_Sendrecv), what a ring allreduce
//               does on every link; the rate is per direction;
//   allreduce:  MPI_Allreduce (sum, f32, in place) of ALLREDUCE bytes at 2 ranks, where each
//               rank sends ALLREDUCE bytes in all (half in the reduce-scatter, half in the
//               all-gather), so bytes / time is the rate each host's link carried;
//   per call:   PER_CALL_TOTAL bytes allreduced in calls of 256 KiB, 1 MiB, 4 MiB and 16 MiB (the
//               cost of a call beyond its bytes: what small buckets pay per bucket).
// Rates are of the MPI payload in Gbit/s (10^9 bit/s); TCP/IP headers add 4.6% on the wire
// (1448 payload bytes in a 1514-byte frame), so a link shaped to R carries at most 0.956 R of
// payload. Median of --reps blocks, after one warm-up block.
//
// Run: mpiexec -n 2 --map-by node ./bench_link [--msg-bytes 16777216] [--count 8]
//      [--allreduce-bytes 67108864] [--per-call-total 33554432] [--reps 3] [--json out.json]
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "bench_common.hpp"

int main(int argc, char** argv) {
  bench::Options opt("bench_link", "raw MPI throughput between two ranks (one way, both ways, allreduce)");
  std::size_t msg = std::size_t{16} << 20, ar = std::size_t{64} << 20, per_call_total = std::size_t{32} << 20;
  int count = 8;
  opt.app.add_option("--msg-bytes", msg, "message size of the point-to-point tests")->type_name("BYTES");
  opt.app.add_option("--count", count, "messages per timed block")->type_name("N");
  opt.app.add_option("--allreduce-bytes", ar, "size of the allreduce")->type_name("BYTES");
  opt.app.add_option("--per-call-total", per_call_total, "bytes of the per-call table (0: no table)")->type_name("BYTES");
  if (const auto rc = opt.parse(argc, argv)) return *rc;
  MPI_Init(&argc, &argv);
  int rank = 0, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (n != 2) {
    if (rank == 0) std::fprintf(stderr, "bench_link: needs exactly 2 ranks (one per host), got %d\n", n);
    MPI_Finalize();
    return 2;
  }
  const int reps = opt.quick_reps();
  std::vector<char> a(msg, 1), b(msg, 2);
  std::vector<float> f(ar / 4, 1.0f);
  const int peer = 1 - rank;
  auto one_way = [&] {
    for (int k = 0; k < count; ++k) {
      if (rank == 0) MPI_Send(a.data(), static_cast<int>(msg), MPI_BYTE, 1, 0, MPI_COMM_WORLD);
      else MPI_Recv(b.data(), static_cast<int>(msg), MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    char ack = 0;  // the receiver has everything
    if (rank == 1) MPI_Send(&ack, 1, MPI_BYTE, 0, 1, MPI_COMM_WORLD);
    else MPI_Recv(&ack, 1, MPI_BYTE, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  };
  auto both_ways = [&] {
    for (int k = 0; k < count; ++k)
      MPI_Sendrecv(a.data(), static_cast<int>(msg), MPI_BYTE, peer, 0, b.data(), static_cast<int>(msg), MPI_BYTE,
                   peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  };
  auto allreduce = [&] {
    MPI_Allreduce(MPI_IN_PLACE, f.data(), static_cast<int>(f.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  };
  struct Test {
    const char* name;
    std::function<void()> body;
    double bytes;  // payload bytes one direction of the link carries per block
  };
  std::vector<Test> tests = {{"one way (MPI_Send)", one_way, static_cast<double>(msg) * count},
                             {"both ways (MPI_Sendrecv), per direction", both_ways, static_cast<double>(msg) * count},
                             {"MPI_Allreduce, bytes each rank sends", allreduce, static_cast<double>(f.size() * 4)}};
  bench::Json rows = bench::Json::array();
  if (rank == 0) std::printf("\n# Raw MPI across the link, 2 ranks, median of %d\n\n", reps);
  bench::Table t({"test", "size", "median s", "Gbit/s (payload)", "best Gbit/s"});
  for (auto& test : tests) {
    std::vector<double> ts;
    for (int r = 0; r <= reps; ++r) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      test.body();
      double dt = MPI_Wtime() - t0;
      MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (r > 0) ts.push_back(dt);  // the first block warms up
    }
    std::sort(ts.begin(), ts.end());
    const double med = ts[ts.size() / 2], best = ts.front();
    const double gbit = test.bytes * 8 / med / 1e9, best_gbit = test.bytes * 8 / best / 1e9;
    t.add({test.name, bench::human_bytes(test.bytes), bench::fmt(med, 3), bench::fmt(gbit, 2), bench::fmt(best_gbit, 2)});
    rows.push(bench::Json::object().set("test", test.name).set("bytes", test.bytes).set("median_s", med)
                  .set("gbit_s", gbit).set("best_gbit_s", best_gbit));
  }
  t.print();
  // The same bytes in calls of several sizes: total time, and time per call.
  bench::Json calls = bench::Json::array();
  if (per_call_total > 0) {
    std::vector<float> g(per_call_total / 4, 1.0f);
    if (rank == 0)
      std::printf("# MPI_Allreduce of %s in calls of each size (median of %d)\n\n",
                  bench::human_bytes(static_cast<double>(per_call_total)).c_str(), reps);
    bench::Table tc({"call size", "calls", "median ms", "ms per call", "Gbit/s (bytes each rank sends)"});
    for (std::size_t c : {std::size_t{256} << 10, std::size_t{1} << 20, std::size_t{4} << 20, std::size_t{16} << 20}) {
      if (c > per_call_total) break;
      std::vector<double> ts;
      const std::size_t k = per_call_total / c;
      for (int r = 0; r <= reps; ++r) {
        MPI_Barrier(MPI_COMM_WORLD);
        const double t0 = MPI_Wtime();
        for (std::size_t i = 0; i < k; ++i)
          MPI_Allreduce(MPI_IN_PLACE, g.data() + i * (c / 4), static_cast<int>(c / 4), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double dt = MPI_Wtime() - t0;
        MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (r > 0) ts.push_back(dt);
      }
      std::sort(ts.begin(), ts.end());
      const double med = ts[ts.size() / 2];
      tc.add({bench::human_bytes(static_cast<double>(c)), std::to_string(k), bench::fmt(med * 1e3, 1),
              bench::fmt(med * 1e3 / static_cast<double>(k), 2), bench::fmt(static_cast<double>(k * c) * 8 / med / 1e9, 2)});
      calls.push(bench::Json::object().set("call_bytes", static_cast<std::int64_t>(c)).set("calls", static_cast<std::int64_t>(k))
                     .set("median_s", med));
    }
    tc.print();
  }
  bench::run_info("link").set("reps", reps).set("rows", rows).set("per_call", calls).write(opt.json);
  MPI_Finalize();
  return 0;
}
